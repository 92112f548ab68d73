"""The GPU check's tables (OUT/gpu_check.md, bench/gpu_check.py), from its results.jsonl."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from gpu_check_gemms import gemm_rows
from gpu_check_head import head_rows
from gpu_check_list import DRY_RUN, GPU, Item, read_lines, work_list
from gpu_profile_table import profile_tables


def tables(path: Path, profiles: bool = True) -> str:
    """The run's tables; with `profiles`, each profiled step's device time by class, read from
    its trace (a minute for a whole run's traces: the card's run leaves it to `--table`)."""
    lines = read_lines(path)
    merged: dict[str, dict[str, Any]] = {}
    for line in lines:
        if "attention" not in line:
            merged.setdefault(line["item"], {}).update(line)
    text = ["# GPU check", "", *_device(merged.get("device", {}))]
    text += head_rows(lines)
    text += _kernel_rows(lines) + _attention_rate(lines) + _speed_rows(lines) + _sweep_rows(lines)
    text += _step_rows(merged) + _fp8_rows(merged) + gemm_rows(lines)
    for name, row in merged.items():
        if row.get("status") not in (None, "done"):
            text.append(f"\n{name}: {row['status']} — {row.get('why')}")
    return "\n".join(text) + "\n" + (profile_tables(path) if profiles else "")


def _device(device: dict[str, Any]) -> list[str]:
    text = [
        f"Device: {device.get('device', '?')} (driver, name, memory: {device.get('driver')}); "
        f"jax {device.get('jax')}, flax {device.get('flax')}, optax {device.get('optax')}, "
        f"Python {device.get('python')}."
    ]
    if "bf16_matmul_flops" in device:
        text.append(
            f"Measured: bf16 matmul chain ({device['matmul_size']}³, median of 5) "
            f"{device['bf16_matmul_flops'] / 1e12:,.0f} TFLOP/s; device-to-device copy "
            f"{device.get('copy_bytes_per_s', 0) / 1e12:,.2f} TB/s (read + written, median of 10)."
        )
    if "fp8_matmul_flops" in device:
        text.append(
            f"The same chain through flax's FP8 dot: {device['fp8_matmul_flops'] / 1e12:,.0f} "
            f"TFLOP/s, {device['fp8_matmul_flops'] / device['bf16_matmul_flops']:.2f}× bf16; "
            f"{device['fp8_gemms']} of its {device['fp8_products']} products are FP8 cuBLASLt "
            f"GEMMs in the compiled program."
        )
    if device.get("platform") == "cpu":
        text.append(
            "A dry run on the CPU (mt5_tiny, small lengths, Pallas's interpreter): it checks the "
            "script, not a GPU. Its predictions are one H100's and do not compare with its times."
        )
    return text


def _kernel_rows(lines: list[dict[str, Any]]) -> list[str]:
    text = ["", "## Kernels: fused against the einsum path ('dot')", "",
            "| attention | dtype | q × k | out | dq | dk | dv | d_bias | vs exact (fused / dot, "
            "worst) | verdict | fwd+bwd fused | fwd+bwd dot | fused TFLOP/s |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for line in lines:
        if "verdict" not in line:
            continue
        errors = line["errors"]["fused_vs_dot"]
        cells = [f"{errors[n]:.1e}" if n in errors else "–"
                 for n in ("out", "dq", "dk", "dv", "d_bias")]  # fmt: skip
        exact = (max(line["errors"]["fused_vs_exact"].values()),
                 max(line["errors"]["dot_vs_exact"].values()))  # fmt: skip
        text.append(
            f"| {line['attention']} | {line['dtype']} | {line['q']} × {line['k']} | "
            + " | ".join(cells)
            + f" | {exact[0]:.1e} / {exact[1]:.1e} | {line['verdict']} | "
            f"{line['ms_fused']:.2f} ms | {line['ms_dot']:.2f} ms | "
            f"{_tflops(line.get('fused_flops'), line['ms_fused'])} |"
        )
    return text


def _milliseconds(value: float | None) -> str:
    return "–" if value is None else f"{value:.2f} ms"


def _speed_rows(lines: list[dict[str, Any]]) -> list[str]:
    """Forward + backward at the tiles chosen on the card, against the default tiles, the
    einsum path and cuDNN's attention; the useful rate (FlashAttention's FLOP convention)."""
    cases = [line for line in lines if "ms_fused_default_tiles" in line]
    if not cases:
        return []
    text = ["", "Forward + backward, median of 10 (useful TFLOP/s: FlashAttention's convention, "
            "3.5 × 4·B·N·T·S·H, half of it causal; cuDNN masks no packed segments):", "",
            "| attention | dtype | fused, chosen tiles | fused, default tiles | dot | cuDNN, "
            "bias | cuDNN, no bias | useful TFLOP/s (fused) |",
            "|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for line in cases:
        text.append(
            f"| {line['attention']} | {line['dtype']} | {_milliseconds(line['ms_fused'])} | "
            f"{_milliseconds(line['ms_fused_default_tiles'])} | {_milliseconds(line['ms_dot'])} | "
            f"{_milliseconds(line.get('ms_cudnn_bias'))} | "
            f"{_milliseconds(line.get('ms_cudnn_no_bias'))} | "
            f"{_tflops(line.get('useful_flops'), line['ms_fused'])} |"
        )
    return text


def _sweep_rows(lines: list[dict[str, Any]]) -> list[str]:
    """Each pass's fastest tiles (q × k, warps, stages, groups) against the default's time."""
    sweeps = [line for line in lines if "tile_sweep" in line]
    if not sweeps:
        return []
    text = ["", "Each pass alone at each candidate tile (gpu_check_tiles.py), median of 10:", "",
            "| attention | pass | chosen: q × k, warps, stages, groups | its time | default "
            "64 × 64, 4, 2 | candidates (failed) |", "|---|---|---|---|---|---|"]  # fmt: skip
    for line in sweeps:
        for row in line["tile_sweep"]:
            tiles, candidates = row["chosen"], row["candidates"]
            best = min(c["ms"] for c in candidates if c["ms"] is not None)
            failed = sum(c["ms"] is None for c in candidates)
            text.append(
                f"| {line['attention']} | {row['pass']} | {tiles['q']} × {tiles['k']}, "
                f"{tiles['warps']}, {tiles['stages']}, {tiles['groups']} | {best:.3f} ms | "
                f"{_milliseconds(candidates[0]['ms'])} | {len(candidates)} ({failed}) |"
            )
    return text


def _step_rows(merged: dict[str, dict[str, Any]]) -> list[str]:
    """The steps' table, and their predictions by kernel class."""
    text = ["", "## Steps, and the cluster model's prediction for the same program", "",
            "| model | remat | attention | layers | compile | step (median) | back to back | "
            "tokens/s | MFU (measured peak) | MFU (datasheet) | XLA peak | allocator peak | "
            "predicted | error | error, back to back | status |",
            "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]  # fmt: skip
    for item in work_list(GPU, extras=True) + work_list(DRY_RUN, extras=True):
        if item.kind in ("step", "training loop") and item.name in merged:
            text.append(_step_row(item, merged[item.name]))
    text += ["", "The prediction by kernel class (seconds per step; launches are in each class):",
             "", "| step | gemm | attention | fusion | copy | other | of which launches |",
             "|---|---|---|---|---|---|---|"]  # fmt: skip
    for item in work_list(GPU, extras=True) + work_list(DRY_RUN, extras=True):
        classes = merged.get(item.name, {}).get("predicted_by_class_s")
        if item.kind == "step" and classes:
            cells = " | ".join(f"{classes.get(kind, 0):.4f}"
                               for kind in ("gemm", "attention", "fusion", "copy", "other"))  # fmt: skip
            launches = merged[item.name]["predicted_launch_s"]
            text.append(f"| {item.name.removeprefix('step ')} | {cells} | {launches:.4f} |")
    return text


def _fp8_rows(merged: dict[str, dict[str, Any]]) -> list[str]:
    """Each FP8 step against the same step in mixed precision: the speed-up (issue 62's goal on
    an H100: 1.3×) and the loss of both over every step, warm-ups first (the same batches)."""
    pairs = [
        (item.name.removesuffix(" fp8"), item.name)
        for item in work_list(GPU, extras=True) + work_list(DRY_RUN, extras=True)
        if item.options.get("precision") == "fp8"
    ]
    rows = [(merged[m], merged[f]) for m, f in dict(pairs).items()
            if "step_s" in merged.get(m, {}) and "step_s" in merged.get(f, {})]  # fmt: skip
    if not rows:
        return []
    text = ["", "## FP8 against mixed precision (the same step, the same batches)", "",
            "| step | mixed | fp8 | speed-up | losses, mixed | losses, fp8 |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for mixed, fp8 in rows:
        losses = [", ".join(f"{x:.3f}" for x in row.get("losses", [])) for row in (mixed, fp8)]
        text.append(
            f"| {fp8['item'].removeprefix('step ')} | {mixed['step_s']:.4f} s | "
            f"{fp8['step_s']:.4f} s | {mixed['step_s'] / fp8['step_s']:.2f}× | "
            f"{losses[0]} | {losses[1]} |"
        )
    return text


def _tflops(flops: float | None, milliseconds: float) -> str:
    return "–" if not flops else f"{flops / milliseconds / 1e9:,.1f}"


def _attention_rate(lines: list[dict[str, Any]]) -> list[str]:
    """The bf16 fused kernels' FLOP-weighted rate over the three attentions, and its share of
    the datasheet peak: a cluster file's `attention_efficiency` (gin/clusters/h100.gin)."""
    cases = [line for line in lines
             if line.get("dtype") == "bfloat16" and line.get("fused_flops")]  # fmt: skip
    if not cases:
        return []
    flops = sum(line["fused_flops"] for line in cases)
    rate = flops / (1e-3 * sum(line["ms_fused"] for line in cases))
    text = (f"\nThe bf16 fused kernels, FLOP-weighted (the kernel inventory's count, "
            f"{flops / 1e9:,.1f} GFLOP): {rate / 1e12:,.1f} TFLOP/s")  # fmt: skip
    datasheet = cases[0].get("datasheet_flops")
    if datasheet:
        text += f", {rate / datasheet:.3f} of the datasheet peak (`attention_efficiency`)"
    return [text + "."]


def _step_row(item: Item, row: dict[str, Any]) -> str:
    def gib(value):
        return "–" if value is None else f"{value / 2**30:.1f} GiB"

    def percent(value):
        return "–" if value is None else f"{100 * value:.1f}%"

    options = item.options
    layers = "loop" if options["scan_layers"] else "unrolled"
    step = row.get("step_s")
    status = row.get("status", "?")
    if row.get("fits") is False:
        status = f"does not fit ({gib(row['memory_limit_bytes'])} usable)"
    compile_s = row.get("compile_s")
    model = options["model"] + (f" (batch {options['batch']})" if "batch" in options else "")
    if "loss_chunk_tokens" in options:
        model += f" (loss chunks of {options['loss_chunk_tokens']})"
    if "precision" in options:
        model += f" ({options['precision']})"
    if "logits_dtype" in options:
        model += f" ({options['logits_dtype']} logits)"
    if options.get("head_kernel"):
        model += " (head kernel)"
    if item.xla_flags:
        model += f" ({' '.join(item.xla_flags)})"
    if item.kind == "training loop":
        model += " (t5scale's training loop)"
    back_to_back = row.get("back_to_back_s")
    timed = "– | – | –"
    if step is not None:
        back = "–" if back_to_back is None else f"{back_to_back:.4f} s"
        timed = f"{step:.4f} s | {back} | {row['tokens_per_s']:,.0f}"
    return (
        f"| {model} | {options['remat']} | "
        f"{row.get('attention_ran', options['attention'])} | {layers} | "
        + ("–" if compile_s is None else f"{compile_s:.0f} s")
        + " | "
        + timed
        + f" | {percent(row.get('mfu_measured_peak'))} | "
        f"{percent(row.get('mfu_datasheet'))} | {gib(row.get('xla_peak_bytes'))} | "
        f"{gib(row.get('allocator_peak_bytes'))} | "
        + ("–" if "predicted_step_s" not in row else f"{row['predicted_step_s']:.4f} s")
        + f" | {percent(row.get('prediction_error'))} | {percent(_back_to_back_error(row))} | "
        f"{status} |"
    )


def _back_to_back_error(row: dict[str, Any]) -> float | None:
    """The prediction against the steps back to back, as a training loop that dispatches ahead
    runs them (t5scale's: t5scale/train/loop.py), not against steps waited for one by one."""
    if row.get("predicted_step_s") is None or row.get("back_to_back_s") is None:
        return None
    return row["predicted_step_s"] / row["back_to_back_s"] - 1
