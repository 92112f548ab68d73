"""Blocks of arrays in Pallas (Triton) kernels: which rows of a block exist, loading and storing
them masked so that a length need not be a whole number of blocks, and the kernels' matmul. The
fused attention (attention_kernels.py) and the output layer's kernel (head_kernel.py) share them,
and the marks of which values vary over a shard_map's manual axes (`varying_as`).
"""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu


def varying_as(x: jax.Array, *like: jax.Array) -> jax.Array:
    """x marked as varying over every manual mesh axis that it or any of `like` varies over.
    Inside a shard_map that checks them, a Triton kernel is opaque to the check: its operands
    and results, and a scan's carry beside them, are marked by hand to agree. Outside a
    shard_map nothing varies and x is returned as it is."""
    axes = set().union(*(jax.typeof(a).manual_axis_type.varying for a in like))
    missing = tuple(sorted(axes - set(jax.typeof(x).manual_axis_type.varying)))
    return lax.pcast(x, missing, to="varying") if missing else x


def chosen_tiles(variable: str, key: str) -> dict | None:
    """The tiles a card chose for `key`, from the JSON file the environment variable `variable`
    names ({key: tiles' fields}, as bench/gpu_check.py's sweeps write it), or None."""
    path = os.environ.get(variable)
    if not (path and os.path.exists(path)):
        return None
    with open(path) as file:
        return json.load(file).get(key) or None


def dot(a, b, trans_a: bool = False, trans_b: bool = False):
    """a·b accumulated in fp32. float32 inputs stay float32 (no TF32): the fp32 path must match
    XLA's numerics."""
    exact = a.dtype == jnp.float32
    return plgpu.dot(a, b, trans_a=trans_a, trans_b=trans_b, allow_tf32=not exact)


def span(block: int, size: int, index):
    """Rows [index·block, (index+1)·block) of a dimension of `size`, which of them exist, and
    the first."""
    start = index * block
    return pl.ds(start, block), start + lax.broadcasted_iota(jnp.int32, (block,), 0) < size, start


def mask(valid, shape: tuple[int, ...]) -> jax.Array:
    """`valid` (rows, or a pair (rows, columns)) spread over a value of `shape`."""
    if isinstance(valid, tuple):
        both = valid[0][:, None] & valid[1][None, :]
    else:
        both = valid.reshape(valid.shape + (1,) * (len(shape) - 1))
    return jnp.broadcast_to(both, shape)


def load(ref, index, valid, other=0):
    """ref[index] with the rows `valid` marks (along the first sliced dimension, and the second
    where `valid` is a pair); the others read as `other`, past the end never touched."""
    return plgpu.load(ref.at[index], mask=mask(valid, ref.at[index].shape), other=other)


def store(ref, index, value, valid):
    """ref[index] = value on the rows `valid` marks (as `load`)."""
    plgpu.store(ref.at[index], value, mask=mask(valid, value.shape))
