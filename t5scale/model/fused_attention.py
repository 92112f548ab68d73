"""The fused attention by the backend its caller names: the model's `attend` (mt5.ShardingHooks)
on whole arrays, and on each device's heads (t5scale/parallel/attention.py, which passes a
placement). The caller holds the target and names the backend; nothing here asks a device."""

from __future__ import annotations

from typing import Literal

import jax

from t5scale.model.attention_kernels import Blocks, flash_attention, in_kernel_form
from t5scale.model.attention_reference import reference_attention, reference_passes
from t5scale.model.attention_tpu import tpu_flash_attention
from t5scale.model.attention_vjp import Placement, whole_arrays

# 'triton': the kernels compiled by Triton (GPUs); 'mosaic': by Mosaic (TPUs; 'mosaic_v4' for
# v4, which has no strided rolls); 'interpreted': the Triton kernels run by Pallas's interpreter
# (any device); 'reference': their arithmetic as einsums (ModelConfig.attention
# 'fused_reference').
Backend = Literal["triton", "mosaic", "mosaic_v4", "interpreted", "reference"]


def fused_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool,
    backend: Backend,
    place: Placement | None = None,
) -> jax.Array:
    """Attention of q [batch, q, heads, dim] over k, v [batch, k, heads, dim] with the position
    bias by its diagonals [heads, q + k − 1] or None and the segment ids, by `backend`. Without a placement the
    reference is plain einsums that JAX differentiates; with one, it gets exactly what the
    Triton kernels would (their padding, their custom_vjp)."""
    arguments = (q, k, v, bias, q_segments, k_segments, causal)
    if backend == "reference" and place is None:
        return reference_attention(*arguments)
    place = place or whole_arrays
    if backend == "reference":
        return in_kernel_form(*arguments, Blocks(), lambda blocks: place(reference_passes(causal)))
    if backend in ("mosaic", "mosaic_v4"):
        return tpu_flash_attention(*arguments, place=place, strided_rolls=backend == "mosaic")
    if backend not in ("triton", "interpreted"):
        raise ValueError(f"unknown attention backend {backend!r}")
    return flash_attention(*arguments, interpret=backend == "interpreted", place=place)
