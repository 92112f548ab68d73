"""Same initialisation and batches → the same 5 steps on every stage and mesh (fp32, ≤ 1e-5)."""

import functools

import jax
import numpy as np
import pytest

from t5scale.data.synthetic import DataConfig, synthetic_batch
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig, make_mesh
from t5scale.train import optim
from t5scale.train.state import abstract_state, create_state, plan_for, state_shardings
from t5scale.train.step import batch_sharding, make_train_step

MODEL = ModelConfig(vocab_size=1024)
DATA = DataConfig(input_length=32, target_length=16)
STEPS, BATCH = 5, 8
TX = optim.make_optimizer(optim.OptimizerConfig(learning_rate=3e-3, warmup_steps=2))


def run_steps(
    parallel: ParallelConfig, devices=None, micro_batches: int = 1, tx=TX, model=MODEL, hlo=None
):
    mesh = make_mesh(parallel, devices)
    plan = plan_for(model, parallel.zero_stage, mesh)
    state = create_state(model, tx, plan, seed=0)
    step = make_train_step(
        model, plan, tx, state_shardings(plan, tx, abstract_state(model, tx)), micro_batches
    )
    losses = []
    for i in range(STEPS):
        batch = jax.device_put(
            synthetic_batch(DATA, BATCH, model.vocab_size, 0, i), batch_sharding(plan)
        )
        if hlo is not None and i == 0:
            hlo.append(step.lower(state, batch).compile().as_text())
        state, metrics = step(state, batch)
        losses.append(float(metrics["loss"]))
    return np.array(losses), jax.device_get(state.params)


@functools.cache  # per process: under xdist a module's tests may interleave with others'
def _single_device():
    return run_steps(ParallelConfig(), devices=jax.devices()[:1])


@pytest.fixture
def single_device():
    return _single_device()


def _relative(a, b) -> float:
    """‖a − b‖ / ‖b‖ over one parameter (max-abs would flag Adam's sign-like updates of
    near-zero gradients, which turn rounding noise into a full learning-rate step)."""
    return float(np.linalg.norm(a - b) / np.linalg.norm(b))


SLOW = pytest.mark.slow  # the same ground again in other combinations: out of CI's budget
LAYOUTS = [
    # In CI: stages 1-3; the mesh shapes 4×2, 2×4 and replica = 2 (8×1: test_zero's stages).
    pytest.param(ParallelConfig(zero_stage=0, zero=8), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=3, zero=8), marks=SLOW),
    ParallelConfig(zero_stage=1, zero=4, tensor=2),
    ParallelConfig(zero_stage=2, zero=2, tensor=4),
    ParallelConfig(zero_stage=3, replica=2, zero=4),
    pytest.param(ParallelConfig(zero_stage=2, replica=2, zero=2, tensor=2), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=1, zero=8), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=2, zero=8), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=3, zero=4, tensor=2), marks=SLOW),
    pytest.param(ParallelConfig(zero_stage=0, zero=2, tensor=4), marks=SLOW),
]


def _layout_id(p) -> str:
    return f"stage{p.zero_stage}-{p.replica}x{p.zero}x{p.tensor}"


@pytest.mark.parametrize("parallel", LAYOUTS, ids=_layout_id)
def test_every_stage_and_mesh_trains_like_one_device(single_device, parallel):
    base_losses, base_params = single_device
    losses, params = run_steps(parallel)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(base_params), strict=True):
        assert _relative(got, want) <= 1e-5


@SLOW  # CI compiles micro-batch accumulation in test_zero's stage 2 collective test
def test_gradient_accumulation_matches_one_big_batch(single_device):
    base_losses, base_params = single_device
    losses, params = run_steps(
        ParallelConfig(zero_stage=2, zero=4), jax.devices()[:4], micro_batches=2
    )
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(base_params), strict=True):
        assert _relative(got, want) <= 1e-5


@SLOW
def test_adafactor_trains_the_same_under_stage_3():
    tx = optim.make_optimizer(
        optim.OptimizerConfig(name="adafactor", learning_rate=1e-2, warmup_steps=2)
    )
    base_losses, base_params = run_steps(ParallelConfig(), jax.devices()[:1], tx=tx)
    losses, params = run_steps(ParallelConfig(zero_stage=3, zero=8), tx=tx)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    assert base_losses[-1] < base_losses[0]
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(base_params), strict=True):
        assert _relative(got, want) <= 1e-5


def test_stage3_gathers_the_tables_when_the_batch_outweighs_them():
    # 8 examples of 32 + 2·16 rows against a 256-id vocabulary: moving the activations would
    # cost as much as gathering the tables (t5scale/parallel/vocab.py), so stage 3 gathers them.
    small_vocab = ModelConfig(vocab_size=256)
    base_losses, base_params = run_steps(ParallelConfig(), jax.devices()[:1], model=small_vocab)
    hlo = []
    losses, params = run_steps(ParallelConfig(zero_stage=3, zero=8), model=small_vocab, hlo=hlo)
    np.testing.assert_allclose(losses, base_losses, rtol=1e-5)
    for got, want in zip(jax.tree.leaves(params), jax.tree.leaves(base_params), strict=True):
        assert _relative(got, want) <= 1e-5
    # Both tables come out of all-gathers whole (in a tuple, where XLA combines gathers).
    d = small_vocab.d_model
    gathered = [line.split("all-gather")[0] for line in hlo[0].splitlines() if "all-gather" in line]
    assert any(f"f32[256,{d}]" in result for result in gathered)  # the embedding
    assert any(f"f32[{d},256]" in result for result in gathered)  # the output projection
