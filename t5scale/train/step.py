"""One training step: gradients in a data-parallel shard_map, then the sharded optimizer update.

The gradient computation is manual over the data-parallel axes (`replica`, `zero`) and automatic
over `tensor`. Inside it the stage's collectives are written out, because XLA on the CPU does not
turn all-reduce + slice into reduce-scatter by itself:

- stages 0 and 1 sum gradients locally over micro-batches, then all-reduce them once;
- stage 2 reduce-scatters each micro-batch's gradients into a 1/N accumulator;
- stage 3 receives parameter shards, all-gathers each where it is used (forward, and again in the
  backward pass under remat); the transpose of that all-gather is the gradient reduce-scatter.

The update then runs in the optimizer state's layout; parameters go back to their own layout,
which for stages 1 and 2 is the all-gather after the update.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.model.mt5 import MT5, ShardingHooks
from t5scale.model.sizes import ModelConfig
from t5scale.parallel import rules
from t5scale.parallel.mesh import DATA_AXES
from t5scale.parallel.zero import LeafLayout, StatePlan
from t5scale.train.state import TrainState

Batch = dict[str, jax.Array]


@dataclasses.dataclass(frozen=True)
class LossConfig:
    z_loss: float = 1e-4


def loss_sums(logits: jax.Array, targets: jax.Array, weights: jax.Array, z_loss: float):
    """Summed cross-entropy and z-loss (log Z squared) over target tokens, padding masked out."""
    log_z = jax.nn.logsumexp(logits, axis=-1)
    # A one-hot product rather than a gather keeps vocab-sharded logits sharded.
    target_logit = jnp.sum(
        logits * jax.nn.one_hot(targets, logits.shape[-1], dtype=logits.dtype), -1
    )
    cross_entropy = jnp.sum((log_z - target_logit) * weights)
    z_term = jnp.sum(z_loss * jnp.square(log_z) * weights)
    return cross_entropy, z_term


def _layout_at(layouts: Any, path: tuple[str, ...]) -> LeafLayout:
    node = layouts
    for key in path:
        node = node[key]
    return node


def _stage3_gather(plan: StatePlan):
    """ZeRO-3: all-gather a parameter's `zero` shard where the model uses it."""

    def gather(x: jax.Array, path: tuple[str, ...], axes: tuple) -> jax.Array:
        layout = _layout_at(plan.layouts, path)
        if layout.zero_dim is None:
            return x
        # Inside the layer scan the parameter has lost its leading `layers` axis.
        dim = layout.zero_dim - (len(layout.axes) - len(axes))
        return lax.all_gather(x, "zero", axis=dim, tiled=True)

    return gather


def _constrain(x: jax.Array, axes: tuple) -> jax.Array:
    return lax.with_sharding_constraint(x, rules.activation_spec(axes))


def _to_varying(x: jax.Array) -> jax.Array:
    """Mark a value as differing across data-parallel devices, so that its gradient stays local
    and every gradient collective is one this module writes."""
    missing = tuple(a for a in DATA_AXES if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def make_gradient_fn(model: ModelConfig, plan: StatePlan, micro_batches: int, loss: LossConfig):
    """(params, batch) → (gradients in their at-rest layout, summed metrics), as a shard_map."""
    stage, zero_size = plan.stage, plan.mesh.shape["zero"]
    hooks = ShardingHooks(constrain=_constrain)
    if stage.shard_parameters:
        hooks = dataclasses.replace(hooks, gather=_stage3_gather(plan))
    module = MT5(model, hooks)

    def scattered(layout: LeafLayout) -> bool:
        return stage.shard_gradients and layout.zero_dim is not None

    def scatter_micro_batch(grads):
        # Stage 3 needs nothing here: its reduce-scatter is the transpose of its all-gather.
        if stage.shard_parameters:
            return grads

        def scatter(g, layout: LeafLayout):
            if not scattered(layout):
                return g
            return lax.psum_scatter(g, "zero", scatter_dimension=layout.zero_dim, tiled=True)

        return jax.tree.map(scatter, grads, plan.layouts)

    def reduce_at_end(grads):
        def reduce(g, layout: LeafLayout):
            return lax.psum(g, ("replica",) if scattered(layout) else DATA_AXES)

        return jax.tree.map(reduce, grads, plan.layouts)

    def zero_accumulator(layout: LeafLayout):
        shape = list(layout.shape)  # `tensor` is automatic: only `zero` shrinks local shapes
        if scattered(layout):
            shape[layout.zero_dim] //= zero_size
        return _to_varying(jnp.zeros(shape, jnp.float32))

    def local_gradients(params, batch: Batch):
        weights = batch["decoder_loss_weights"].astype(jnp.float32)
        total_weight = jnp.maximum(lax.psum(jnp.sum(weights), DATA_AXES), 1.0)
        params = jax.tree.map(_to_varying, params)

        def micro_loss(p, mb: Batch):
            logits = module.apply(
                {"params": p},
                mb["encoder_input_tokens"],
                mb["decoder_input_tokens"],
                mb["encoder_segment_ids"],
                mb["decoder_segment_ids"],
            )
            targets, mask = mb["decoder_target_tokens"], mb["decoder_loss_weights"]
            ce, z = loss_sums(logits, targets, mask, loss.z_loss)
            return (ce + z) / total_weight, (ce, z)

        def accumulate(acc, mb: Batch):
            (_, sums), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, mb)
            return jax.tree.map(jnp.add, acc, scatter_micro_batch(grads)), sums

        micro = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)
        acc0 = jax.tree.map(zero_accumulator, plan.layouts)
        grads, (ce, z) = lax.scan(accumulate, acc0, micro)
        metrics = {
            "cross_entropy_sum": lax.psum(jnp.sum(ce), DATA_AXES),
            "z_loss_sum": lax.psum(jnp.sum(z), DATA_AXES),
            "target_tokens": total_weight,
        }
        return reduce_at_end(grads), metrics

    return jax.shard_map(
        local_gradients,
        mesh=plan.mesh,
        in_specs=(plan.manual_param_specs, P(DATA_AXES)),
        out_specs=(plan.manual_grad_specs, P()),
        axis_names=set(DATA_AXES),
    )


def make_train_step(
    model: ModelConfig,
    plan: StatePlan,
    tx: optax.GradientTransformation,
    state_shardings: TrainState,
    micro_batches: int = 1,
    loss: LossConfig = LossConfig(),
):
    """The jitted step(state, batch) → (state, metrics); the state is donated."""
    gradient_fn = make_gradient_fn(model, plan, micro_batches, loss)
    update_layout = plan.update_shardings

    def step(state: TrainState, batch: Batch):
        grads, sums = gradient_fn(state.params, batch)
        grads = lax.with_sharding_constraint(grads, update_layout)
        params = lax.with_sharding_constraint(state.params, update_layout)
        updates, opt_state = tx.update(grads, state.opt_state, params)
        params = optax.apply_updates(params, updates)
        params = lax.with_sharding_constraint(params, plan.param_shardings)
        tokens = sums["target_tokens"]
        metrics = {
            "loss": (sums["cross_entropy_sum"] + sums["z_loss_sum"]) / tokens,
            "cross_entropy": sums["cross_entropy_sum"] / tokens,
            "z_loss": sums["z_loss_sum"] / tokens,
            "grad_norm": optax.tree.norm(grads),
            "target_tokens": tokens,
        }
        return TrainState(state.step + 1, params, opt_state), metrics

    batch_sharding = NamedSharding(plan.mesh, P(DATA_AXES))
    return jax.jit(
        step,
        in_shardings=(state_shardings, batch_sharding),
        out_shardings=(state_shardings, NamedSharding(plan.mesh, P())),
        donate_argnums=0,
    )


def batch_sharding(plan: StatePlan) -> NamedSharding:
    return NamedSharding(plan.mesh, P(DATA_AXES))


def gradient_fn_jitted(
    model: ModelConfig, plan: StatePlan, micro_batches: int, loss: LossConfig = LossConfig()
) -> Any:
    """The gradient computation alone, jitted with at-rest shardings (for memory accounting)."""
    gradient_fn = make_gradient_fn(model, plan, micro_batches, loss)
    return jax.jit(
        gradient_fn,
        in_shardings=(plan.param_shardings, batch_sharding(plan)),
        out_shardings=(plan.grad_shardings, NamedSharding(plan.mesh, P())),
    )
