"""Synthetic packed span-corruption batches and the learning-rate schedule."""

import jax
import numpy as np
import pytest

from t5scale.data.batch import Batch
from t5scale.data.synthetic import FEATURES, DataConfig, synthetic_batch
from t5scale.train.optim import OptimizerConfig, inverse_sqrt_schedule, learning_rate_at


def test_synthetic_batch_has_the_packed_span_corruption_layout():
    batch = synthetic_batch(
        DataConfig(), batch_size=4, vocab_size=250112, seed=0, step=0
    ).features()
    assert set(batch) == set(FEATURES)
    for name, array in batch.items():
        assert array.dtype == np.int32
        assert array.shape == (4, 1024 if name.startswith("encoder") else 229)
    for prefix, tokens in (
        ("encoder", "encoder_input_tokens"),
        ("decoder", "decoder_target_tokens"),
    ):
        segments, positions = batch[f"{prefix}_segment_ids"], batch[f"{prefix}_positions"]
        padding = segments == 0
        assert (batch[tokens][padding] == 0).all() and (batch[tokens][~padding] > 0).all()
        # Positions count from 0 within each packed example.
        starts = np.diff(segments, axis=1, prepend=0) != 0
        assert (positions[starts & ~padding] == 0).all()
        assert (positions[~starts & ~padding] > 0).all()
    # Decoder inputs: targets shifted right by one inside each example, 0 at each start.
    targets, inputs = batch["decoder_target_tokens"], batch["decoder_input_tokens"]
    inside = batch["decoder_positions"] > 0
    assert (inputs[:, 1:][inside[:, 1:]] == targets[:, :-1][inside[:, 1:]]).all()
    assert (inputs[~inside] == 0).all()
    assert (batch["decoder_loss_weights"] == (batch["decoder_segment_ids"] > 0)).all()


def test_synthetic_batches_are_deterministic_per_seed_and_step():
    config = DataConfig(input_length=64, target_length=16)
    first = synthetic_batch(config, 2, 1000, seed=3, step=7)
    again = synthetic_batch(config, 2, 1000, seed=3, step=7)
    other = synthetic_batch(config, 2, 1000, seed=3, step=8)
    first, again, other = (batch.features() for batch in (first, again, other))
    assert all((first[k] == again[k]).all() for k in FEATURES)
    assert any((first[k] != other[k]).any() for k in FEATURES)


def test_the_batch_record_is_seqio_features_and_flattens_as_the_dict_did():
    """A Batch is made from seqio's dict at the data edge and gives it back; JAX flattens it in
    the order it flattened the dict (sorted names), so the compiled step's arguments keep
    their order."""
    batch = synthetic_batch(DataConfig(input_length=16, target_length=8), 2, 100, seed=0, step=0)
    features = batch.features() | {"a_task_feature": np.zeros(2)}  # extra features are left
    again = Batch.of_features(features)
    assert all(np.array_equal(again.features()[k], batch.features()[k]) for k in FEATURES)
    as_dict = {k: batch.features()[k] for k in FEATURES}
    assert [id(x) for x in jax.tree.leaves(batch)] == [id(x) for x in jax.tree.leaves(as_dict)]
    assert batch.rows == 2 and batch.map(lambda x: x[:1]).rows == 1


@pytest.mark.parametrize("shape", ["linear", "constant"])
def test_inverse_square_root_schedule(shape):
    config = OptimizerConfig(learning_rate=0.01, warmup_steps=100, warmup_shape=shape)
    lr = inverse_sqrt_schedule(config)
    at = {step: float(lr(step - 1)) for step in (1, 50, 100, 400, 10_000)}
    assert at[100] == pytest.approx(0.01)
    assert at[400] == pytest.approx(0.01 / 2)  # sqrt(100 / 400)
    assert at[10_000] == pytest.approx(0.001)
    if shape == "linear":
        assert at[1] == pytest.approx(0.0001) and at[50] == pytest.approx(0.005)
    else:  # T5's 1/sqrt(max(step, warmup)): flat during warm-up
        assert at[1] == at[50] == pytest.approx(0.01)


@pytest.mark.parametrize("shape", ["linear", "constant"])
def test_the_logged_rate_is_the_optimizer_s_and_needs_no_device(shape):
    """The training loop logs each step's rate between two steps, where a computation on the
    device would wait for the step in flight (the H200, 2026-11-29). On the host it is the rate
    the optimizer's compiled update uses, to float32's rounding (XLA may divide by the warm-up
    as a product with its reciprocal: one ulp)."""
    config = OptimizerConfig(learning_rate=3e-3, warmup_steps=7, warmup_shape=shape)
    counts = np.arange(0, 40, dtype=np.int32)
    in_program = jax.jit(jax.vmap(inverse_sqrt_schedule(config)))(counts)
    with jax.transfer_guard("disallow"):  # not a value moves to a device
        on_host = [learning_rate_at(config, int(count)) for count in counts]
    np.testing.assert_allclose(on_host, np.asarray(in_program), rtol=2e-7)
