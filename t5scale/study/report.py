"""report.md and PNG plots from a study's results.jsonl (`t5scale report STUDY_DIR`).

Where the grid has several micro-batch sizes, remat policies or learning rates for one model,
stage and device count, the tables and plots show the best of them by tokens/s per device (the
full rows are in results.jsonl).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from pathlib import Path

from t5scale.errors import ConfigError
from t5scale.model.sizes import PRESETS
from t5scale.study.records import TrialRecord, parse_results

GIB = 2**30
STAGE_COLOURS = {0: "#4c72b0", 1: "#dd8452", 2: "#55a868", 3: "#c44e52"}


def load_results(study_dir: str | Path) -> tuple[list[TrialRecord], list[int]]:
    """results.jsonl's records, and the numbers of its lines that are no record (a line cut by
    a kill, whose trial the study reruns, or one that is not results.jsonl's at all); a
    ConfigError where no trial completed, since then there is nothing to plot."""
    path = Path(study_dir, "results.jsonl")
    if not path.is_file():
        raise ConfigError(f"{path} does not exist: run `t5scale study` with that STUDY_DIR first")
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as error:
        raise ConfigError(f"{path}: cannot be read: {error}") from None
    skipped: list[int] = []
    records = list(parse_results(text, skipped.append).values())
    if not any(record.result.status == "ok" for record in records):
        lines = "lines {} are not records" if len(skipped) > 1 else "line {} is not a record"
        bad = f"; {lines.format(_numbers(skipped))}" if skipped else ""
        raise ConfigError(f"{path}: no completed trial to report ({len(records)} records{bad})")
    return records, skipped


def _numbers(numbers: Sequence[int], shown: int = 5) -> str:
    more = f" and {len(numbers) - shown} more" if len(numbers) > shown else ""
    return ", ".join(map(str, numbers[:shown])) + more


PointKey = tuple[str, int, int]  # model, stage, devices


def _point_of(record: TrialRecord) -> PointKey:
    return record.point.model, record.point.stage, record.point.devices


def best_timed(records: Sequence[TrialRecord]) -> dict[PointKey, TrialRecord]:
    """(model, stage, devices) → the ok timed trial with the most tokens/s per device."""
    best: dict[PointKey, TrialRecord] = {}
    for record in records:
        if record.kind != "timed" or record.result.status != "ok" or record.repeat:
            continue  # a point's first trial (its repeats are in results.jsonl)
        if record.result.timing is None or record.result.analysis is None:
            continue  # a line by hand or an older writer: nothing to plot
        key = _point_of(record)
        speed = record.result.timing.tokens_per_s_per_device
        if key not in best or speed > best[key].result.timing.tokens_per_s_per_device:
            best[key] = record
    return best


@dataclasses.dataclass(frozen=True)
class MemoryPoint:
    """A point's smallest compiled memory: XLA's per-device peak and the ZeRO formula's."""

    xla_peak: int
    formula: float
    budget: int | None
    fits: bool


def memory_points(records: Sequence[TrialRecord]) -> dict[PointKey, MemoryPoint]:
    """(model, stage, devices) → the smallest XLA estimate compiled (out-of-memory included)."""
    points: dict[PointKey, MemoryPoint] = {}
    for record in records:
        analysis = record.result.analysis
        if analysis is None:
            continue
        key = _point_of(record)
        peak = analysis.memory_per_device.peak_estimate_bytes
        if key not in points or peak < points[key].xla_peak:
            points[key] = MemoryPoint(
                xla_peak=peak,
                formula=analysis.model_state_per_device.zero_formula_bytes.total,
                budget=record.result.memory_budget_bytes,
                fits=record.result.status != "out-of-memory",
            )
    return points


def write_report(study_dir: str | Path) -> Path:
    study_dir = Path(study_dir)
    records, skipped = load_results(study_dir)
    best = best_timed(records)
    memory = memory_points(records)
    models = sorted({r.point.model for r in records}, key=_model_order)
    plots = {
        "step_time.png": _plot_lines(best, models, "step", "seconds per step", "Step time"),
        "tokens_per_device.png": _plot_lines(
            best, models, "per_device", "tokens/s per device", "Tokens/s per device (scaling)"
        ),
        "mfu.png": _plot_lines(best, models, "mfu", "MFU (%)", "Model FLOPs utilisation"),
        "memory.png": _plot_memory(memory, models),
    }
    for name, figure in plots.items():
        figure.savefig(study_dir / name, dpi=110, bbox_inches="tight")
    path = study_dir / "report.md"
    text = _markdown(study_dir, records, best, memory, models)
    if skipped:
        many = len(skipped) > 1
        text += (f"\n{len(skipped)} line{'s' * many} of results.jsonl "
                 f"{'are not records' if many else 'is not a record'}, left out "
                 f"(line{'s' * many} {_numbers(skipped)}).\n")  # fmt: skip
    path.write_text(text, encoding="utf-8")
    return path


def _model_order(name: str) -> int:
    order = ("tiny", "small", "base", "large", "xl", "xxl")
    return next((i for i, size in enumerate(order) if name.endswith("_" + size)), len(order))


def _value(record: TrialRecord, what: str) -> float:
    timing = record.result.timing
    if what == "step":
        return timing.step_time_s.median
    if what == "per_device":
        return timing.tokens_per_s_per_device
    return float("nan") if timing.mfu is None else 100 * timing.mfu  # none: a simulated trial


def _bounds(record: TrialRecord, what: str) -> tuple[float, float]:
    """The interval of the step time's median (min and max in a study before intervals), or of
    tokens/s per device derived from it."""
    timing = record.result.timing
    step = timing.step_time_s
    if what == "step":
        return step.low, step.high
    per_device = timing.tokens_per_s_per_device * step.median
    return per_device / step.high, per_device / step.low


def _or_dash(value: float | None, form: str) -> str:
    return "—" if value is None else form.format(value)


def _gib(value: float | None) -> str:
    return "—" if value is None else f"{value / GIB:.2f}"


def _figure(models: Sequence[str]):
    # Here, not at the top: the headless backend must be chosen before pyplot is imported, and
    # only `t5scale report` draws.
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(1, len(models), figsize=(4.6 * len(models), 3.8), squeeze=False)
    return figure, axes[0]


def _plot_lines(best, models, what: str, ylabel: str, title: str):
    figure, axes = _figure(models)
    for ax, model in zip(axes, models, strict=True):
        for stage in range(4):
            points = sorted((d, r) for (m, s, d), r in best.items() if m == model and s == stage)
            if not points:
                continue
            xs = [d for d, _ in points]
            ys = [_value(r, what) for _, r in points]
            ax.plot(xs, ys, marker="o", color=STAGE_COLOURS[stage], label=f"ZeRO {stage}")
            if what in ("step", "per_device"):  # the median's interval, as error bars
                bounds = [_bounds(r, what) for _, r in points]
                below = [y - low for y, (low, _) in zip(ys, bounds, strict=True)]
                above = [high - y for y, (_, high) in zip(ys, bounds, strict=True)]
                ax.errorbar(xs, ys, yerr=[below, above], fmt="none", capsize=3,
                            color=STAGE_COLOURS[stage])  # fmt: skip
        ax.set_xscale("log", base=2)
        ax.set_xlabel("devices")
        ax.set_ylabel(ylabel)
        ax.set_title(model)
        ax.grid(alpha=0.3)
        if ax.get_legend_handles_labels()[0]:  # none where every trial failed
            ax.legend(fontsize=8)
    figure.suptitle(f"{title} (best micro-batch and remat per point; lines end where pruned)")
    return figure


def _plot_memory(memory, models):
    figure, axes = _figure(models)
    for ax, model in zip(axes, models, strict=True):
        device_counts = sorted({count for (m, _, count) in memory if m == model})
        width = 0.8 / max(len(device_counts), 1)
        for index, count in enumerate(device_counts):
            stages = [s for s in range(4) if (model, s, count) in memory]
            xs = [s - 0.4 + width * (index + 0.5) for s in stages]
            peaks = [memory[model, s, count].xla_peak / GIB for s in stages]
            formula = [memory[model, s, count].formula / GIB for s in stages]
            ax.bar(xs, peaks, width * 0.9, label=f"XLA, {count} dev", alpha=0.8)
            ax.scatter(xs, formula, marker="_", s=200, color="black", zorder=3,
                       label="ZeRO formula (model state)" if index == 0 else None)  # fmt: skip
        ax.set_xticks(range(4), [f"ZeRO {s}" for s in range(4)])
        ax.set_ylabel("GiB per device")
        ax.set_title(model)
        ax.grid(alpha=0.3, axis="y")
    handles, labels = axes[0].get_legend_handles_labels()
    if labels:  # none where no trial compiled
        figure.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=8,
                      bbox_to_anchor=(0.5, -0.08))  # fmt: skip
    figure.suptitle("Memory per device: XLA's compiled estimate (bars) and the ZeRO formula")
    return figure


def _markdown(study_dir, records, best, memory, models) -> str:
    lines = [f"# Study report: {study_dir}", "", *_preamble(records)]
    lines += [
        "",
        "![step time](step_time.png)",
        "![tokens per device](tokens_per_device.png)",
        "![MFU](mfu.png)",
        "![memory](memory.png)",
        "",
        "## Timed trials (best per model, stage and device count)",
        "",
        "Best over micro-batch size, remat and learning rate, each configuration by its first "
        "timed trial (its repeats, which the funnel compares, are in results.jsonl).",
        "",
        "| model | stage | devices | batch | step s [low, high] | n | tokens/s | tokens/s/device "
        "| MFU | XLA GiB/device | allocator peak GiB | ZeRO formula GiB | compile s "
        "| collectives per step |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    compile_time = {
        record.key.split(":", 1)[1]: record.result.analysis.compile_time_s
        for record in records
        if record.kind == "compile" and record.result.analysis is not None
    }
    ordered = sorted(best.items(), key=lambda kv: (_model_order(kv[0][0]), kv[0][1:]))
    lines += [_timed_row(point, record, compile_time) for point, record in ordered]
    if any(record.same_program_as is not None for record in best.values()):
        lines += ["", "† the same compiled program as another stage's trial at this device count "
                  "(on one device every stage is): its timing is reused, not measured again."]  # fmt: skip
    failed = [record for record in records if record.result.status != "ok"]
    lines += ["", f"## Trials that did not run ({len(failed)})", ""]
    if failed:
        lines += ["| kind | model | stage | devices | micro-batch | remat | status | why |",
                  "|---|---|---|---|---|---|---|---|"]  # fmt: skip
        for record in failed:
            point, result = record.point, record.result
            lines.append(
                f"| {record.kind} | {point.model} | {point.stage} | {point.devices} | "
                f"{point.micro_batch_size} | {point.remat} | {result.status} | {result.error or ''} |"
            )
    funnel = Path(study_dir, "funnel.md")
    if funnel.exists():
        lines += ["", "The funnel's rounds: [funnel.md](funnel.md)."]
    return "\n".join(lines) + "\n"


def _preamble(records: Sequence[TrialRecord]) -> list[str]:
    """report.md's paragraph on the machine, the trials' shared settings and how they were
    measured."""
    ran = next((record for record in records if record.machine is not None), None)
    machine = ran.machine if ran else None
    peak = next((r.peak_flops_per_s for r in records if r.peak_flops_per_s is not None), 0.0)
    timed = [record for record in records if record.kind == "timed"]
    steps = next(
        (r.result.timing.step_time_s for r in timed if r.result.status == "ok" and r.result.timing),
        None,
    )
    kind, backend, source = (
        (machine.device_kind, machine.backend, machine.peak_source) if machine else ("?",) * 3
    )
    lines = [
        f"Machine: {kind} ({backend}); peak {peak / 1e12:.3g} TFLOP/s per device ({source}).",
    ]
    shared = _model_settings(ran) if ran else []
    if shared:
        lines.append(f"Every trial's model also had: `{'`, `'.join(shared)}`.")
    precisions = sorted({
        (record.point.dtype, record.result.analysis.precision.mode)
        for record in records if record.result.analysis is not None
    })  # fmt: skip
    if precisions:
        said = ", ".join(f"{dtype} compute with {mode} model state" for dtype, mode in precisions)
        lines.append(f"Precision: {said} (t5scale/train/precision.py).")
    if steps:
        lines.append(
            "Step time: the median of the timed steps, each to block_until_ready, after the "
            "warm-up steps found in the timings (t5scale/study/evidence.py); [low, high]: the "
            f"median's distribution-free interval ({100 * (steps.confidence or 0.95):.0f}% or "
            "more), n: the timed samples; the plots draw it as error bars. Compile time from "
            "the compile-only round where there was one. Memory at run time: the allocator's "
            "peak where the backend reports one (— where it does not, as on the CPU)."
        )
    if backend == "cpu":
        lines.append(
            "On the CPU the emulated devices share this machine's cores and its one measured "
            "peak: more devices cannot be faster here, and tokens/s per device falls by "
            "construction. What the CPU shows truly is memory per device and the collectives."
        )
    return lines


def _timed_row(point: PointKey, record: TrialRecord, compile_time: dict[str, float]) -> str:
    """The row of report.md's table of timed trials for `point`'s best trial."""
    (model, stage, devices), result = point, record.result
    analysis, timing = result.analysis, result.timing
    low, high = _bounds(record, "step")
    compiled_s = compile_time.get(record.key.split(":", 1)[1], analysis.compile_time_s)
    state = analysis.model_state_per_device
    return (
        f"| {model} | {stage} | {devices} | {record.point.batch_size} | "
        f"{timing.step_time_s.median:.3g}{' †' if record.same_program_as is not None else ''} "
        f"[{low:.3g}, {high:.3g}] | {timing.step_time_s.samples or '?'} | "
        f"{_or_dash(timing.tokens_per_s, '{:,.0f}')} | {timing.tokens_per_s_per_device:,.0f} | "
        f"{_or_dash(timing.mfu and 100 * timing.mfu, '{:.1f}%')} | {analysis.memory_per_device.peak_estimate_bytes / GIB:.2f} | "
        f"{_gib(timing.allocator_peak_bytes)} | "
        f"{state.zero_formula_bytes.total / GIB:.2f} ({state.zero_formula}) | "
        f"{compiled_s:.1f} | {analysis.collectives.summary()} |"
    )


def _model_settings(record: TrialRecord) -> list[str]:
    """What the trial's model set beyond its size and the grid (remat, dtype), e.g.
    `ModelConfig.scan_layers=False`: from its run, or in a line written before runs were kept,
    from its gin bindings."""
    if record.run is None:
        return [b for b in record.gin_bindings if b.startswith("ModelConfig.")
                and "remat" not in b and "dtype" not in b]  # fmt: skip
    model, size = record.run.model, PRESETS.get(record.run.model.name)
    if size is None:  # a custom model's gin file: no size to compare with
        return []
    return [
        f"ModelConfig.{field.name}={getattr(model, field.name)!r}"
        for field in dataclasses.fields(model)
        if field.name not in ("remat", "dtype")
        and getattr(model, field.name) != getattr(size, field.name)
    ]
