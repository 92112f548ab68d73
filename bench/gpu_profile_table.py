"""Where a profiled step's time went on the device, by kernel class, beside the cluster model's
prediction for each class: one table per step item that the GPU check profiled (issue 59;
bench/gpu_check_profile.py saves the profiles, t5scale/analysis/device_profile.py reads them).

    python bench/gpu_profile_table.py gpu_check      # the run's --out directory
    python bench/gpu_profile_table.py gpu_check --top 15   # and each step's top other kernels

No GPU needed: the profiles, the programs and the predictions are in the run's directory.
"""

from __future__ import annotations

import argparse
import gzip
from pathlib import Path
from typing import Any

from gpu_check_list import read_lines

# Each class's counterpart among the cluster model's (predict_program's compute_by_class_s);
# None: it has none. Its fusions are both ours; its collectives are its communication.
MODEL_CLASS = {
    "gemm": "gemm",
    "attention": "attention",
    "elementwise": "fusion",
    "reduction": None,
    "copy": "copy",
    "collective": None,
    "other": "other",
}
_LABELS = {
    "gemm": "GEMMs",
    "attention": "attention kernels",
    "elementwise": "elementwise fusions",
    "reduction": "reduction fusions",
    "copy": "copies and transposes",
    "collective": "collectives",
    "other": "other",
}


def profile_tables(results: Path, top: int = 0) -> str:
    """The tables of every profiled step item of a run, from its results.jsonl ('' if none
    was profiled). A profile that cannot be read costs its own table alone."""
    merged: dict[str, dict[str, Any]] = {}
    for line in read_lines(results):
        merged.setdefault(line["item"], {}).update(line)
    text = []
    for item, row in merged.items():
        if "profile" not in row:
            continue
        if not row["profile"]:
            text += ["", f"{item}: not profiled — {row.get('why')}"]
            continue
        try:
            trace, module = _read_profile(results.parent / row["profile"])
            text += ["", *item_table(trace, module, item, row)]
            text += rates_table(trace, module, row)
            text += [*top_table(trace, module, row, top)] if top else []
        except Exception as error:  # noqa: BLE001 (the run's other tables still print)
            text += ["", f"{item}: its profile could not be read — {type(error).__name__}: {error}"]
    if not text:
        return ""
    return "\n".join(["", "## Where the profiled steps' time went on the device", *text]) + "\n"


def _read_profile(directory: Path):
    """(the trace, the parsed program) of one profiled step, read once for its tables."""
    from t5scale.analysis.device_profile import read_trace
    from t5scale.analysis.hlo_module import parse_module

    with gzip.open(directory / "program.hlo.txt.gz", "rt") as program:
        module = parse_module(program.read())
    return read_trace(directory / "trace.json.gz"), module


def item_table(trace, module, item: str, row: dict[str, Any]) -> list[str]:
    from t5scale.analysis.device_profile import device_profile

    profile = device_profile(trace, module, row["profiled_steps"])
    wall = profile.wall_s
    text = [f"### {item}", "", _about(profile, row), "",
            "| class | per step | share of the wall | kernels per step | cluster model |",
            "|---|---|---|---|---|"]  # fmt: skip
    predicted = row.get("predicted_by_class_s") or {}
    for kind, label in _LABELS.items():
        seconds = profile.seconds[kind]
        text.append(f"| {label} | {_ms(seconds)} | {_share(seconds, wall)} | "
                    f"{profile.kernels[kind]:,.0f} | {_model(kind, predicted, row)} |")  # fmt: skip
    kernels = sum(profile.seconds.values())
    compute = row.get("predicted_compute_s")
    text += [
        f"| all kernels | {_ms(kernels)} | {_share(kernels, wall)} | "
        f"{sum(profile.kernels.values()):,.0f} | {_ms(compute) if compute else '–'} |",
        f"| less kernels at once on two lanes | {_ms(-profile.concurrent_s)} | | | |",
        f"| idle between kernels | {_ms(profile.idle_s)} | {_share(profile.idle_s, wall)} | | "
        + _launches(row)
        + " |",
        f"| the step on the device | {_ms(wall)} | 100% | | {_ms(row.get('predicted_step_s'))} |",
        f"| of which the head and loss | {_ms(profile.cuts['head_and_loss'])} | "
        f"{_share(profile.cuts['head_and_loss'], wall)} | | none |",
        f"| of which the update after the gradient (AdamW) | {_ms(profile.cuts['update'])} | "
        f"{_share(profile.cuts['update'], wall)} | | none |",
    ]
    return text


def rates_table(trace, module, row: dict[str, Any]) -> list[str]:
    """The step's fusions and copies by size, at the bytes a second they ran at, and its
    attention kernels by pass (t5scale/analysis/kernel_rates.py)."""
    from t5scale.analysis.kernel_rates import attention_by_pass, bandwidth_by_size

    steps = row["profiled_steps"]
    text = ["", "Its fusions and copies by size (bytes read and written, as the kernel inventory "
            "counts them):", "", "| kernels of | per step | bytes | time | rate |",
            "|---|---|---|---|---|"]  # fmt: skip
    for band in bandwidth_by_size(trace, module, steps):
        text.append(f"| {band.label} | {band.kernels:,.0f} | {band.bytes / 1e9:.2f} GB | "
                    f"{_ms(band.seconds)} | {band.rate / 1e12:.2f} TB/s |")  # fmt: skip
    passes = attention_by_pass(trace, steps)
    if passes:
        text += ["", "Its attention kernels by pass:", "", "| pass | per step |", "|---|---|"]
        text += [f"| {name} | {_ms(seconds)} |" for name, seconds in passes.items()]
    return text


def top_table(trace, module, row: dict[str, Any], top: int) -> list[str]:
    """The step's `top` instructions by device time that are neither GEMMs nor attention."""
    from t5scale.analysis.top_ops import top_ops

    ops = top_ops(trace, module, row["profiled_steps"], ("gemm", "attention"), top)
    text = ["", f"Its {top} other instructions with the most time:", "",
            "| instruction | class | per step | kernels per step | what | op_name |",
            "|---|---|---|---|---|---|"]  # fmt: skip
    for op in ops:
        text.append(f"| {op.instruction} | {op.kind} | {_ms(op.seconds)} | {op.launches:,.0f} | "
                    f"{op.summary} | {op.op_name} |")  # fmt: skip
    return text


def _about(profile, row: dict[str, Any]) -> str:
    where = ("XLA:CPU's operations on the host's threads: the dry run, which proves the reader "
             "and measures no GPU" if row.get("profile_on") == "cpu" else
             "the kernels on the device's streams")  # fmt: skip
    text = (f"{profile.steps} steps profiled ({where}); the device's wall "
            f"{_ms(profile.wall_s)} per step against the timed steps' median "
            f"{_ms(row.get('step_s'))}.")  # fmt: skip
    if row.get("profile_on") == "gpu":  # CommandBufferThunk, while a profiler runs
        text += " While profiling, XLA runs its CUDA graphs kernel by kernel."
    notes = [
        f"{profile.by_name} kernels classed by their own name" if profile.by_name else "",
        f"{profile.by_place} library kernels joined to their instruction by their place"
        if profile.by_place else "",
        f"{profile.containers} events left out for holding others" if profile.containers else "",
        f"{profile.other_programs} of other programs left out" if profile.other_programs else "",
        f"{len(profile.uneven_ops)} HLO ops whose count the steps do not divide"
        if profile.uneven_ops else "",
    ]  # fmt: skip
    notes = [note for note in notes if note]
    return text + (f" Read: {'; '.join(notes)}." if notes else "")


def _model(kind: str, predicted: dict[str, float], row: dict[str, Any]) -> str:
    if kind == "elementwise" and "fusion" in predicted:
        return f"{_ms(predicted['fusion'])} (its fusions: this row and the next)"
    if kind == "reduction":
        return "in its fusions, above"
    if kind == "collective" and "predicted_step_s" in row:
        exposed = row["predicted_step_s"] - row["predicted_compute_s"]
        return f"{_ms(exposed)} exposed communication"
    model = MODEL_CLASS[kind]
    return _ms(predicted[model]) if model in predicted else "–"


def _launches(row: dict[str, Any]) -> str:
    launches = row.get("predicted_launch_s")
    if launches is None:
        return "none"
    return f"none (its launches, {_ms(launches)}, are in the classes)"


def _ms(seconds: float | None) -> str:
    return "–" if seconds is None else f"{seconds * 1e3:,.3f} ms"


def _share(seconds: float, wall: float) -> str:
    return f"{100 * seconds / wall:.1f}%" if wall else "–"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("out", type=Path, help="the GPU check's --out directory")
    parser.add_argument("--top", type=int, default=0, help="each step's top N other kernels")
    args = parser.parse_args()
    print(profile_tables(args.out / "results.jsonl", args.top) or "No step item was profiled.\n",
          end="")  # fmt: skip


if __name__ == "__main__":
    main()
