"""The output layer and the training loss in one: cross-entropy plus z-loss (log Z squared, as
T5 and PaLM use it), summed over target tokens with padding masked out; the step divides by
the token count.

It sits beside the model, below parallel/ and train/, because both use it: the train step's
dense loss (t5scale/train/gradients.py) and stage 3's vocabulary-parallel one
(t5scale/parallel/vocab.py). It depends on nothing but JAX and the model's configuration.

mT5's output layer is the largest array of a step: batch 32 at length 229 makes 7,328 × 250,112
logits, 7.3 GB in fp32 and as much again for their gradient. `head_loss` never holds them: it
runs the output projection, log-sum-exp, target logit and z-loss over chunks of `chunk` tokens
in a scan, so at most a [chunk, vocab] block lives at once (as MaxText's vocabulary tiling and
levanter's blockwise cross-entropy do). Its custom VJP computes the gradient in the forward pass,
chunk by chunk, while each block's logits are at hand: d loss / d logits is known there up to
the one scalar the step scales the loss by (1 / target tokens), so nothing is recomputed and the
backward pass only scales the two gradients it kept — the decoder output's ([tokens, d_model])
and the projection's ([d_model, vocab], the size of the gradient it will be anyway). The
projection's FLOPs are those of the untiled head: one matmul forward, two for the gradient.
The logits' gradients of a few chunks, about PRODUCT_TOKENS tokens, are kept in one buffer (in
the compute dtype) and meet in one product for each of the two gradients: the projection's fp32
gradient is read and written once a product, not once a chunk.

Split by vocabulary (`HeadLoss.axis`, stage 3's vocabulary-parallel head, t5scale/parallel/
vocab.py), each device holds a slice of the columns; each chunk's maximum, sum of exponentials
and target logit are combined across slices (pmax, psum), so that every device knows each token's
log Z. Each device then returns the loss of the tokens it counts (`counted`) but the gradient of
every token's loss with respect to what it holds, its slice and its part of the decoder output:
that is the gradient of the group's loss as long as every device's loss is scaled by the same
number, which the step's division by the global token count guarantees.

`loss_sums` on whole logits is the untiled reference (ModelConfig.loss_chunk_tokens = 0).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax

from t5scale.model import head_kernel
from t5scale.model.head_kernel import NEG_INF, HeadTiles
from t5scale.model.sizes import ModelConfig
from t5scale.model.triton_blocks import varying_as

# Automatic chunks keep one [chunk, vocab slice] block of fp32 logits within this many bytes:
# at most 268 tokens at mT5's 250,112 ids, whose products still fill a GPU's matmul units.
CHUNK_BYTES = 256 * 2**20
# Tokens whose logits' gradients meet in one product for the projection's gradient. Each product
# reads and writes the whole fp32 [d_model, vocab] sum, 8 bytes an entry for 2·K FLOPs, K its
# tokens: at one chunk of 264 that is about 58 FLOP a byte, far below a GPU's ridge (an H100's
# 989 TFLOP/s × 0.70 over 3.35 TB/s × 0.89: about 230), and an H200 spent 22 ms of mt5_large's
# step on 28 such products for 5.4 ms of arithmetic (docs/benchmarks.md, fifteenth session).
# About 1,024 tokens a product reach about 200 FLOP a byte, for the bf16 gradients of a few
# chunks kept at once (0.5 GB at mT5's vocabulary), not a larger block of fp32 logits.
PRODUCT_TOKENS = 1024
# What one more product costs, in tokens of padding: its read and write of the fp32 [d_model,
# vocab] gradient (8 bytes an entry) take an H100 about as long as the three head GEMMs of
# about 300 tokens (6·d_model·vocab FLOPs each, at the ridge of 230 FLOP a byte above).
PRODUCT_COST_TOKENS = 300


def loss_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, z_loss: float
) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy, summed z-loss) from whole logits [batch, length, vocab]."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot product rather than a gather keeps vocab-sharded logits sharded.
    target_logit = jnp.sum(
        logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1
    )
    return weighted_sums(log_z, target_logit, weights, z_loss)


def weighted_sums(
    log_z: jax.Array, target_logit: jax.Array, weights: jax.Array, z_loss: float
) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy, summed z-loss) from each token's log Z and target logit."""
    cross_entropy = jnp.sum((log_z - target_logit) * weights)
    z_term = jnp.sum(z_loss * jnp.square(log_z) * weights)
    return cross_entropy, z_term


def chunk_tokens(requested: int | None, tokens: int, vocab_columns: int) -> int:
    """Tokens per chunk: `requested`, or for None as few chunks as keep each block of fp32
    logits within CHUNK_BYTES, as many as whole products of about PRODUCT_TOKENS take, evened
    out (to a multiple of 8) so that the last chunk's padding costs next to nothing; never more
    than `tokens`."""
    if requested is None:
        largest = max(1, CHUNK_BYTES // (4 * vocab_columns))
        chunks = -(-tokens // largest)
        per_product = max(1, round(PRODUCT_TOKENS / largest))
        if chunks > per_product:
            chunks = -(-chunks // per_product) * per_product
        even = -(-tokens // chunks)
        requested = min(largest, -(-even // 8) * 8)
    return max(1, min(requested, tokens))


def kernel_chunk_tokens(requested: int | None, tokens: int, block: int) -> int:
    """Tokens per chunk of the head's kernel (head_kernel.py), each chunk one product: whole
    blocks of `block` tokens (a block part padding costs the kernel a whole one), `requested`
    rounded up to them, or for None at most PRODUCT_TOKENS, the least of padding and products
    together, a product costing PRODUCT_COST_TOKENS (7,328 tokens: 8 chunks of 960, 4.8%
    padding, rather than 23 products of 320 with 32 tokens of it). A requested size smaller
    than PRODUCT_TOKENS shares products as XLA's route's chunks do (chunks_per_product)."""
    blocks = -(-tokens // block)
    if requested is not None:
        return min(-(-requested // block), blocks) * block
    most = max(1, min(PRODUCT_TOKENS // block, blocks))

    def cost(per_chunk: int) -> float:
        chunks = -(-blocks // per_chunk)
        return chunks * per_chunk + chunks * PRODUCT_COST_TOKENS / block

    return min(range(most, 0, -1), key=cost) * block


def chunks_per_product(chunk: int, chunks: int) -> int:
    """How many chunks' logit gradients one product sums into the projection's gradient: the
    divisor of `chunks` nearest PRODUCT_TOKENS / chunk (no chunk of padding alone is added)."""
    wanted = max(1.0, PRODUCT_TOKENS / chunk)
    divisors = [k for k in range(1, chunks + 1) if chunks % k == 0]
    return min(divisors, key=lambda k: (abs(k - wanted), -k))


def _keep(x: jax.Array, axes: tuple[str, ...]) -> jax.Array:
    del axes
    return x


def model_loss_sums(
    model: ModelConfig,
    decoded: jax.Array,
    lm_head: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    z_loss: float,
    counted: jax.Array | None = None,
    axis: str | None = None,
    constrain: Callable[[jax.Array, tuple[str, ...]], jax.Array] = _keep,
    kernel: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, cross-entropy sum, z-loss sum) of the decoder's output [batch, length, d_model]
    through lm_head [d_model, vocab or its slice over `axis`], in chunks of the model's
    loss_chunk_tokens (0: all tokens in one chunk); `counted` defaults to `weights`. kernel:
    HeadLoss.kernel."""
    x = decoded.reshape(-1, decoded.shape[-1])
    requested = x.shape[0] if model.loss_chunk_tokens == 0 else model.loss_chunk_tokens
    tiles = head_kernel.tiles_for(x.shape[1]) if kernel else HeadTiles()
    if kernel:
        chunk = kernel_chunk_tokens(requested, x.shape[0], tiles.tokens)
    else:
        chunk = chunk_tokens(requested, x.shape[0], lm_head.shape[1])
    products = chunks_per_product(chunk, -(-x.shape[0] // chunk))
    how = HeadLoss(
        z_loss=z_loss, chunk=chunk, vocab_size=model.vocab_size, compute_dtype=model.dtype,
        logits_dtype=model.logits_dtype, axis=axis, constrain=constrain,
        product_chunks=products, kernel=kernel, tiles=tiles,
    )  # fmt: skip
    weights = weights.reshape(-1).astype(jnp.float32)
    counted = weights if counted is None else counted.reshape(-1).astype(jnp.float32)
    return head_loss(x, lm_head, targets.reshape(-1), weights, counted, how)


@dataclasses.dataclass(frozen=True)
class HeadLoss:
    """How `head_loss` runs (hashable: it is a static argument of the custom VJP).

    chunk: tokens per chunk. vocab_size: the real vocabulary; columns past it (padding of a
    vocabulary split over `axis`) take no part. axis: the manual mesh axis the columns are split
    over, or None. compute_dtype: the matmuls' input dtype (they accumulate in fp32).
    logits_dtype: the dtype the logits are written in (ModelConfig.logits_dtype); the loss
    reads them into fp32.
    constrain(array, logical axes): pins a block's sharding (tensor parallelism splits the
    vocabulary of the logits and of the projection's gradient). product_chunks: chunks whose
    logit gradients one product sums into the projection's gradient (PRODUCT_TOKENS).
    kernel: None, XLA's GEMM and reductions; 'triton' (or 'interpreted', Pallas's interpreter
    of it) the projection and the reduction in one kernel (head_kernel.py), at `tiles`.
    """

    z_loss: float
    chunk: int
    vocab_size: int
    compute_dtype: str = "float32"
    logits_dtype: str = "float32"
    axis: str | None = None
    constrain: Callable[[jax.Array, tuple[str, ...]], jax.Array] = _keep
    product_chunks: int = 1
    kernel: str | None = None
    tiles: HeadTiles = HeadTiles()


def head_loss(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    weights: jax.Array,
    counted: jax.Array,
    how: HeadLoss,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, cross-entropy sum, z-loss sum) of tokens x [tokens, d_model] projected by w
    [d_model, vocab (slice)]: the loss is Σ counted·(log Z − target logit + z·log Z²), with the
    gradient of Σ weights·(…) (the same where nothing is split: see the module's docstring). The
    two sums, for metrics, carry no gradient."""
    loss, log_z, target_logit = _head_loss(x, w, targets, weights, counted, how)
    log_z, target_logit = lax.stop_gradient(log_z), lax.stop_gradient(target_logit)
    return (loss, *weighted_sums(log_z, target_logit, counted, how.z_loss))


def _column_start(how: HeadLoss, columns: int) -> jax.Array | int:
    return 0 if how.axis is None else lax.axis_index(how.axis) * columns


def _across_slices(how: HeadLoss, reduce, x: jax.Array) -> jax.Array:
    return x if how.axis is None else reduce(x, how.axis)


def _in_chunks(how: HeadLoss, group: int, *arrays: jax.Array) -> tuple[int, list[jax.Array]]:
    """The arrays (leading axis: tokens) zero-padded to whole groups of `group` chunks, as
    [groups, group, chunk, …]."""
    tokens = arrays[0].shape[0]
    groups = -(-tokens // (group * how.chunk))
    padding = groups * group * how.chunk - tokens

    def split(a: jax.Array) -> jax.Array:
        a = jnp.pad(a, [(0, padding)] + [(0, 0)] * (a.ndim - 1))
        return a.reshape(groups, group, how.chunk, *a.shape[1:])

    return tokens, [split(a) for a in arrays]


def row_statistics(logits: jax.Array, is_target: jax.Array) -> tuple[jax.Array, ...]:
    """Each row's maximum m, Σ exp(x − m) and target logit (Σ of the logits `is_target` marks),
    in one pass over the logits: an online log-sum-exp as one reduction of (maximum, sum, target)
    triples (two combine as the larger maximum, the sums rescaled to it, one exp a combination,
    and the targets added). The fp32 logits are the largest array the loss reads: a pass for the
    maximum, another for the sum and a third for the target logit read them three times (the
    target's pass alone took 1.7 ms of mt5_small's 48.5 ms step on an H200)."""

    def combine(a, b):
        (max_a, sum_a, target_a), (max_b, sum_b, target_b) = a, b
        a_larger = max_a >= max_b
        larger, smaller = jnp.maximum(max_a, max_b), jnp.minimum(max_a, max_b)
        kept, rescaled = jnp.where(a_larger, sum_a, sum_b), jnp.where(a_larger, sum_b, sum_a)
        return larger, kept + rescaled * jnp.exp(smaller - larger), target_a + target_b

    # the start: the lowest float, not −inf (−inf − −inf would be NaN), and sums of 0
    zero = jnp.zeros((), logits.dtype)
    start = (jnp.finfo(logits.dtype).min, zero, zero)
    ones = jnp.ones_like(logits)  # each logit a triple (x, 1, x or 0): its own maximum, exp(x − x)
    targets = jnp.where(is_target, logits, zero)
    return lax.reduce((logits, ones, targets), start, combine, (logits.ndim - 1,))


def _local_statistics(how: HeadLoss, w: jax.Array, with_gradients: bool, x_c, t_c, column):
    """This slice's (maximum, Σ exp(x − maximum), target logit) per token, and what the
    gradient is made from: the fp32 logits (XLA's route), or the kernel's exp(x − m) and each
    column tile's m (head_kernel.py; nothing for the gradient without with_gradients)."""
    start = _column_start(how, w.shape[1])
    if how.kernel:
        peaks, sums, targets, *exp = head_kernel.tile_statistics(
            x_c, w, t_c - start, how.vocab_size - start, how.tiles,
            write_exp=with_gradients, interpret=how.kernel == "interpreted",
        )  # fmt: skip
        return head_kernel.row_statistics(peaks, sums, targets), (exp, peaks)
    logits = jnp.matmul(x_c, w, preferred_element_type=how.logits_dtype).astype(jnp.float32)
    logits = how.constrain(logits, ("length", "vocab"))
    if w.shape[1] * (1 if how.axis is None else lax.axis_size(how.axis)) > how.vocab_size:
        logits = jnp.where(column < how.vocab_size, logits, NEG_INF)
    return row_statistics(logits, column == t_c[:, None]), logits


def _chunk(how: HeadLoss, w: jax.Array, with_gradients: bool, inputs):
    """One chunk's log Z and target logit per token, and with_gradients its logits' gradient
    (per unit of the loss's cotangent), from x_c [chunk, d_model] through w in the compute dtype."""
    x_c, t_c, w_c = inputs
    columns = w.shape[1]
    # The column ids made here, not captured: XLA fuses an iota into its users.
    column = _column_start(how, columns) + lax.broadcasted_iota(jnp.int32, (how.chunk, columns), 1)
    local_stats, made_from = _local_statistics(how, w, with_gradients, x_c, t_c, column)
    local_peak, local_sum, local_target = local_stats
    peak = _across_slices(how, lax.pmax, local_peak)
    # each slice's sum rescaled to one peak, and its target logit (0 where it holds none)
    local = jnp.stack([local_sum * jnp.exp(local_peak - peak), local_target])
    sum_exp, target_logit = _across_slices(how, lax.psum, local)
    log_z = peak + jnp.log(sum_exp)
    if not with_gradients:
        return log_z, target_logit
    # d loss / d logit = weight · ((1 + 2z·log Z)·softmax − [target]), per unit cotangent.
    scale = w_c * (1.0 + 2.0 * how.z_loss * log_z)
    if how.kernel:
        (exp,), peaks = made_from
        d_logits = head_kernel.softmax_times(exp, peaks, log_z, scale, how.tiles)
    else:
        d_logits = scale[:, None] * jnp.exp(made_from - log_z[:, None])
    d_logits = (d_logits - jnp.where(column == t_c[:, None], w_c[:, None], 0.0)).astype(w.dtype)
    return log_z, target_logit, how.constrain(d_logits, ("length", "vocab"))


def _chunk_group(how: HeadLoss, w: jax.Array, carry, inputs):
    """A group of how.product_chunks chunks (a scan's step): their logits' gradients are written,
    in place, into one buffer that every group reuses, and meet in one product for each
    gradient (PRODUCT_TOKENS). carry: (w's gradient so far, the buffer)."""
    dw, kept = carry
    sums = []
    for i in range(how.product_chunks):
        # After the chunk before it (a barrier): one block of fp32 logits lives at a time.
        inputs_i, kept = lax.optimization_barrier(([a[i] for a in inputs], kept))
        *sums_i, d_logits = _chunk(how, w, True, inputs_i)
        kept = lax.dynamic_update_slice_in_dim(kept, d_logits, i * how.chunk, axis=0)
        sums.append(sums_i)
    kept = how.constrain(kept, ("length", "vocab"))
    dx = jnp.matmul(kept, w.T, preferred_element_type=jnp.float32)
    # x's transpose behind a barrier: both products stay in the row-major form fast CPU
    # kernels take (t5scale/model/mt5.py, project_to_vocab).
    x_t = lax.optimization_barrier(inputs[0].reshape(-1, w.shape[0]).T)
    dw = dw + jnp.matmul(x_t, kept, preferred_element_type=jnp.float32)
    log_z, target_logit = (jnp.stack(a) for a in zip(*sums, strict=True))
    carry = (how.constrain(dw, ("embed", "vocab")), kept)
    return carry, (log_z, target_logit, dx.reshape(how.product_chunks, how.chunk, -1))


def _scan_chunks(how: HeadLoss, x, w, targets, weights, counted, with_gradients: bool):
    """The loss, each token's log Z and target logit, and with_gradients the loss's gradients
    (per unit of the loss's cotangent) for x (fp32) and w (fp32)."""
    dtype = jnp.dtype(how.compute_dtype)
    w_compute = w.astype(dtype)
    group = how.product_chunks if with_gradients else 1
    tokens, chunks = _in_chunks(how, group, x.astype(dtype), targets, weights.astype(jnp.float32))
    if with_gradients:
        # inside a shard_map a scan's carry keeps one type from step to step
        dw = how.constrain(varying_as(jnp.zeros(w.shape, jnp.float32), x, w), ("embed", "vocab"))
        kept = varying_as(jnp.zeros((group * how.chunk, w.shape[1]), dtype), x, w)
        carry = (dw, how.constrain(kept, ("length", "vocab")))
        step = functools.partial(_chunk_group, how, w_compute)
    else:
        carry = None

        def step(carry, inputs):
            return carry, _chunk(how, w_compute, False, [a[0] for a in inputs])

    carry, per_chunk = lax.scan(step, carry, chunks)
    log_z, target_logit = (a.reshape(-1)[:tokens] for a in per_chunk[:2])
    per_token = log_z - target_logit + how.z_loss * jnp.square(log_z)
    loss = jnp.sum(per_token * counted.astype(jnp.float32))
    if not with_gradients:
        return (loss, log_z, target_logit), None
    dx = per_chunk[2].reshape(-1, x.shape[1])[:tokens]
    return (loss, log_z, target_logit), (dx, carry[0])


@functools.partial(jax.custom_vjp, nondiff_argnums=(5,))
def _head_loss(x, w, targets, weights, counted, how: HeadLoss):
    outputs, _ = _scan_chunks(how, x, w, targets, weights, counted, with_gradients=False)
    return outputs


def _head_loss_forward(x, w, targets, weights, counted, how: HeadLoss):
    outputs, (dx, dw) = _scan_chunks(how, x, w, targets, weights, counted, with_gradients=True)
    return outputs, (dx, dw, jnp.zeros((), x.dtype), jnp.zeros((), w.dtype))


def _head_loss_backward(how: HeadLoss, residuals, cotangents):
    del how
    dx, dw, x_like, w_like = residuals
    # Only the loss carries a gradient: head_loss stops those of log Z and the target logit.
    loss_cotangent = cotangents[0]
    return (
        (loss_cotangent * dx).astype(x_like.dtype),
        (loss_cotangent * dw).astype(w_like.dtype),
        None,
        None,
        None,
    )


_head_loss.defvjp(_head_loss_forward, _head_loss_backward)
