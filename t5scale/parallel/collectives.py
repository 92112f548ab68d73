"""Explicit data-parallel collectives, issued one after another in a fixed order.

JAX gives every explicit collective (lax.psum, psum_scatter, all_gather) the same channel id, and
XLA's CPU backend keys its in-process rendezvous on that id: two such collectives that may run at
the same time can meet in one rendezvous and abort the program ("Id can't be larger than the
number of participating threads"). On GPUs and TPUs collectives run in stream order anyway. So
every group of collectives written here goes through `in_order`, which makes each collective's
input depend on the previous one's result; its transpose (the backward pass) is ordered too.

The dependency is arithmetic (x + 0 · one element of the dependency) because XLA removes
optimization barriers late in compilation, and it never folds a floating multiply by zero (NaN
semantics): one scalar op per collective.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

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


def to_varying(x: jax.Array, axes: Sequence[str]) -> jax.Array:
    """x marked as differing across the manual `axes`: so that a gradient stays local (every
    gradient collective is one t5scale writes), and a scan's carry keeps one type."""
    missing = tuple(a for a in axes if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x
