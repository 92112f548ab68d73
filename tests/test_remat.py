"""remat = 'auto': the cheapest policy whose compiled step fits the budget (t5scale/train/setup.py)."""

import functools
import json

import pytest
from conftest import tiny_setup

from t5scale.analysis.records import RematChoice, StepAnalysis
from t5scale.data.config import DataConfig
from t5scale.errors import ConfigError
from t5scale.model.sizes import REMAT_LADDER, ModelConfig
from t5scale.parallel.mesh import ParallelConfig

# Long enough inputs that each policy keeps less than the one before it.
AUTO = {"model": ModelConfig(vocab_size=1024, remat="auto"),
        "data": DataConfig(input_length=128, target_length=32)}  # fmt: skip


@functools.cache
def _setup():
    return tiny_setup(ParallelConfig(), devices=1, **AUTO)


@functools.cache
def _peaks() -> dict[str, int]:
    """Each policy's compiled peak per device, compiled on its own."""

    def peak(policy: str) -> int:
        analysis = _setup().with_remat(policy).compile().analysis
        return analysis.memory_per_device.peak_estimate_bytes

    return {policy: peak(policy) for policy in REMAT_LADDER}


@functools.cache
def _auto(policy: str):
    """The 'auto' step whose budget `policy` fits exactly (each cheaper one is over)."""
    return _setup().compile(memory_budget_bytes=_peaks()[policy])


def test_the_ladder_saves_memory_at_each_rung():
    peaks = _peaks()
    assert peaks["dots"] > peaks["minimal"] > peaks["full"], peaks


# In CI the middle rung: 'dots' is the CLI test's choice, 'full' the fallback test's.
@pytest.mark.parametrize(
    "policy",
    [pytest.param(p, marks=pytest.mark.slow) if p != "minimal" else p for p in REMAT_LADDER],
)
def test_auto_takes_the_cheapest_policy_that_fits(policy):
    budget = _peaks()[policy]
    step = _auto(policy)
    assert step.setup.run.model.remat == policy
    chosen = step.analysis.to_json()["remat"]
    assert chosen["requested"] == "auto" and chosen["policy"] == policy and chosen["fits"]
    assert [t["policy"] for t in chosen["tried"]] == list(
        REMAT_LADDER[: REMAT_LADDER.index(policy) + 1]
    )
    assert chosen["tried"][-1]["peak_estimate_bytes"] == budget


def test_auto_falls_back_to_full_and_says_it_does_not_fit():
    step = _setup().compile(memory_budget_bytes=_peaks()["full"] - 1)
    chosen = step.analysis.to_json()["remat"]
    assert chosen["policy"] == "full" and not chosen["fits"]


def test_a_fixed_policy_is_recorded_and_auto_is_never_traced_unchosen():
    step = _setup().with_remat("minimal").compile()
    assert step.analysis.to_json()["remat"] == {"requested": "minimal", "policy": "minimal"}
    with pytest.raises(ConfigError, match="chosen by Setup.compile"):
        _setup().train_step()
    with pytest.raises(ValueError, match="dots, minimal, full or auto"):
        ModelConfig(remat="some")


def test_an_analysis_from_before_dots_was_named_so_reads_as_dots():
    """step_analysis.json (and results.jsonl's analyses) written when 'dots' was 'none'."""
    analysis = _auto("minimal").analysis  # tried 'dots', then chose 'minimal'
    written = json.loads(json.dumps(analysis.to_json()))
    assert written["remat"]["tried"][0]["policy"] == "dots"
    written["remat"]["tried"][0]["policy"] = "none"
    assert StepAnalysis.from_json(written) == analysis
    written["remat"] = {"requested": "none", "policy": "none"}  # a fixed policy
    assert StepAnalysis.from_json(written).remat == RematChoice(requested="dots", policy="dots")
