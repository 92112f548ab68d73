"""The train state, created directly in its shardings (never whole on one device), and the one
form it is checkpointed in.

The state is (step, parameters, optimizer state) as the stage and the precision lay it out
(t5scale/parallel/layout.py, t5scale/train/precision.py): in mixed precision the parameters are
the bf16 working copy and the optimizer state holds the fp32 master; a tree the stage shards is
padded. Its *canonical* form — fp32 parameters in the model's shapes and the optimizer's own
state — is what checkpoints hold, so a checkpoint restores into any stage, mesh, device count
and precision (`to_canonical`, `from_canonical`).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.linen as nn
import flax.struct
import jax
import jax.numpy as jnp
import optax
from jax.sharding import NamedSharding, PartitionSpec

from t5scale.model.mt5 import MT5
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.layout import StateLayout, is_leaf_layout
from t5scale.parallel.zero import STAGES
from t5scale.train.precision import FLOAT32, MasterState, Precision, cast


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any


def canonical_init(model: ModelConfig, tx: optax.GradientTransformation):
    """rng → the canonical state: fp32 parameters in the model's shapes, fresh optimizer state.
    The random values do not depend on the mesh (partitionable threefry)."""

    def init(rng: jax.Array) -> TrainState:
        tokens = jnp.zeros((1, 8), jnp.int32)
        params = nn.meta.unbox(MT5(model).init(rng, tokens, tokens)["params"])
        return TrainState(jnp.zeros((), jnp.int32), params, tx.init(params))

    return init


def _map_opt_params(tx, fn, opt_state: Any, layout: StateLayout) -> Any:
    """fn(leaf, LeafLayout) on every parameter-shaped tree inside an optimizer state."""
    return optax.tree_map_params(
        tx, fn, opt_state, layout.leaves, transform_non_params=lambda x: x, is_leaf=is_leaf_layout
    )


def from_canonical(
    state: TrainState, tx: optax.GradientTransformation, layout: StateLayout, precision: Precision
) -> TrainState:
    """The state as the stage and precision keep it, from its canonical form."""
    stage = layout.stage
    params, opt_state = state.params, state.opt_state
    if stage.shard_optimizer_state:
        opt_state = _map_opt_params(tx, lambda x, leaf: leaf.pad(x), opt_state, layout)
    if precision.mixed:
        master = layout.pad(params) if stage.shard_optimizer_state else params
        opt_state = MasterState(master, opt_state)
        params = cast(params, precision.param_dtype)
    if stage.shard_parameters:
        params = layout.pad(params)
    return TrainState(state.step, params, opt_state)


def to_canonical(
    state: TrainState, tx: optax.GradientTransformation, layout: StateLayout, precision: Precision
) -> TrainState:
    """The canonical form of a state: fp32 parameters (the master, when mixed) and the
    optimizer's own state, in the model's shapes."""
    params, opt_state = state.params, state.opt_state
    if precision.mixed:
        params, opt_state = opt_state.master, opt_state.inner
    opt_state = _map_opt_params(tx, lambda x, leaf: leaf.unpad(x), opt_state, layout)
    return TrainState(state.step, layout.unpad(params), opt_state)


def initializer(
    model: ModelConfig, tx: optax.GradientTransformation, layout: StateLayout, precision: Precision
):
    """rng → a fresh state as the stage and precision keep it (not jitted)."""
    init = canonical_init(model, tx)
    return lambda rng: from_canonical(init(rng), tx, layout, precision)


def abstract_state(
    model: ModelConfig, tx: optax.GradientTransformation, layout: StateLayout, precision: Precision
) -> TrainState:
    """The state's shapes and dtypes (jax.ShapeDtypeStruct leaves), nothing allocated."""
    return jax.eval_shape(initializer(model, tx, layout, precision), jax.random.key(0))


def state_shardings(
    layout: StateLayout, tx: optax.GradientTransformation, shapes: TrainState, precision: Precision
) -> TrainState:
    """The at-rest sharding of every leaf of a state shaped like `shapes`."""
    opt_state = shapes.opt_state
    if precision.mixed:
        opt_state = MasterState(
            layout.update_shardings, layout.opt_state_shardings(tx, opt_state.inner)
        )
    else:
        opt_state = layout.opt_state_shardings(tx, opt_state)
    return TrainState(
        step=NamedSharding(layout.mesh, PartitionSpec()),
        params=layout.param_shardings,
        opt_state=opt_state,
    )


def canonical_shardings(
    layout: StateLayout, tx: optax.GradientTransformation, shapes: TrainState
) -> TrainState:
    """Shardings of the canonical form: everything split over `zero` where the model's shapes
    allow, as stage 3 would (so that little is whole on one device while a checkpoint restores)."""
    everything_sharded = dataclasses.replace(layout.unpadded(), stage=STAGES[3])
    return state_shardings(everything_sharded, tx, shapes, FLOAT32)


def with_shardings(shapes: Any, shardings: Any) -> Any:
    """Shapes, dtypes and shardings without arrays: what a step compiles for and a checkpoint
    restores into."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )
