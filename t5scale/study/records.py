"""A trial's records: what the study asks of it (`TrialSpec`), what its process found
(`TrialResult`: a status, the compiled step's analysis, the timing), and what results.jsonl
keeps of it (`TrialRecord`: the result in its study's context).

JSON only where a file is written or read: the trial's SPEC.json and RESULT.json
(t5scale/study/trial.py), machine.json, and results.jsonl (`parse_results`), whose lines keep
their format. A line written before a Point field or value was renamed is read under the new
name.
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Callable, Mapping
from typing import Any, Self

from t5scale.analysis.records import StepAnalysis
from t5scale.jsonform import JsonRecord, fields_from_json, fields_to_json, written_when_none
from t5scale.study.config import Point
from t5scale.study.evidence import Interval, Measurement, TimingRule
from t5scale.target import topology_from_json
from t5scale.train.config import RunConfig
from t5scale.xla_gpu import GpuTopology
from t5scale.xla_tpu import TpuTopology


@dataclasses.dataclass(frozen=True)
class Machine(JsonRecord):
    """The backend the study's trials run on, probed once per study (machine.json)."""

    backend: str
    device_kind: str
    device_count: int
    peak_flops_per_s: float
    peak_source: str
    device_memory_limit_bytes: int | None  # None: the backend reports no limit (the CPU)
    host_memory_bytes: int

    def label(self) -> MachineLabel:
        return MachineLabel(self.backend, self.device_kind, self.peak_source)


@dataclasses.dataclass(frozen=True)
class MachineLabel(JsonRecord):
    """Which machine ran a trial, as its record names it."""

    backend: str
    device_kind: str
    peak_source: str


@dataclasses.dataclass(frozen=True, kw_only=True)
class StepTimes(JsonRecord):
    """A trial's step time: the median and its interval (evidence.Interval's fields), how the
    measurement stopped (evidence.Measurement.summary) and how the samples were taken
    (t5scale/study/measure.py). A drawn trial of known speed (known_speeds.py) has only the first two."""

    low: float
    median: float
    high: float
    confidence: float | None = None  # None: a study before intervals (low, high: min, max)
    samples: int | None = None
    of: str = "steps"
    warmup_samples: int = 0
    precise: bool | None = None
    stopped_by: str | None = None
    statistic: str | None = None
    steps_per_sample: int | None = None
    timed_steps: int | None = None
    warmup_steps: int | None = None
    min: float | None = None
    max: float | None = None
    spread: float | None = None  # (max - min) / median
    precision_asked: float | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        # A study before intervals recorded the timed steps' range instead.
        bounds = {
            "low": data.get("low", data.get("min")),
            "high": data.get("high", data.get("max")),
        }
        return super().from_json(dict(data) | bounds)

    @classmethod
    def measured(cls, found: Measurement) -> Self:
        """What `evidence.measure` found, before how the samples were taken is added."""
        return cls(**found.interval.as_dict(), warmup_samples=found.warmup,
                   precise=found.precise, stopped_by=found.stopped_by)  # fmt: skip

    @property
    def interval(self) -> Interval:
        return Interval(self.low, self.median, self.high, self.confidence or 0.95,
                        self.samples or 0, self.of)  # fmt: skip


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialTiming(JsonRecord):
    """What a timed trial measured: its step times and what follows from them, and the loss.
    A drawn trial of known speed (t5scale/study/known_speeds.py) has no loss, MFU or memory."""

    step_time_s: StepTimes
    step_times_s: tuple[float, ...]  # per sample, the warm-up included
    losses: tuple[float, ...] = ()
    allocator_peak_bytes: int | None = written_when_none()  # None: the backend reports none
    tokens_per_step: int
    tokens_per_s: float | None = None
    tokens_per_s_per_device: float
    mfu: float | None = None
    final_loss: float | None = None
    # the loss's median over the last quarter of the steps, with its interval
    loss_interval: Interval | None = None
    loss_samples: tuple[float, ...] = ()
    tokens_seen: int | None = None


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialResult(JsonRecord):
    """What a trial's process found (RESULT.json), with the parent's wall time and log.

    status: 'ok', 'out-of-memory', 'compile error', 'timeout' or 'crash'. The memory check
    (the budget and whether the step fits it) is made wherever the step was compiled, or
    found too large by the ZeRO formula alone; the timing, where a timed trial ran."""

    status: str
    analysis: StepAnalysis | None = None
    memory_budget_bytes: int | None = written_when_none()
    fits: bool | None = None
    program_fingerprint: str | None = None  # compile-only trials: the program's hash
    profile_dir: str | None = None
    timing: TrialTiming | None = None
    error: str | None = None
    wall_s: float | None = None
    log: str | None = None

    def to_json(self) -> dict[str, Any]:
        """Its fields, the timing's spread among them, the memory check's two only where it
        was made."""
        written = fields_to_json(self)
        if self.fits is None:
            del written["memory_budget_bytes"]
        timing = written.pop("timing", {})
        after = {name: written.pop(name) for name in ("error", "wall_s", "log") if name in written}
        return written | timing | after

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        result = super().from_json(data)
        if "step_time_s" not in data:
            return result
        return dataclasses.replace(result, timing=TrialTiming.from_json(data))


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialSpec(JsonRecord):
    """What a trial's process is asked to do (SPEC.json): compile the point ('compile'), and
    time ('timed') or profile ('profile') it."""

    kind: str
    point: Point
    run: RunConfig  # the point's run (Point.run): what the trial's process compiles
    devices_per_process: int = 1
    memory_budget_bytes: int | None = written_when_none()
    timing: TimingRule = TimingRule()
    token_budget: int = 0  # the loss objective: at least the steps these tokens take
    peak_flops_per_s: float = 0.0  # the machine's, for MFU
    tensorboard_dir: str | None = None  # timed trials: one TensorBoard run each
    profile_dir: str | None = None
    # A compile trial for a cluster's GPUs (XLA's GPU compiler, t5scale/xla_gpu.py) or a TPU
    # pod's slices (XLA's TPU compiler, t5scale/xla_tpu.py) rather than for the devices at hand.
    compile_only_topology: GpuTopology | TpuTopology | None = None

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        spec = fields_from_json(cls, data)
        if spec.compile_only_topology is None:
            return spec
        written = topology_from_json(data["compile_only_topology"])
        return dataclasses.replace(spec, compile_only_topology=written)


@dataclasses.dataclass(frozen=True, kw_only=True)
class TrialRecord:
    """One line of results.jsonl: a finished trial's result in the study's context. A timed
    trial whose compiled program another one already timed reuses that one's record (its
    result and context), says whose (`same_program_as`) and what measuring it cost."""

    key: str  # Point.key: a restarted study skips the trials it finds
    kind: str  # 'compile', 'timed' or 'profile'
    point: Point
    result: TrialResult
    round_name: str = ""
    run: RunConfig | None = None  # None: a drawn trial, or a line written before runs
    # Lines written before the run was kept as a value held the point as gin bindings.
    gin_bindings: tuple[str, ...] = ()
    machine: MachineLabel | None = None  # None: a drawn trial (known_speeds.py)
    peak_flops_per_s: float | None = None
    finished_at: str | None = None
    tensorboard_dir: str | None = None
    repeat: int = 0
    same_program_as: str | None = None
    measured_wall_s: float | None = None

    @property
    def wall_s(self) -> float:
        return self.result.wall_s or 0.0

    def to_json(self) -> dict[str, Any]:
        context = {
            "key": self.key, "kind": self.kind, "round": self.round_name,
            "config": self.point.as_dict(), "config_point": dataclasses.asdict(self.point),
            "run": self.run and self.run.to_json(),
            "machine": self.machine and self.machine.to_json(),
            "peak_flops_per_s": self.peak_flops_per_s, "finished_at": self.finished_at,
            "tensorboard_dir": self.tensorboard_dir, "repeat": self.repeat,
        }  # fmt: skip
        reuse = {"same_program_as": self.same_program_as, "measured_wall_s": self.measured_wall_s}
        reused = {name: value for name, value in reuse.items() if value is not None}
        return context | self.result.to_json() | reused

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> Self:
        """A line of results.jsonl. One that names a Point field or value by an earlier name
        (micro_batches, remat 'dots') gets the key the trial has now, so that a restarted study
        finds it."""
        written = data["config_point"] if "config_point" in data else data["config"]
        point, key = Point.from_json(written), data["key"]
        if Point.written_by_earlier_names(written):
            key = point.key(key.split(":", 1)[0])
        machine = data.get("machine")
        return cls(
            key=key, kind=data["kind"], point=point, result=TrialResult.from_json(data),
            round_name=data.get("round", ""),
            run=RunConfig.from_json(data["run"]) if data.get("run") else None,
            gin_bindings=tuple(data.get("gin_bindings", ())),
            machine=MachineLabel.from_json(machine) if machine else None,
            peak_flops_per_s=data.get("peak_flops_per_s"), finished_at=data.get("finished_at"),
            tensorboard_dir=data.get("tensorboard_dir"), repeat=data.get("repeat", 0),
            same_program_as=data.get("same_program_as"),
            measured_wall_s=data.get("measured_wall_s"),
        )  # fmt: skip


def parse_results(
    text: str, skipped: Callable[[int], None] = lambda number: None
) -> dict[str, TrialRecord]:
    """results.jsonl's records by key (a later line of a key wins); a line that is no record,
    such as one cut by a kill, is left out and its number told to `skipped`."""
    records = {}
    for number, line in enumerate(text.splitlines(), 1):
        try:
            record = TrialRecord.from_json(json.loads(line))
        except (ValueError, KeyError, TypeError, AttributeError):  # e.g. "config": [1]
            skipped(number)
            continue
        records[record.key] = record
    return records
