"""The funnel's decisions and its account (funnel.md): pure functions over trial records."""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections import Counter, defaultdict
from collections.abc import Sequence
from typing import Protocol

from t5scale.study.config import Configuration, Point
from t5scale.study.evidence import Interval, median_interval, samples_needed
from t5scale.study.records import TrialRecord

# The study's default: the truly best configuration survives the funnel with this probability
# (on drawn trials of known speed: docs/funnel.md). Each trial's own timing interval is at 95% (evidence.py).
CONFIDENCE = 0.99


@functools.lru_cache(maxsize=1024)
def student_t_quantile(probability: float, freedom: int) -> float:
    """Student's t quantile. scipy.stats is imported here, when a study compares trials:
    importing it takes a second, which every start of the CLI would otherwise pay. Cached: a
    study asks for the same few quantiles again and again."""
    import scipy.stats

    return float(scipy.stats.t.ppf(probability, freedom))


def objective_interval(
    record: TrialRecord, objective: str, confidence: float | None = None
) -> Interval:
    """The record's objective and its interval, higher is better: tokens/s per device (from
    the step time's interval), or the negated loss over the last window of steps. With a
    `confidence`, the interval is computed again from the record's samples at that level."""
    timing = record.result.timing
    if objective == "loss":
        stored, samples = timing.loss_interval, timing.loss_samples
    else:
        stored = timing.step_time_s.interval
        samples = timing.step_times_s[timing.step_time_s.warmup_samples :]
    if samples:
        interval = median_interval(list(samples), confidence or stored.confidence)
    else:
        interval = stored
    if objective == "loss":
        return interval.map(lambda loss: -loss)
    per_device = timing.tokens_per_step / record.point.devices
    return interval.map(lambda t: per_device / t)


@dataclasses.dataclass(frozen=True)
class Comparison:
    """A model's configurations in one round: the best, and each other with its interval at the
    round's `level`.

    From steps (one trial per configuration): a configuration is worse when its interval lies
    wholly below the best's. From trials (two or more each, `pooled` = the standard deviation
    of one trial's log median, pooled over the configurations, and its degrees of freedom):
    when the best's lead over it, on the log scale, exceeds zero by a one-sided t bound at
    (1 − confidence)/(m − 1) — the two-sample test, which needs a smaller gap than two
    intervals apart. Either way every configuration compared with the best is tested at a
    share of 1 − confidence, so the truly best is dropped with probability below it."""

    level: float
    best: TrialRecord
    top: Interval
    others: list[tuple[TrialRecord, Interval]]
    pooled: tuple[float, int] | None = None
    confidence: float = CONFIDENCE

    def conclusive(self, interval: Interval) -> bool:
        """Enough samples for the interval to reach the level: else it proves nothing."""
        return interval.confidence >= self.level

    def lead(self, interval: Interval) -> float | None:
        """The best's lead over `interval`'s configuration that holds with the stated
        confidence, as a fraction of the objective (> 0: worse; None: no evidence either way)."""
        if self.pooled is None:
            if not (self.conclusive(interval) and self.conclusive(self.top)):
                return None
            return (self.top.low - interval.high) / abs(self.top.median)
        spread, freedom = self.pooled
        compared = len(self.others)
        t = student_t_quantile(1 - (1 - self.confidence) / compared, freedom)
        gap = abs(math.log(abs(self.top.median)) - math.log(abs(interval.median)))
        bound = gap - t * spread * math.sqrt(1 / self.top.samples + 1 / interval.samples)
        return math.expm1(bound)

    def worse(self, interval: Interval) -> bool:
        lead = self.lead(interval)
        return lead is not None and lead > 0


def _compared(
    records: Sequence[TrialRecord], objective: str, confidence: float
) -> dict[str, Comparison]:
    """Per model, an interval for each of its m configurations at 1 − (1 − confidence)/m
    (Bonferroni: all m hold at once with probability ≥ confidence) and what `Comparison.worse`
    needs. The best: the highest median among the conclusive.

    Where every configuration was timed in two or more trials (separate processes: the
    study's `repeats`), the evidence comes from the trials' medians, so that it includes how
    much a trial's own process moves the median (`replicated_intervals`); otherwise from each
    trial's step samples (`objective_interval`), which see only the noise within a trial."""
    by_model: dict[str, dict[Configuration, list[TrialRecord]]] = defaultdict(dict)
    for record in records:
        by_model[record.point.model].setdefault(configuration_of(record), []).append(record)
    result = {}
    for model, trials in by_model.items():
        level = 1 - (1 - confidence) / len(trials)
        pooled = None
        if len(trials) > 1 and all(len(group) >= 2 for group in trials.values()):
            intervals, pooled = replicated_intervals(trials, objective, level)
        else:
            intervals = [(group[0], objective_interval(group[0], objective, level))
                         for group in trials.values()]  # fmt: skip
        candidates = [pair for pair in intervals if pair[1].confidence >= level] or intervals
        best, top = max(candidates, key=lambda pair: pair[1].median)
        others = [(r, i) for r, i in intervals if r is not best]
        result[model] = Comparison(level, best, top, others, pooled, confidence)
    return result


def replicated_intervals(
    trials: dict[Configuration, list[TrialRecord]], objective: str, level: float
) -> tuple[list[tuple[TrialRecord, Interval]], tuple[float, int]]:
    """(first trial, interval) per configuration from its trials' medians — a t-interval on
    the log of the objective, its `samples` trials, not steps — and (the pooled standard
    deviation of one trial's log median, its degrees of freedom): one variance for all
    configurations, on the log scale (noise in proportion to the value)."""
    logs = {c: [math.log(_objective_value(r, objective)) for r in group]
            for c, group in trials.items()}  # fmt: skip
    freedom = sum(len(values) - 1 for values in logs.values())
    squares = sum(
        sum((v - statistics.fmean(values)) ** 2 for v in values) for values in logs.values()
    )
    spread = math.sqrt(squares / freedom)
    t = student_t_quantile(1 - (1 - level) / 2, freedom)
    result = []
    sign = -1 if objective == "loss" else 1  # higher is better
    for c, values in logs.items():
        centre, half = statistics.fmean(values), t * spread / math.sqrt(len(values))
        interval = Interval(math.exp(centre - half), math.exp(centre), math.exp(centre + half),
                            level, len(values), "trials")  # fmt: skip
        result.append((trials[c][0], interval.map(lambda v: sign * v)))
    return result, (spread, freedom)


def _objective_value(record: TrialRecord, objective: str) -> float:
    """A trial's median of the objective, as a positive number (tokens/s per device, loss)."""
    return abs(objective_interval(record, objective).median)


def samples_to_compare(confidence: float, configurations: Sequence[Configuration]) -> int:
    """The fewest samples a trial needs for its interval to take part in a round of these
    configurations (see `_compared`): fewer can never be dropped nor drop another."""
    per_model = Counter(c.model for c in configurations)
    return samples_needed(1 - (1 - confidence) / max(per_model.values(), default=1))


@dataclasses.dataclass(frozen=True)
class Dropped:
    """A configuration worse than its model's best with the stated confidence, and why."""

    configuration: Configuration
    interval: Interval
    best: Configuration
    best_interval: Interval
    lead: float  # the best's lead that holds with the stated confidence (a fraction)

    def evidence(self, objective: str) -> str:
        unit = "loss" if objective == "loss" else "tokens/s/device"
        sign = -1 if objective == "loss" else 1
        return (
            f"{self.configuration.label()}: {show_interval(self.interval, sign)} {unit}; "
            f"{self.best.label()}: {show_interval(self.best_interval, sign)} is "
            f"{'lower' if sign < 0 else 'higher'} by more than {100 * self.lead:.1f}%"
        )


def show_interval(interval: Interval, sign: int, level: float = 0.0) -> str:
    shown = interval.map(lambda v: sign * v)
    short = f"; too few samples for {100 * level:.4g}%" if interval.confidence < level else ""
    return (
        f"{shown.median:,.4g} [{shown.low:,.4g}, {shown.high:,.4g}] "
        f"({100 * interval.confidence:.4g}%, {interval.samples} {interval.of}{short})"
    )


def prune_on_evidence(
    records: Sequence[TrialRecord], objective: str, confidence: float = CONFIDENCE
) -> list[Dropped]:
    """The configurations, per model, worse than the best with the stated confidence (see
    `Comparison`). The rest go on, ties included."""
    ok = [r for r in records if r.result.status == "ok"]
    dropped = []
    for comparison in _compared(ok, objective, confidence).values():
        for record, interval in comparison.others:
            if comparison.worse(interval):
                dropped.append(Dropped(
                    configuration_of(record), interval, configuration_of(comparison.best),
                    comparison.top, comparison.lead(interval),
                ))  # fmt: skip
    return dropped


@dataclasses.dataclass(frozen=True)
class Winner:
    """A model's best trial, and those it does not beat with the stated confidence."""

    record: TrialRecord
    interval: Interval
    tied: list[tuple[TrialRecord, Interval]]  # best first
    level: float  # each interval's confidence (Bonferroni over the final round)
    rivals: int  # the other configurations of its model in that round


def winners(
    timed: Sequence[TrialRecord], objective: str, confidence: float = CONFIDENCE
) -> dict[str, Winner]:
    """Per model, the best ok trial at the largest device count any of its trials reached,
    with the others there that it does not beat with the stated confidence: tied within the
    evidence."""
    ok = [r for r in timed if r.result.status == "ok"]
    largest: dict[str, int] = {}
    for record in ok:
        model = record.point.model
        largest[model] = max(largest.get(model, 0), record.point.devices)
    final = [r for r in ok if r.point.devices == largest[r.point.model]]
    result = {}
    for model, comparison in _compared(final, objective, confidence).items():
        tied = [
            (r, interval) for r, interval in comparison.others if not comparison.worse(interval)
        ]
        tied.sort(key=lambda pair: pair[1].median, reverse=True)
        result[model] = Winner(
            comparison.best, comparison.top, tied, comparison.level, len(comparison.others)
        )
    return result


def synchronisation_words(point: Point) -> str:
    if point.sync == "every_step":
        return "synchronised every step"
    mode, _, every = point.sync.partition("/")
    return f"{mode.replace('_', ' ')} every {every} steps over {point.replicas} replicas"


def configuration_of(record: TrialRecord) -> Configuration:
    """The record's configuration (a field a study before it lacks: its default)."""
    return record.point.configuration


@dataclasses.dataclass
class Round:
    """One round of the funnel: what entered, what was run, what left and why."""

    name: str
    entered: int
    records: list[TrialRecord]
    left: int = 0
    dropped: list[Dropped] = dataclasses.field(default_factory=list)  # worse, with evidence
    note: str = ""

    @property
    def pruned(self) -> int:
        return len(self.dropped)

    def reasons(self) -> Counter:
        return Counter(r.result.status for r in self.records if r.result.status != "ok")

    def wall_s(self) -> float:
        return sum(r.wall_s for r in self.records)

    def device_s(self) -> float:
        return sum(r.wall_s * r.point.devices for r in self.records)


class Trials(Protocol):
    """What runs the funnel's trials: real processes (runner.py) or drawn trials of known speed (known_speeds.py)."""

    def compile(
        self, configurations: list[Configuration], devices: int, name: str
    ) -> list[TrialRecord]:
        """Compile-only trials: a record each, status 'ok' where the point fits."""

    def time(
        self, configurations: list[Configuration], devices: int, name: str
    ) -> list[TrialRecord]:
        """Timed trials: a record each (each of a configuration's repeats), with the objective's
        samples where status is 'ok'."""

    def ahead(self, alive: int, devices: Sequence[int]) -> None:
        """Told after each round how many configurations go on to which device counts."""


@dataclasses.dataclass
class Search:
    rounds: list[Round]
    compile_records: list[TrialRecord]
    timed_records: list[TrialRecord]


def search(
    configurations: Sequence[Configuration],
    devices: Sequence[int],
    trials: Trials,
    objective: str,
    funnel: bool = True,
    confidence: float = CONFIDENCE,
) -> Search:
    """The funnel (or, with funnel=False, the grid: every point timed).

    At each device count, smallest first, the configurations still in are compiled (no step
    runs) and those that do not fit are not timed there; the rest are timed, and a
    configuration is dropped only when it is worse than its model's best with the stated
    confidence (see `Comparison`). Not on 1 device (every ZeRO stage is the same program there) and not
    in the last round (nothing is left to save)."""
    devices = sorted(devices)
    result = Search([], [], [])
    alive = set(configurations)
    # Each pruning round at a share of 1 − confidence (Bonferroni over the rounds): the truly
    # best survives the whole funnel with probability ≥ confidence.
    pruning_rounds = max(1, len([d for d in devices[:-1] if d > 1]))
    per_round = 1 - (1 - confidence) / pruning_rounds
    for index, d in enumerate(devices):
        per = f"{d} device{'s' if d > 1 else ''}"
        # Stage-major, models interleaved: on one device every stage is the same program, and
        # a stage's twin then starts after it has compiled (and loads it from the cache).
        todo = sorted(alive, key=lambda c: (c.stage, c.model, c))
        if funnel:
            todo, failed = _compile_round(trials, todo, d, per, result)
            alive -= failed
        entered = len(todo)
        records = trials.time(todo, d, f"{per}, timed")
        result.timed_records += records
        alive -= {configuration_of(r) for r in records if r.result.status != "ok"}
        ok = [r for r in records if r.result.status == "ok" and configuration_of(r) in alive]
        note, dropped = "", []
        last = index == len(devices) - 1
        if funnel and not last and d > 1 and ok:
            dropped = prune_on_evidence(ok, objective, per_round)
            alive -= {drop.configuration for drop in dropped}
            note = _pruned_note(objective, per_round, confidence, pruning_rounds)
        elif funnel and d == 1 and not last:
            note = "no pruning on 1 device: every ZeRO stage is the same program there"
        result.rounds.append(Round(
            f"{len(result.rounds) + 1}: {per}, timed", entered, records,
            left=len({configuration_of(r) for r in ok} & alive), dropped=dropped,
            note=note,
        ))  # fmt: skip
        trials.ahead(len(alive), devices[index + 1 :])
    return result


def _compile_round(
    trials: Trials, todo: list[Configuration], d: int, per: str, result: Search
) -> tuple[list[Configuration], set[Configuration]]:
    """(what compiled and fits, to time; what crashed or timed out, out of the study)."""
    records = trials.compile(todo, d, f"{per}, compile")
    result.compile_records += records
    fits = [configuration_of(r) for r in records if r.result.status == "ok"]
    # A crash or timeout is no matter of device count: that configuration is out. One that
    # does not fit, or does not divide this mesh, may still run on another count.
    failed = {configuration_of(r) for r in records if r.result.status in ("crash", "timeout")}
    result.rounds.append(Round(
        f"{len(result.rounds) + 1}: {per}, compile only", len(records), records,
        left=len(fits), note="XLA's per-device memory estimate against the budget",
    ))  # fmt: skip
    return fits, failed


def _pruned_note(objective: str, per_round: float, confidence: float, rounds: int) -> str:
    return (
        f"dropped what is worse than its model's best by {objective} at "
        f"{100 * per_round:.4g}% confidence (the study's {100 * confidence:.4g}% shared "
        f"by {rounds} pruning rounds); ties go on"
    )


def timed_kind(repeat: int) -> str:
    """The kind in a timed trial's key: 'timed' for the first, 'timed#2', … for repeats."""
    return "timed" if repeat == 0 else f"timed#{repeat + 1}"
