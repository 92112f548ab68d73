"""The custom_vjp every fused attention sits in, whichever passes compute it (Triton's kernels,
Mosaic's, their arithmetic as einsums; on whole arrays or each device's heads): the forward
pass keeps its output and log-sum-exp for the backward pass, which recomputes the rest."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
from jax.ad_checkpoint import checkpoint_name

# The name the forward pass gives what it keeps: remat "dots" keeps it as it keeps a matmul's
# output (t5scale/model/mt5.py, remat_policy), so that the backward pass runs no forward kernel.
KEPT = "fused_attention_kept"


@dataclasses.dataclass(frozen=True)
class Passes:
    """forward(q, k, v, bias, q segments, k segments) -> (output, log-sum-exp);
    backward(those six, output, log-sum-exp, d_out) -> (dq, dk, dv, the bias's gradient or
    None); on arguments in the form the passes take them."""

    forward: Callable[..., tuple[jax.Array, jax.Array]]
    backward: Callable[..., tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]]


# Where passes run: on the arrays as given, or (t5scale/parallel/attention.py) on each device's
# heads, inside the custom_vjp.
Placement = Callable[[Passes], Passes]


def whole_arrays(passes: Passes) -> Passes:
    return passes


@functools.partial(jax.custom_vjp, nondiff_argnums=(6,))
def differentiable(q, k, v, bias, q_segments, k_segments, passes: Passes) -> jax.Array:
    """`passes`' output, differentiable in q, k, v and bias (not in the segment ids)."""
    return passes.forward(q, k, v, bias, q_segments, k_segments)[0]


def _forward(q, k, v, bias, q_segments, k_segments, passes: Passes):
    out, lse = passes.forward(q, k, v, bias, q_segments, k_segments)
    out, lse = checkpoint_name(out, KEPT), checkpoint_name(lse, KEPT)
    return out, (q, k, v, bias, q_segments, k_segments, out, lse)


def _backward(passes: Passes, residuals, d_out):
    q_segments, k_segments = residuals[4:6]
    dq, dk, dv, d_bias = passes.backward(*residuals, d_out)
    no_gradient = (np.zeros(s.shape, jax.dtypes.float0) for s in (q_segments, k_segments))
    return dq, dk, dv, d_bias, *no_gradient


differentiable.defvjp(_forward, _backward)
