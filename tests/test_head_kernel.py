"""The output layer's kernel (t5scale/model/head_kernel.py): run by Pallas's interpreter on the
CPU it gives the loss and gradients of XLA's route (t5scale/model/head.py), in fp32 to fp32's
rounding and in bf16 to bf16's; compiled for an H100 it is one Triton kernel per chunk, priced
as the GEMM it replaces, and no fp32 logits are written."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from conftest import relative_difference

from t5scale.model.head import HeadLoss, head_loss, kernel_chunk_tokens, loss_sums
from t5scale.model.head_kernel import HeadTiles, tile_statistics
from t5scale.model.sizes import ModelConfig
from t5scale.startup import cuda_plugin_installed

Z_LOSS = 1e-4
# Small tiles, so that 37 tokens and 300 columns are ragged blocks of each (and 48 of d_model
# three steps of the inner loop).
SMALL = HeadTiles(tokens=16, columns=64, depth=16)


def _inputs(tokens: int = 37, d_model: int = 48, vocab: int = 300, dtype=jnp.float32):
    keys = jax.random.split(jax.random.key(1), 4)
    x = jax.random.normal(keys[0], (tokens, d_model)).astype(dtype)
    w = (0.3 * jax.random.normal(keys[1], (d_model, vocab))).astype(dtype)
    targets = jax.random.randint(keys[2], (tokens,), 0, vocab)
    weights = (jax.random.uniform(keys[3], (tokens,)) > 0.2).astype(jnp.float32)  # padding
    return x, w, targets, weights


def _loss_and_gradients(how: HeadLoss, x, w, targets, weights):
    def loss(x, w):
        total, cross_entropy, z_term = head_loss(x, w, targets, weights, weights, how)
        return total, (cross_entropy, z_term)

    return jax.jit(jax.value_and_grad(loss, (0, 1), has_aux=True))(x, w)


@pytest.mark.parametrize(
    ("chunk", "product_chunks", "vocab_size"),
    [
        (37, 1, 300),  # one chunk: 3 token blocks (the last of 5 tokens), 5 column tiles
        (16, 2, 300),  # 3 chunks in products of 2, the last product half padding
        (37, 1, 290),  # the last 10 columns past the vocabulary (a split's padding)
    ],
)
def test_the_kernel_gives_xla_s_loss_and_gradients_in_fp32(chunk, product_chunks, vocab_size):
    x, w, targets, weights = _inputs()
    targets = jnp.minimum(targets, vocab_size - 1)
    xla = HeadLoss(z_loss=Z_LOSS, chunk=chunk, vocab_size=vocab_size,
                   product_chunks=product_chunks)  # fmt: skip
    kernel = HeadLoss(z_loss=Z_LOSS, chunk=chunk, vocab_size=vocab_size,
                      product_chunks=product_chunks, kernel="interpreted", tiles=SMALL)  # fmt: skip
    (want, want_sums), want_grads = _loss_and_gradients(xla, x, w, targets, weights)
    (got, got_sums), got_grads = _loss_and_gradients(kernel, x, w, targets, weights)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(got_sums, want_sums, rtol=1e-6)
    for mine, reference in zip(got_grads, want_grads, strict=True):
        assert relative_difference(np.asarray(mine), np.asarray(reference)) < 1e-6
    if vocab_size < w.shape[1]:
        assert not np.any(got_grads[1][:, vocab_size:])  # padding columns get no gradient
    # and against the whole logits, not only XLA's tiled route
    whole = sum(loss_sums((x @ w)[:, :vocab_size], targets, weights, Z_LOSS))
    np.testing.assert_allclose(got, whole, rtol=1e-6)
    # Without differentiation the kernel writes no exp(x − m), and the loss is the same.
    forward = jax.jit(lambda x, w: head_loss(x, w, targets, weights, weights, kernel)[0])
    np.testing.assert_allclose(forward(x, w), want, rtol=1e-6)


def test_in_bf16_the_gradient_is_xla_s_to_bf16_s_rounding():
    """bf16 operands: the same fp32 loss (both accumulate the same bf16 products in fp32), and
    the logits' gradient rounded twice (exp(x − m) to bf16, then the rescaled value) against
    XLA's once: within a few of bf16's 2⁻⁸ of XLA's gradients, and as near the fp32 ones."""
    x, w, targets, weights = _inputs(dtype=jnp.bfloat16)
    xla = HeadLoss(z_loss=Z_LOSS, chunk=37, vocab_size=300, compute_dtype="bfloat16")
    kernel = HeadLoss(z_loss=Z_LOSS, chunk=37, vocab_size=300, compute_dtype="bfloat16",
                      kernel="interpreted", tiles=SMALL)  # fmt: skip
    exact = HeadLoss(z_loss=Z_LOSS, chunk=37, vocab_size=300)
    (want, _), want_grads = _loss_and_gradients(xla, x, w, targets, weights)
    (got, _), got_grads = _loss_and_gradients(kernel, x, w, targets, weights)
    fp32 = (x.astype(jnp.float32), w.astype(jnp.float32))
    _, exact_grads = _loss_and_gradients(exact, *fp32, targets, weights)
    np.testing.assert_allclose(got, want, rtol=1e-5)
    for mine, reference, truth in zip(got_grads, want_grads, exact_grads, strict=True):
        mine, reference, truth = (np.asarray(a, np.float32) for a in (mine, reference, truth))
        assert relative_difference(mine, reference) < 3 * 2**-8
        assert relative_difference(mine, truth) < 2 * relative_difference(reference, truth) + 2**-8


def test_each_tile_s_statistics_and_exponentials_are_its_own():
    """tile_statistics alone: per column tile, the maximum, Σ exp(x − max) and target logit of
    that tile's logits, and exp(x − max) itself, for ragged rows and columns; a target outside
    the columns (another slice's) is in no tile."""
    x, w, targets, _ = _inputs()
    # no target: -1, one past every tile, one past the columns inside the last (ragged) tile
    targets = targets.at[0].set(-1).at[1].set(400).at[2].set(310)
    peaks, sums, target_logits, exp = tile_statistics(x, w, targets, 300, SMALL, write_exp=True,
                                                      interpret=True)  # fmt: skip
    logits = np.asarray(x @ w)
    for tile in range(5):
        block = logits[:, tile * 64 : (tile + 1) * 64]
        np.testing.assert_allclose(peaks[tile], block.max(1), rtol=1e-6)
        np.testing.assert_allclose(sums[tile], np.exp(block - block.max(1, keepdims=True)).sum(1),
                                   rtol=1e-5)  # fmt: skip
        inside = (targets >= tile * 64) & (targets < min((tile + 1) * 64, 300))
        want = np.where(inside, logits[np.arange(37), np.clip(targets, 0, 299)], 0.0)
        np.testing.assert_allclose(target_logits[tile], want, rtol=1e-6)
        np.testing.assert_allclose(exp[:, tile * 64 : (tile + 1) * 64],
                                   np.exp(block - block.max(1, keepdims=True)), rtol=1e-5)  # fmt: skip
    assert not np.any(target_logits[:, :3])


def test_split_over_a_vocabulary_axis_the_kernel_gives_the_whole_loss_and_gradient():
    """Stage 3's vocabulary-parallel head (HeadLoss.axis): each of 2 slices of 150 columns (the
    last 10 padding past the vocabulary of 290) runs the kernel on its own columns, their
    statistics combined over the axis (here a vmap's named axis, as the interpreter cannot run
    inside the step's shard_map): every slice's loss is the whole logits' loss, and the slices'
    gradients are the whole projection's gradient. A target in another slice's columns was
    counted as a masked column's logit (-1e10) before the kernel masked targets too."""
    x, w, targets, weights = _inputs(vocab=290)
    slices = jnp.pad(w, ((0, 0), (0, 10))).reshape(48, 2, 150).transpose(1, 0, 2)

    def slice_loss(w_slice, kernel):
        how = HeadLoss(z_loss=Z_LOSS, chunk=16, vocab_size=290, axis="zero", kernel=kernel,
                       tiles=SMALL)  # fmt: skip
        return head_loss(x, w_slice, targets, weights, weights, how)[0]

    def whole(w):
        return sum(loss_sums(x @ w, targets, weights, Z_LOSS))

    want, want_grad = jax.value_and_grad(whole)(w)
    for kernel in ("interpreted", None):
        split = jax.vmap(jax.value_and_grad(lambda s, k=kernel: slice_loss(s, k)), axis_name="zero")
        losses, grads = split(slices)
        np.testing.assert_allclose(losses, [want, want], rtol=1e-6)
        got = grads.transpose(1, 0, 2).reshape(48, 300)
        assert relative_difference(np.asarray(got[:, :290]), np.asarray(want_grad)) < 1e-6
        assert not np.any(got[:, 290:])


def test_a_d_model_or_tiles_the_kernel_cannot_step_through_is_one_line():
    with pytest.raises(ValueError, match="powers of two >= 16, got \\(48, 128, 64\\)"):
        HeadTiles(tokens=48)
    with pytest.raises(ValueError, match="head_kernel needs d_model a multiple of 16, got 100"):
        ModelConfig(name="custom", vocab_size=512, d_model=100, d_ff=256, num_heads=4, d_kv=25,
                    num_encoder_layers=1, num_decoder_layers=1, head_kernel=True)  # fmt: skip


def test_kernel_chunks_are_whole_blocks_and_pad_little():
    # 7,328 targets (batch 32 × 229) in blocks of 64: 8 chunks of 960 (4.8% padding), not 8
    # of 1,024 (11.8%) nor 23 products of 320; a requested size rounds up to whole blocks
    assert kernel_chunk_tokens(None, 7328, 64) == 960
    assert kernel_chunk_tokens(300, 7328, 64) == 320
    assert kernel_chunk_tokens(None, 45, 64) == 64  # fewer tokens than a block: one block


@pytest.mark.skipif(not cuda_plugin_installed(), reason="needs jax's CUDA plugin (test extra)")
def test_for_an_h100_the_kernel_is_one_gemm_and_no_fp32_logits_are_written():
    """Compiled for an H100 (no GPU here): the head's loss and gradients at mt5_small's vocabulary
    and d_model for 832 tokens (one chunk) hold one Triton kernel, which the cluster
    model's inventory counts as a GEMM of 2·T·D·V FLOPs, and no [832, 250112] fp32 array; XLA's
    route writes its logits in fp32."""
    from t5scale.analysis.hlo_module import parse_module
    from t5scale.analysis.kernels import read_program
    from t5scale.xla_gpu import GpuTopology, compiler_options

    device = GpuTopology("h100_sxm").devices()[0]
    placed = jax.sharding.SingleDeviceSharding(device)
    tokens, d_model, vocab = 832, 512, 250112
    x = jax.ShapeDtypeStruct((tokens, d_model), jnp.bfloat16, sharding=placed)
    w = jax.ShapeDtypeStruct((d_model, vocab), jnp.bfloat16, sharding=placed)
    ids = jax.ShapeDtypeStruct((tokens,), jnp.int32, sharding=placed)
    weights = jax.ShapeDtypeStruct((tokens,), jnp.float32, sharding=placed)
    programs = {}
    for kernel in ("triton", None):
        how = HeadLoss(z_loss=Z_LOSS, chunk=tokens, vocab_size=vocab, compute_dtype="bfloat16",
                       kernel=kernel)  # fmt: skip

        def loss(x, w, targets, weights, how=how):
            return head_loss(x, w, targets, weights, weights, how)[0]

        lowered = jax.jit(jax.grad(loss, (0, 1))).lower(x, w, ids, weights)
        text = lowered.compile(compiler_options=compiler_options([device])).as_text()
        programs[kernel] = text, read_program(parse_module(text))
    logits_bytes = tokens * vocab * 4

    def writes_fp32_logits(program) -> bool:
        return any(kernel.bytes_written >= logits_bytes for kernel in program.kernels)

    (text, program), (_, xla) = programs["triton"], programs[None]
    assert writes_fp32_logits(xla) and not writes_fp32_logits(program)
    assert text.count('"t5_head_statistics"') == 1
    # the kernel's product and the gradient's two (dx and dw), all GEMMs
    assert program.inventory.gemm.flops == pytest.approx(3 * 2 * tokens * d_model * vocab)
    assert re.search(rf"bf16\[{tokens},{vocab}\]", text)  # exp(x − m), in bf16
