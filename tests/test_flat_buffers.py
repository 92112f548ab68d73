"""Collectives on flat buffers (t5scale/parallel/collectives.py) give what the same collective
gives on the array in its own shape, on 8 emulated devices: the reduce-scatter along any
dimension, the all-gather that undoes it, and the all-reduce of a tree. (Where the gradients
take them: a mesh across the slow network, tests/test_multihost_training.py for numerics of
whole steps, tests/test_zero_across_slices.py for what crosses DCN.)"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from t5scale.parallel import collectives

DEVICES = 8


def _on_every_device(fn, *arrays):
    """fn on each device's slice of `arrays` (split on their first axis), the results stacked."""
    mesh = jax.make_mesh((DEVICES,), ("zero",), axis_types=(jax.sharding.AxisType.Auto,))
    mapped = jax.shard_map(fn, mesh=mesh, in_specs=P("zero"), out_specs=P("zero"))
    return jax.jit(mapped)(*arrays)


@pytest.mark.parametrize("dim, shape", [(0, (16, 6, 64)), (1, (3, 16, 6)), (2, (6, 5, 24))])
def test_a_flat_reduce_scatter_and_gather_are_the_plain_ones(dim, shape):
    """Each device's [1, *shape] part: summed over the 8, split along `dim` (the sum of
    various shapes' whole rows, 128-wide and not), then gathered back whole."""
    parts = jax.random.normal(jax.random.key(0), (DEVICES, *shape), jnp.float32)

    def plain(x):
        return lax.psum_scatter(x[0], "zero", scatter_dimension=dim, tiled=True)[None]

    def flat(x):
        scatter = functools.partial(lax.psum_scatter, axis_name="zero", scatter_dimension=0,
                                    tiled=True)  # fmt: skip
        return collectives.as_flat_buffer(x[0], dim, DEVICES, scatter)[None]

    want, got = _on_every_device(plain, parts), _on_every_device(flat, parts)
    assert got.shape == want.shape
    np.testing.assert_allclose(got, want, rtol=1e-6)

    def gather_flat(x):
        gather = functools.partial(lax.all_gather, axis_name="zero", axis=0, tiled=True)
        return collectives.as_flat_buffer(x[0], dim, 1, gather)[None]

    whole = _on_every_device(gather_flat, got)
    np.testing.assert_allclose(whole[3], parts.sum(0), rtol=1e-5, atol=1e-5)


def test_a_tree_is_summed_in_flat_buffers_leaf_by_leaf():
    tree = {"w": jnp.arange(DEVICES * 3 * 128.0).reshape(DEVICES, 3, 128),
            "b": jnp.arange(DEVICES * 5.0).reshape(DEVICES, 5)}  # fmt: skip

    def summed(w, b):
        total = collectives.psum_as_flat_buffers({"w": w[0], "b": b[0]}, "zero")
        return total["w"][None], total["b"][None]

    w, b = _on_every_device(summed, tree["w"], tree["b"])
    np.testing.assert_array_equal(w[5], tree["w"].sum(0))
    np.testing.assert_array_equal(b[0], tree["b"].sum(0))
