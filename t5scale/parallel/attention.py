"""The fused attention placed on the mesh: inside the train step's data-parallel shard_map, where
each device already holds its examples, each device attends over its own heads, in a shard_map
over the axis tensor parallelism splits the heads over (t5scale/parallel/rules.py), the only
axis XLA still partitions there. The kernels (t5scale/model/attention_kernels.py) are opaque to
XLA's partitioner, so they must be given whole heads.

What runs in that shard_map follows the model's resolved attention (ModelConfig.attention,
t5scale/model/sizes.py): 'fused', the kernels, compiled by Triton on GPUs and by Mosaic on TPUs
(t5scale/model/attention_tpu.py, whose custom_vjp is its own); 'fused_reference', the
kernels' arithmetic as einsums (t5scale/model/attention_reference.py) given exactly what the
kernels would be given: the arguments padded as the kernels take them, the segments, the bias
[heads, q, k], the same shard_map and custom_vjp. That is the fused route on devices the
kernels do not compile for (CPUs): Pallas's interpreter cannot yet run inside that shard_map
(it loses the values' manual-axis types in its loops), and the kernels themselves are tested
on their own (tests/test_attention.py).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from t5scale.model import attention_tpu
from t5scale.model.attention_kernels import (
    Blocks,
    backward_pass,
    forward_pass,
    kernel_arguments,
    without_head_padding,
)
from t5scale.model.attention_reference import reference_attention, reference_backward
from t5scale.parallel.rules import TENSOR_RULES, activation_spec
from t5scale.target import Target

HEADS_AXIS = TENSOR_RULES["heads"]  # the mesh axis the heads are split over
_HEADS = activation_spec(("batch", "length", "heads", "kv"))  # q, k, v, out and their gradients
_PER_HEAD = activation_spec(("batch", "heads", "length"))  # the log-sum-exp [batch, heads, q]
_BIAS = activation_spec(("heads", "length", "length"))  # the position bias [heads, q, k]


def _varying_like(x: jax.Array, like: jax.Array) -> jax.Array:
    """x marked as varying over the manual mesh axes `like` varies over (a value out of a
    shard_map that does not check them has lost that mark)."""
    missing = tuple(
        set(jax.typeof(like).manual_axis_type.varying) - set(jax.typeof(x).manual_axis_type.varying)
    )
    return lax.pcast(x, missing, to="varying") if missing else x


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


# The shard_maps do not check which values vary over the manual axes, so their results have
# lost that mark; the forward and backward passes mark them again (`_varying_like`), and the
# custom_vjp sits outside the shard_maps. The reference's backward pass is its closed form,
# recomputing the probabilities, as the kernels do.
@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _attention_on_heads(q, k, v, bias, q_segments, k_segments, mesh, causal, blocks, kind):
    arguments = (q, k, v, bias, q_segments, k_segments)
    return _attention_on_heads_forward(*arguments, mesh, causal, blocks, kind)[0]


def _attention_on_heads_forward(q, k, v, bias, q_segments, k_segments, mesh, causal, blocks, kind):
    """`kind`: 'triton' (GPUs), 'mosaic' (TPUs) or 'reference' (their arithmetic as einsums)."""

    def forward(q, k, v, bias, q_segments, k_segments):
        if kind == "triton":
            return forward_pass(q, k, v, bias, q_segments, k_segments, causal, blocks, False)
        if kind == "mosaic":
            return attention_tpu.forward(q, k, v, bias, q_segments, k_segments, causal)
        out = reference_attention(q, k, v, bias, q_segments, k_segments, causal)
        # the reference keeps no log-sum-exp: a stand-in of its shape [batch, heads, q]
        return out, jnp.zeros(out.shape[:1] + out.shape[2:3] + out.shape[1:2], jnp.float32)

    arguments = (q, k, v, bias, q_segments, k_segments)
    out, lse = _on_heads(mesh, forward, arguments, _specs_of(bias), (_HEADS, _PER_HEAD))
    out = _varying_like(out, q)
    return out, (q, k, v, bias, q_segments, k_segments, out, lse)


def _attention_on_heads_backward(mesh, causal, blocks, kind, residuals, d_out):
    q, k, v, bias, q_segments, k_segments, out, lse = residuals

    def backward(q, k, v, bias, q_segments, k_segments, out, lse, d_out):
        if kind == "triton":
            return backward_pass(
                q, k, v, bias, q_segments, k_segments, out, lse, d_out, causal, blocks, False
            )
        if kind == "mosaic":
            return attention_tpu.backward(
                q, k, v, bias, q_segments, k_segments, out, lse, d_out, causal
            )
        return reference_backward(q, k, v, bias, q_segments, k_segments, d_out, causal)

    bias_spec = None if bias is None else _BIAS
    dq, dk, dv, d_bias = _on_heads(
        mesh, backward, (*residuals, d_out), _specs_of(bias, _HEADS, _PER_HEAD, _HEADS),
        (_HEADS, _HEADS, _HEADS, bias_spec),
    )  # fmt: skip
    dq, dk, dv = (_varying_like(g, x) for g, x in ((dq, q), (dk, k), (dv, v)))
    if bias is not None:
        d_bias = _varying_like(d_bias, bias)
    return (
        dq, dk, dv, d_bias,
        np.zeros(q_segments.shape, jax.dtypes.float0),
        np.zeros(k_segments.shape, jax.dtypes.float0),
    )  # fmt: skip


_attention_on_heads.defvjp(_attention_on_heads_forward, _attention_on_heads_backward)


def attend_on_mesh(
    mesh: Mesh,
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool = False,
    kernels: bool = True,
) -> jax.Array:
    """The model's `attend` on `mesh` (mt5.ShardingHooks): q [batch, q, heads, dim] over k, v
    [batch, k, heads, dim], with the position bias [heads, q, k] or None and the segment ids,
    on each device's heads; with the kernels ('fused') or, `kernels=False`
    ('fused_reference'), their arithmetic as einsums."""
    tpu = Target.of(list(mesh.devices.flat)).is_tpu  # Mosaic's kernels: model/attention_tpu.py
    inside = jax.sharding.get_abstract_mesh()  # the data-parallel shard_map's, if inside one
    mesh = mesh if inside.empty else inside
    kind = ("mosaic" if tpu else "triton") if kernels else "reference"
    if kind == "mosaic":  # they take the arguments as they are (and pad lengths themselves)
        segments = (q_segments.astype(jnp.int32), k_segments.astype(jnp.int32))
        return _attention_on_heads(q, k, v, bias, *segments, mesh, causal, Blocks(), kind)
    arguments, blocks = kernel_arguments(q, k, v, bias, q_segments, k_segments, causal, Blocks())
    out = _attention_on_heads(*arguments, mesh, causal, blocks, kind)
    return without_head_padding(out, q.shape[3])
