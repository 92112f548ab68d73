"""funnel.md: what each round of the funnel dropped and on what evidence, the winner with what
it is tied with, and the device time the funnel saved against timing every grid point."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable, Sequence

from t5scale.study.config import Point
from t5scale.study.funnel import (
    Round,
    Winner,
    configuration_of,
    show_interval,
    synchronisation_words,
    timed_kind,
)
from t5scale.study.records import TrialRecord


def full_grid_estimate(
    grid: Sequence[Point],
    compile_records: Iterable[TrialRecord],
    timed_records: Iterable[TrialRecord],
    repeats: int = 1,
) -> tuple[float, float]:
    """(wall s, device s) that timing every grid point would have cost, as estimated here.

    A grid trial compiles and then times; the funnel ran those halves as separate trials (the
    timed one loading the step from the compilation cache), so a point is charged both. What
    the funnel measured is charged as measured (a reused timing at what measuring it cost). A
    point it never compiled or timed is charged the median measured trial of the same model,
    kind and device count, or of the nearest device count measured.
    """
    measured = {}
    walls: dict[tuple[str, str, int], list[float]] = defaultdict(list)
    for record in [*compile_records, *timed_records]:
        wall = record.wall_s if record.measured_wall_s is None else record.measured_wall_s
        measured[record.key] = (record.result.status, wall)
        walls[record.kind, record.point.model, record.point.devices].append(wall)

    def estimate(kind: str, model: str, devices: int) -> float:
        near = sorted((abs(d - devices), d) for k, m, d in walls if k == kind and m == model)
        if not near:
            return 0.0
        values = sorted(walls[kind, model, near[0][1]])
        return values[len(values) // 2]

    wall = device = 0.0
    for point in grid:
        status, cost = measured.get(point.key("compile"), (None, None))
        if cost is None:
            cost = estimate("compile", point.model, point.devices)
        if status in (None, "ok"):  # a point that fit (or was never checked) is also timed
            for repeat in range(repeats):
                timed = measured.get(point.key(timed_kind(repeat)), (None, None))[1]
                cost += (
                    timed if timed is not None else estimate("timed", point.model, point.devices)
                )
        wall += cost
        device += cost * point.devices
    return wall, device


def remat_words(record: TrialRecord) -> str:
    """The trial's remat policy, with what 'auto' chose."""
    analysis = record.result.analysis
    if analysis is not None and analysis.remat.requested == "auto":
        return f"auto → {analysis.remat.policy}"
    return record.point.remat


def _winner_lines(model: str, winner: Winner, objective: str) -> list[str]:
    """funnel.md's lines on a model's winner and what it does not beat."""
    sign = -1 if objective == "loss" else 1
    unit = "loss" if objective == "loss" else "tokens/s/device"
    point, timing = winner.record.point, winner.record.result.timing
    lines = [
        f"- **{model}**: ZeRO stage {point.stage}, micro-batch {point.micro_batch_size}, remat "
        f"{remat_words(winner.record)}, lr {point.learning_rate:g}, {synchronisation_words(point)} at "
        f"{point.devices} devices: {show_interval(winner.interval, sign, winner.level)} {unit}, step "
        f"{timing.step_time_s.median:.3g} s, final loss {timing.final_loss:.4f}"
    ]
    if winner.tied:
        lines.append(f"  - tied within the evidence (not beaten with the stated confidence): "
                     f"{len(winner.tied)}")  # fmt: skip
        lines += [
            f"    - {configuration_of(r).label()}: {show_interval(interval, sign, winner.level)}"
            for r, interval in winner.tied
        ]
    elif winner.rivals:
        lines.append(f"  - ahead of the {winner.rivals} other(s) of its last round with the "
                     "stated confidence")  # fmt: skip
    else:
        lines.append("  - the only one of its model left in the last round (the earlier "
                     "rounds dropped the others on the evidence above)")  # fmt: skip
    return lines


def render(
    rounds: Sequence[Round],
    best: dict[str, Winner],
    objective: str,
    spent: tuple[float, float],
    full_grid: tuple[float, float] | None,
) -> str:
    """funnel.md: rounds, what each dropped and on what evidence, the winners and their ties,
    and the device-time spent against the full grid."""
    lines = [
        "# Funnel",
        "",
        f"Objective: `{objective}` (higher tokens/s per device wins; for `loss`, the lower loss "
        "after the token budget). Each round's configurations are grid points without their "
        "device count. At each device count the configurations still in are first compiled "
        "(no step runs) and those that do not fit the memory budget are not timed there; the "
        "rest are timed until the median step time is known to the stated precision (or the "
        "budget is spent), and a configuration is dropped only when it is worse than its "
        "model's best with the stated confidence: with two or more trials per configuration, "
        "the best's lead over it passes a one-sided two-sample t test on the trials' log "
        "medians (the variance pooled over the round, Bonferroni over its comparisons); with one, "
        "its interval lies wholly below the best's. Intervals: median [low, high] (confidence, "
        "samples), each at the round's Bonferroni level (docs/funnel.md).",
        "",
        "| round | entered | trials | failed (why) | dropped | left | trial wall s | device·s |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for round_ in rounds:
        why = ", ".join(f"{n} {status}" for status, n in sorted(round_.reasons().items())) or "-"
        lines.append(
            f"| {round_.name} | {round_.entered} | {len(round_.records)} | {why} | {round_.pruned} | {round_.left} | "
            f"{round_.wall_s():.0f} | {round_.device_s():.0f} |"
        )
    notes = [f"- {round_.name}: {round_.note}" for round_ in rounds if round_.note]
    if notes:
        lines += ["", *notes]
    for round_ in rounds:
        if round_.dropped:
            lines += ["", f"Dropped in round {round_.name}:", ""]
            lines += [f"- {drop.evidence(objective)}" for drop in round_.dropped]
    lines += ["", "## Winner", ""]
    if not best:
        lines.append("No configuration ran to the end.")
    for model, winner in sorted(best.items()):
        lines += _winner_lines(model, winner, objective)
    wall, device = spent
    lines += ["", "## Device time", "", f"Spent: {wall:.0f} s of trials, {device:.0f} device·s "
              "(trial wall time × its device count)."]  # fmt: skip
    if full_grid:
        grid_wall, grid_device = full_grid
        lines.append(
            f"Timing every grid point would have cost about {grid_wall:.0f} s and "
            f"{grid_device:.0f} device·s (estimated: see `full_grid_estimate` in "
            f"t5scale/study/funnel_report.py): the funnel saved {100 * (1 - device / grid_device):.0f}% "
            "of the device time."
            if grid_device
            else "No grid estimate: nothing was compiled."
        )
    return "\n".join(lines) + "\n"
