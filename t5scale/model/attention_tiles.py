"""Which tiles of a packed attention can hold an allowed score, so that the kernels
(attention_kernels.py) skip the others: in a row that seqio packed, each example attends to
itself alone, and with three examples to a row about two tiles in three are wholly masked.

A tile is live when the ranges of the (non-padding) segment ids of its queries and of its keys
overlap, and, causal, when its first key is not past its last query. Disjoint ranges share no
id, so a tile called dead has no allowed score whatever the ids; where each example's tokens
are one run (seqio's packing), overlapping ranges do share one, and no dead tile is computed.
Computed in XLA from the segment ids, O(batch × length), before each kernel.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

_NONE = 2**30  # an id range's bounds where a block has no segment


def _id_ranges(segments: jax.Array, block: int) -> tuple[jax.Array, jax.Array]:
    """(lowest, highest) positive segment id of each block of `segments` [batch, length]:
    [batch, blocks] each; a block of padding alone gets (_NONE, −_NONE)."""
    batch, length = segments.shape
    blocks = -(-length // block)
    padded = jnp.pad(segments, ((0, 0), (0, blocks * block - length)))
    valid = padded > 0
    by_block = padded.reshape(batch, blocks, block)
    valid = valid.reshape(batch, blocks, block)
    lowest = jnp.min(jnp.where(valid, by_block, _NONE), axis=2)
    highest = jnp.max(jnp.where(valid, by_block, -_NONE), axis=2)
    return lowest, highest


def live_tiles(
    q_segments: jax.Array, k_segments: jax.Array, causal: bool, block_q: int, block_k: int
) -> jax.Array:
    """[batch, query blocks, key blocks]: whether the tile can hold an allowed score."""
    q_low, q_high = _id_ranges(q_segments, block_q)
    k_low, k_high = _id_ranges(k_segments, block_k)
    live = jnp.maximum(q_low[:, :, None], k_low[:, None, :]) <= jnp.minimum(
        q_high[:, :, None], k_high[:, None, :]
    )
    if causal:
        first_key = jnp.arange(live.shape[2]) * block_k
        last_query = (jnp.arange(live.shape[1]) + 1) * block_q - 1
        live = live & (first_key[None, :] <= last_query[:, None])[None]
    return live


def live_spans(live: jax.Array) -> jax.Array:
    """[..., 2] int32: the first live block along the last axis of `live` and one past the
    last, (0, 0) where none is: the loop bounds of a kernel that streams those blocks."""
    blocks = live.shape[-1]
    any_live = jnp.any(live, axis=-1)
    first = jnp.argmax(live, axis=-1)
    end = blocks - jnp.argmax(live[..., ::-1], axis=-1)
    spans = jnp.stack([first, end], axis=-1).astype(jnp.int32)
    return jnp.where(any_live[..., None], spans, 0)


def live_examples(live: jax.Array) -> jax.Array:
    """[query blocks, key blocks, 1 + batch] int32: how many examples each tile is live in,
    then those examples in order (the rest of the row is padding, never read)."""
    by_tile = jnp.moveaxis(live, 0, -1)  # [query blocks, key blocks, batch]
    order = jnp.argsort(~by_tile, axis=-1, stable=True).astype(jnp.int32)
    count = jnp.sum(by_tile, axis=-1, dtype=jnp.int32)
    return jnp.concatenate([count[..., None], order], axis=-1)
