"""The train state, created directly in its shardings (never whole on one device)."""

from __future__ import annotations

from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from t5scale.model.mt5 import MT5
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.layout import StateLayout


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def _init_fn(model: ModelConfig, tx: optax.GradientTransformation):
    def init(rng: jax.Array) -> TrainState:
        tokens = jnp.zeros((1, 8), jnp.int32)
        params = nn.meta.unbox(MT5(model).init(rng, tokens, tokens)["params"])
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    return init


def abstract_state(model: ModelConfig, tx: optax.GradientTransformation) -> TrainState:
    """The state's shapes and dtypes (jax.ShapeDtypeStruct leaves), nothing allocated."""
    return jax.eval_shape(_init_fn(model, tx), jax.random.key(0))


def state_shardings(
    layout: StateLayout, tx: optax.GradientTransformation, shapes: TrainState
) -> TrainState:
    """The at-rest sharding of every leaf of a state shaped like `shapes`."""
    return TrainState(
        step=NamedSharding(layout.mesh, PartitionSpec()),
        params=layout.param_shardings,
        opt_state=layout.opt_state_shardings(tx, shapes.opt_state),
    )


def with_shardings(shapes: Any, shardings: Any) -> Any:
    """Shapes, dtypes and shardings without arrays: what a step compiles for and a checkpoint
    restores into."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def state_initializer(model: ModelConfig, tx: optax.GradientTransformation, shardings: TrainState):
    """The jitted init: random key → TrainState in its at-rest shardings."""
    return jax.jit(_init_fn(model, tx), out_shardings=shardings)


def create_state(
    model: ModelConfig, tx: optax.GradientTransformation, shardings: TrainState, seed: int
) -> TrainState:
    """Initialise parameters and optimizer state straight into their at-rest shardings.

    The random values do not depend on the mesh (partitionable threefry), so every stage and
    mesh shape starts from the same parameters.
    """
    state = state_initializer(model, tx, shardings)(jax.random.key(seed))
    # Wait: on XLA's CPU backend two multi-device programs running at once can meet in the same
    # collective rendezvous and abort (seen with the init and the first ZeRO-3 step).
    return jax.block_until_ready(state)
