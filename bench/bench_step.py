"""Train-step speed on this machine: tokens/s, MFU against the measured matmul peak, compile time.

    python bench/bench_step.py [--models mt5_tiny mt5_small] [--steps 3] [--repeats 2] [--no-torch]
    python bench/bench_step.py --models mt5_small mt5_base --batch 32 --input-length 1024 \
        --target-length 229 --dtype bfloat16 --steps 10        # on a GPU

Not a test: it prints a markdown table (and JSON with --out) for docs/benchmarks.md.

Each t5scale run (one device, and each ZeRO stage on all devices) is one of the study's trials
(t5scale/study/trial.py): a process of its own that compiles, checks the one-step program's
memory, and then times --steps steps (at least 6) back to back, each to block_until_ready, as
a training run would, leaving out the warm-up steps it finds in the timings
(t5scale/study/evidence.py); compile time is reported apart. With
--steps-per-execution k > 1, t5scale's runs take k steps per XLA execution
(TrainConfig.steps_per_execution) and each execution gives its time over k as the step time;
one device is then also run at k = 1. The Hugging Face PyTorch MT5ForConditionalGeneration
baseline runs through the same process isolation (this file's `--worker`), on the same config,
batch, lengths and optimizer (AdamW, lr 1e-3, weight decay 0.01, no gradient clipping).

Runs go one at a time, in --repeats repeats whose order alternates (forwards, then backwards), so
that a machine whose speed drifts favours no run; a step is never timed right after another
run's step (docs/benchmarks.md says why). "speed vs 1 device" is the median over repeats of the
1-device t5scale run's median step time over the run's, in the same repeat. MFU = model FLOPs
per step (t5scale.analysis.flops) / (step time · peak · devices), the peak being this machine's
measured matmul FLOP/s shared by all emulated devices (they share the same cores).

On a GPU the same script runs on the devices it has, takes the datasheet's peak for the compute
dtype, and runs the transformers baseline on CUDA with bf16 autocast and fp32 parameters, the
same mixed precision t5scale uses with --dtype bfloat16.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

from t5scale.analysis.flops import mfu, training_flops_per_step
from t5scale.analysis.memory import cpu_memory_budget
from t5scale.config import build_run_config, parse_gin
from t5scale.data.config import DataConfig
from t5scale.jsonform import to_json
from t5scale.model.sizes import preset
from t5scale.study.config import Point
from t5scale.study.trial import TRIAL_PROGRAM, run_trial, write_result
from t5scale.train.config import RunConfig, TrainConfig

CPU_DEVICES = 8
TIMEOUT_S = 3600


@dataclasses.dataclass(frozen=True)
class Workload:
    batch: int = 8
    input_length: int = 512
    target_length: int = 114
    dtype: str = "float32"
    remat: str = "dots"
    steps: int = 3
    precision: str = "auto"  # PrecisionConfig.mode: with bfloat16, auto is mixed precision

    def run_config(self) -> RunConfig:
        return RunConfig(
            train=TrainConfig(batch_size=self.batch),
            data=DataConfig(input_length=self.input_length, target_length=self.target_length),
        )


def t5scale_spec(
    model: str,
    stage: int,
    devices: int,
    workload: Workload,
    k: int,
    machine: dict,
    head: str = "tiled",
):
    """A timed trial of the study: the model at `stage` over `devices` (zero = all of them);
    head 'whole': the untiled output layer (ModelConfig.loss_chunk_tokens = 0)."""
    point = Point(
        model=model, stage=stage, micro_batch_size=workload.batch // devices, remat=workload.remat,
        learning_rate=1e-3, devices=devices, input_length=workload.input_length,
        target_length=workload.target_length, dtype=workload.dtype, precision=workload.precision,
    )  # fmt: skip
    if machine["backend"] == "cpu":
        budget = cpu_memory_budget(machine["host_memory_bytes"], devices)
    else:
        budget = machine["device_memory_limit_bytes"]
    return {
        "kind": "timed",
        "label": {
            "model": model,
            "framework": "t5scale (JAX)"
            + (f", {k} steps per execution" if k > 1 else "")
            + (", whole logits" if head == "whole" else ""),
            "stage": stage,
            "devices": devices,
        },  # fmt: skip
        "devices_per_process": devices,
        "point": point.__dict__,
        "memory_budget_bytes": budget,
        # exactly --steps samples (at least 6: the fewest a 95% interval needs); the warm-up is
        # found in them (t5scale/study/evidence.py) and left out of the step time
        "timing": {
            "precision": 1e-9,
            "min_samples": workload.steps,
            "max_samples": workload.steps,
            "max_seconds": TIMEOUT_S,
        },
        "peak_flops_per_s": machine["peak_flops_per_s"],
        "run": to_json(point.run(base_run(model, k, head))),
    }


def base_run(model: str, k: int, head: str) -> RunConfig:
    """The model's run before the point is applied, read from gin as the study reads it
    (t5scale/config.py, study_runs). Plain AdamW without clipping, exactly as the transformers
    baseline runs it."""
    bindings = [f"STEPS_PER_EXECUTION={k}", "OptimizerConfig.grad_clip_norm=None"]
    parse_gin([f"gin/models/{model}.gin"],
              bindings + (["ModelConfig.loss_chunk_tokens=0"] if head == "whole" else []))  # fmt: skip
    return build_run_config()


def transformers_spec(model: str, workload: Workload) -> dict:
    label = {"model": model, "framework": "transformers (PyTorch)", "stage": "-", "devices": 1}
    return {"kind": "transformers", "label": label, "model": model,
            "workload": dataclasses.asdict(workload)}  # fmt: skip


def time_transformers(model_name: str, workload: Workload) -> dict:
    """In the worker process: the baseline's warm-up step, then --steps (at least 6) timed steps."""
    import contextlib

    import torch
    from transformers import MT5Config, MT5ForConditionalGeneration

    torch.set_num_threads(os.cpu_count() or 1)
    # XLA:CPU flushes denormals to zero (FTZ/DAZ); PyTorch keeps them by default, which made
    # its matmuls several times slower on an Intel CPU (docs/benchmarks.md). Same numerics.
    torch.set_flush_denormal(True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    autocast = (
        torch.autocast(device, dtype=torch.bfloat16)
        if workload.dtype == "bfloat16"
        else contextlib.nullcontext()
    )
    m = preset(model_name)
    config = MT5Config(
        vocab_size=m.vocab_size, d_model=m.d_model, d_ff=m.d_ff, num_heads=m.num_heads,
        d_kv=m.d_kv, num_layers=m.num_encoder_layers, num_decoder_layers=m.num_decoder_layers,
        feed_forward_proj="gated-gelu", tie_word_embeddings=False, dropout_rate=0.0,
    )  # fmt: skip
    model = MT5ForConditionalGeneration(config).to(device).train()
    # fused: one kernel for the whole update on CUDA (the fastest torch AdamW there).
    optimizer = torch.optim.AdamW(
        model.parameters(), lr=1e-3, weight_decay=0.01, fused=device == "cuda"
    )
    inputs = torch.randint(2, m.vocab_size, (workload.batch, workload.input_length), device=device)
    labels = torch.randint(2, m.vocab_size, (workload.batch, workload.target_length), device=device)

    def step() -> None:
        with autocast:
            loss = model(input_ids=inputs, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if device == "cuda":
            torch.cuda.synchronize()

    step()  # warm-up
    times = []
    for _ in range(max(workload.steps, 6)):  # as many as t5scale's runs time
        started = time.perf_counter()
        step()
        times.append(time.perf_counter() - started)
    return {"status": "ok", "step_times_s": times}


def worker(spec_path: str, result_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    result = time_transformers(spec["model"], Workload(**spec["workload"]))
    write_result(Path(result_path), result)


def _after_warmup(result: dict) -> list[float]:
    """A run's step times without the warm-up the trial found (none for transformers)."""
    warmup = result.get("step_time_s", {}).get("warmup_samples", 0)
    return result["step_times_s"][warmup:]


def time_runs(specs: list[dict], repeats: int, work_dir: Path) -> list[dict]:
    """Each spec's row, its step times gathered over `repeats` repeats of alternating order; the
    first spec is the reference that "speed vs 1 device" compares with."""
    rows: list[dict | None] = [None] * len(specs)
    medians: list[list[float]] = [[] for _ in specs]
    for r in range(repeats):
        order = list(range(len(specs)))[:: 1 if r % 2 == 0 else -1]
        for index in order:
            if rows[index] is not None and rows[index]["status"] != "ok":
                continue  # compiled once: it does not fit
            spec = specs[index]
            program = (os.path.abspath(__file__), "--worker")
            result = run_trial(
                spec, work_dir, f"repeat{r}-run{index}", TIMEOUT_S,
                program=program if spec["kind"] == "transformers" else TRIAL_PROGRAM,
            )  # fmt: skip
            print(f"repeat {r + 1}/{repeats}: {spec['label']} {result['status']}", file=sys.stderr,
                  flush=True)  # fmt: skip
            if result["status"] not in ("ok", "out-of-memory"):
                sys.exit(f"bench: {spec['label']} failed: {result.get('error')} ({result['log']})")
            row = rows[index] = rows[index] or dict(spec["label"]) | {"status": result["status"],
                                                                      "step_times_s": []}  # fmt: skip
            if "analysis" in result and "compile_s" not in row:  # repeat 1: no cached program
                row["compile_s"] = result["analysis"]["compile_time_s"]
                peak = result["analysis"]["memory_per_device"]["peak_estimate_bytes"]
                row["memory_per_device_gib"] = peak / 2**30
            if result["status"] == "ok":
                kept = _after_warmup(result)
                row["step_times_s"] += kept
                medians[index].append(statistics.median(kept))
    for row, per_repeat in zip(rows, medians, strict=True):
        if row["status"] == "ok":
            row["step_s"] = statistics.median(row["step_times_s"])
            row["repeat_medians_s"] = per_repeat
    for row, per_repeat in zip(rows[1:], medians[1:], strict=True):
        if row["status"] == "ok" and medians[0]:
            # > 1: faster than the reference in the same repeat
            row["speed_vs_1_device"] = statistics.median(
                ref / own for ref, own in zip(medians[0], per_repeat, strict=True)
            )
    return rows


def run_specs(args, workload: Workload, machine: dict, name: str) -> list[dict]:
    devices = CPU_DEVICES if machine["backend"] == "cpu" else machine["device_count"]
    k = args.steps_per_execution
    specs = []
    for head in [] if args.no_t5scale else args.heads:
        # The reference ("speed vs 1 device"): one device at --steps-per-execution.
        specs.append(t5scale_spec(name, 0, 1, workload, k, machine, head))
        if k > 1:
            specs.append(t5scale_spec(name, 0, 1, workload, 1, machine, head))
        if devices > 1 and not args.one_device:
            specs += [t5scale_spec(name, stage, devices, workload, k, machine, head)
                      for stage in range(4)]  # fmt: skip
    if name in args.torch_models and not args.no_torch:
        specs.append(transformers_spec(name, workload))
    return specs


def print_table(rows: list[dict], workload: Workload, args, device_kind: str) -> None:
    print(f"\n{device_kind}: batch {workload.batch}, lengths {workload.input_length}/"
          f"{workload.target_length}, AdamW (no clipping), {workload.dtype} compute, precision "
          f"{workload.precision}, remat {workload.remat}; "
          f"each run in its own process, {max(workload.steps, 6)} steps back to back (t5scale: the "
          "warm-up found in them and left out; transformers: after 1 warm-up step), in "
          f"{args.repeats} repeats of alternating order; step s: the median of all its steps\n")  # fmt: skip
    print("| model | framework | devices | stage | compile s | step s | tokens/s | MFU "
          "| speed vs 1 device |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for row in rows:
        compile_s = f"{row['compile_s']:.1f}" if "compile_s" in row else "-"
        ratio = f"{row['speed_vs_1_device']:.2f}×" if "speed_vs_1_device" in row else "-"
        head = f"| {row['model']} | {row['framework']} | {row['devices']} | {row['stage']} | "
        if row["status"] != "ok":
            print(f"{head}{compile_s} | {row['status']} ({row['memory_per_device_gib']:.1f} "
                  "GiB/device) | | | |")  # fmt: skip
            continue
        print(f"{head}{compile_s} | {row['step_s']:.3g} | {row['tokens_per_s']:,.0f} | "
              f"{100 * row['mfu']:.0f}% | {ratio} |")  # fmt: skip


def command_line() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--models", nargs="+", default=["mt5_tiny", "mt5_small"])
    parser.add_argument("--steps", type=int, default=3, help="timed steps per run and repeat")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--steps-per-execution", type=int, default=1,
                        help="k > 1: t5scale also runs k steps per XLA execution on one device, "
                             "and so on all devices (TrainConfig.steps_per_execution)")  # fmt: skip
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--input-length", type=int, default=512)
    parser.add_argument("--target-length", type=int, default=114)
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--remat", choices=["dots", "minimal", "full"], default="dots")
    parser.add_argument("--precision", choices=["auto", "float32", "mixed"], default="auto",
                        help="t5scale's model state (PrecisionConfig.mode): auto is mixed "
                             "precision with --dtype bfloat16, fp32 otherwise")  # fmt: skip
    parser.add_argument("--torch-models", nargs="*", default=["mt5_small"],
                        help="models that also get the transformers baseline")  # fmt: skip
    parser.add_argument("--heads", nargs="+", choices=["tiled", "whole"], default=["tiled"],
                        help="t5scale's output layer: tiled (the default) and/or whole logits "
                             "(loss_chunk_tokens=0), each run alike, to compare them")  # fmt: skip
    parser.add_argument("--one-device", action="store_true", help="t5scale on one device only")
    parser.add_argument("--no-torch", action="store_true")
    parser.add_argument("--no-t5scale", action="store_true", help="only the baseline")
    parser.add_argument("--out", help="write the results as JSON here too")
    parser.add_argument("--worker", nargs=2, help=argparse.SUPPRESS)  # the baseline's process
    return parser


def main() -> None:
    parser = command_line()
    args = parser.parse_args()
    if args.worker:
        worker(*args.worker)
        return
    if args.steps < 1 or args.repeats < 1 or args.steps_per_execution < 1:
        parser.error("--steps, --repeats and --steps-per-execution must be at least 1")
    workload = Workload(args.batch, args.input_length, args.target_length, args.dtype, args.remat,
                  args.steps, args.precision)  # fmt: skip
    work_dir = Path(tempfile.mkdtemp(prefix="t5scale_bench_"))
    # A cache of this run's own: repeat 1's compile times are compiles, not cache loads.
    os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", str(work_dir / "compile_cache"))
    machine = run_trial({"kind": "machine", "dtype": workload.dtype}, work_dir, "machine", 600)
    if machine["status"] != "ok":
        sys.exit(f"bench: could not probe the machine: {machine.get('error')}")
    peak = machine["peak_flops_per_s"]
    print(f"{workload.dtype} peak: {peak / 1e12:.3f} TFLOP/s ({machine['peak_source']})")
    rows = []
    for name in args.models:
        flops = training_flops_per_step(
            preset(name), workload.batch, workload.input_length, workload.target_length
        )
        for row in time_runs(run_specs(args, workload, machine, name), args.repeats, work_dir):
            row["model_flops_per_step"] = flops
            if row["status"] == "ok":
                row["tokens_per_s"] = workload.run_config().tokens_per_step / row["step_s"]
                # emulated CPU devices share one peak; a GPU run uses one device per process
                row["mfu"] = mfu(flops, row["step_s"], peak, 1 if machine["backend"] == "cpu"
                                 else row["devices"])  # fmt: skip
            rows.append(row)
    print_table(rows, workload, args, machine["device_kind"])
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump({"peak_flops_per_s": peak, "peak_source": machine["peak_source"],
                       "workload": dataclasses.asdict(workload), "device": machine["device_kind"],
                       "repeats": args.repeats, "runs": rows}, f, indent=2)  # fmt: skip


if __name__ == "__main__":
    main()
