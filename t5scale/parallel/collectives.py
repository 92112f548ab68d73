"""Explicit data-parallel collectives, issued one after another in a fixed order.

JAX gives every explicit collective (lax.psum, psum_scatter, all_gather) the same channel id, and
XLA's CPU backend keys its in-process rendezvous on that id: two such collectives that may run at
the same time can meet in one rendezvous and abort the program ("Id can't be larger than the
number of participating threads"). On GPUs and TPUs collectives run in stream order anyway. So
every group of collectives written here goes through `in_order`, which makes each collective's
input depend on the previous one's result; its transpose (the backward pass) is ordered too.

The dependency is arithmetic (x + 0 · one element of the dependency) because XLA removes
optimization barriers late in compilation, and it never folds a floating multiply by zero (NaN
semantics). The add spans x, but XLA fuses it into x's producer or consumer (AdamW's fusion, a
gradient's cast): no pass of its own in the H200's programs (twenty-fourth session). Adding the
zero to x's first element alone (a dynamic-update-slice) changed nothing there.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax


def ordered_after(x: jax.Array, dependency) -> jax.Array:
    """`x`, made to depend on every array in `dependency`: what consumes it runs after them."""
    anchor = sum(leaf.reshape(-1)[0].astype(x.dtype) for leaf in jax.tree.leaves(dependency))
    return x + anchor * jnp.zeros((), x.dtype)


def in_order(
    values: Sequence[jax.Array], collective: Callable[[int, jax.Array], jax.Array], start=None
) -> list[jax.Array]:
    """[collective(i, values[i])], each issued after the previous one's result (and `start`)."""
    results, previous = [], start
    for index, value in enumerate(values):
        if previous is not None:
            value = ordered_after(value, previous)
        previous = collective(index, value)
        results.append(previous)
    return results


def as_flat_buffer(
    x: jax.Array, dim: int, parts: int, collective: Callable[[jax.Array], jax.Array]
) -> jax.Array:
    """collective(buffer) on x as one flat buffer, as DeepSpeed moves a flattened parameter
    group: x with `dim` (the dimension a reduce-scatter splits or an all-gather joins) first,
    flattened into rows of 128 values (a TPU tile's lanes) where each of its `parts` shards
    (1 for an all-reduce) fills whole rows, else into one row; the result back in x's order
    (`dim` 1/N or N times as long).

    Why: XLA:TPU hands a collective between slices its operand in the tiled layout it chose, so
    a small minor dimension (mt5_small's 6 heads, a 64-wide head) crossed DCN padded to 128
    lanes, and a reduce-scatter along a dimension other than the major one crossed DCN whole
    before the slice's own reduce-scatter (docs/cluster_model.md, "ZeRO across slices"). Rows of
    128 are lane-dense whatever x's shape. The optimization barriers keep XLA from moving the
    reshapes through an all-reduce, which undid the flattening. Only for an array that no
    automatic (tensor) axis splits: flattening a split dimension moves data."""
    moved = jnp.moveaxis(x, dim, 0)
    buffer = lax.optimization_barrier(_rows(moved, parts))
    result = lax.optimization_barrier(collective(buffer))
    return jnp.moveaxis(result.reshape(-1, *moved.shape[1:]), 0, dim)


def psum_as_flat_buffers(tree: Any, axes) -> Any:
    """lax.psum of every leaf of `tree` over `axes`, in one all-reduce, each leaf as a flat
    buffer (as_flat_buffer's reasons)."""
    # A barrier per leaf: one over the tree would make every leaf vary over every manual axis
    # that any one varies over.
    rows = jax.tree.map(lambda x: lax.optimization_barrier(_rows(x, 1)), tree)
    total = lax.psum(rows, axes)
    return jax.tree.map(lambda t, x: lax.optimization_barrier(t).reshape(x.shape), total, tree)


def _rows(x: jax.Array, parts: int) -> jax.Array:
    lanes = 128 if x.size % (128 * parts) == 0 else x.size // parts
    return x.reshape(-1, max(lanes, 1))


def to_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """x marked as differing across the manual `axes`: so that a gradient stays local (every
    gradient collective is one t5scale writes), and a scan's carry keeps one type."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x
