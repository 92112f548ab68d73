"""Same initialisation and batches → the same 5 steps on every stage and mesh (fp32, ≤ 1e-5)."""

import jax
import numpy as np
import pytest
from conftest import (
    assert_same_parameters,
    one_device_reference,
    run_steps,
    tiny_setup,
    train_tiny,
)

from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.optim import OptimizerConfig


@pytest.fixture
def single_device():
    return one_device_reference()


SLOW = pytest.mark.slow  # the same ground again in other combinations: out of CI's budget
LAYOUTS = [
    # In CI: stages 2 and 3; the mesh shapes 2×4 and replica = 2 (8×1: test_zero's stages).
    pytest.param(ParallelConfig(zero_stage=0, zero=8), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=3, zero=8), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=1, zero=4, tensor=2), marks=SLOW),
    ParallelConfig(zero_stage=2, zero=2, tensor=4),
    ParallelConfig(zero_stage=3, replica=2, zero=4),
    pytest.param(ParallelConfig(zero_stage=2, replica=2, zero=2, tensor=2), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=1, zero=8), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=2, zero=8), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=3, zero=4, tensor=2), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=0, zero=2, tensor=4), marks=SLOW),
]


def _layout_id(parallel) -> str:
    return f"stage{parallel.zero_stage}-{parallel.replica}x{parallel.zero}x{parallel.tensor}"


@pytest.mark.parametrize("parallel", LAYOUTS, ids=_layout_id)
def test_every_stage_and_mesh_trains_like_one_device(single_device, parallel):
    base_losses, base_params = single_device
    losses, params = train_tiny(parallel)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert_same_parameters(params, base_params)


@SLOW  # CI compiles micro-batch accumulation in test_zero's stage 2 collective test
def test_gradient_accumulation_matches_one_big_batch(single_device):
    base_losses, base_params = single_device
    losses, params = train_tiny(ParallelConfig(zero_stage=2, zero=4), devices=4, micro_batches=2)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert_same_parameters(params, base_params)


@SLOW
def test_adafactor_trains_the_same_under_stage_3():
    adafactor = OptimizerConfig(name="adafactor", learning_rate=1e-2, warmup_steps=2)
    base_losses, base_params = train_tiny(ParallelConfig(), devices=1, optimizer=adafactor)
    losses, params = train_tiny(ParallelConfig(zero_stage=3, zero=8), optimizer=adafactor)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert base_losses[-1] < base_losses[0]
    assert_same_parameters(params, base_params)


@pytest.mark.slow  # CI: stage 3's vocabulary-parallel head (test_loss.py) and its table (test_zero.py)
def test_stage3_gathers_the_tables_when_the_batch_outweighs_them():
    # 8 examples of 32 + 2·16 rows against a 256-id vocabulary: moving the activations would
    # cost as much as gathering the tables (t5scale/parallel/vocab.py), so stage 3 gathers them.
    small_vocab = ModelConfig(vocab_size=256)
    base_losses, base_params = train_tiny(ParallelConfig(), devices=1, model=small_vocab)
    setup = tiny_setup(ParallelConfig(zero_stage=3, zero=8), model=small_vocab)
    step = setup.compile()
    state, losses = run_steps(setup, setup.create_state(seed=0), 0, 4, step.compiled)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert_same_parameters(jax.device_get(state.params), base_params)
    # Both tables come out of all-gathers whole (in a tuple, where XLA combines gathers).
    width = small_vocab.d_model
    hlo = step.compiled.as_text()
    gathered = [line.split("all-gather")[0] for line in hlo.splitlines() if "all-gather" in line]
    assert any(f"f32[256,{width}]" in result for result in gathered)  # the embedding
    assert any(f"f32[{width},256]" in result for result in gathered)  # the output projection
