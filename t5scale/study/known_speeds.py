"""The funnel driven by trials of known speed: true step times drawn with injected noise, no JAX.

How often does the funnel keep the truly best configuration, and how much device time does it
save against timing every grid point, as the timing noise grows? The same `funnel.search` and
`evidence.measure` as a real study, with trials that draw step times instead of running them.

The grid of known speeds (`true_step_time`) is a weak-scaled study of one model: ZeRO stages 0-3,
micro-batches 1-8, remat dots or full, 1-8 devices. Its speeds are made up but shaped like
measured ones: small micro-batches waste the device (0.45 of the best at 1 sequence), full
remat costs a quarter, and each stage's communication grows with log2(devices), stage 3 the
most. The ranking is the same at every device count (what a funnel assumes); stages 1 and 2
stay within 1.5% of each other, a near-tie no timing separates.

Noise: each step time is the true one times a log-normal factor (σ = the step noise, so 20%
noise is a 20% coefficient of variation and the true time is the median), and each trial's
steps share one more factor (σ = the trial noise, 9% by default: as measured on this machine);
the first two samples of every trial are 3× and 1.5× slower (warm-up, which the timing must
find). Each configuration is timed in two trials, as the study does by default.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections.abc import Sequence

from t5scale.study import funnel
from t5scale.study.config import Configuration, Point
from t5scale.study.evidence import TimingRule, measure
from t5scale.study.records import StepTimes, TrialRecord, TrialResult, TrialTiming

MICRO_BATCH_EFFICIENCY = {1: 0.45, 2: 0.7, 4: 0.9, 8: 1.0}
REMAT_EFFICIENCY = {"dots": 1.0, "full": 0.75}
STAGE_OVERHEAD_PER_DOUBLING = {0: 0.03, 1: 0.02, 2: 0.025, 3: 0.06}
TOKENS_PER_SEQUENCE = 160  # 128 + 32
BEST_TOKENS_PER_S_PER_DEVICE = 2000.0
DEVICES = (1, 2, 4, 8)
WARMUP_FACTORS = (3.0, 1.5)
# Trial to trial, the quick study's medians moved by 9% (the standard deviation of one trial's
# log median, 15 points timed in two studies on this 2-core machine; docs/funnel.md).
TRIAL_NOISE = 0.09
REPEATS = 2  # the study's default


def configurations() -> list[Configuration]:
    return [
        Configuration("sim", stage, micro_batch, remat, 1e-3)
        for stage in STAGE_OVERHEAD_PER_DOUBLING
        for micro_batch in MICRO_BATCH_EFFICIENCY
        for remat in REMAT_EFFICIENCY
    ]


def true_tokens_per_s_per_device(c: Configuration, devices: int) -> float:
    overhead = STAGE_OVERHEAD_PER_DOUBLING[c.stage] * math.log2(devices)
    efficiency = MICRO_BATCH_EFFICIENCY[c.micro_batch_size] * REMAT_EFFICIENCY[c.remat]
    return BEST_TOKENS_PER_S_PER_DEVICE * efficiency / (1 + overhead)


def true_step_time(c: Configuration, devices: int) -> float:
    return c.micro_batch_size * TOKENS_PER_SEQUENCE / true_tokens_per_s_per_device(c, devices)


@dataclasses.dataclass(frozen=True)
class TrialCosts:
    """Seconds a drawn trial costs besides its steps."""

    start_s: float = 5.0  # a process starts, loads the program from the compilation cache
    compile_s: float = 15.0  # compiling the step (a grid trial compiles; a funnel trial did)


@dataclasses.dataclass(frozen=True)
class Noise:
    """Per step: a log-normal factor of σ = `step` on every step time. Per trial: one more
    factor of σ = `trial` on all of a trial's steps (its process, the machine's state then)."""

    step: float
    trial: float = TRIAL_NOISE


class SimulatedTrials:
    """funnel.Trials drawing step times from `true_step_time` with log-normal noise, each
    configuration in `repeats` trials as the study runs them."""

    def __init__(self, noise: Noise, seed: int, rule: TimingRule, costs: TrialCosts,
                 repeats: int = REPEATS):  # fmt: skip
        self.noise, self.rule, self.costs, self.repeats = noise, rule, costs, repeats
        self.rng = random.Random(seed)

    def _record(
        self, c: Configuration, devices: int, kind: str, wall: float,
        timing: TrialTiming | None = None, repeat: int = 0,
    ) -> TrialRecord:  # fmt: skip
        point = Point(**vars(c), devices=devices)  # asdict's deep copies cost a tenth of a run
        result = TrialResult(status="ok", timing=timing, wall_s=wall)
        return TrialRecord(key=f"{kind}:{c}:{devices}", kind=kind, point=point, result=result,
                           repeat=repeat)  # fmt: skip

    def compile(self, configurations, devices: int, name: str) -> list[TrialRecord]:
        wall = self.costs.start_s + self.costs.compile_s
        return [self._record(c, devices, "compile", wall) for c in configurations]

    def time(self, configurations, devices: int, name: str, compile_first: bool = False):
        records = []
        rule = self.rule  # as the study's runner: a floor of steps only for one trial each
        if self.repeats == 1:
            floor = funnel.samples_to_compare(self.rule.confidence, configurations)
            rule = dataclasses.replace(self.rule, min_samples=max(self.rule.min_samples, floor))
        for repeat in range(self.repeats):
            for c in configurations:
                drawn: list[float] = []
                truth = true_step_time(c, devices) * self.rng.lognormvariate(0.0, self.noise.trial)
                sample = functools.partial(self._draw, truth, drawn)
                # the drawn clock: the steps drawn so far
                found = measure(sample, rule, clock=functools.partial(sum, drawn))
                wall = self.costs.start_s + sum(drawn)
                if compile_first and repeat == 0:
                    wall += self.costs.compile_s
                tokens = c.micro_batch_size * TOKENS_PER_SEQUENCE * devices
                timing = TrialTiming(
                    step_time_s=StepTimes.measured(found),
                    step_times_s=tuple(found.samples), tokens_per_step=tokens,
                    tokens_per_s_per_device=tokens / devices / found.interval.median,
                    final_loss=0.0,
                )  # fmt: skip
                kind = funnel.timed_kind(repeat)
                records.append(self._record(c, devices, kind, wall, timing, repeat))
        return records

    def _draw(self, truth: float, drawn: list[float]) -> float:
        warmup = WARMUP_FACTORS[len(drawn)] if len(drawn) < len(WARMUP_FACTORS) else 1.0
        # random.lognormvariate(0, σ) is exp(normalvariate(0, σ)): the same draws, one call less
        sample = truth * warmup * math.exp(self.rng.normalvariate(0.0, self.noise.step))
        drawn.append(sample)
        return sample

    def ahead(self, alive: int, devices: Sequence[int]) -> None:
        pass


class _GridTrials(SimulatedTrials):
    """Every grid point timed, each trial compiling its own step."""

    def time(self, configurations, devices: int, name: str, compile_first: bool = True):
        return super().time(configurations, devices, name, compile_first=True)


RULE, COSTS = TimingRule(), TrialCosts()  # the study's defaults


def device_seconds(records: Sequence[TrialRecord]) -> float:
    return sum(r.wall_s * r.point.devices for r in records)


@dataclasses.dataclass(frozen=True)
class Outcome:
    best_survived: bool  # the truly best configuration was timed in the last round
    winner_is_best: bool  # and was also the funnel's winner (not only among its ties)
    device_s: float  # what the funnel's trials cost, × their device counts


def run_funnel(
    noise: Noise,
    seed: int,
    rule: TimingRule = RULE,
    costs: TrialCosts = COSTS,
    confidence: float = funnel.CONFIDENCE,
) -> Outcome:
    """One funnel of drawn trials at `noise`."""
    grid = configurations()
    last = max(DEVICES)
    truly_best = max(grid, key=lambda c: true_tokens_per_s_per_device(c, last))
    found = funnel.search(grid, DEVICES, SimulatedTrials(noise, seed, rule, costs),
                          "tokens_per_s_per_device", confidence=confidence)  # fmt: skip
    final = {funnel.configuration_of(r) for r in found.timed_records if r.point.devices == last}
    (winner,) = funnel.winners(found.timed_records, "tokens_per_s_per_device", confidence).values()
    return Outcome(
        best_survived=truly_best in final,
        winner_is_best=funnel.configuration_of(winner.record) == truly_best,
        device_s=device_seconds(found.compile_records + found.timed_records),
    )


def grid_device_seconds(
    noise: Noise, seed: int, rule: TimingRule = RULE, costs: TrialCosts = COSTS
) -> float:
    """What timing every grid point costs at `noise` (each trial compiling its step)."""
    every = funnel.search(configurations(), DEVICES, _GridTrials(noise, seed, rule, costs),
                          "tokens_per_s_per_device", funnel=False)  # fmt: skip
    return device_seconds(every.timed_records)


def survival_and_saving(
    noise: Noise,
    runs: int,
    grid_runs: int = 10,
    rule: TimingRule = RULE,
    confidence: float = funnel.CONFIDENCE,
) -> dict[str, float]:
    """Over `runs` seeded funnels: how often the truly best survived and won, and the device
    time saved against the mean of `grid_runs` drawn grids."""
    outcomes = [run_funnel(noise, seed, rule, confidence=confidence) for seed in range(runs)]
    grid = sum(grid_device_seconds(noise, 10**6 + seed, rule) for seed in range(grid_runs))
    grid /= grid_runs
    savings = sorted(1 - o.device_s / grid for o in outcomes)
    return {
        "step_noise": noise.step,
        "trial_noise": noise.trial,
        "runs": runs,
        "best_survived": sum(o.best_survived for o in outcomes) / runs,
        "best_won": sum(o.winner_is_best for o in outcomes) / runs,
        "saving_mean": sum(savings) / runs,
        "saving_min": savings[0],
        "saving_max": savings[-1],
        "grid_device_s": grid,
    }
