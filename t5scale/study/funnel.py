"""The funnel's decisions and its account (funnel.md): pure functions over trial records."""

from __future__ import annotations

import dataclasses
import math
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from typing import Any

from t5scale.study.config import Configuration, Point


def score(record: dict[str, Any], objective: str) -> float:
    """Higher is better: tokens/s per device, or the negated loss after the token budget."""
    if objective == "loss":
        return -record["final_loss"]
    return record["tokens_per_s_per_device"]


def keep_best(
    records: Sequence[dict[str, Any]], objective: str, keep_fraction: float
) -> set[Configuration]:
    """Per model, the best ceil(keep_fraction · n) configurations of n timed ok (at least one)."""
    by_model: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for record in records:
        if record["status"] == "ok":
            by_model[record["config"]["model"]].append(record)
    kept = set()
    for group in by_model.values():
        group.sort(key=lambda r: score(r, objective), reverse=True)
        kept |= {
            configuration_of(r) for r in group[: max(1, math.ceil(keep_fraction * len(group)))]
        }
    return kept


def _synchronised(config: dict[str, Any]) -> str:
    """How the point's replicas synchronise, in words."""
    sync = config.get("sync", "every_step")
    if sync == "every_step":
        return "synchronised every step"
    mode, _, every = sync.partition("/")
    return f"{mode.replace('_', ' ')} every {every} steps over {config['replicas']} replicas"


def configuration_of(record: dict[str, Any]) -> Configuration:
    """The record's configuration (a field a study before it lacks: its default)."""
    config = record["config"]
    return Configuration(
        *(config.get(f.name, f.default) for f in dataclasses.fields(Configuration))
    )


@dataclasses.dataclass
class Round:
    """One round of the funnel: what entered, what was run, what left and why."""

    name: str
    entered: int
    records: list[dict[str, Any]]
    left: int = 0
    pruned: int = 0  # ranked below the cut
    note: str = ""

    def reasons(self) -> Counter:
        return Counter(r["status"] for r in self.records if r["status"] != "ok")

    def wall_s(self) -> float:
        return sum(r["wall_s"] for r in self.records)

    def device_s(self) -> float:
        return sum(r["wall_s"] * r["config"]["devices"] for r in self.records)


def full_grid_estimate(
    grid: Sequence[Point],
    compile_records: Iterable[dict[str, Any]],
    timed_records: Iterable[dict[str, Any]],
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
        wall = record.get("measured_wall_s", record["wall_s"])
        measured[record["key"]] = (record["status"], wall)
        walls[record["kind"], record["config"]["model"], record["config"]["devices"]].append(wall)

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
            timed = measured.get(point.key("timed"), (None, None))[1]
            cost += timed if timed is not None else estimate("timed", point.model, point.devices)
        wall += cost
        device += cost * point.devices
    return wall, device


def render(
    rounds: Sequence[Round],
    winners: dict[str, dict[str, Any]],
    objective: str,
    spent: tuple[float, float],
    full_grid: tuple[float, float] | None,
) -> str:
    """funnel.md: rounds, reasons, winners, and the device-time spent against the full grid."""
    lines = [
        "# Funnel",
        "",
        f"Objective: `{objective}` (higher tokens/s per device wins; for `loss`, the lower loss "
        "after the token budget). Each round's configurations are grid points without their "
        "device count. At each device count the configurations still in are first compiled "
        "(no step runs) and those that do not fit the memory budget are not timed there; the "
        "rest are timed, and the best fraction per model goes on to the next device count.",
        "",
        "| round | entered | trials | failed (why) | pruned | left | trial wall s | device·s |",
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
    lines += ["", "## Winner", ""]
    if not winners:
        lines.append("No configuration ran to the end.")
    for model, record in sorted(winners.items()):
        config = record["config"]
        lines.append(
            f"- **{model}**: ZeRO stage {config['stage']}, micro-batch {config['micro_batch_size']}, remat "
            f"{config['remat']}, lr {config['learning_rate']:g}, {_synchronised(config)} at "
            f"{config['devices']} devices: "
            f"{record['tokens_per_s_per_device']:,.0f} tokens/s per device, step "
            f"{record['step_time_s']['median']:.3g} s, final loss {record['final_loss']:.4f}"
        )
    wall, device = spent
    lines += ["", "## Device time", "", f"Spent: {wall:.0f} s of trials, {device:.0f} device·s "
              "(trial wall time × its device count)."]  # fmt: skip
    if full_grid:
        grid_wall, grid_device = full_grid
        lines.append(
            f"Timing every grid point would have cost about {grid_wall:.0f} s and "
            f"{grid_device:.0f} device·s (estimated: see `full_grid_estimate` in "
            f"t5scale/study/funnel.py): the funnel saved {100 * (1 - device / grid_device):.0f}% "
            "of the device time."
            if grid_device
            else "No grid estimate: nothing was compiled."
        )
    return "\n".join(lines) + "\n"
