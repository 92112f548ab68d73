"""T5's attention as Pallas kernels for TPUs (Mosaic): t5scale's fused attention
(attention_kernels.py, Triton, for GPUs) written again for the TPU's blocks, with the same
arithmetic (attention_reference.py) and the same promise: T5's position bias [heads, q, k] (made
per device from its diagonals, the form the fused route hands every kernel) is read by head and block, shared by the batch, its gradient summed over the batch inside the
kernel, and no [batch, heads, q, k] array is ever in the program (jax's own TPU flash attention
takes the bias batch-sized: docs/attention.md, "On TPUs").

The kernels take [batch, heads, length, dim] and lengths padded to whole blocks of BLOCK (128:
the TPU's lanes; padding is segment 0, so nothing attends to it), and run on a grid whose last
axis is the reduction, kept in VMEM scratch:
- forward, per (example, head, query block), over the key blocks: an online softmax
  (FlashAttention-2), the output and the log-sum-exp per query;
- dk and dv, per (example, head, key block), over the query blocks;
- dq and the bias's gradient, per (head, query block), over the key blocks and then the
  examples: each example's dq rows stay in VMEM until the last key block, and each block of
  the bias's gradient sums the examples before it is written once.
Causal attention skips the blocks above the diagonal. `interpret=True` runs the same kernels
through Pallas's TPU interpreter on any backend (the tests, on the CPU).
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
    bias_matrix,
    check_lengths,
    diagonal_sums,
)
from t5scale.model.attention_vjp import Passes, Placement, differentiable, whole_arrays

BLOCK = 128


def _dot(a, b, contract_a: int, contract_b: int) -> jax.Array:
    return lax.dot_general(a, b, (((contract_a,), (contract_b,)), ((), ())),
                           preferred_element_type=jnp.float32)  # fmt: skip


def _logits(q, k, bias_ref, q_segments, k_segments, i, j, causal: bool) -> jax.Array:
    """[query block, key block] logits, masked where a query may not attend to a key."""
    logits = _dot(q, k, 1, 1)
    if bias_ref is not None:
        logits = logits + bias_ref[...].astype(jnp.float32)
    mask = allowed(q_segments, k_segments, causal, i * BLOCK, j * BLOCK)  # (BLOCK, 1), (1, BLOCK)
    return jnp.where(mask, logits, MASKED)


def _visits(i, j, causal: bool):
    """Whether query block i reads key block j: all of them, or up to the diagonal."""
    return j <= i if causal else True


def _forward_kernel(*refs, causal: bool, has_bias: bool):
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
        logits = _logits(q_ref[...], k_ref[...], bias_ref, q_seg_ref[...], k_seg_ref[...], i, j,
                         causal)  # fmt: skip
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


def _probabilities(q, k, bias_ref, q_segments, k_segments, lse, i, j, causal: bool):
    return jnp.exp(_logits(q, k, bias_ref, q_segments, k_segments, i, j, causal) - lse)


def _dkv_kernel(*refs, causal: bool, has_bias: bool):
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
        p = _probabilities(q, k_ref[...], bias_ref, q_seg_ref[...], k_seg_ref[...], lse_ref[...],
                           i, j, causal)  # fmt: skip
        dv[...] += _dot(p.astype(d_out.dtype), d_out, 0, 0)
        d_logits = p * (_dot(d_out, v_ref[...], 1, 1) - delta_ref[...])
        dk[...] += _dot(d_logits.astype(q.dtype), q, 0, 0)

    @pl.when(i == pl.num_programs(3) - 1)
    def _():
        dk_ref[...] = dk[...].astype(dk_ref.dtype)
        dv_ref[...] = dv[...].astype(dv_ref.dtype)


def _dq_kernel(*refs, causal: bool, has_bias: bool):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    q_seg_ref, k_seg_ref, d_out_ref, lse_ref, delta_ref, dq_ref, *refs = refs
    d_bias_ref = refs.pop(0) if has_bias else None
    (dq,) = refs  # [batch, BLOCK, dim]: every example's rows of this query block
    i, j, b = pl.program_id(1), pl.program_id(2), pl.program_id(3)

    @pl.when(j == 0)
    def _():
        dq[b] = jnp.zeros(dq.shape[1:], jnp.float32)

    if has_bias:

        @pl.when(b == 0)
        def _():
            d_bias_ref[...] = jnp.zeros(d_bias_ref.shape, d_bias_ref.dtype)

    @pl.when(_visits(i, j, causal))
    def _():
        k = k_ref[...]
        p = _probabilities(q_ref[...], k, bias_ref, q_seg_ref[...], k_seg_ref[...], lse_ref[...],
                           i, j, causal)  # fmt: skip
        d_logits = p * (_dot(d_out_ref[...], v_ref[...], 1, 1) - delta_ref[...])
        dq[b] += _dot(d_logits.astype(k.dtype), k, 1, 0)
        if has_bias:
            d_bias_ref[...] += d_logits.astype(d_bias_ref.dtype)

    @pl.when(j == pl.num_programs(2) - 1)
    def _():
        dq_ref[b] = dq[b].astype(dq_ref.dtype)


def _interpreter(interpret: bool):
    """Pallas's TPU interpreter (VMEM scratch and all) where asked, else Mosaic."""
    return pltpu.InterpretParams() if interpret else False


def _params(*semantics: str) -> pltpu.CompilerParams:
    return pltpu.CompilerParams(dimension_semantics=semantics)


def _segment_specs(index_q, index_k):
    """Query segments as a column [BLOCK, 1], key segments as a row [1, BLOCK]."""
    return [pl.BlockSpec((None, BLOCK, 1), index_q), pl.BlockSpec((None, 1, BLOCK), index_k)]


def forward_pass(q, k, v, bias, q_segments, k_segments, causal: bool, interpret: bool = False):
    """Output [b, h, q, d] and log-sum-exp [b, h, q, 1] of arguments in the kernels' form."""
    batch, heads, q_len, dim = q.shape
    k_len = k.shape[2]
    grid = (batch, heads, q_len // BLOCK, k_len // BLOCK)
    q_spec = pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, i, j: (b, h, i, 0))
    kv_spec = pl.BlockSpec((None, None, BLOCK, dim), lambda b, h, i, j: (b, h, j, 0))
    in_specs = [q_spec, kv_spec, kv_spec]
    if bias is not None:
        in_specs.append(pl.BlockSpec((None, BLOCK, BLOCK), lambda b, h, i, j: (h, i, j)))
    in_specs += _segment_specs(lambda b, h, i, j: (b, i, 0), lambda b, h, i, j: (b, 0, j))
    lse_spec = pl.BlockSpec((None, None, BLOCK, 1), lambda b, h, i, j: (b, h, i, 0))
    return pl.pallas_call(
        functools.partial(_forward_kernel, causal=causal, has_bias=bias is not None),
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
                  interpret=False):  # fmt: skip
    """(dq, dk, dv, the bias's gradient or None) of arguments in the kernels' form."""
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
        in_specs.append(pl.BlockSpec((None, BLOCK, BLOCK), lambda b, h, j, i: (h, i, j)))
    in_specs += _segment_specs(lambda b, h, j, i: (b, i, 0), lambda b, h, j, i: (b, 0, j))
    in_specs += [pl.BlockSpec(row, at_q), pl.BlockSpec(column, at_q), pl.BlockSpec(column, at_q)]
    dk, dv = pl.pallas_call(
        functools.partial(_dkv_kernel, causal=causal, has_bias=has_bias),
        grid=(batch, heads, k_len // BLOCK, q_len // BLOCK),
        in_specs=in_specs,
        out_specs=[pl.BlockSpec(row, at_k), pl.BlockSpec(row, at_k)],
        out_shape=[jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)],
        scratch_shapes=[pltpu.VMEM((BLOCK, dim), jnp.float32)] * 2,
        compiler_params=_params("parallel", "parallel", "parallel", "arbitrary"),
        interpret=_interpreter(interpret),
        name="t5_attention_backward_dkv" + ("_causal" if causal else ""),
    )(q, k, v, *([bias] if has_bias else []), q_segments, k_segments, d_out, lse, delta)

    # dq and the bias's gradient: grid (head, query block i, key block j, example b)
    at_q, at_k = (lambda h, i, j, b: (b, h, i, 0)), (lambda h, i, j, b: (b, h, j, 0))
    in_specs = [pl.BlockSpec(row, at_q), pl.BlockSpec(row, at_k), pl.BlockSpec(row, at_k)]
    bias_spec = pl.BlockSpec((None, BLOCK, BLOCK), lambda h, i, j, b: (h, i, j))
    if has_bias:
        in_specs.append(bias_spec)
    in_specs += _segment_specs(lambda h, i, j, b: (b, i, 0), lambda h, i, j, b: (b, 0, j))
    in_specs += [pl.BlockSpec(row, at_q), pl.BlockSpec(column, at_q), pl.BlockSpec(column, at_q)]
    dq_spec = pl.BlockSpec((batch, None, BLOCK, dim), lambda h, i, j, b: (0, h, i, 0))
    out_specs = [dq_spec, *([bias_spec] if has_bias else [])]
    out_shape = [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if has_bias:
        out_shape.append(jax.ShapeDtypeStruct(bias.shape, jnp.float32))
    dq, *d_bias = pl.pallas_call(
        functools.partial(_dq_kernel, causal=causal, has_bias=has_bias),
        grid=(heads, q_len // BLOCK, k_len // BLOCK, batch),
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        scratch_shapes=[pltpu.VMEM((batch, BLOCK, dim), jnp.float32)],
        compiler_params=_params("parallel", "parallel", "arbitrary", "arbitrary"),
        interpret=_interpreter(interpret),
        name="t5_attention_backward_dq" + ("_causal" if causal else ""),
    )(q, k, v, *([bias] if has_bias else []), q_segments, k_segments, d_out, lse, delta)
    d_bias = d_bias[0].astype(bias.dtype) if has_bias else None
    return dq, dk, dv, d_bias


def _kernel_form(q, k, v, bias, q_segments, k_segments):
    """[batch, length, heads, dim] arguments as the kernels take them: heads first, lengths
    padded to whole blocks (padding is segment 0), segments as a column and a row."""
    q_pad, k_pad = -q.shape[1] % BLOCK, -k.shape[1] % BLOCK

    def heads_first(x, pad):
        return jnp.pad(x, ((0, 0), (0, pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    if bias is not None:  # by its diagonals: these kernels read it [heads, q, k], each device's
        bias = jnp.pad(bias_matrix(bias, q.shape[1], k.shape[1]), ((0, 0), (0, q_pad), (0, k_pad)))
    return (
        heads_first(q, q_pad), heads_first(k, k_pad), heads_first(v, k_pad), bias,
        jnp.pad(q_segments, ((0, 0), (0, q_pad)))[:, :, None],
        jnp.pad(k_segments, ((0, 0), (0, k_pad)))[:, None, :],
    )  # fmt: skip


def _length_first(x: jax.Array, length: int) -> jax.Array:
    return x.transpose(0, 2, 1, 3)[:, :length]


def _forward(q, k, v, bias, q_segments, k_segments, causal: bool, interpret: bool = False):
    """(output [batch, q, heads, dim], log-sum-exp [batch, heads, q]) of q [batch, q, heads,
    dim] over k, v [batch, k, heads, dim]."""
    q_len = q.shape[1]
    out, lse = forward_pass(*_kernel_form(q, k, v, bias, q_segments, k_segments), causal, interpret)
    return _length_first(out, q_len), lse[:, :, :q_len, 0]


def _backward(q, k, v, bias, q_segments, k_segments, out, lse, d_out, causal: bool,
             interpret: bool = False):  # fmt: skip
    """(dq, dk, dv, the bias's gradient or None), as `_forward` lays them out."""
    q_len, k_len = q.shape[1], k.shape[1]
    q_pad = -q_len % BLOCK
    arguments = _kernel_form(q, k, v, bias, q_segments, k_segments)

    def padded(x):  # [batch, q, heads, dim] as the kernels take the queries
        return jnp.pad(x, ((0, 0), (0, q_pad), (0, 0), (0, 0))).transpose(0, 2, 1, 3)

    lse = jnp.pad(lse, ((0, 0), (0, 0), (0, q_pad)))[..., None]
    dq, dk, dv, d_bias = backward_pass(*arguments, padded(out), lse, padded(d_out), causal,
                                       interpret)  # fmt: skip
    if d_bias is not None:
        d_bias = diagonal_sums(d_bias[:, :q_len, :k_len])
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
) -> jax.Array:
    """Attention of q [batch, q, heads, dim] over k, v [batch, k, heads, dim] with the position
    bias by its diagonals [heads, q + k − 1] (or None) and segment ids [batch, q] / [batch, k] (0: padding); returns
    [batch, q, heads, dim] in q's dtype. Differentiable in q, k, v and bias."""
    check_lengths(q, k, causal)
    options = {"causal": causal, "interpret": interpret}
    passes = Passes(functools.partial(_forward, **options), functools.partial(_backward, **options))
    segments = (q_segments.astype(jnp.int32), k_segments.astype(jnp.int32))
    return differentiable(q, k, v, bias, *segments, place(passes))
