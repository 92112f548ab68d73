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
from t5scale.train.replicas import OuterState, per_replica, replica_mean, split_over_replicas


class TrainState(flax.struct.PyTreeNode):
    step: jax.Array
    params: Any
    opt_state: Any
    # Local SGD and DiLoCo (t5scale/train/replicas.py): the OuterState, with `params` and
    # `opt_state` then one per replica on a leading axis. None when replicas step together.
    outer: Any = None


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
    state: TrainState,
    tx: optax.GradientTransformation,
    layout: StateLayout,
    precision: Precision,
    outer_tx: optax.GradientTransformation | None = None,
) -> TrainState:
    """The state as the stage and precision keep it, from its canonical form."""
    if state.outer is not None:
        return _for_each_replica(from_canonical, state, tx, layout, precision, outer_tx)
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
    state: TrainState,
    tx: optax.GradientTransformation,
    layout: StateLayout,
    precision: Precision,
    outer_tx: optax.GradientTransformation | None = None,
) -> TrainState:
    """The canonical form of a state: fp32 parameters (the master, when mixed) and the
    optimizer's own state, in the model's shapes."""
    if state.outer is not None:
        return _for_each_replica(to_canonical, state, tx, layout, precision, outer_tx)
    params, opt_state = state.params, state.opt_state
    if precision.mixed:
        params, opt_state = opt_state.master, opt_state.inner
    opt_state = _map_opt_params(tx, lambda x, leaf: leaf.unpad(x), opt_state, layout)
    return TrainState(state.step, layout.unpad(params), opt_state)


def _for_each_replica(convert, state, tx, layout, precision, outer_tx) -> TrainState:
    """`convert` (from_canonical or to_canonical) of local SGD's or DiLoCo's state: each
    replica's parameters and optimizer state, and the outer state as optimizer state."""

    def one_replica(params, opt_state):
        converted = convert(TrainState(state.step, params, opt_state), tx, layout, precision)
        return converted.params, converted.opt_state

    params, opt_state = jax.vmap(one_replica)(state.params, state.opt_state)
    outer = state.outer
    if layout.stage.shard_optimizer_state:
        padding = convert is from_canonical

        def resize(x, leaf):
            return leaf.pad(x) if padding else leaf.unpad(x)

        outer = OuterState(
            jax.tree.map(lambda leaf, x: resize(x, leaf), layout.leaves, outer.anchor,
                         is_leaf=is_leaf_layout),
            _map_opt_params(outer_tx, resize, outer.momentum, layout),
        )  # fmt: skip
    return TrainState(state.step, params, opt_state, outer)


def local_canonical(state: TrainState, replicas: int, outer_tx) -> TrainState:
    """Local SGD's or DiLoCo's canonical state from a synchronous one: every replica starts
    from its parameters and optimizer state, the anchor is its parameters, no outer momentum."""
    outer = OuterState(state.params, outer_tx.init(state.params))
    return TrainState(
        state.step, per_replica(state.params, replicas), per_replica(state.opt_state, replicas),
        outer,
    )  # fmt: skip


def initializer(
    model: ModelConfig,
    tx: optax.GradientTransformation,
    layout: StateLayout,
    precision: Precision,
    outer_tx: optax.GradientTransformation | None = None,
):
    """rng → a fresh state as the stage and precision keep it (not jitted); with `outer_tx`, as
    local SGD or DiLoCo keep it."""
    init = canonical_initializer(model, tx, layout, outer_tx)
    return lambda rng: from_canonical(init(rng), tx, layout, precision, outer_tx)


def canonical_initializer(
    model: ModelConfig,
    tx: optax.GradientTransformation,
    layout: StateLayout,
    outer_tx: optax.GradientTransformation | None = None,
):
    """rng → the canonical state; with `outer_tx`, local SGD's or DiLoCo's (one copy of the
    parameters and optimizer state per replica of `layout`'s mesh)."""
    init = canonical_init(model, tx)
    if outer_tx is None:
        return init
    replicas = layout.mesh.shape["replica"]
    return lambda rng: local_canonical(init(rng), replicas, outer_tx)


def abstract_state(
    model: ModelConfig,
    tx: optax.GradientTransformation,
    layout: StateLayout,
    precision: Precision,
    outer_tx: optax.GradientTransformation | None = None,
) -> TrainState:
    """The state's shapes and dtypes (jax.ShapeDtypeStruct leaves), nothing allocated."""
    return jax.eval_shape(initializer(model, tx, layout, precision, outer_tx), jax.random.key(0))


def _one_replica(shapes: Any) -> Any:
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape[1:], x.dtype), shapes)


def state_shardings(
    layout: StateLayout,
    tx: optax.GradientTransformation,
    shapes: TrainState,
    precision: Precision,
    outer_tx: optax.GradientTransformation | None = None,
) -> TrainState:
    """The at-rest sharding of every leaf of a state shaped like `shapes`. Local SGD's and
    DiLoCo's per-replica trees are split over `replica` when they hold one entry per replica of
    the mesh (else, a checkpoint of another replica count, whole on every device)."""
    if shapes.outer is not None:
        replicas = jax.tree.leaves(shapes.params)[0].shape[0]
        one = TrainState(shapes.step, _one_replica(shapes.params), _one_replica(shapes.opt_state))
        inner = state_shardings(layout, tx, one, precision)
        over = "replica" if replicas == layout.mesh.shape["replica"] else None
        outer = OuterState(
            layout.update_shardings, layout.opt_state_shardings(outer_tx, shapes.outer.momentum)
        )
        return TrainState(
            inner.step, split_over_replicas(inner.params, over),
            split_over_replicas(inner.opt_state, over), outer,
        )  # fmt: skip
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
    layout: StateLayout,
    tx: optax.GradientTransformation,
    shapes: TrainState,
    outer_tx: optax.GradientTransformation | None = None,
) -> TrainState:
    """Shardings of the canonical form: everything split over `zero` where the model's shapes
    allow, as stage 3 would (so that little is whole on one device while a checkpoint restores)."""
    everything_sharded = dataclasses.replace(layout.unpadded(), stage=STAGES[3])
    return state_shardings(everything_sharded, tx, shapes, FLOAT32, outer_tx)


def with_shardings(shapes: Any, shardings: Any) -> Any:
    """Shapes, dtypes and shardings without arrays: what a step compiles for and a checkpoint
    restores into."""
    return jax.tree.map(
        lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), shapes, shardings
    )


def synchronised_canonical(state: TrainState) -> TrainState:
    """A synchronous canonical state from local SGD's or DiLoCo's at a synchronisation: the
    anchor's parameters and the replicas' inner optimizer states averaged."""
    return TrainState(state.step, state.outer.anchor, replica_mean(state.opt_state))


def change_replicas(
    state: TrainState, replicas: int | None, outer_tx: optax.GradientTransformation | None
) -> TrainState:
    """A canonical state for another synchronisation: `replicas` None for every step, else that
    many replicas with `outer_tx` (a checkpoint's form into a run's). The same replica count
    keeps each replica's state; otherwise the state must be at a synchronisation (the caller
    checks). The outer momentum is kept where both forms have one of the same structure."""
    if replicas is None:
        return synchronised_canonical(state) if state.outer is not None else state
    if state.outer is None:
        return local_canonical(state, replicas, outer_tx)
    if jax.tree.leaves(state.params)[0].shape[0] != replicas:
        momentum = state.outer.momentum
        state = local_canonical(synchronised_canonical(state), replicas, outer_tx)
        state = state.replace(outer=state.outer.replace(momentum=momentum))
    fresh = outer_tx.init(state.outer.anchor)
    if jax.tree.structure(fresh) != jax.tree.structure(state.outer.momentum):
        state = state.replace(outer=state.outer.replace(momentum=fresh))
    return state
