"""Vocabulary-parallel embedding and cross-entropy, inside the data-parallel shard_map (stage 3).

mT5's embedding and output projection are 250,112 × d_model each: at mt5_small's size more than
its layers together. Gathering them whole on every device, and reduce-scattering their dense
gradients, moved more than the layers and cost much of the step (docs/benchmarks.md). Here each
device keeps its slice of the vocabulary and the batch's activations travel instead
(Megatron-LM's vocabulary parallelism, over `zero`):

- embedding: the zero group's token ids are all-gathered (a few KB), each device looks up the ids
  that fall in its slice (zero elsewhere) and a reduce-scatter sums the partial rows back to each
  device's own examples. The gradient is a scatter-add into the local slice only.
- output projection: the decoder's output is all-gathered over the group, each device computes
  the logits of its vocabulary slice for every token of the group, chunk by chunk, and the
  softmax's max, sum of exponentials and target logit are combined across slices
  (t5scale/model/head.py). The gradient of the local slice needs no collective; that of the
  decoder's output is the reduce-scatter (the gather's transpose) of its partial sums over
  slices.

This pays while the group's tokens are few against the vocabulary (`pays_off`); with many
devices and long sequences the tables are gathered whole as before (t5scale/train/gradients.py).

Every collective here is chained after the one before it (t5scale/parallel/collectives.py), and
the first one after `after_this`, the previous collective of the step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from t5scale.data.batch import Batch
from t5scale.model.head import model_loss_sums
from t5scale.model.mt5 import look_up_rows
from t5scale.model.sizes import ModelConfig
from t5scale.parallel import collectives

AXIS = "zero"


def pays_off(group_batch: int, input_length: int, target_length: int, vocab_size: int) -> bool:
    """Whether moving a micro-batch's activations costs less than gathering the tables.

    Per micro-batch the group's embedded rows travel twice (reduce-scatter, and the all-gather
    of their gradient) and the decoder's output twice, in all 2·B·(L_in + 2·L_out) rows of
    d_model; gathering both tables and reduce-scattering their gradients moves 4·V rows.
    """
    return group_batch * (input_length + 2 * target_length) < 2 * vocab_size


def _slice_start(rows_per_device: int) -> jax.Array:
    """The first row of this device's slice along a dimension split over `zero`."""
    return lax.axis_index(AXIS) * rows_per_device


def _gather_ids(ids: jax.Array, after_this) -> jax.Array:
    """The zero group's ids, stacked on the batch axis. They travel as float32 (exact below
    2**24) because the ordering dependency is a floating multiply by zero."""
    as_float = collectives.ordered_after(ids.astype(jnp.float32), after_this)
    return lax.all_gather(as_float, AXIS, axis=0, tiled=True).astype(jnp.int32)


def embed(table: jax.Array, tokens: jax.Array, dtype, after_this) -> jax.Array:
    """Rows of `tokens` [batch, length] from this device's vocabulary slice `table` [V/N, d]."""
    all_tokens = _gather_ids(tokens, after_this)
    local = all_tokens - _slice_start(table.shape[0])
    inside = (local >= 0) & (local < table.shape[0])
    rows = look_up_rows(table, jnp.clip(local, 0, table.shape[0] - 1))
    # One slice holds each id, so the sum below adds zeros: exact in the compute dtype.
    partial = jnp.where(inside[..., None], rows, 0.0).astype(dtype)
    # The gradient path to `after_this` orders the backward pass's collectives the same way.
    partial = collectives.ordered_after(partial, after_this)
    return lax.psum_scatter(partial, AXIS, scatter_dimension=0, tiled=True)


def loss_sums(
    model: ModelConfig,
    decoded: jax.Array,
    lm_head: jax.Array,
    batch: Batch,
    z_loss: float,
    constrain,
    kernel: str | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, cross-entropy sum, z-loss sum) of this device's examples of `batch`, from the
    decoder's output [b, T, d] and this device's slice of lm_head [d, V/N], whose columns past the
    vocabulary size (padding) take no part; the gradient as t5scale/model/head.py's module docstring
    says, its parts summed back to their examples by the all-gather's transpose."""
    targets, weights = batch.decoder_target_tokens, batch.decoder_loss_weights
    group_decoded = lax.all_gather(decoded, AXIS, axis=0, tiled=True)
    group_targets = _gather_ids(targets, group_decoded)
    as_float = collectives.ordered_after(weights.astype(jnp.float32), group_targets)
    group_weights = lax.all_gather(as_float, AXIS, axis=0, tiled=True)
    # This device's own examples count in its loss, so that the step's sums over devices count
    # each token once.
    row = jnp.arange(group_weights.shape[0])[:, None]
    start = _slice_start(decoded.shape[0])
    mine = (row >= start) & (row < start + decoded.shape[0])
    return model_loss_sums(
        model, group_decoded, lm_head, group_targets, group_weights, z_loss,
        counted=jnp.where(mine, group_weights, 0.0), axis=AXIS, constrain=constrain,
        kernel=kernel,
    )  # fmt: skip
