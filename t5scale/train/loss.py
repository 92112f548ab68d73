"""The training loss: cross-entropy plus z-loss (log Z squared, as T5 and PaLM use it), summed
over target tokens with padding masked out; the step divides by the token count."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def loss_sums(
    logits: jax.Array, targets: jax.Array, weights: jax.Array, z_loss: float
) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy, summed z-loss) from whole logits [batch, length, vocab]."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot product rather than a gather keeps vocab-sharded logits sharded.
    target_logit = jnp.sum(
        logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1
    )
    return weighted_sums(log_z, target_logit, weights, z_loss)


def weighted_sums(
    log_z: jax.Array, target_logit: jax.Array, weights: jax.Array, z_loss: float
) -> tuple[jax.Array, jax.Array]:
    """(summed cross-entropy, summed z-loss) from each token's log Z and target logit."""
    cross_entropy = jnp.sum((log_z - target_logit) * weights)
    z_term = jnp.sum(z_loss * jnp.square(log_z) * weights)
    return cross_entropy, z_term
