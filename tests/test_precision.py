"""Mixed precision as DeepSpeed's ZeRO keeps it (t5scale/train/precision.py), shown from the
compiled step on 8 emulated devices: bf16 at every stage with mT5's real vocabulary, DeepSpeed's
per-device model-state bytes from XLA's memory analysis, and bf16 collectives half of fp32's.
(Training alike on every stage and mesh: tests/test_precision_training.py.)"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import run_steps, tiny_setup

from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.optim import OptimizerConfig
from t5scale.train.precision import PrecisionConfig

MIXED = PrecisionConfig(mode="mixed")
FP32 = PrecisionConfig(mode="float32")
SLOW = pytest.mark.slow  # the same ground at other stages: out of CI's budget
# mT5's vocabulary on a tiny model: at stage 3 the tables take the vocabulary-parallel path,
# whose bf16 reduce-scatters aborted XLA:CPU (t5scale/xla_cpu.py, 3.).
REAL_VOCABULARY = ModelConfig(
    vocab_size=250_112, d_model=32, d_ff=64, num_heads=2, d_kv=16, dtype="bfloat16"
)


@pytest.mark.parametrize(
    "precision, stage",
    [  # CI: mixed precision trains at stage 3 on a padded mesh (test_precision_training.py)
        *[pytest.param(MIXED, stage, marks=SLOW) for stage in (0, 1, 2, 3)],
        *[pytest.param(FP32, stage, marks=SLOW) for stage in (0, 1, 2, 3)],
    ],
    ids=lambda value: value.mode if isinstance(value, PrecisionConfig) else f"stage{value}",
)
def test_bf16_runs_at_every_stage_with_the_real_vocabulary(precision, stage):
    """Compile, then run 2 steps of two micro-batches, in bf16 compute with mT5's vocabulary."""
    setup = tiny_setup(
        ParallelConfig(zero_stage=stage, zero=8), model=REAL_VOCABULARY, precision=precision,
        batch_size=16, micro_batches=2, optimizer=OptimizerConfig(grad_clip_norm=None),
    )  # fmt: skip
    _, losses = run_steps(setup, setup.create_state(seed=0), 0, 1)
    assert setup.precision.mixed == (precision is MIXED)
    assert np.all(np.isfinite(losses)), losses
    # 250,112 ids: the loss starts near log(V) (12.4) plus z-loss, not at some other value.
    assert 11 < losses[0] < 14
    params_dtype = {leaf.dtype for leaf in jax.tree.leaves(setup.state.params)}
    assert params_dtype == {jnp.dtype("bfloat16" if precision is MIXED else "float32")}


# A vocabulary small enough that stage 3 gathers the tables: every collective carries
# parameters or gradients, none the batch's activations (which are bf16 in both modes).
SMALL_VOCABULARY = ModelConfig(vocab_size=256, dtype="bfloat16")


@functools.cache  # per process: under xdist a module's tests may interleave with others'
def _analysis(precision: PrecisionConfig, stage: int) -> dict:
    setup = tiny_setup(
        ParallelConfig(zero_stage=stage, zero=8), model=SMALL_VOCABULARY, precision=precision
    )
    return setup.compile().analysis.to_json()


# DeepSpeed's per-device model-state bytes in mixed precision (ZeRO paper, K = 12).
DEEPSPEED = {0: (16, 0), 1: (4, 12), 2: (2, 14), 3: (0, 16)}  # stage: (whole, split over N)


# CI: stage 3, whose program the collectives' test below compiles too
@pytest.mark.parametrize("stage", [3, *[pytest.param(s, marks=SLOW) for s in (0, 1, 2)]])
def test_mixed_model_state_per_device_is_deepspeeds_from_xlas_memory_analysis(stage):
    analysis = _analysis(MIXED, stage)
    state = analysis["model_state_per_device"]
    psi, shards = analysis["parameters"], analysis["mesh"]["zero"]
    whole, split = DEEPSPEED[stage]
    expected = whole * psi + split * psi / shards
    measured = state["xla_parameters_and_optimizer_bytes"] + state["gradient_bytes"]
    assert abs(measured - expected) <= 0.05 * expected, (measured, expected)
    assert abs(state["zero_formula_bytes"]["total"] - expected) <= 0.001 * expected
    assert state["zero_formula"] == {0: "16Ψ", 1: "4Ψ + 12Ψ/N", 2: "2Ψ + 14Ψ/N", 3: "16Ψ/N"}[stage]
    assert analysis["precision"] == {
        "mode": "mixed", "parameters": "bfloat16", "gradients": "bfloat16", "fp32_master": True,
    }  # fmt: skip


@pytest.mark.parametrize("stage", [3, *[pytest.param(s, marks=SLOW) for s in (0, 1, 2)]])
def test_mixed_collectives_move_half_of_fp32s_bytes(stage):
    mixed, fp32 = _analysis(MIXED, stage)["collectives"], _analysis(FP32, stage)["collectives"]
    assert set(mixed) - {"widened_by_backend"} == set(fp32) - {"widened_by_backend"}
    compared = 0
    for kind in ("all-reduce", "all-gather", "reduce-scatter"):
        if kind not in fp32 or fp32[kind]["bytes"] < 1024:  # scalars: loss sums, the norm
            continue
        ratio = mixed[kind]["bytes"] / fp32[kind]["bytes"]
        assert 0.48 <= ratio <= 0.53, (kind, ratio)
        compared += 1
    # The gradients' collective, and from stage 1 on the parameters' all-gather.
    assert compared >= (1 if stage == 0 else 2)
    # XLA:CPU runs them in f32 (it has no 16-bit collectives); the analysis counts them at bf16.
    assert mixed["widened_by_backend"] > 0 and "widened_by_backend" not in fp32
