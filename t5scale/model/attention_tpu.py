"""T5's attention as Pallas kernels for TPUs (Mosaic): t5scale's fused attention
(attention_kernels.py, Triton, for GPUs) written again for the TPU's blocks, with the same
arithmetic (attention_reference.py) and the same promise: T5's position bias is read by its
diagonals, shared by the batch, its gradient summed over the batch inside the kernel, and no
[batch, heads, q, k] array, nor the bias's [heads, q, k], is ever in the program (jax's own TPU
flash attention takes the bias batch-sized: docs/attention.md, "On TPUs").

The kernels take [batch, heads, length, dim] and lengths padded to whole blocks of BLOCK (128:
the TPU's lanes; padding is segment 0, so nothing attends to it), and run on a grid whose last
axis is the reduction, kept in VMEM scratch:
- forward, per (example, head, query block), over the key blocks: an online softmax
  (FlashAttention-2), the output and the log-sum-exp per query;
- dk and dv, per (example, head, key block), over the query blocks;
- dq and the bias's gradient, per (head, query block), over the key blocks and then the
  examples: each example's dq rows stay in VMEM until the last key block, and each tile of
  the bias's gradient sums the examples before it is summed along its diagonals, once.
Each tile's bias is the Toeplitz matrix of a window of 2·BLOCK diagonals (a head's padded
diagonals are a few kB of VMEM), made by a strided roll that shifts row r by r more: its
gradient goes back the same way (rows reversed on the MXU, then that roll), into one row of
diagonals per (head, query block) that XLA adds up. TPU v4 has no strided rolls: there the skew
is plain rolls (`_skew`). Causal attention skips the blocks above the diagonal. `interpret=True`
runs the same kernels through Pallas's TPU interpreter on any backend (the tests, on the CPU).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from t5scale.model.attention_reference import (
    MASKED,
    allowed,
    check_lengths,
)
from t5scale.model.attention_vjp import Passes, Placement, differentiable, whole_arrays

BLOCK = 128


def _dot(a, b, contract_a: int, contract_b: int) -> jax.Array:
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           preferred_element_type=jnp.float32)  # fmt: skip


def _window(i, j, q_blocks: int):
    """Where tile (i, j)'s 2·BLOCK diagonals start in the padded diagonals, in blocks
    (`_diagonal_blocks`): key − query runs from (j − i)·BLOCK − (BLOCK − 1)."""
    return j - i + q_blocks - 1


def _rows_columns() -> tuple[jax.Array, jax.Array]:
    square = (BLOCK, BLOCK)
    return tuple(lax.broadcasted_iota(jnp.int32, square, axis) for axis in (0, 1))


def _skew(x: jax.Array, shift: int, strided: bool) -> jax.Array:
    """A [BLOCK, BLOCK] tile's row r rolled right by shift + r: one strided roll from TPU v5 on.
    Mosaic has none on v4: there each vreg of 8 rows rolls by its first row's shift, then
    each row by its place in the vreg, in steps of 1, 2 and 4."""
    if strided:
        return pltpu.roll(x, shift, 1, stride=1, stride_axis=0)
    vregs = [pltpu.roll(x[r : r + 8], (shift + r) % BLOCK, 1) for r in range(0, BLOCK, 8)]
    x = jnp.concatenate(vregs, axis=0)
    in_vreg = lax.broadcasted_iota(jnp.int32, x.shape, 0) % 8
    for step in (1, 2, 4):
        x = jnp.where(in_vreg & step != 0, pltpu.roll(x, step, 1), x)
    return x


def _bias_tile(diagonals_ref, window, strided: bool) -> jax.Array:
    """The tile's bias T[r, c] = W[BLOCK − 1 + c − r] of its window W of 2·BLOCK diagonals, the
    blocks `window` (lo) and `window` + 1 (hi): row r of the block, rolled right by 1 + r (a
    strided roll), holds lo's part (c ≤ r) where it wraps around and hi's where it does not."""
    lo, hi = diagonals_ref[window], diagonals_ref[window + 1]  # [1, BLOCK] each
    rows, columns = _rows_columns()
    source = jnp.where(rows + columns >= BLOCK - 1, lo, hi)
    return _skew(source, 1, strided)


def _window_sums(tile: jax.Array, strided: bool) -> tuple[jax.Array, jax.Array]:
    """`_bias_tile`'s transpose: the [BLOCK, BLOCK] tile summed along each diagonal, as the
    window's lo and hi blocks [1, BLOCK]. Rolling row r left by 1 + r would undo the skew, but
    Mosaic's strides are small and not negative: the rows reversed instead (a permutation on
    the MXU, at fp32 precision), row r' = BLOCK − 1 − r rolled right by r' puts the
    tile's diagonal c − r in one column, lo's where the roll did not wrap (column ≥ r')."""
    rows, columns = _rows_columns()
    reverse = (rows + columns == BLOCK - 1).astype(jnp.float32)
    reversed_rows = lax.dot(reverse, tile, precision=lax.Precision.HIGHEST,
                            preferred_element_type=jnp.float32)  # fmt: skip
    skewed = _skew(reversed_rows, 0, strided)
    lo = jnp.sum(jnp.where(columns >= rows, skewed, 0.0), axis=0, keepdims=True)
    return lo, jnp.sum(jnp.where(columns >= rows, 0.0, skewed), axis=0, keepdims=True)


def _tile_bias(bias_ref, i, j, q_blocks, strided: bool):
    """Tile (i, j)'s bias [BLOCK, BLOCK], or None without a bias."""
    return None if bias_ref is None else _bias_tile(bias_ref, _window(i, j, q_blocks), strided)


def _logits(q, k, bias, q_segments, k_segments, i, j, causal: bool) -> jax.Array:
    """[query block, key block] logits, masked where a query may not attend to a key."""
    logits = _dot(q, k, 1, 1)
    if bias is not None:
        logits = logits + bias
    mask = allowed(q_segments, k_segments, causal, i * BLOCK, j * BLOCK)  # (BLOCK, 1), (1, BLOCK)
    return jnp.where(mask, logits, MASKED)


def _visits(i, j, causal: bool):
    """Whether query block i reads key block j: all of them, or up to the diagonal."""
    return j <= i if causal else True


def _forward_kernel(*refs, causal: bool, has_bias: bool, strided: bool):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    q_seg_ref, k_seg_ref, out_ref, lse_ref, running_max, total, acc = refs
    i, j = pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        running_max[...] = jnp.full(running_max.shape, -jnp.inf, jnp.float32)
        total[...] = jnp.zeros(total.shape, jnp.float32)
        acc[...] = jnp.zeros(acc.shape, jnp.float32)

    @pl.when(_visits(i, j, causal))
    def _():
        bias = _tile_bias(bias_ref, i, j, pl.num_programs(2), strided)
        logits = _logits(q_ref[...], k_ref[...], bias, q_seg_ref[...], k_seg_ref[...], i, j, causal)
        new_max = jnp.maximum(running_max[...], jnp.max(logits, axis=1, keepdims=True))
        p = jnp.exp(logits - new_max)
        rescale = jnp.exp(running_max[...] - new_max)
        total[...] = total[...] * rescale + jnp.sum(p, axis=1, keepdims=True)
        acc[...] = acc[...] * rescale + _dot(p.astype(v_ref.dtype), v_ref[...], 1, 0)
        running_max[...] = new_max

    @pl.when(j == pl.num_programs(3) - 1)
    def _():
        out_ref[...] = (acc[...] / total[...]).astype(out_ref.dtype)
        lse_ref[...] = running_max[...] + jnp.log(total[...])


def _probabilities(q, k, bias, q_segments, k_segments, lse, i, j, causal: bool):
    return jnp.exp(_logits(q, k, bias, q_segments, k_segments, i, j, causal) - lse)


def _dkv_kernel(*refs, causal: bool, has_bias: bool, strided: bool):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    q_seg_ref, k_seg_ref, d_out_ref, lse_ref, delta_ref, dk_ref, dv_ref, dk, dv = refs
    j, i = pl.program_id(2), pl.program_id(3)  # key block, query block (the reduction)

    @pl.when(i == 0)
    def _():
        dk[...] = jnp.zeros(dk.shape, jnp.float32)
        dv[...] = jnp.zeros(dv.shape, jnp.float32)

    @pl.when(_visits(i, j, causal))
    def _():
        q, d_out = q_ref[...], d_out_ref[...]
        bias = _tile_bias(bias_ref, i, j, pl.num_programs(3), strided)
        p = _probabilities(q, k_ref[...], bias, q_seg_ref[...], k_seg_ref[...], lse_ref[...],
                           i, j, causal)  # fmt: skip
        dv[...] += _dot(p.astype(d_out.dtype), d_out, 0, 0)
        d_logits = p * (_dot(d_out, v_ref[...], 1, 1) - delta_ref[...])
        dk[...] += _dot(d_logits.astype(q.dtype), q, 0, 0)

    @pl.when(i == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk[...].astype(dk_ref.dtype)
        dv_ref[...] = dv[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, causal: bool, has_bias: bool, strided: bool):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    q_seg_ref, k_seg_ref, d_out_ref, lse_ref, delta_ref, dq_ref, *refs = refs
    d_bias_ref = refs.pop(0) if has_bias else None
    dq, *d_tile = refs  # dq [batch, BLOCK, dim]: every example's rows of this query block
    i, j, b = pl.program_id(1), pl.program_id(2), pl.program_id(3)
    visits = _visits(i, j, causal)

    @pl.when(j == 0)
    def _():
        dq[b] = jnp.zeros(dq.shape[1:], jnp.float32)

    @pl.when(visits)
    def _():
        k = k_ref[...]
        bias = _tile_bias(bias_ref, i, j, pl.num_programs(1), strided)
        p = _probabilities(q_ref[...], k, bias, q_seg_ref[...], k_seg_ref[...], lse_ref[...],
                           i, j, causal)  # fmt: skip
        d_logits = p * (_dot(d_out_ref[...], v_ref[...], 1, 1) - delta_ref[...])
        dq[b] += _dot(d_logits.astype(k.dtype), k, 1, 0)
        if has_bias:  # the tile's gradient, summed over the examples
            d_tile[0][...] = jnp.where(b == 0, 0.0, d_tile[0][...]) + d_logits

    if has_bias:
        _bias_gradient(d_bias_ref, d_tile[0], i, j, b, visits, strided)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        dq_ref[b] = dq[b].astype(dq_ref.dtype)


def _bias_gradient(d_bias_ref, d_tile, i, j, b, visits, strided: bool) -> None:
    """Adds the tile's gradient, summed over the examples, to its window of the query block's
    diagonals [q blocks + k blocks, 1, BLOCK] (zeroed at its first tile) once, at the last
    example."""

    @pl.when((j == 0) & (b == 0))
    def _():
        d_bias_ref[...] = jnp.zeros(d_bias_ref.shape, d_bias_ref.dtype)

    @pl.when(visits & (b == pl.num_programs(3) - 1))
    def _():
        window = _window(i, j, pl.num_programs(1))
        lo, hi = _window_sums(d_tile[...], strided)
        d_bias_ref[window] += lo
        d_bias_ref[window + 1] += hi


def _interpreter(interpret: bool):
    """Pallas's TPU interpreter (VMEM scratch and all) where asked, else Mosaic."""
    return pltpu.InterpretParams() if interpret else False


def _params(*semantics: str) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _diagonals_spec(bias, head) -> pl.BlockSpec:
    """A head's padded diagonals [q blocks + k blocks, 1, BLOCK] (`_diagonal_blocks`), whole:
    a few kB, read once per head, the tiles' windows indexed by block."""
    return pl.BlockSpec((None, *bias.shape[1:]), lambda *grid: (head(*grid), 0, 0, 0))


def _segment_specs(index_q, index_k):
    """Query segments as a column [BLOCK, 1], key segments as a row [1, BLOCK]."""
    return [pl.BlockSpec((None, BLOCK, 1), index_q), pl.BlockSpec((None, 1, BLOCK), index_k)]


def forward_pass(q, k, v, bias, q_segments, k_segments, causal: bool, interpret: bool = False,
                 strided: bool = True):  # fmt: skip
    """Output [b, h, q, d] and log-sum-exp [b, h, q, 1] of arguments in the kernels' form."""
    batch, heads, q_len, dim = q.shape
    k_len = k.shape[2]
    grid = (batch, heads, q_len // BLOCK, k_len // BLOCK)
    q_spec = pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, i, j: (b, h, j, 0))
    in_specs = [q_spec, kv_spec, kv_spec]
    if bias is not None:
        in_specs.append(_diagonals_spec(bias, lambda b, h, i, j: h))
    in_specs += _segment_specs(lambda b, h, i, j: (b, i, 0), lambda b, h, i, j: (b, 0, j))
    lse_spec = pl.BlockSpec((None, None, BLOCK, 1), lambda b, h, i, j: (b, h, i, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, causal=causal, strided=strided,
                          has_bias=bias is not None),
        grid=grid,
        in_specs=in_specs,
        out_specs=[q_spec, lse_spec],
        out_shape=[jax.ShapeDtypeStruct(q.shape, q.dtype),
                   jax.ShapeDtypeStruct((batch, heads, q_len, 1), jnp.float32)],
        scratch_shapes=[pltpu.VMEM((BLOCK, 1), jnp.float32), pltpu.VMEM((BLOCK, 1), jnp.float32),
                        pltpu.VMEM((BLOCK, dim), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=_interpreter(interpret),
        name="t5_attention_forward" + ("_causal" if causal else ""),
    )(q, k, v, *([bias] if bias is not None else []), q_segments, k_segments)  # fmt: skip


def backward_pass(q, k, v, bias, q_segments, k_segments, out, lse, d_out, causal: bool,
                  interpret: bool = False, strided: bool = True):  # fmt: skip
    """(dq, dk, dv, the bias's gradient or None) of arguments in the kernels' form, the
    bias's in float32 as the diagonals are padded."""
    batch, heads, q_len, dim = q.shape
    k_len = k.shape[2]
    has_bias = bias is not None
    delta = jnp.sum(out.astype(jnp.float32) * d_out.astype(jnp.float32), axis=-1, keepdims=True)
    row = (None, None, BLOCK, dim)
    column = (None, None, BLOCK, 1)

    # dk, dv: grid (example, head, key block j, query block i)
    at_q, at_k = (lambda b, h, j, i: (b, h, i, 0)), (lambda b, h, j, i: (b, h, j, 0))
    in_specs = [pl.BlockSpec(row, at_q), pl.BlockSpec(row, at_k), pl.BlockSpec(row, at_k)]
    if has_bias:
        in_specs.append(_diagonals_spec(bias, lambda b, h, j, i: h))
    in_specs += _segment_specs(lambda b, h, j, i: (b, i, 0), lambda b, h, j, i: (b, 0, j))
    in_specs += [pl.BlockSpec(row, at_q), pl.BlockSpec(column, at_q), pl.BlockSpec(column, at_q)]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, causal=causal, strided=strided, has_bias=has_bias),
        grid=(batch, heads, k_len // BLOCK, q_len // BLOCK),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec(row, at_k), pl.BlockSpec(row, at_k)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((BLOCK, dim), jnp.float32)] * 2,
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=_interpreter(interpret),
        name="t5_attention_backward_dkv" + ("_causal" if causal else ""),
    )(q, k, v, *([bias] if has_bias else []), q_segments, k_segments, d_out, lse, delta)
    arguments = (q, k, v, bias, q_segments, k_segments, d_out, lse, delta)
    dq, d_bias = _dq_pass(*arguments, causal, interpret, strided)
    return dq, dk, dv, d_bias


def _dq_pass(q, k, v, bias, q_segments, k_segments, d_out, lse, delta, causal: bool,
             interpret: bool, strided: bool):  # fmt: skip
    """dq and the bias's gradient (or None): grid (head, query block i, key block j, example b)."""
    batch, heads, q_len, dim = q.shape
    k_len = k.shape[2]
    has_bias = bias is not None
    row = (None, None, BLOCK, dim)
    column = (None, None, BLOCK, 1)
    at_q, at_k = (lambda h, i, j, b: (b, h, i, 0)), (lambda h, i, j, b: (b, h, j, 0))
    in_specs = [pl.BlockSpec(row, at_q), pl.BlockSpec(row, at_k), pl.BlockSpec(row, at_k)]
    if has_bias:
        in_specs.append(_diagonals_spec(bias, lambda h, i, j, b: h))
    in_specs += _segment_specs(lambda h, i, j, b: (b, i, 0), lambda h, i, j, b: (b, 0, j))
    in_specs += [pl.BlockSpec(row, at_q), pl.BlockSpec(column, at_q), pl.BlockSpec(column, at_q)]
    out_specs = [pl.BlockSpec((batch, None, BLOCK, dim), lambda h, i, j, b: (0, h, i, 0))]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    scratch_shapes = [pltpu.VMEM((batch, BLOCK, dim), jnp.float32)]
    if has_bias:  # per (head, query block) its diagonals' gradient, and a tile summed over b
        q_blocks = q_len // BLOCK
        out_specs.append(pl.BlockSpec((None, None, *bias.shape[1:]),
                                      lambda h, i, j, b: (h, i, 0, 0, 0)))  # fmt: skip
        out_shape.append(jax.ShapeDtypeStruct((heads, q_blocks, *bias.shape[1:]), jnp.float32))
        scratch_shapes.append(pltpu.VMEM((BLOCK, BLOCK), jnp.float32))
    dq, *d_bias = pl.pallas_call(
        functools.partial(_dq_kernel, causal=causal, strided=strided, has_bias=has_bias),
        grid=(heads, q_len // BLOCK, k_len // BLOCK, batch),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=scratch_shapes,
        compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=_interpreter(interpret),
        name="t5_attention_backward_dq" + ("_causal" if causal else ""),
    )(q, k, v, *([bias] if has_bias else []), q_segments, k_segments, d_out, lse, delta)
    return dq, jnp.sum(d_bias[0], axis=1) if has_bias else None  # XLA adds the query blocks


def _diagonal_blocks(diagonals: jax.Array, q_len: int, k_len: int) -> jax.Array:
    """The diagonals [heads, q + k − 1] in float32 as the kernels read them: q_pad zeros in
    front (q_len padded is q_pad more) and zeros after, to (q blocks + k blocks) whole blocks
    [heads, blocks, 1, BLOCK]. Query block i and key block j then read blocks j − i + q blocks
    − 1 and the next (`_window`): no window leaves the array, each starts on a lane boundary."""
    q_pad, k_pad = -q_len % BLOCK, -k_len % BLOCK
    blocks = (q_len + q_pad + k_len + k_pad) // BLOCK
    after = blocks * BLOCK - q_pad - diagonals.shape[1]
    padded = jnp.pad(diagonals.astype(jnp.float32), ((0, 0), (q_pad, after)))
    return padded.reshape(diagonals.shape[0], blocks, 1, BLOCK)


def _kernel_form(q, k, v, bias, q_segments, k_segments):
    """[batch, length, heads, dim] arguments as the kernels take them: heads first, lengths
    padded to whole blocks (padding is segment 0), segments as a column and a row."""
    q_pad, k_pad = -q.shape[1] % BLOCK, -k.shape[1] % BLOCK

    def heads_first(x, pad):
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    if bias is not None:
        bias = _diagonal_blocks(bias, q.shape[1], k.shape[1])
    return (
        heads_first(q, q_pad), heads_first(k, k_pad), heads_first(v, k_pad), bias,
        jnp.pad(q_segments, ((0, 0), (0, q_pad)))[:, :, None],
        jnp.pad(k_segments, ((0, 0), (0, k_pad)))[:, None, :],
    )  # fmt: skip


def _length_first(x: jax.Array, length: int) -> jax.Array:
    return x.transpose(0, 2, 1, 3)[:, :length]


def _forward(q, k, v, bias, q_segments, k_segments, causal: bool, interpret: bool = False,
             strided: bool = True):  # fmt: skip
    """(output [batch, q, heads, dim], log-sum-exp [batch, heads, q]) of q [batch, q, heads,
    dim] over k, v [batch, k, heads, dim]."""
    q_len = q.shape[1]
    arguments = _kernel_form(q, k, v, bias, q_segments, k_segments)
    out, lse = forward_pass(*arguments, causal, interpret, strided)
    return _length_first(out, q_len), lse[:, :, :q_len, 0]


def _backward(q, k, v, bias, q_segments, k_segments, out, lse, d_out, causal: bool,
              interpret: bool = False, strided: bool = True):  # fmt: skip
    """(dq, dk, dv, the bias's gradient or None), as `_forward` lays them out."""
    q_len, k_len = q.shape[1], k.shape[1]
    q_pad = -q_len % BLOCK
    arguments = _kernel_form(q, k, v, bias, q_segments, k_segments)

    def padded(x):  # [batch, q, heads, dim] as the kernels take the queries
        return jnp.pad(x, ((0, 0), (0, q_pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, q_pad)))[..., None]
    dq, dk, dv, d_bias = backward_pass(*arguments, padded(out), lse, padded(d_out), causal,
                                       interpret, strided)  # fmt: skip
    if d_bias is not None:  # the padding's diagonals off
        d_bias = d_bias.reshape(d_bias.shape[0], -1)[:, q_pad : q_pad + q_len + k_len - 1]
        d_bias = d_bias.astype(bias.dtype)
    return _length_first(dq, q_len), _length_first(dk, k_len), _length_first(dv, k_len), d_bias


def tpu_flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool = False,
    interpret: bool = False,
    place: Placement = whole_arrays,
    strided_rolls: bool = True,
) -> jax.Array:
    """Attention of q [batch, q, heads, dim] over k, v [batch, k, heads, dim] with the position
    bias by its diagonals [heads, q + k − 1] (or None) and segment ids [batch, q] / [batch, k]
    (0: padding); returns [batch, q, heads, dim] in q's dtype. Differentiable in q, k, v and
    bias. `strided_rolls`: the chip has Mosaic's strided rolls (TPU v5 on; False for v4)."""
    check_lengths(q, k, causal)
    options = {"causal": causal, "interpret": interpret, "strided": strided_rolls}
    passes = Passes(functools.partial(_forward, **options), functools.partial(_backward, **options))
    segments = (q_segments.astype(jnp.int32), k_segments.astype(jnp.int32))
    return differentiable(q, k, v, bias, *segments, place(passes))
