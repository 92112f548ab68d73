"""The tiled output layer and loss (t5scale/model/head.py) against the whole logits: the same
loss and gradients, chunk sizes that divide the tokens or not, on every stage and mesh."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import relative_difference, synthetic_batches, tiny_setup

from t5scale.model.head import (
    HeadLoss,
    chunk_tokens,
    chunks_per_product,
    head_loss,
    loss_sums,
    model_loss_sums,
)
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.mesh import ParallelConfig
from t5scale.train.precision import PrecisionConfig
from t5scale.train.step import gradient_fn_jitted

Z_LOSS = 1e-4


def _head_inputs(tokens: int = 37, d_model: int = 16, vocab: int = 300):
    keys = jax.random.split(jax.random.key(0), 4)
    x = jax.random.normal(keys[0], (tokens, d_model))
    w = 0.3 * jax.random.normal(keys[1], (d_model, vocab))
    targets = jax.random.randint(keys[2], (tokens,), 0, vocab)
    weights = (jax.random.uniform(keys[3], (tokens,)) > 0.2).astype(jnp.float32)  # padding
    return x, w, targets, weights


@pytest.mark.parametrize(  # of 37 tokens, 5 and 8 leave a partial last chunk
    ("chunk", "product_chunks"),
    [
        pytest.param(1, 1, marks=pytest.mark.slow),
        (5, 1),
        (5, 3),  # 8 chunks in products of 3: the last product has a chunk of padding alone
        pytest.param(8, 2, marks=pytest.mark.slow),
        (37, 1),
    ],
)
def test_tiled_loss_and_gradients_equal_the_whole_logits(chunk, product_chunks):
    x, w, targets, weights = _head_inputs()

    def whole(x, w):
        cross_entropy, z_term = loss_sums(x @ w, targets, weights, Z_LOSS)
        return cross_entropy + z_term, (cross_entropy, z_term)

    def tiled(x, w):
        how = HeadLoss(z_loss=Z_LOSS, chunk=chunk, vocab_size=w.shape[1],
                       product_chunks=product_chunks)  # fmt: skip
        loss, cross_entropy, z_term = head_loss(x, w, targets, weights, weights, how)
        return loss, (cross_entropy, z_term)

    (want, want_sums), want_grads = jax.value_and_grad(whole, (0, 1), has_aux=True)(x, w)
    (got, got_sums), got_grads = jax.jit(jax.value_and_grad(tiled, (0, 1), has_aux=True))(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_sums, want_sums, rtol=1e-6)
    for mine, reference in zip(got_grads, want_grads, strict=True):
        assert relative_difference(np.asarray(mine), np.asarray(reference)) < 1e-6
    # Without differentiation the same scan runs without the gradient work.
    np.testing.assert_allclose(jax.jit(tiled)(x, w)[0], want, rtol=1e-6)


def test_logits_written_in_bf16_give_the_loss_of_the_rounded_logits():
    """ModelConfig.logits_dtype='bfloat16': the loss is that of the whole logits rounded to
    bf16 (fp32 arithmetic from there), through model_loss_sums; with fp32 logits it is not."""
    x, w, targets, weights = _head_inputs(tokens=40, d_model=64, vocab=1000)
    x, w = 3 * x.astype(jnp.bfloat16), 3 * w.astype(jnp.bfloat16)  # logits of a few units
    exact = jnp.matmul(x, w, preferred_element_type=jnp.float32)
    rounded = sum(loss_sums(exact.astype(jnp.bfloat16).astype(jnp.float32), targets, weights,
                            Z_LOSS))  # fmt: skip

    def loss(logits_dtype):
        model = ModelConfig(vocab_size=1000, dtype="bfloat16", logits_dtype=logits_dtype,
                            loss_chunk_tokens=16)  # fmt: skip
        step = jax.jit(lambda: model_loss_sums(model, x[None], w, targets, weights, Z_LOSS)[0])
        # XLA:CPU, allowed excess precision (its default), drops a bf16 round trip; a GPU's
        # GEMM writes the bf16 it is asked for (docs/benchmarks.md, twenty-third session).
        return step.lower().compile({"xla_allow_excess_precision": False})()

    np.testing.assert_allclose(loss("bfloat16"), rounded, rtol=1e-6)
    assert abs(loss("float32") / rounded - 1) > 1e-5  # bf16's rounding is seen
    np.testing.assert_allclose(loss("float32"), sum(loss_sums(exact, targets, weights, Z_LOSS)),
                               rtol=1e-6)  # fmt: skip
    with pytest.raises(ValueError, match="logits_dtype must be float32 or the compute dtype"):
        ModelConfig(logits_dtype="bfloat16")  # fp32 compute


def test_padding_columns_past_the_vocabulary_take_no_part():
    x, w, targets, weights = _head_inputs(vocab=300)
    padded = jnp.pad(w, ((0, 0), (0, 20)), constant_values=5.0)  # large logits, if they counted
    how = HeadLoss(z_loss=Z_LOSS, chunk=8, vocab_size=300)
    got = head_loss(x, padded, targets, weights, weights, how)[0]
    want = sum(loss_sums(x @ w, targets, weights, Z_LOSS))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    gradient = jax.grad(lambda p: head_loss(x, p, targets, weights, weights, how)[0])(padded)
    assert not np.any(gradient[:, 300:])


def test_a_chunk_s_logits_are_reduced_in_one_pass():
    """Maximum, sum of exponentials and target logit in one reduction of the [chunk, vocab]
    logits (head.row_statistics): XLA:GPU (jax 0.11.2) ran a separate target logit reduction
    as a second full read of the fp32 logits, 1.7 ms of mt5_small's step on an H200."""
    x, w, targets, weights = _head_inputs(vocab=300)
    how = HeadLoss(z_loss=Z_LOSS, chunk=8, vocab_size=300)

    def loss(x, w):
        return head_loss(x, w, targets, weights, weights, how)[0]

    for f in (loss, jax.value_and_grad(loss, (0, 1))):
        text = jax.jit(f).lower(x, w).as_text()
        reductions = [line for line in text.splitlines() if "stablehlo.reduce(" in line]
        over_logits = [line for line in reductions if "tensor<8x300xf32>" in line]
        assert len(over_logits) == 1, over_logits
        assert over_logits[0].count("init:") == 3  # maximum, sum and target logit together


def test_automatic_chunks_hold_one_block_of_logits_within_256_mib_and_pad_little():
    # 7,328 targets (batch 32 × 229) at mT5's vocabulary: 28 chunks of 264 (at most 268 fit)
    assert chunk_tokens(None, tokens=7328, vocab_columns=250112) == 264
    assert 264 * 4 * 250112 <= 256 * 2**20 and 28 * 264 - 7328 < 8 * 28
    assert chunk_tokens(None, tokens=912, vocab_columns=250112) == 232  # 4 chunks, not 256s
    assert chunk_tokens(None, tokens=128, vocab_columns=1024) == 128  # all at once
    assert chunk_tokens(5, tokens=128, vocab_columns=1024) == 5
    with pytest.raises(ValueError, match="loss_chunk_tokens"):
        ModelConfig(loss_chunk_tokens=-1)


def test_the_projection_s_gradient_sums_about_1024_tokens_a_product():
    # 28 chunks of 264: 7 products of 4 chunks (1,056 tokens), not 28 of one
    assert chunks_per_product(264, 28) == 4
    # 3,664 targets would make 14 chunks, which products of 4 do not divide: 16 of 232
    assert chunk_tokens(None, tokens=3664, vocab_columns=250112) == 232
    assert chunks_per_product(232, 16) == 4
    assert chunks_per_product(1048, 7) == 1  # chunks of 1,048 are products of their own
    assert chunks_per_product(264, 29) == 1  # a count only 1 and itself divide: no padding
    assert chunks_per_product(5, 4) == 4  # small chunks: all of them in one product


# ---- the train step's gradients on 8 devices ------------------------------------------------

UNTILED = ModelConfig(vocab_size=1024, loss_chunk_tokens=0)
# 5 tokens per chunk divides neither a device's 16 target tokens nor stage 3's group of 128.
TILED = ModelConfig(vocab_size=1024, loss_chunk_tokens=5)


def _gradients(parallel: ParallelConfig, model: ModelConfig, devices: int = 8, **changes):
    """(gradients on the host in the model's shapes, cross-entropy sum) of the first batch, at
    the one-device run's initial parameters (every stage and mesh initialises alike)."""
    setup = tiny_setup(parallel, devices, model=model, **changes)
    params = jax.tree.map(
        lambda x, like: x.astype(like.dtype), _initial_params(), setup.state.params
    )
    params = jax.device_put(params, setup.layout.param_shardings)
    run = setup.run
    step = gradient_fn_jitted(run.model, setup.layout, run.train, setup.precision)
    grads, sums = step(params, synthetic_batches(setup, 0, 0)[0])
    grads = jax.device_get(setup.layout.unpad(grads))
    return grads, float(sums.cross_entropy)


@functools.cache
def _initial_params():
    return jax.device_get(
        tiny_setup(ParallelConfig(), 1, model=UNTILED).create_state(seed=0).params
    )


@functools.cache
def _whole_logits_on_one_device():
    return _gradients(ParallelConfig(), UNTILED, devices=1)


@pytest.mark.parametrize(
    "parallel",
    [
        # CI: stage 3's vocabulary-parallel head; stages 0-2 compute the loss alike: -m slow.
        pytest.param(ParallelConfig(zero_stage=0, zero=8), marks=pytest.mark.slow),
        pytest.param(ParallelConfig(zero_stage=1, zero=4, tensor=2), marks=pytest.mark.slow),
        pytest.param(ParallelConfig(zero_stage=2, replica=2, zero=4), marks=pytest.mark.slow),
        ParallelConfig(zero_stage=3, zero=8),  # the vocabulary-parallel head
        # ... and split over `tensor` within it: the same code paths as the two above
        pytest.param(ParallelConfig(zero_stage=3, zero=4, tensor=2), marks=pytest.mark.slow),
    ],
    ids=lambda p: f"stage{p.zero_stage}-{p.replica or 1}x{p.zero}x{p.tensor}",
)
def test_tiled_gradients_equal_the_whole_logits_on_every_stage(parallel):
    want_grads, want_loss = _whole_logits_on_one_device()
    grads, loss = _gradients(parallel, TILED)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True)
    worst = max(relative_difference(got, want) for got, want in pairs)
    assert worst <= 1e-5, worst


def test_tiled_mixed_precision_matches_the_whole_logits_to_bf16():
    """bf16 compute with an fp32 master, stage 3's vocabulary-parallel head, against fp32 whole
    logits: they agree to bf16's precision (the tiled head keeps its products in fp32)."""
    mixed = dataclasses.replace(TILED, dtype="bfloat16")
    want_grads, want_loss = _whole_logits_on_one_device()
    grads, loss = _gradients(
        ParallelConfig(zero_stage=3, zero=8), mixed, precision=PrecisionConfig(mode="mixed")
    )
    np.testing.assert_allclose(loss, want_loss, rtol=1e-2)
    pairs = zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True)
    worst = max(relative_difference(np.float32(got), want) for got, want in pairs)
    assert worst < 5e-2, worst
