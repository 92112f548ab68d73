"""The fused attention placed on the mesh: inside the train step's data-parallel shard_map, where
each device already holds its examples, each device attends over its own heads, in a shard_map
over the axis tensor parallelism splits the heads over (t5scale/parallel/rules.py), the only
axis XLA still partitions there. The kernels (t5scale/model/attention_kernels.py,
attention_tpu.py) are opaque to XLA's partitioner, so they must be given whole heads.

'fused_reference' runs the kernels' arithmetic as einsums given exactly what the kernels would
be given (their padding, the segments, the bias's diagonals, the same shard_map and
custom_vjp): the fused route on devices the kernels do not compile for (CPUs), since Pallas's
interpreter cannot yet run inside that shard_map (it loses the values' manual-axis types in its
loops); the kernels themselves are tested on their own (tests/test_attention.py).
"""

from __future__ import annotations

import jax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from t5scale.model.attention_vjp import Passes, Placement
from t5scale.model.fused_attention import Backend, fused_attention
from t5scale.model.triton_blocks import varying_as
from t5scale.parallel.rules import TENSOR_RULES, activation_spec
from t5scale.target import Target

HEADS_AXIS = TENSOR_RULES["heads"]  # the mesh axis the heads are split over
_HEADS = activation_spec(("batch", "length", "heads", "kv"))  # q, k, v, out and their gradients
_PER_HEAD = activation_spec(("batch", "heads", "length"))  # the log-sum-exp [batch, heads, q]
_BIAS = activation_spec(("heads", None))  # the position bias by its diagonals [heads, q + k − 1]


def _on_heads(mesh, function, arguments, in_specs, out_specs):
    """`function` on each device's heads: a shard_map over the heads' axis (and any other axis
    of one device that is not manual yet, such as `pipeline` without a pipeline: Mosaic's
    kernels refuse to be partitioned automatically even over one device). It does not check
    which values vary over the manual axes: Triton's kernels are opaque to that check."""
    manual = set(getattr(mesh, "manual_axes", ()))
    single = {axis for axis, size in mesh.shape.items() if size == 1 and axis not in manual}
    return jax.shard_map(
        function, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
        axis_names={HEADS_AXIS} | single, check_vma=False,
    )(*arguments)  # fmt: skip


def _specs_of(bias, *more) -> tuple:
    """The shard_map's specs of (q, k, v, bias, q segments, k segments, *more)."""
    return (_HEADS, _HEADS, _HEADS, None if bias is None else _BIAS, P(), P(), *more)


def kernels_for(mesh: Mesh) -> Backend:
    """The fused kernels that compile for `mesh`'s devices (the model's ShardingHooks.kernels):
    Mosaic's on TPUs (v4's without strided rolls), Triton's on GPUs, elsewhere Triton's run by
    Pallas's interpreter."""
    target = Target.of(list(mesh.devices.flat))
    if target.is_tpu:
        return "mosaic" if target.strided_rolls else "mosaic_v4"
    return "triton" if target.fused_kernels else "interpreted"


def _on_each_devices_heads(mesh) -> Placement:
    """The passes each in a shard_map over the heads. Those shard_maps do not check which values
    vary over the manual axes, so their results have lost that mark: it is set again here, and
    the custom_vjp sits outside the shard_maps."""

    def place(passes: Passes) -> Passes:
        def forward(q, k, v, bias, q_segments, k_segments):
            arguments = (q, k, v, bias, q_segments, k_segments)
            out_specs = (_HEADS, _PER_HEAD)
            out, lse = _on_heads(mesh, passes.forward, arguments, _specs_of(bias), out_specs)
            return varying_as(out, q), lse

        def backward(q, k, v, bias, q_segments, k_segments, out, lse, d_out):
            arguments = (q, k, v, bias, q_segments, k_segments, out, lse, d_out)
            in_specs = _specs_of(bias, _HEADS, _PER_HEAD, _HEADS)
            out_specs = (_HEADS, _HEADS, _HEADS, None if bias is None else _BIAS)
            dq, dk, dv, d_bias = _on_heads(mesh, passes.backward, arguments, in_specs, out_specs)
            dq, dk, dv = (varying_as(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))
            if bias is not None:
                d_bias = varying_as(d_bias, bias)
            return dq, dk, dv, d_bias

        return Passes(forward, backward)

    return place


def attend_on_mesh(
    mesh: Mesh,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool,
    backend: Backend,
) -> jax.Array:
    """The model's `attend` on `mesh` (mt5.ShardingHooks): `fused_attention` on each device's
    heads."""
    inside = jax.sharding.get_abstract_mesh()  # the data-parallel shard_map's, if inside one
    mesh = mesh if inside.empty else inside
    place = _on_each_devices_heads(mesh)
    return fused_attention(q, k, v, bias, q_segments, k_segments, causal, backend, place)
