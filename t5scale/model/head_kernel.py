"""The output projection and the loss's reduction over the vocabulary in one Pallas (Triton)
kernel, so that the fp32 logits never reach memory (ModelConfig.head_kernel; head.py runs it
chunk by chunk in place of XLA's GEMM and reduction).

XLA's head writes each chunk's logits in fp32 from cuBLAS, reads them once for each row's
maximum, Σ exp and target logit, and again for the gradient exp(x − log Z), which it writes in
the compute dtype: 14 bytes a logit beside the GEMM, at mT5's 250,112 ids the largest traffic
of the step outside the GEMMs (5.4 ms of mt5_small's 46 ms on an H200, docs/benchmarks.md).
Here one program per (block of tokens, block of columns) multiplies its tile in fp32 registers
and, before anything is written, reduces it to each row's maximum m, Σ exp(x − m) and target
logit over its columns, and (for the gradient) writes exp(x − m) in the compute dtype. The
tiles' statistics combine into log Z outside (12 bytes a token a tile of 128 columns: 22 MB for
960 tokens at mT5's vocabulary); the gradient is then exp(x − m)·exp(m − log Z) less the
target's one-hot, one elementwise pass in the compute dtype: 6 bytes a logit, not 14. The loss
is the same fp32 arithmetic up to the order of its sums (and in fp32 no TF32 in the kernel's
products); in bf16 the gradient is rounded twice (to bf16 before and after the rescaling) where
XLA's path rounds it once.

Rows (tokens) and columns past the arrays' ends are loaded masked and never stored; columns
from `limit` on (a vocabulary padded for a split) are masked out of the statistics. The FLOPs
are those of the GEMM it replaces (the cluster model counts it as one: analysis/kernels.py).
`interpret=True` runs the same kernel through XLA on any backend (the tests, on the CPU).
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from t5scale.model.triton_blocks import chosen_tiles, dot, load, span, store, varying_as

NEG_INF = -1e10  # a masked column's logit (head.py's too)
KERNEL_NAME = "t5_head_statistics"


@dataclasses.dataclass(frozen=True)
class HeadTiles:
    """A program's tile (tokens × columns of the vocabulary, powers of two ≥ 16 for Triton's
    dot), the d_model slice each step of its inner loop multiplies, Triton's warps and
    pipeline stages. Untimed on a card: bench/gpu_check.py's head items choose them."""

    tokens: int = 64
    columns: int = 128
    depth: int = 64
    warps: int = 4
    stages: int = 3

    def __post_init__(self) -> None:
        sizes = (self.tokens, self.columns, self.depth)
        if any(size < 16 or size & (size - 1) for size in sizes):
            raise ValueError(f"HeadTiles: tokens, columns and depth must be powers of two >= 16, "
                             f"got {sizes}")  # fmt: skip


# A JSON file of tiles chosen on a card ({d_model: HeadTiles' fields}), read where it names the
# d_model at hand: how bench/gpu_check.py's steps take what its head item measured in the run.
TILES_FILE = "T5SCALE_HEAD_TILES"


def tiles_for(d_model: int) -> HeadTiles:
    """The tiles for this d_model: from TILES_FILE where it names it, else the defaults."""
    chosen = chosen_tiles(TILES_FILE, str(d_model))
    return HeadTiles(**chosen) if chosen else HeadTiles()


def _load_block(ref, index, valid, whole: bool):
    # unmasked where the array is whole blocks (static): a masked load costs a compare a value
    return ref[index] if whole else load(ref, index, valid)


def _statistics_kernel(x_ref, w_ref, targets_ref, limit_ref, *out_refs, tiles: HeadTiles,
                       depth_step: int):  # fmt: skip
    peak_ref, sum_ref, target_ref, *exp_ref = out_refs
    tokens, depth = x_ref.shape
    columns = w_ref.shape[1]
    rows, row_valid, _ = span(tiles.tokens, tokens, pl.program_id(0))
    tile = pl.program_id(1)
    cols, col_valid, col_start = span(tiles.columns, columns, tile)
    whole_rows, whole_cols = tokens % tiles.tokens == 0, columns % tiles.columns == 0
    every_depth = jnp.ones((depth_step,), jnp.bool_)

    def step(i, acc):
        inner = pl.ds(i * depth_step, depth_step)
        x = _load_block(x_ref, (rows, inner), row_valid, whole_rows)
        w = _load_block(w_ref, (inner, cols), (every_depth, col_valid), whole_cols)
        return acc + dot(x, w)

    start = jnp.zeros((tiles.tokens, tiles.columns), jnp.float32)
    logits = lax.fori_loop(0, depth // depth_step, step, start)
    column = col_start + lax.broadcasted_iota(jnp.int32, logits.shape, 1)
    inside = column < limit_ref[0]
    logits = jnp.where(inside, logits, NEG_INF)
    peak = jnp.max(logits, axis=1)
    exp = jnp.exp(logits - peak[:, None])
    targets = load(targets_ref, rows, row_valid, other=-1)
    # a target past the columns (another slice's, beyond a ragged last tile) is in none
    target = jnp.sum(jnp.where(inside & (column == targets[:, None]), logits, 0.0), axis=1)
    store(peak_ref, (tile, rows), peak, row_valid)
    store(sum_ref, (tile, rows), jnp.sum(exp, axis=1), row_valid)
    store(target_ref, (tile, rows), target, row_valid)
    if exp_ref:
        store(exp_ref[0], (rows, cols), exp.astype(exp_ref[0].dtype), (row_valid, col_valid))


def tile_statistics(
    x: jax.Array,
    w: jax.Array,
    targets: jax.Array,
    limit: jax.Array | int,
    tiles: HeadTiles = HeadTiles(),
    *,
    write_exp: bool,
    interpret: bool = False,
) -> tuple[jax.Array, ...]:
    """Each (column tile, token)'s maximum m, Σ exp(x − m) and target logit ([tiles, tokens],
    fp32), and where `write_exp` exp(x − m) [tokens, columns] in x's dtype, of the logits x·w
    (x [tokens, d_model], w [d_model, columns], accumulated in fp32). targets: each token's
    column (−1 or any number outside [0, columns): none); columns from `limit` on are left out."""
    tokens, depth = x.shape
    columns = w.shape[1]
    # d_model a whole number of inner steps (mT5's are multiples of 64)
    depth_step = math.gcd(tiles.depth, depth)
    grid = (pl.cdiv(tokens, tiles.tokens), pl.cdiv(columns, tiles.columns))
    limit = jnp.reshape(jnp.minimum(jnp.asarray(limit, jnp.int32), columns), (1,))
    given = (x, w.astype(x.dtype), targets.astype(jnp.int32), limit)
    arguments = [varying_as(a, *given) for a in given]
    mat = jax.typeof(arguments[0]).manual_axis_type

    def shape(*dims: int, dtype=jnp.float32) -> jax.ShapeDtypeStruct:
        return jax.ShapeDtypeStruct(dims, dtype, manual_axis_type=mat)

    out_shape = [shape(grid[1], tokens)] * 3
    if write_exp:
        out_shape.append(shape(tokens, columns, dtype=x.dtype))
    return pl.pallas_call(
        functools.partial(_statistics_kernel, tiles=tiles, depth_step=depth_step),
        grid=grid,
        out_shape=out_shape,
        compiler_params=plgpu.CompilerParams(num_warps=tiles.warps, num_stages=tiles.stages),
        interpret=interpret,
        name=KERNEL_NAME,
    )(*arguments)


def row_statistics(
    peaks: jax.Array, sums: jax.Array, targets: jax.Array
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Each token's maximum, Σ exp(x − maximum) and target logit over all its column tiles
    (the tiles' statistics [tiles, tokens] combined)."""
    peak = jnp.max(peaks, axis=0)
    return peak, jnp.sum(sums * jnp.exp(peaks - peak), axis=0), jnp.sum(targets, axis=0)


def softmax_times(
    exp: jax.Array, peaks: jax.Array, log_z: jax.Array, scale: jax.Array, tiles: HeadTiles
) -> jax.Array:
    """scale · softmax [tokens, columns] in fp32, from the kernel's exp(x − m) and each tile's
    m: exp(x − m) · exp(m − log Z) · scale, one elementwise pass (XLA fuses the spreading of each
    tile's factor over its columns)."""
    tokens, columns = exp.shape
    factor = scale[:, None] * jnp.exp(peaks.T - log_z[:, None])  # [tokens, tiles]
    spread = jnp.broadcast_to(factor[:, :, None], (*factor.shape, tiles.columns))
    return exp.astype(jnp.float32) * spread.reshape(tokens, -1)[:, :columns]
