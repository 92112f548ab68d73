"""Timing with its uncertainty (t5scale/study/evidence.py): pure Python, simulated step times."""

from __future__ import annotations

import math
import random

import pytest

from t5scale.study.evidence import (
    TimingRule,
    measure,
    median_interval,
    rank,
    samples_needed,
    warmup_length,
)


def test_the_order_statistic_interval_is_the_sign_tests():
    for n in (6, 20, 100):
        lower, achieved = rank(n, 0.95)
        below = sum(math.comb(n, k) for k in range(lower)) / 2**n  # P(B < lower)
        assert achieved == pytest.approx(1 - 2 * below) and achieved >= 0.95
        wider = sum(math.comb(n, k) for k in range(lower + 1)) / 2**n
        assert 1 - 2 * wider < 0.95  # the narrowest that holds
    assert rank(100, 0.95)[0] == 40  # x(40)..x(61), the textbook's
    assert samples_needed(0.95) == 6 and samples_needed(0.99) == 8
    assert rank(5, 0.95) == (1, 1 - 2 / 32)  # too few: the whole range, and its lower confidence


def test_the_interval_holds_the_true_median_as_often_as_it_says():
    rng = random.Random(0)
    trials, held = 2000, 0
    for _ in range(trials):
        times = [rng.lognormvariate(0.0, 0.3) for _ in range(15)]  # true median 1.0
        interval = median_interval(times, 0.95)
        held += interval.low <= 1.0 <= interval.high
    assert held / trials >= 0.95 - 3 * math.sqrt(0.95 * 0.05 / trials)


def test_warmup_is_found_in_the_timings_and_noise_alone_is_seldom_cut():
    rng = random.Random(1)
    found_exactly, cut_from_noise = 0, 0
    for _ in range(200):
        noise = [rng.lognormvariate(0.0, 0.1) for _ in range(30)]
        found_exactly += warmup_length([5.0, 2.5, 1.6, *noise]) == 3  # compile, autotuning, …
        cut_from_noise += warmup_length(noise) > 0
    assert found_exactly >= 190  # now and then a slow 4th step goes with them
    assert cut_from_noise <= 10  # a slow first step by chance, now and then (≤ 5%)
    # a gradual warm-up, as mt5_tiny's 8-device steps on this machine: cut as far as it is slow
    steps = [0.14, 0.039, 0.033, 0.032, 0.032, 0.032, 0.030, 0.029, 0.029, 0.029, 0.029, 0.030]
    assert warmup_length(steps) == 6


def test_timing_stops_at_the_precision_or_the_budget():
    rng = random.Random(2)
    draw = lambda sigma: lambda: rng.lognormvariate(0.0, sigma)  # noqa: E731
    quiet = measure(draw(0.02), TimingRule(precision=0.05))
    assert quiet.precise and quiet.stopped_by == "precision"
    assert quiet.interval.half_width() <= 0.05 and len(quiet.samples) <= 12
    noisy = measure(draw(0.5), TimingRule(precision=0.05, max_samples=40))
    assert not noisy.precise and noisy.stopped_by == "max_samples" and len(noisy.samples) == 40

    clock = [0.0]

    def one_second_steps() -> float:
        clock[0] += 1.0
        return rng.lognormvariate(0.0, 0.5)

    # the time budget ends a measurement only once it has its floor of samples (here 10)
    timed = measure(one_second_steps, TimingRule(min_samples=10, max_seconds=3.0), lambda: clock[0])
    assert timed.stopped_by == "max_seconds" and len(timed.samples) - timed.warmup >= 10
