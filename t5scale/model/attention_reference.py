"""What t5scale's fused attention kernels compute (attention_kernels.py, attention_tpu.py), as
einsums over the [batch, heads, q, k] scores in XLA, and its backward pass in the closed form
the kernels use; the mask rule the kernels share.

    softmax(q·kᵀ + bias, masked) · v, no 1/sqrt(d) scale (T5 folds it into the query's init)

The position bias comes by its diagonals [heads, q + k − 1], bias[h, q, k] = diagonals[h, k − q
+ q_len − 1] (T5's depends on the head and k − q alone): `bias_matrix` and `diagonal_sums` turn
one form into the other, and its gradient back.

It runs where the kernels do not ('fused_reference': the fused route with this arithmetic).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from t5scale.model.attention_vjp import Passes

# Finite: a row with every key masked (a padding query) then gets p = 1 everywhere instead of
# NaN; its output is never used (nothing attends to padding, and the loss skips it).
MASKED = -1e30


def allowed(q_segments, k_segments, causal: bool, q_start=0, k_start=0) -> jax.Array:
    """Which query may attend to which key, over the last two dimensions (queries, keys) that
    the query segments (a column) and key segments (a row) broadcast to: both in the same packed
    segment, the key not padding (segment 0) and, when causal, not ahead of the query (the
    block's first query at `q_start`, its first key at `k_start`)."""
    mask = (q_segments == k_segments) & (k_segments > 0)
    if causal:
        square = mask.shape[-2:]  # the same for every example
        rows = q_start + lax.broadcasted_iota(jnp.int32, square, 0)
        columns = k_start + lax.broadcasted_iota(jnp.int32, square, 1)
        mask = mask & (columns <= rows)
    return mask


def bias_matrix(diagonals: jax.Array, q_len: int, k_len: int) -> jax.Array:
    """The bias [heads, q, k] of its diagonals [heads, q + k − 1]."""
    index = np.arange(k_len)[None, :] - np.arange(q_len)[:, None] + q_len - 1
    return diagonals[:, index]


def diagonal_sums(matrix: jax.Array) -> jax.Array:
    """[..., q, k] summed along each diagonal k − q: [..., q + k − 1], as `bias_matrix`'s
    gradient. The rows reversed and each padded by q zeros, the flat array read as rows one
    shorter puts element (q, k) at column k − q + q_len − 1 of row q: a column sum is left."""
    q_len, k_len = matrix.shape[-2:]
    lead = matrix.shape[:-2]
    padded = jnp.pad(matrix[..., ::-1, :], [(0, 0)] * len(lead) + [(0, 0), (0, q_len)])
    flat = padded.reshape(*lead, q_len * (k_len + q_len))[..., : q_len * (k_len + q_len - 1)]
    return jnp.sum(flat.reshape(*lead, q_len, k_len + q_len - 1), axis=-2)


def check_lengths(q: jax.Array, k: jax.Array, causal: bool) -> None:
    """Causal attention's mask is the square's lower triangle: as many queries as keys."""
    if causal and q.shape[1] != k.shape[1]:
        raise ValueError(
            f"causal attention needs as many queries as keys, got {q.shape[1]}, {k.shape[1]}"
        )


def reference_attention(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    causal: bool = False,
) -> jax.Array:
    """Attention of q [batch, q, heads, dim] over k, v [batch, k, heads, dim] with the position
    bias by its diagonals [heads, q + k − 1] (or None) and segment ids [batch, q] / [batch, k] (0: padding), as the
    kernels compute it; returns [batch, q, heads, dim] in q's dtype."""
    p = _probabilities(q, k, bias, q_segments, k_segments, causal)
    return jnp.einsum("bhqk,bkhd->bqhd", p.astype(q.dtype), v)


def _probabilities(q, k, bias, q_segments, k_segments, causal: bool) -> jax.Array:
    logits = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32)
    if bias is not None:
        logits = logits + bias_matrix(bias, q.shape[1], k.shape[1])[None].astype(jnp.float32)
    mask = allowed(q_segments[:, :, None], k_segments[:, None, :], causal)
    return jax.nn.softmax(jnp.where(mask[:, None], logits, MASKED), axis=-1)


def reference_backward(
    q: jax.Array,
    k: jax.Array,
    v: jax.Array,
    bias: jax.Array | None,
    q_segments: jax.Array,
    k_segments: jax.Array,
    d_out: jax.Array,
    causal: bool = False,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array | None]:
    """reference_attention's gradients (dq, dk, dv, the bias's or None) for the output's
    cotangent `d_out`, in the kernels' closed form: dv = pᵀ·dout,
    ds = p ∘ (dout·vᵀ − rowsum(dout ∘ out)), dq = ds·k, dk = dsᵀ·q, the bias's = Σ_batch ds summed
    along each diagonal."""
    p = _probabilities(q, k, bias, q_segments, k_segments, causal)
    d_out32 = d_out.astype(jnp.float32)
    dv = jnp.einsum("bhqk,bqhd->bkhd", p, d_out32)
    d_p = jnp.einsum("bqhd,bkhd->bhqk", d_out32, v.astype(jnp.float32))
    d_logits = p * (d_p - jnp.sum(d_p * p, axis=-1, keepdims=True))
    dq = jnp.einsum("bhqk,bkhd->bqhd", d_logits, k.astype(jnp.float32))
    dk = jnp.einsum("bhqk,bqhd->bkhd", d_logits, q.astype(jnp.float32))
    d_bias = None if bias is None else diagonal_sums(jnp.sum(d_logits, axis=0)).astype(bias.dtype)
    return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype), d_bias


def reference_passes(causal: bool) -> Passes:
    """The kernels' passes as einsums: the backward pass in closed form, recomputing the
    probabilities as the kernels do (it needs no log-sum-exp: a zero stand-in of its shape)."""

    def forward(q, k, v, bias, q_segments, k_segments):
        out = reference_attention(q, k, v, bias, q_segments, k_segments, causal)
        return out, jnp.zeros(out.shape[:1] + out.shape[2:3] + out.shape[1:2], jnp.float32)

    def backward(q, k, v, bias, q_segments, k_segments, out, lse, d_out):
        return reference_backward(q, k, v, bias, q_segments, k_segments, d_out, causal)

    return Passes(forward, backward)


def packed_segment_ids(rng: np.random.Generator, batch: int, length: int) -> np.ndarray:
    """Segment ids of `batch` rows as seqio packs them, to check the kernels on (the tests,
    bench/gpu_check.py): 3 examples of random lengths (segments 1, 2, 3) and a padding tail."""
    rows = np.zeros((batch, length), np.int32)
    for row in rows:
        cuts = np.sort(rng.choice(np.arange(1, length), size=3, replace=False))
        row[:] = np.searchsorted(cuts, np.arange(length), side="right") + 1
        row[cuts[-1] :] = 0
    return rows
