"""T5's attention as one fused kernel per pass: a Pallas (Triton) flash attention that takes
T5's additive position bias [heads, q, k] (shared by the batch; None in cross attention) and
packed segment ids, and never forms a [batch, heads, q, k] tensor (docs/attention.md says why
this route and not cuDNN's). What it computes, as einsums, and its mask: attention_reference.py;
its custom_vjp: attention_vjp.py; its placement on the mesh: t5scale/parallel/attention.py.

Forward: one program per (query block, example, head) streams the key blocks with an online
softmax (FlashAttention-2) and keeps the log-sum-exp. Backward, in two kernels, recomputing the
probabilities block by block:
- per (key block, example, head): dk and dv, over the query blocks;
- per (query block, head): dq for each example in turn, and the bias's gradient summed over
  the examples in a [q block, k] slab that this program alone writes (deterministic: no atomics).
Lengths need not be whole blocks: the last block's rows past the end are loaded masked (as
padding, segment 0) and never stored, so the arguments are used as they are, with no padded copy
of them in the program. The head dimension is padded to a power of two where it is not one.
`interpret=True` runs the same kernels through XLA on any backend (the tests, on the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from t5scale.model.attention_reference import MASKED, allowed, check_lengths
from t5scale.model.attention_vjp import Passes, Placement, differentiable, whole_arrays


@dataclasses.dataclass(frozen=True)
class Blocks:
    """Tile sizes (powers of two, >= 16 for Triton's dot), and Triton's warps per program."""

    q: int = 64
    k: int = 64
    num_warps: int = 4


def _dot(a, b, trans_a: bool = False, trans_b: bool = False):
    # float32 inputs stay float32 (no TF32): the fp32 path must match the einsum's numerics
    exact = a.dtype == jnp.float32
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=not exact)


def _span(block: int, size: int, index):
    """Rows [index·block, (index+1)·block) of a dimension of `size`, and which of them exist."""
    start = index * block
    return pl.ds(start, block), start + lax.broadcasted_iota(jnp.int32, (block,), 0) < size


def _mask(valid, shape: tuple[int, ...]) -> jax.Array:
    """`valid` (rows, or a pair (rows, columns)) spread over a value of `shape`."""
    if isinstance(valid, tuple):
        mask = valid[0][:, None] & valid[1][None, :]
    else:
        mask = valid.reshape(valid.shape + (1,) * (len(shape) - 1))
    return jnp.broadcast_to(mask, shape)


def _load(ref, index, valid, other=0):
    """ref[index] with the rows `valid` marks (along the first sliced dimension, and the second
    where `valid` is a pair); the others read as `other`, past the end never touched."""
    return plgpu.load(ref.at[index], mask=_mask(valid, ref.at[index].shape), other=other)


def _store(ref, index, value, valid):
    """ref[index] = value on the rows `valid` marks (as `_load`)."""
    plgpu.store(ref.at[index], value, mask=_mask(valid, value.shape))


def _logits(q, k, bias_ref, rows, columns, valid):
    logits = _dot(q, k, trans_b=True)
    if bias_ref is not None:
        logits = logits + _load(bias_ref, (rows, columns), valid).astype(jnp.float32)
    return logits


def _key_blocks(q_block: int, block_q: int, block_k: int, length: int, causal: bool):
    """How many key blocks query block `q_block` reads: up to its diagonal when causal."""
    every = pl.cdiv(length, block_k)
    if causal:
        return jnp.minimum(lax.div((q_block + 1) * block_q + block_k - 1, block_k), every)
    return every


def _forward_kernel(*refs, causal: bool, has_bias: bool, block_q: int, block_k: int):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    q_segments_ref, k_segments_ref, out_ref, lse_ref = refs
    q_len, k_len = q_ref.shape[0], k_ref.shape[0]
    q_block = pl.program_id(0)
    rows, row_valid = _span(block_q, q_len, q_block)
    q = _load(q_ref, rows, row_valid)
    q_segments = _load(q_segments_ref, rows, row_valid)

    def step(j, carry):
        acc, running_max, total = carry
        keys, key_valid = _span(block_k, k_len, j)
        logits = _logits(
            q, _load(k_ref, keys, key_valid), bias_ref, rows, keys, (row_valid, key_valid)
        )
        k_segments = _load(k_segments_ref, keys, key_valid)  # past the end: 0, masked
        mask = allowed(
            q_segments[:, None], k_segments[None, :], causal, q_block * block_q, j * block_k
        )
        logits = jnp.where(mask, logits, MASKED)
        new_max = jnp.maximum(running_max, jnp.max(logits, axis=1))
        p = jnp.exp(logits - new_max[:, None])
        rescale = jnp.exp(running_max - new_max)
        total = total * rescale + jnp.sum(p, axis=1)
        v = _load(v_ref, keys, key_valid)
        acc = acc * rescale[:, None] + _dot(p.astype(v.dtype), v)
        return acc, new_max, total

    start = (
        jnp.zeros(q.shape, jnp.float32),
        jnp.full((block_q,), -jnp.inf, jnp.float32),
        jnp.zeros((block_q,), jnp.float32),
    )
    blocks = _key_blocks(q_block, block_q, block_k, k_len, causal)
    acc, running_max, total = lax.fori_loop(0, blocks, step, start)
    _store(out_ref, rows, (acc / total[:, None]).astype(out_ref.dtype), row_valid)
    _store(lse_ref, rows, running_max + jnp.log(total), row_valid)


def _probabilities(q, k, bias_ref, rows, columns, valid, lse, mask):
    logits = _logits(q, k, bias_ref, rows, columns, valid)
    return jnp.where(mask, jnp.exp(logits - lse[:, None]), 0.0)


def _dkv_kernel(*refs, causal: bool, has_bias: bool, block_q: int, block_k: int):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    q_segments_ref, k_segments_ref, d_out_ref, lse_ref, delta_ref, dk_ref, dv_ref = refs
    q_len, k_len = q_ref.shape[0], k_ref.shape[0]
    k_block = pl.program_id(0)
    keys, key_valid = _span(block_k, k_len, k_block)
    k, v = _load(k_ref, keys, key_valid), _load(v_ref, keys, key_valid)
    k_segments = _load(k_segments_ref, keys, key_valid)

    def step(i, carry):
        dk, dv = carry
        rows, row_valid = _span(block_q, q_len, i)
        q, d_out = _load(q_ref, rows, row_valid), _load(d_out_ref, rows, row_valid)
        q_segments = _load(q_segments_ref, rows, row_valid)
        mask = allowed(
            q_segments[:, None], k_segments[None, :], causal, i * block_q, k_block * block_k
        )
        lse = _load(lse_ref, rows, row_valid)
        p = _probabilities(q, k, bias_ref, rows, keys, (row_valid, key_valid), lse, mask)
        dv = dv + _dot(p.astype(d_out.dtype), d_out, trans_a=True)
        delta = _load(delta_ref, rows, row_valid)
        d_logits = p * (_dot(d_out, v, trans_b=True) - delta[:, None])
        dk = dk + _dot(d_logits.astype(q.dtype), q, trans_a=True)
        return dk, dv

    first = lax.div(k_block * block_k, block_q) if causal else 0
    start = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(first, pl.cdiv(q_len, block_q), step, start)
    _store(dk_ref, keys, dk.astype(dk_ref.dtype), key_valid)
    _store(dv_ref, keys, dv.astype(dv_ref.dtype), key_valid)


def _dq_kernel(*refs, causal: bool, has_bias: bool, block_q: int, block_k: int):
    q_ref, k_ref, v_ref, *refs = refs
    bias_ref = refs.pop(0) if has_bias else None
    q_segments_ref, k_segments_ref, d_out_ref, lse_ref, delta_ref, dq_ref, *d_bias = refs
    batch, q_len, k_len = q_ref.shape[0], q_ref.shape[1], k_ref.shape[1]
    q_block = pl.program_id(0)
    rows, row_valid = _span(block_q, q_len, q_block)
    blocks = _key_blocks(q_block, block_q, block_k, k_len, causal)

    def example(b, carry):
        # one indexer per access: Pallas's interpreter cannot store through `ref.at[b].at[...]`
        q, d_out = _load(q_ref, (b, rows), row_valid), _load(d_out_ref, (b, rows), row_valid)
        lse, delta = _load(lse_ref, (b, rows), row_valid), _load(delta_ref, (b, rows), row_valid)
        q_segments = _load(q_segments_ref, (b, rows), row_valid)

        def step(j, dq):
            keys, key_valid = _span(block_k, k_len, j)
            k, v = _load(k_ref, (b, keys), key_valid), _load(v_ref, (b, keys), key_valid)
            k_segments = _load(k_segments_ref, (b, keys), key_valid)
            mask = allowed(
                q_segments[:, None], k_segments[None, :], causal, q_block * block_q, j * block_k
            )
            valid = (row_valid, key_valid)
            p = _probabilities(q, k, bias_ref, rows, keys, valid, lse, mask)
            d_logits = p * (_dot(d_out, v, trans_b=True) - delta[:, None])
            if has_bias:  # this program alone writes these rows: add example b's share
                (d_bias_ref,) = d_bias
                earlier = _load(d_bias_ref, (rows, keys), valid)
                _store(d_bias_ref, (rows, keys), jnp.where(b > 0, earlier, 0.0) + d_logits, valid)
            return dq + _dot(d_logits.astype(k.dtype), k)

        dq = lax.fori_loop(0, blocks, step, jnp.zeros(q.shape, jnp.float32))
        _store(dq_ref, (b, rows), dq.astype(dq_ref.dtype), row_valid)
        return carry

    lax.fori_loop(0, batch, example, 0)
    if has_bias and causal:  # keys past the diagonal were never visited: no gradient there
        (d_bias_ref,) = d_bias

        def clear(j, carry):
            keys, key_valid = _span(block_k, k_len, j)
            _store(d_bias_ref, (rows, keys), jnp.zeros((block_q, block_k)), (row_valid, key_valid))
            return carry

        lax.fori_loop(blocks, pl.cdiv(k_len, block_k), clear, 0)


def forward_pass(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool,
    blocks: Blocks,
    interpret: bool,
) -> tuple[jax.Array, jax.Array]:
    """The forward kernel on arguments in the kernels' form (`_kernel_arguments`): the output
    and the log-sum-exp per query [batch, heads, q], which the backward pass takes."""
    batch, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    has_bias = bias is not None
    # Each program sees its example's and head's whole sequences and slices its own blocks.
    q_spec, kv_spec = (
        pl.BlockSpec((None, n, None, dim), lambda i, b, h: (b, 0, h, 0)) for n in (q_len, k_len)
    )
    in_specs = [q_spec, kv_spec, kv_spec]
    if has_bias:
        in_specs.append(pl.BlockSpec((None, q_len, k_len), lambda i, b, h: (h, 0, 0)))
    in_specs += [
        pl.BlockSpec((None, q_len), lambda i, b, h: (b, 0)),
        pl.BlockSpec((None, k_len), lambda i, b, h: (b, 0)),
    ]
    kernel = functools.partial(
        _forward_kernel, causal=causal, has_bias=has_bias, block_q=blocks.q, block_k=blocks.k
    )
    out, lse = pl.pallas_call(
        kernel,
        grid=(pl.cdiv(q_len, blocks.q), batch, heads),
        in_specs=in_specs,
        out_specs=[q_spec, pl.BlockSpec((None, None, q_len), lambda i, b, h: (b, h, 0))],
        out_shape=[
            jax.ShapeDtypeStruct(q.shape, q.dtype),
            jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32),
        ],
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2),
        interpret=interpret,
        name="t5_attention_forward" + ("_causal" if causal else ""),
    )(q, k, v, *([bias] if has_bias else []), q_segments, k_segments)
    return out, lse


def backward_pass(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    out: jax.Array,
    lse: jax.Array,
    d_out: jax.Array,
    causal: bool,
    blocks: Blocks,
    interpret: bool,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """The two backward kernels: (dq, dk, dv, the bias's gradient or None) from the forward
    pass's output and log-sum-exp and the output's cotangent `d_out`."""
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    bias_args = [] if bias is None else [bias]
    operands = (q, k, v, *bias_args, q_segments, k_segments, d_out, lse, delta)
    call = functools.partial(
        _backward_call, q=q, k=k, bias=bias, causal=causal, blocks=blocks, interpret=interpret
    )
    dk, dv = _dkv_call(call, q, k, v, bias is not None, blocks.k)(*operands)
    dq, *d_bias = _dq_call(call, q, k, bias, blocks.q)(*operands)
    return dq, dk, dv, d_bias[0].astype(bias.dtype) if bias is not None else None


def _backward_call(
    kernel, grid, in_specs, out_specs, out_shape, name: str, *, q, k, bias, causal, blocks,
    interpret,
):  # fmt: skip
    """A backward kernel's pallas_call, with the settings both share."""
    sizes = {"causal": causal, "has_bias": bias is not None, "block_q": blocks.q,
             "block_k": blocks.k}  # fmt: skip
    return pl.pallas_call(
        functools.partial(kernel, **sizes),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=blocks.num_warps, num_stages=2),
        interpret=interpret,
        name=name + ("_causal" if causal else ""),
    )


def _dkv_call(call, q: jax.Array, k: jax.Array, v: jax.Array, has_bias: bool, block_k: int):
    """dk, dv: one program per (key block, example, head), over its example's and head's
    queries."""
    batch, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    q_spec, kv_spec = (
        pl.BlockSpec((None, n, None, dim), lambda j, b, h: (b, 0, h, 0)) for n in (q_len, k_len)
    )
    per_query = pl.BlockSpec((None, None, q_len), lambda j, b, h: (b, h, 0))
    in_specs = [q_spec, kv_spec, kv_spec]
    if has_bias:
        in_specs.append(pl.BlockSpec((None, q_len, k_len), lambda j, b, h: (h, 0, 0)))
    in_specs += [
        pl.BlockSpec((None, q_len), lambda j, b, h: (b, 0)),
        pl.BlockSpec((None, k_len), lambda j, b, h: (b, 0)),
        q_spec,
        per_query,
        per_query,
    ]
    shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    grid = (pl.cdiv(k_len, block_k), batch, heads)
    return call(_dkv_kernel, grid, in_specs, [kv_spec, kv_spec], shapes,
                "t5_attention_backward_dkv")  # fmt: skip


def _dq_call(call, q: jax.Array, k: jax.Array, bias: jax.Array | None, block_q: int):
    """dq and the bias's gradient: one program per (query block, head), the examples in
    turn."""
    batch, q_len, heads, dim = q.shape
    k_len = k.shape[1]
    q_spec, kv_spec = (
        pl.BlockSpec((batch, n, None, dim), lambda i, h: (0, 0, h, 0)) for n in (q_len, k_len)
    )
    per_query = pl.BlockSpec((batch, None, q_len), lambda i, h: (0, h, 0))
    bias_spec = pl.BlockSpec((None, q_len, k_len), lambda i, h: (h, 0, 0))
    in_specs = [q_spec, kv_spec, kv_spec, *([bias_spec] if bias is not None else [])]
    in_specs += [
        pl.BlockSpec((batch, q_len), lambda i, h: (0, 0)),
        pl.BlockSpec((batch, k_len), lambda i, h: (0, 0)),
        q_spec,
        per_query,
        per_query,
    ]
    out_specs, out_shape = [q_spec], [jax.ShapeDtypeStruct(q.shape, q.dtype)]
    if bias is not None:
        out_specs.append(bias_spec)
        out_shape.append(jax.ShapeDtypeStruct(bias.shape, jnp.float32))
    grid = (pl.cdiv(q_len, block_q), heads)
    return call(_dq_kernel, grid, in_specs, out_specs, out_shape, "t5_attention_backward_dq")


def _block(length: int, preferred: int) -> int:
    """The preferred block, or for a shorter sequence the power of two that covers it (>= 16)."""
    return min(preferred, max(16, pl.next_power_of_2(length)))


def _kernel_arguments(q, k, v, bias, q_segments, k_segments, causal: bool, blocks: Blocks):
    """The arguments as the kernels take them (int32 segment ids; the head dimension a power of
    two >= 16, zero-padded where it is not one) and the blocks for these lengths."""
    check_lengths(q, k, causal)
    q_len, k_len, dim = q.shape[1], k.shape[1], q.shape[3]
    blocks = dataclasses.replace(blocks, q=_block(q_len, blocks.q), k=_block(k_len, blocks.k))
    if causal:  # the diagonal walk assumes one block size
        blocks = dataclasses.replace(blocks, k=blocks.q)
    padded_dim = max(16, pl.next_power_of_2(dim))
    if padded_dim != dim:
        q, k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, padded_dim - dim)]) for x in (q, k, v))
    segments = (q_segments.astype(jnp.int32), k_segments.astype(jnp.int32))
    return (q, k, v, bias, *segments), blocks


def in_kernel_form(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool,
    blocks: Blocks,
    passes: Callable[[Blocks], Passes],
) -> jax.Array:
    """`passes(blocks fitted to these lengths)` on the arguments as the kernels take them,
    their output cut back to the heads' dim."""
    arguments, blocks = _kernel_arguments(q, k, v, bias, q_segments, k_segments, causal, blocks)
    out = differentiable(*arguments, passes(blocks))
    dim = q.shape[3]
    return out if out.shape[3] == dim else out[..., :dim]


def flash_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool = False,
    blocks: Blocks = Blocks(),
    interpret: bool = False,
    place: Placement = whole_arrays,
) -> jax.Array:
    """Attention of q [batch, q, heads, dim] over k, v [batch, k, heads, dim] with `bias`
    [heads, q, k] (or None) and segment ids [batch, q] / [batch, k] (0: padding); returns
    [batch, q, heads, dim] in q's dtype. Differentiable in q, k, v and bias."""

    def passes(blocks: Blocks) -> Passes:
        options = {"causal": causal, "blocks": blocks, "interpret": interpret}
        forward, backward = (functools.partial(f, **options) for f in (forward_pass, backward_pass))
        return place(Passes(forward, backward))

    return in_kernel_form(q, k, v, bias, q_segments, k_segments, causal, blocks, passes)
