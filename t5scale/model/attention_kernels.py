"""T5's attention as fused kernels, one per pass: a Pallas (Triton) flash attention that takes
T5's additive position bias by its diagonals [heads, q + k − 1] (shared by the batch; None in
cross attention) and packed segment ids, and never forms a [batch, heads, q, k] tensor nor reads
a [heads, q, k] bias (docs/attention.md says why this route and not cuDNN's). What it computes,
as einsums, and its mask: attention_reference.py; its custom_vjp: attention_vjp.py; its
placement on the mesh: t5scale/parallel/attention.py.

T5's bias depends only on the head and k − q, so a tile's bias is gathered from the head's
diagonals (a few kB, in cache) instead of read from a [heads, q, k] array per example.

Forward: one program per (query block, example, head) streams the key blocks with an online
softmax (FlashAttention-2) and keeps the log-sum-exp. Backward, recomputing the probabilities
block by block, in three kernels that each own what they write (deterministic: no atomics):
- dk and dv per (key block, example, head), over the query blocks;
- dq per (query block, example, head), over the key blocks;
- the bias's gradient per (query block, key block, head and group of examples), summed over the
  group's examples in registers and written once; XLA adds the groups and each diagonal.
Lengths need not be whole blocks: the last block's rows past the end are loaded masked (as
padding, segment 0) and never stored. The head dimension is padded to a power of two where it is
not one. Each pass has its own tiles, warps and stages (`Blocks`), chosen on the card
(bench/gpu_check_kernels.py). `interpret=True` runs the same kernels through XLA on any backend
(the tests, on the CPU).
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

from t5scale.model.attention_reference import MASKED, check_lengths, diagonal_sums
from t5scale.model.attention_tiles import live_examples, live_spans, live_tiles
from t5scale.model.attention_vjp import Passes, Placement, differentiable, whole_arrays
from t5scale.model.triton_blocks import chosen_tiles
from t5scale.model.triton_blocks import dot as _dot
from t5scale.model.triton_blocks import load as _load
from t5scale.model.triton_blocks import span as _span
from t5scale.model.triton_blocks import store as _store


@dataclasses.dataclass(frozen=True)
class Tiles:
    """One pass's tile (powers of two, >= 16 for Triton's dot), Triton's warps and pipeline
    stages per program, (the bias's gradient only) how many groups split the batch and (dk, dv
    only) whether the tile's scores are computed transposed."""

    q: int = 64
    k: int = 64
    warps: int = 4
    stages: int = 2
    groups: int = 1
    # dk and dv only: each tile's scores as [keys, queries], so that no product's left operand
    # is transposed first (the compile-only H100 PTX: 2,466 instructions in the loop, not 2,604)
    transposed: bool = False


@dataclasses.dataclass(frozen=True)
class Blocks:
    """The tiles of each pass. The defaults: the fastest, or within 2% of it, for each of
    mT5-Large's three attentions on an H200 (bench/gpu_check.py's sweep of 2026-11-28,
    docs/benchmarks.md); larger tiles and 8 warps were slower in every pass. dk and dv from
    the scores transposed, and the bias's gradient at 64 x 32: the least time over the three
    in the sweep of 2026-11-30, the first to time either (dk, dv: encoder 0.69 ms, decoder
    0.18, cross 0.32, against 1.18, 0.25 and 0.44 untransposed at 64 x 64; the bias's
    gradient: encoder 0.58, decoder 0.20, against 0.65 and 0.26 at 64 x 64)."""

    forward: Tiles = Tiles(64, 32, 4, 3)
    dkv: Tiles = Tiles(32, 64, 4, 3, transposed=True)
    dq: Tiles = Tiles(64, 32, 4, 3)
    bias: Tiles = Tiles(64, 32, 4, 2)


def uniform(tiles: Tiles) -> Blocks:
    return Blocks(tiles, tiles, tiles, tiles)


PASSES = tuple(field.name for field in dataclasses.fields(Blocks))
# A JSON file of tiles chosen on a card ({shape key: {pass: Tiles' fields}}, `shape_key`), read
# where it names the shape at hand: how bench/gpu_check.py's steps use what its kernels item
# measured in the same run.
TILES_FILE = "T5SCALE_ATTENTION_TILES"


def shape_key(q_len: int, k_len: int, causal: bool) -> str:
    return f"{q_len}x{k_len}" + (" causal" if causal else "")


def blocks_for(q_len: int, k_len: int, causal: bool) -> Blocks:
    """The tiles for these lengths: from TILES_FILE where it names them, else the defaults."""
    chosen = chosen_tiles(TILES_FILE, shape_key(q_len, k_len, causal))
    if chosen:
        return Blocks(**{name: Tiles(**chosen[name]) for name in PASSES if name in chosen})
    return Blocks()


def _positions(row_start, key_start, shape: tuple[int, int], keys_first: bool):
    """Each score's query and key of a tile [queries, keys] (or, `keys_first`, [keys,
    queries]) from `row_start` and `key_start`."""
    rows_axis, keys_axis = (1, 0) if keys_first else (0, 1)
    rows = row_start + lax.broadcasted_iota(jnp.int32, shape, rows_axis)
    keys = key_start + lax.broadcasted_iota(jnp.int32, shape, keys_axis)
    return rows, keys


def _bias_tile(bias_ref, q_len: int, k_len: int, row_start, key_start, shape: tuple[int, int],
               keys_first: bool = False):  # fmt: skip
    """The bias of queries from `row_start` and keys from `key_start` ([keys, queries] where
    `keys_first`), gathered from the head's diagonals: bias[q, k] = diagonals[k − q + q_len −
    1], the diagonals padded on both sides by at least a tile (`_padded`) so that rows and keys
    past the end read in bounds, with no clipping."""
    pad = (bias_ref.shape[0] - (q_len + k_len - 1)) // 2
    rows, keys = _positions(row_start, key_start, shape, keys_first)
    return bias_ref[keys - rows + (q_len - 1 + pad)].astype(jnp.float32)


def _padded(bias: jax.Array | None, tiles: Tiles) -> jax.Array | None:
    """The diagonals with a tile's worth of zeros on each side, as `_bias_tile` reads them."""
    if bias is None:
        return None
    pad = max(tiles.q, tiles.k)
    return jnp.pad(bias, ((0, 0), (pad, pad)))


def _allowed(q_segments, k_segments, causal: bool, row_start, key_start,
             keys_first: bool = False) -> jax.Array:  # fmt: skip
    """attention_reference.allowed for the keys' segments in the kernels' form, padding −1
    (`_kernel_arguments`; keys past the end load as −1 too): one comparison says both same
    segment and not padding ([keys, queries] where `keys_first`). Fewer operations per score is
    speed here: at 64 dims a head the kernels are bound by their elementwise work, not by their
    matmuls."""
    if keys_first:
        mask = k_segments[:, None] == q_segments[None, :]
    else:
        mask = q_segments[:, None] == k_segments[None, :]
    if causal:
        rows, keys = _positions(row_start, key_start, mask.shape, keys_first)
        mask = mask & (keys <= rows)
    return mask


def _logits(q, k, bias_ref, q_len: int, k_len: int, row_start, key_start, mask,
            keys_first: bool = False):  # fmt: skip
    """q·kᵀ + bias (k·qᵀ + its bias where `keys_first`) where `mask` allows, MASKED elsewhere."""
    logits = _dot(k, q, trans_b=True) if keys_first else _dot(q, k, trans_b=True)
    if bias_ref is not None:
        logits = logits + _bias_tile(bias_ref, q_len, k_len, row_start, key_start, logits.shape,
                                     keys_first)  # fmt: skip
    return jnp.where(mask, logits, MASKED)


def _key_segments(ref, index, valid):
    return _load(ref, index, valid, other=-1)


def _split(refs, has_bias: bool):
    """(q, k, v, bias or None, *rest) of a kernel's refs."""
    q_ref, k_ref, v_ref, *rest = refs
    return q_ref, k_ref, v_ref, (rest.pop(0) if has_bias else None), rest


def _forward_kernel(*refs, causal: bool, has_bias: bool, block_q: int, block_k: int):
    q_ref, k_ref, v_ref, bias_ref, refs = _split(refs, has_bias)
    q_segments_ref, k_segments_ref, spans_ref, out_ref, lse_ref = refs
    q_len, k_len = q_ref.shape[0], k_ref.shape[0]
    q_block = pl.program_id(0)
    rows, row_valid, row_start = _span(block_q, q_len, q_block)
    q = _load(q_ref, rows, row_valid)
    q_segments = _load(q_segments_ref, rows, row_valid)

    def step(j, carry):
        acc, running_max, total = carry
        keys, key_valid, key_start = _span(block_k, k_len, j)
        k = _load(k_ref, keys, key_valid)
        k_segments = _key_segments(k_segments_ref, keys, key_valid)
        mask = _allowed(q_segments, k_segments, causal, row_start, key_start)
        logits = _logits(q, k, bias_ref, q_len, k_len, row_start, key_start, mask)
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
    # the live key blocks alone (attention_tiles.py): the others hold no allowed score
    acc, running_max, total = lax.fori_loop(spans_ref[0], spans_ref[1], step, start)
    out = jnp.where(total[:, None] > 0, acc / total[:, None], 0.0)  # 0: a block of padding
    _store(out_ref, rows, out.astype(out_ref.dtype), row_valid)
    # A row every key is masked for (a padding query) keeps 0, not about MASKED: the backward
    # passes' exp(logits − lse) is then 0 wherever masked, with no mask of their own to apply.
    lse = jnp.where(running_max > MASKED / 2, running_max + jnp.log(total), 0.0)
    _store(lse_ref, rows, lse, row_valid)


def _d_logits(q, k, v, d_out, bias_ref, q_len, k_len, row_start, key_start, lse, delta, mask):
    """The scores' gradient p ∘ (d_out·vᵀ − delta) of one tile, p recomputed."""
    logits = _logits(q, k, bias_ref, q_len, k_len, row_start, key_start, mask)
    p = jnp.exp(logits - lse[:, None])  # 0 where masked: MASKED − lse underflows (lse is finite)
    return p, p * (_dot(d_out, v, trans_b=True) - delta[:, None])


def _dkv_kernel(*refs, causal: bool, has_bias: bool, transposed: bool, block_q: int,
                block_k: int):  # fmt: skip
    q_ref, k_ref, v_ref, bias_ref, refs = _split(refs, has_bias)
    q_segments_ref, k_segments_ref, spans_ref, d_out_ref, lse_ref, delta_ref = refs[:6]
    dk_ref, dv_ref = refs[6:]
    q_len, k_len = q_ref.shape[0], k_ref.shape[0]
    k_block = pl.program_id(0)
    keys, key_valid, key_start = _span(block_k, k_len, k_block)
    k, v = _load(k_ref, keys, key_valid), _load(v_ref, keys, key_valid)
    k_segments = _key_segments(k_segments_ref, keys, key_valid)

    def step(i, carry):
        dk, dv = carry
        rows, row_valid, row_start = _span(block_q, q_len, i)
        q, d_out = _load(q_ref, rows, row_valid), _load(d_out_ref, rows, row_valid)
        q_segments = _load(q_segments_ref, rows, row_valid)
        lse, delta = _load(lse_ref, rows, row_valid), _load(delta_ref, rows, row_valid)
        if transposed:
            # The tile's scores as [keys, queries] (FlashAttention-2's backward as Triton's own
            # tutorial writes it): p and its gradient are the left operands of dv's and dk's
            # products in the layout their own products made them, not transposed first.
            mask = _allowed(q_segments, k_segments, causal, row_start, key_start, True)
            logits = _logits(q, k, bias_ref, q_len, k_len, row_start, key_start, mask, True)
            p = jnp.exp(logits - lse[None, :])  # 0 where masked
            d_logits = p * (_dot(v, d_out, trans_b=True) - delta[None, :])
            return dk + _dot(d_logits.astype(q.dtype), q), dv + _dot(p.astype(v.dtype), d_out)
        mask = _allowed(q_segments, k_segments, causal, row_start, key_start)
        p, d_logits = _d_logits(q, k, v, d_out, bias_ref, q_len, k_len, row_start, key_start,
                                lse, delta, mask)  # fmt: skip
        dv = dv + _dot(p.astype(d_out.dtype), d_out, trans_a=True)
        dk = dk + _dot(d_logits.astype(q.dtype), q, trans_a=True)
        return dk, dv

    start = (jnp.zeros(k.shape, jnp.float32), jnp.zeros(v.shape, jnp.float32))
    dk, dv = lax.fori_loop(spans_ref[0], spans_ref[1], step, start)  # the live query blocks
    _store(dk_ref, keys, dk.astype(dk_ref.dtype), key_valid)
    _store(dv_ref, keys, dv.astype(dv_ref.dtype), key_valid)


def _dq_kernel(*refs, causal: bool, has_bias: bool, block_q: int, block_k: int):
    q_ref, k_ref, v_ref, bias_ref, refs = _split(refs, has_bias)
    q_segments_ref, k_segments_ref, spans_ref, d_out_ref, lse_ref, delta_ref, dq_ref = refs
    q_len, k_len = q_ref.shape[0], k_ref.shape[0]
    rows, row_valid, row_start = _span(block_q, q_len, pl.program_id(0))
    q, d_out = _load(q_ref, rows, row_valid), _load(d_out_ref, rows, row_valid)
    lse, delta = _load(lse_ref, rows, row_valid), _load(delta_ref, rows, row_valid)
    q_segments = _load(q_segments_ref, rows, row_valid)

    def step(j, dq):
        keys, key_valid, key_start = _span(block_k, k_len, j)
        k, v = _load(k_ref, keys, key_valid), _load(v_ref, keys, key_valid)
        k_segments = _key_segments(k_segments_ref, keys, key_valid)
        mask = _allowed(q_segments, k_segments, causal, row_start, key_start)
        _, d_logits = _d_logits(q, k, v, d_out, bias_ref, q_len, k_len, row_start, key_start,
                                lse, delta, mask)  # fmt: skip
        return dq + _dot(d_logits.astype(k.dtype), k)

    dq = lax.fori_loop(spans_ref[0], spans_ref[1], step, jnp.zeros(q.shape, jnp.float32))
    _store(dq_ref, rows, dq.astype(dq_ref.dtype), row_valid)


def _bias_kernel(*refs, causal: bool, groups: int, block_q: int, block_k: int):
    q_ref, k_ref, v_ref, bias_ref, refs = _split(refs, True)
    q_segments_ref, k_segments_ref, examples_ref, d_out_ref, lse_ref, delta_ref = refs[:6]
    (d_bias_ref,) = refs[6:]
    batch, q_len, k_len = q_ref.shape[0], q_ref.shape[1], k_ref.shape[1]
    rows, row_valid, row_start = _span(block_q, q_len, pl.program_id(0))
    keys, key_valid, key_start = _span(block_k, k_len, pl.program_id(1))
    # the examples this tile is live in (attention_tiles.live_examples), this group's share
    per_group = pl.cdiv(batch, groups)
    first = (pl.program_id(2) % groups) * per_group
    last = jnp.minimum(first + per_group, examples_ref[0])
    bias = _bias_tile(bias_ref, q_len, k_len, row_start, key_start, (block_q, block_k))

    def example(t, total):
        b = examples_ref[1 + t]
        # one indexer per access: Pallas's interpreter cannot load through `ref.at[b].at[...]`
        q, d_out = _load(q_ref, (b, rows), row_valid), _load(d_out_ref, (b, rows), row_valid)
        k, v = _load(k_ref, (b, keys), key_valid), _load(v_ref, (b, keys), key_valid)
        lse, delta = _load(lse_ref, (b, rows), row_valid), _load(delta_ref, (b, rows), row_valid)
        q_segments = _load(q_segments_ref, (b, rows), row_valid)
        k_segments = _key_segments(k_segments_ref, (b, keys), key_valid)
        mask = _allowed(q_segments, k_segments, causal, row_start, key_start)
        logits = jnp.where(mask, _dot(q, k, trans_b=True) + bias, MASKED)
        p = jnp.exp(logits - lse[:, None])
        return total + p * (_dot(d_out, v, trans_b=True) - delta[:, None])

    total = lax.fori_loop(first, last, example, jnp.zeros((block_q, block_k), jnp.float32))
    _store(d_bias_ref, (rows, keys), total, (row_valid, key_valid))


def _call(kernel, grid, in_specs, out_specs, out_shape, name: str, tiles: Tiles,
          interpret: bool, **options):  # fmt: skip
    """A pass's pallas_call with its tiles' settings."""
    return pl.pallas_call(
        functools.partial(kernel, block_q=tiles.q, block_k=tiles.k, **options),
        grid=grid,
        in_specs=in_specs,
        out_specs=out_specs,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret,
        name=name + ("_causal" if options["causal"] else ""),
    )


def _per_example_and_head(q: jax.Array, k: jax.Array, bias: jax.Array | None):
    """The specs of (q, k, v, bias, q segments, k segments), and of q-shaped and per-query
    arrays, for a grid (block, example, head): each program sees its example's and head's whole
    sequences (and its head's diagonals) and slices its own blocks."""
    dim = q.shape[3]
    q_spec, kv_spec = (
        pl.BlockSpec((None, n, None, dim), lambda i, b, h: (b, 0, h, 0))
        for n in (q.shape[1], k.shape[1])
    )
    specs = [q_spec, kv_spec, kv_spec]
    if bias is not None:
        specs.append(pl.BlockSpec((None, bias.shape[1]), lambda i, b, h: (h, 0)))
    specs += [
        pl.BlockSpec((None, q.shape[1]), lambda i, b, h: (b, 0)),
        pl.BlockSpec((None, k.shape[1]), lambda i, b, h: (b, 0)),
    ]
    per_query = pl.BlockSpec((None, None, q.shape[1]), lambda i, b, h: (b, h, 0))
    return specs, q_spec, kv_spec, per_query


def _spans(q_segments, k_segments, causal: bool, tiles: Tiles, over_queries: bool = False):
    """Each block's live span of the blocks it streams ([batch, blocks, 2]: key blocks of each
    query block, or query blocks of each key block), and its spec for a grid (block, example,
    head)."""
    live = live_tiles(q_segments, k_segments, causal, tiles.q, tiles.k)
    spans = live_spans(jnp.swapaxes(live, 1, 2) if over_queries else live)
    return spans, pl.BlockSpec((None, None, 2), lambda i, b, h: (b, i, 0))


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
    batch, q_len, heads, _ = q.shape
    tiles = blocks.forward
    bias = _padded(bias, tiles)
    in_specs, q_spec, _, per_query = _per_example_and_head(q, k, bias)
    spans, spans_spec = _spans(q_segments, k_segments, causal, tiles)
    out, lse = _call(
        _forward_kernel, (pl.cdiv(q_len, tiles.q), batch, heads), [*in_specs, spans_spec],
        [q_spec, per_query],
        [jax.ShapeDtypeStruct(q.shape, q.dtype),
         jax.ShapeDtypeStruct((batch, heads, q_len), jnp.float32)],
        "t5_attention_forward", tiles, interpret, causal=causal, has_bias=bias is not None,
    )(q, k, v, *([bias] if bias is not None else []), q_segments, k_segments, spans)  # fmt: skip
    return out, lse


def dkv_pass(q, k, v, bias, q_segments, k_segments, d_out, lse, delta, causal: bool,
             tiles: Tiles, interpret: bool) -> tuple[jax.Array, jax.Array]:  # fmt: skip
    """dk, dv: one program per (key block, example, head), over its queries."""
    batch, k_len, heads, _ = k.shape
    bias = _padded(bias, tiles)
    in_specs, q_spec, kv_spec, per_query = _per_example_and_head(q, k, bias)
    spans, spans_spec = _spans(q_segments, k_segments, causal, tiles, over_queries=True)
    shapes = [jax.ShapeDtypeStruct(k.shape, k.dtype), jax.ShapeDtypeStruct(v.shape, v.dtype)]
    return _call(
        _dkv_kernel, (pl.cdiv(k_len, tiles.k), batch, heads),
        [*in_specs, spans_spec, q_spec, per_query, per_query], [kv_spec, kv_spec], shapes,
        "t5_attention_backward_dkv", tiles, interpret, causal=causal, has_bias=bias is not None,
        transposed=tiles.transposed,
    )(q, k, v, *([bias] if bias is not None else []), q_segments, k_segments, spans, d_out, lse,
      delta)  # fmt: skip


def dq_pass(q, k, v, bias, q_segments, k_segments, d_out, lse, delta, causal: bool,
            tiles: Tiles, interpret: bool) -> jax.Array:  # fmt: skip
    """dq: one program per (query block, example, head), over its keys."""
    batch, q_len, heads, _ = q.shape
    bias = _padded(bias, tiles)
    in_specs, q_spec, _, per_query = _per_example_and_head(q, k, bias)
    spans, spans_spec = _spans(q_segments, k_segments, causal, tiles)
    return _call(
        _dq_kernel, (pl.cdiv(q_len, tiles.q), batch, heads),
        [*in_specs, spans_spec, q_spec, per_query, per_query], q_spec,
        jax.ShapeDtypeStruct(q.shape, q.dtype),
        "t5_attention_backward_dq", tiles, interpret, causal=causal, has_bias=bias is not None,
    )(q, k, v, *([bias] if bias is not None else []), q_segments, k_segments, spans, d_out, lse,
      delta)  # fmt: skip


def bias_pass(q, k, v, bias, q_segments, k_segments, d_out, lse, delta, causal: bool,
              tiles: Tiles, interpret: bool) -> jax.Array:  # fmt: skip
    """The bias's gradient by its diagonals [heads, q + k − 1] in float32: one program per
    (query block, key block, head and group of examples) sums its tile over the group's
    examples; XLA adds the groups and each diagonal (one [groups, heads, q, k] array, written
    once: the diagonals' sum of a tile needs values other threads hold)."""
    batch, q_len, heads, dim = q.shape
    k_len, groups = k.shape[1], tiles.groups
    bias = _padded(bias, tiles)
    q_spec, kv_spec = (
        pl.BlockSpec((batch, n, None, dim), lambda i, j, hg: (0, 0, hg // groups, 0))
        for n in (q_len, k_len)
    )
    per_query = pl.BlockSpec((batch, None, q_len), lambda i, j, hg: (0, hg // groups, 0))
    in_specs = [
        q_spec, kv_spec, kv_spec,
        pl.BlockSpec((None, bias.shape[1]), lambda i, j, hg: (hg // groups, 0)),
        pl.BlockSpec((batch, q_len), lambda i, j, hg: (0, 0)),
        pl.BlockSpec((batch, k_len), lambda i, j, hg: (0, 0)),
        pl.BlockSpec((None, None, 1 + batch), lambda i, j, hg: (i, j, 0)),
        q_spec, per_query, per_query,
    ]  # fmt: skip
    live = live_tiles(q_segments, k_segments, causal, tiles.q, tiles.k)
    out_spec = pl.BlockSpec(
        (None, None, q_len, k_len), lambda i, j, hg: (hg % groups, hg // groups, 0, 0)
    )
    tiles_of_groups = _call(
        _bias_kernel, (pl.cdiv(q_len, tiles.q), pl.cdiv(k_len, tiles.k), heads * groups),
        in_specs, out_spec, jax.ShapeDtypeStruct((groups, heads, q_len, k_len), jnp.float32),
        "t5_attention_backward_bias", tiles, interpret, causal=causal, groups=groups,
    )(q, k, v, bias, q_segments, k_segments, live_examples(live), d_out, lse, delta)  # fmt: skip
    return diagonal_sums(jnp.sum(tiles_of_groups, axis=0))


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
    """The backward kernels: (dq, dk, dv, the bias's gradient or None) from the forward pass's
    output and log-sum-exp and the output's cotangent `d_out`."""
    delta = jnp.einsum("bqhd,bqhd->bhq", out.astype(jnp.float32), d_out.astype(jnp.float32))
    operands = (q, k, v, bias, q_segments, k_segments, d_out, lse, delta, causal)
    dk, dv = dkv_pass(*operands, blocks.dkv, interpret)
    dq = dq_pass(*operands, blocks.dq, interpret)
    if bias is None:
        return dq, dk, dv, None
    return dq, dk, dv, bias_pass(*operands, blocks.bias, interpret).astype(bias.dtype)


def fit_tiles(tiles: Tiles, q_len: int, k_len: int, batch: int) -> Tiles:
    """The tiles, or for a shorter sequence the power of two that covers it (>= 16)."""
    return dataclasses.replace(
        tiles,
        q=min(tiles.q, max(16, pl.next_power_of_2(q_len))),
        k=min(tiles.k, max(16, pl.next_power_of_2(k_len))),
        groups=max(1, min(tiles.groups, batch)),
    )


def _kernel_arguments(q, k, v, bias, q_segments, k_segments, causal: bool, blocks: Blocks):
    """The arguments as the kernels take them (int32 segment ids, the keys' padding −1; the head
    dimension a power of two >= 16, zero-padded where it is not one) and the blocks for these
    lengths."""
    check_lengths(q, k, causal)
    batch, q_len, _, dim = q.shape
    k_len = k.shape[1]
    fitted = {name: fit_tiles(getattr(blocks, name), q_len, k_len, batch) for name in PASSES}
    padded_dim = max(16, pl.next_power_of_2(dim))
    if padded_dim != dim:
        q, k, v = (jnp.pad(x, [(0, 0), (0, 0), (0, 0), (0, padded_dim - dim)]) for x in (q, k, v))
    # the keys' padding as −1, so that the kernels' one comparison of segments also masks it
    k_segments = jnp.where(k_segments > 0, k_segments, -1).astype(jnp.int32)
    return (q, k, v, bias, q_segments.astype(jnp.int32), k_segments), Blocks(**fitted)


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
    blocks: Blocks | None = None,
    interpret: bool = False,
    place: Placement = whole_arrays,
) -> jax.Array:
    """Attention of q [batch, q, heads, dim] over k, v [batch, k, heads, dim] with the position
    bias by its diagonals [heads, q + k − 1] (or None) and segment ids [batch, q] / [batch, k]
    (0: padding); returns [batch, q, heads, dim] in q's dtype. Differentiable in q, k, v and
    bias. `blocks`: each pass's tiles (None: `blocks_for` these lengths)."""
    if blocks is None:
        blocks = blocks_for(q.shape[1], k.shape[1], causal)

    def passes(blocks: Blocks) -> Passes:
        options = {"causal": causal, "blocks": blocks, "interpret": interpret}
        forward, backward = (functools.partial(f, **options) for f in (forward_pass, backward_pass))
        return place(Passes(forward, backward))

    return in_kernel_form(q, k, v, bias, q_segments, k_segments, causal, blocks, passes)
