"""Timings with their uncertainty: an interval for the median, the warm-up found in the data,
and a rule that times until the interval is narrow enough or the budget is spent.

Pure Python (no JAX): the study's trials time real steps with it, and tests drive it with
step times of known speed, drawn (known_speeds.py).

The interval is distribution-free: step times are skewed (a hiccup is slow, never fast), so
no normal approximation is assumed. For n samples sorted x(1) ≤ … ≤ x(n), [x(l), x(n+1-l)]
holds the true median with probability 1 − 2·P(B < l), B ~ Binomial(n, ½) (the sign test's
interval; any statistics text, e.g. Conover, "Practical Nonparametric Statistics", §3.2).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable
from typing import Any


@dataclasses.dataclass(frozen=True)
class Interval:
    """A median and the interval that holds the true median with probability `confidence`."""

    low: float
    median: float
    high: float
    confidence: float  # achieved, ≥ the requested one where there were enough samples
    samples: int
    of: str = "steps"  # what the samples are: steps (one trial), or trials (their medians)

    def below(self, other: Interval) -> bool:
        """Wholly below `other`: lower with (at least) both intervals' confidence."""
        return self.high < other.low

    def half_width(self) -> float:
        """The larger side of the interval, relative to the median."""
        return max(self.median - self.low, self.high - self.median) / abs(self.median)

    def map(self, f: Callable[[float], float]) -> Interval:
        """The interval of f(value) for a monotone f (a decreasing f swaps the ends)."""
        a, b = f(self.low), f(self.high)
        return dataclasses.replace(self, low=min(a, b), median=f(self.median), high=max(a, b))

    def as_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@functools.lru_cache(maxsize=4096)
def rank(n: int, confidence: float) -> tuple[int, float]:
    """(l, achieved confidence) of the order-statistic interval [x(l), x(n+1-l)] with the
    largest l that still reaches `confidence`; l = 1 (the whole range) when n is too small."""
    alpha = 1 - confidence
    lower, tail, term = 1, 0.5**n, 0.5**n  # tail = P(B < lower + 1) = P(B ≤ lower)
    while lower + 1 <= (n + 1) // 2:
        term *= (n - lower + 1) / lower  # P(B = lower)
        if 2 * (tail + term) > alpha:
            break
        tail += term
        lower += 1
    return lower, 1 - 2 * (tail if lower > 1 else 0.5**n)


def samples_needed(confidence: float) -> int:
    """The fewest samples whose whole range holds the median with `confidence` (6 at 95%)."""
    n = 1
    while 1 - 2 * 0.5**n < confidence:
        n += 1
    return n


def median_interval(values: list[float], confidence: float = 0.95, presorted: bool = False):
    """The median of `values` and its distribution-free interval."""
    x = values if presorted else sorted(values)
    n = len(x)
    if n == 0:
        raise ValueError("no samples")
    lower, achieved = rank(n, confidence)
    median = (x[(n - 1) // 2] + x[n // 2]) / 2
    return Interval(x[lower - 1], median, x[n - lower], achieved, n)


def warmup_length(values: list[float]) -> int:
    """How many leading samples are warm-up: the run of first samples slower than the steady
    state's band, at most half of them. The steady state is the second half of the samples;
    its band reaches 3 robust standard deviations (1.4826 × the median absolute deviation) above
    its median, and at least 1% above, so that noise alone is cut about once in 700 samples
    (a normal tail) and a gradual warm-up (a cache filling) is cut as far as it is slower."""
    n = len(values)
    if n < 4:
        return 0
    steady = sorted(values[n // 2 :])
    middle = len(steady) // 2
    centre = steady[middle]
    distances = [abs(v - centre) for v in steady]
    distances.sort()
    spread = distances[middle]
    band = centre + max(3 * 1.4826 * spread, 0.01 * abs(centre))
    warmup = 0
    while warmup < n // 2 and values[warmup] > band:
        warmup += 1
    return warmup


@dataclasses.dataclass(frozen=True)
class TimingRule:
    """Time until the median's interval is within ±precision of it (at `confidence`), or until
    max_samples are taken, or max_seconds are spent once there are `floor` samples after the
    warm-up (min_samples, and at least the fewest that can reach `confidence`)."""

    precision: float = 0.05
    confidence: float = 0.95
    min_samples: int = 0  # 0: the fewest that can reach `confidence`
    max_samples: int = 200
    max_seconds: float = 60.0

    def __post_init__(self) -> None:
        if not (0 < self.precision < 1 and 0.5 < self.confidence < 1):
            raise ValueError("precision must be in (0, 1) and confidence in (0.5, 1)")
        if self.max_samples < 1 or self.max_seconds <= 0:
            raise ValueError("max_samples must be >= 1 and max_seconds > 0")

    @property
    def floor(self) -> int:
        return max(self.min_samples, samples_needed(self.confidence))


@dataclasses.dataclass(frozen=True)
class Measurement:
    """What `measure` found: every sample, the warm-up it cut and the rest's interval."""

    samples: list[float]
    warmup: int
    interval: Interval
    precise: bool  # the interval reached the rule's precision (else the budget ran out)
    stopped_by: str  # 'precision', 'max_samples' or 'max_seconds'

    def summary(self) -> dict[str, Any]:
        return {
            **self.interval.as_dict(),
            "warmup_samples": self.warmup,
            "precise": self.precise,
            "stopped_by": self.stopped_by,
        }


def measure(
    sample: Callable[[], float], rule: TimingRule, clock: Callable[[], float] = time.perf_counter
) -> Measurement:
    """Take samples (e.g. step times) until `rule` is met; the warm-up is re-found at each check.

    The rule is checked at the floor and then every time the samples grow by an eighth, so that
    checking costs little even with many samples."""
    started = clock()
    samples: list[float] = []
    floor = next_check = rule.floor
    while True:
        samples.append(sample())
        n = len(samples)
        if n < next_check and n < rule.max_samples:
            continue
        next_check = n + max(1, n // 8)
        warmup = warmup_length(samples)
        kept = samples[warmup:]
        interval = median_interval(kept, rule.confidence)
        enough = len(kept) >= floor
        precise = enough and interval.half_width() <= rule.precision
        # the time budget stops only a measurement that has its floor of samples
        stopped_by = (
            "precision" if precise
            else "max_samples" if n >= rule.max_samples
            else "max_seconds" if enough and clock() - started >= rule.max_seconds
            else None
        )  # fmt: skip
        if stopped_by:
            return Measurement(samples, warmup, interval, precise, stopped_by)
