"""The funnel's decisions on evidence, without JAX: pruning on one or repeated trials, the
winner and what is tied with it, and the simulated funnel's survival and saving
(t5scale/study/funnel.py, known_speeds.py). The real study runs are in test_study.py."""

import dataclasses

import numpy as np
import pytest

from t5scale.study import funnel, known_speeds
from t5scale.study.config import Point
from t5scale.study.evidence import median_interval
from t5scale.study.known_speeds import Noise
from t5scale.study.records import StepTimes, TrialRecord, TrialResult, TrialTiming

OBJ = "tokens_per_s_per_device"


def _timed(
    stage: int, step_times: list[float], losses: list[float], repeat: int = 0
) -> TrialRecord:
    point = Point("m", stage, 1, "dots", 1e-3, devices=2)
    steps = StepTimes(**median_interval(step_times).as_dict(), warmup_samples=1)
    timing = TrialTiming(step_time_s=steps, step_times_s=(9.0, *step_times), tokens_per_step=200,
                         tokens_per_s_per_device=100 / steps.median,
                         loss_interval=median_interval(losses), loss_samples=tuple(losses))  # fmt: skip
    return TrialRecord(key=f"timed:{stage}:{repeat}", kind="timed", point=point, repeat=repeat,
                       result=TrialResult(status="ok", timing=timing))  # fmt: skip


def test_pruning_one_trial_each_drops_what_lies_wholly_below():
    rng = np.random.default_rng(0)
    noisy = lambda centre, n=30: list(centre * rng.lognormal(0, 0.05, n))  # noqa: E731
    runs = [
        _timed(0, noisy(1.0), noisy(5.0)),  # fastest
        _timed(1, noisy(1.02), noisy(4.0)),  # 2% slower: a tie; the lowest loss, or tied
        _timed(2, noisy(1.5), noisy(4.01)),  # 50% slower: dropped by speed; tied on loss
        _timed(3, noisy(1.0, 3), noisy(9.0, 3)),  # too few samples to say anything: kept
    ]
    late = _timed(3, [1.0], [1.0])
    runs.append(
        dataclasses.replace(late, result=dataclasses.replace(late.result, status="timeout"))
    )
    by_speed = funnel.prune_on_evidence(runs, OBJ, confidence=0.95)
    assert [(d.configuration.stage, d.best.stage) for d in by_speed] == [(2, 0)]
    assert by_speed[0].interval.high < by_speed[0].best_interval.low and by_speed[0].lead > 0
    # the round's 4 intervals at 1 - 0.05/4 each (Bonferroni): all hold at once with 95%
    assert by_speed[0].interval.confidence >= 1 - 0.05 / 4
    by_loss = funnel.prune_on_evidence(runs, "loss", confidence=0.95)
    # 4.0 and 4.01 tie: either is the best, and stage 0's 5.0 is worse than both
    assert [d.configuration.stage for d in by_loss] == [0] and by_loss[0].best.stage in (1, 2)
    assert "is lower by more than" in by_loss[0].evidence("loss")
    (winner,) = funnel.winners(runs, OBJ, confidence=0.95).values()
    assert winner.record is runs[0] and {r.point.stage for r, _ in winner.tied} == {1, 3}


def test_pruning_over_repeated_trials_counts_the_trial_to_trial_spread():
    """Each trial's steps agree closely (1% noise), but trials move by 8%: the one-trial
    intervals would call a 10% gap certain; two trials each show it is not."""
    rng = np.random.default_rng(1)
    trial = lambda centre: list(centre * rng.lognormal(0, 0.01, 30))  # noqa: E731
    factors = [1.0, 1.08, 0.93, 1.0, 1.06, 0.95, 1.0, 0.92]  # per trial, as a busy machine
    centres = [1.0, 1.0, 1.1, 1.1, 1.6, 1.6, 1.0, 1.0]  # stages 0, 1, 2, 3: two trials each
    runs = [_timed(i // 2, trial(c * f), [1.0] * 6, repeat=i % 2)
            for i, (c, f) in enumerate(zip(centres, factors, strict=True))]  # fmt: skip
    one_each = [r for r in runs if r.repeat == 0]
    assert {d.configuration.stage for d in funnel.prune_on_evidence(one_each, OBJ, 0.95)} == {1, 2}
    dropped = funnel.prune_on_evidence(runs, OBJ, 0.95)
    assert [d.configuration.stage for d in dropped] == [2]  # 60% slower: beyond the spread
    assert dropped[0].interval.of == "trials" and dropped[0].interval.samples == 2
    (winner,) = funnel.winners(runs, OBJ, 0.95).values()
    assert {r.point.stage for r, _ in winner.tied} == {0, 1, 3} - {winner.record.point.stage}


@pytest.mark.slow  # 500 funnels in pure Python; bench/funnel_noise.py's small mode runs in CI
def test_the_simulated_funnel_keeps_the_best_and_saves_device_time():
    """Known true speeds, log-normal noise per step (and per trial), 100-200 seeded funnels
    per noise level, no JAX: the truly best survives, and most of the grid's time is saved."""
    for noise, runs in ((Noise(0.05, 0), 100), (Noise(0.2, 0), 200), (Noise(0.5, 0), 100),
                        (Noise(0.2, 0.09), 100)):  # fmt: skip
        found = known_speeds.survival_and_saving(noise, runs)
        assert found["best_survived"] >= 0.99, found
        assert found["saving_mean"] > 0.3, found
        if noise == Noise(0.2, 0):
            assert found["saving_min"] > 0.4, found
