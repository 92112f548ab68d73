"""The jitted train and eval steps: gradients (t5scale/train/gradients.py), then the sharded
optimizer update (`apply_update`).

The update runs in the optimizer state's layout: in fp32 on the parameters themselves, in mixed
precision on the fp32 master, from which the new bf16 working copy is cast. Parameters then go
back to their own layout, which for stages 1 and 2 is the all-gather after the update (of the
bf16 copy, when mixed).
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.data.batch import Batch
from t5scale.model.head import model_loss_sums
from t5scale.model.mt5 import LM_HEAD, MT5, ShardingHooks, model_variables
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.attention import kernels_for
from t5scale.parallel.layout import StateLayout
from t5scale.parallel.mesh import DATA_AXES
from t5scale.train import replicas as replicas_module
from t5scale.train.config import TrainConfig
from t5scale.train.gradients import gradient_fn
from t5scale.train.metrics import LossSums, StepMetrics
from t5scale.train.precision import FLOAT32, MasterState, Precision, cast
from t5scale.train.replicas import ReplicaSyncConfig
from t5scale.train.state import TrainState


def apply_update(
    tx: optax.GradientTransformation,
    layout: StateLayout,
    precision: Precision,
    state: TrainState,
    grads: Any,
) -> tuple[Any, Any]:
    """(new parameters, new optimizer state) from gradients in their at-rest layout."""
    stage, update_layout = layout.stage, layout.update_shardings
    if stage.shard_optimizer_state:
        grads = layout.pad(grads)  # stage 1's whole gradients, for the sharded update
    grads = lax.with_sharding_constraint(grads, update_layout)
    if precision.mixed:
        master, inner = state.opt_state.master, state.opt_state.inner
        updates, inner = tx.update(cast(grads, jnp.float32), inner, master)
        master = optax.apply_updates(master, updates)
        return working_copy(layout, precision, master), MasterState(master, inner)
    params = state.params
    if stage.shard_optimizer_state:
        params = layout.pad(params)
    params = lax.with_sharding_constraint(params, update_layout)
    updates, opt_state = tx.update(grads, state.opt_state, params)
    return working_copy(layout, precision, optax.apply_updates(params, updates)), opt_state


def working_copy(layout: StateLayout, precision: Precision, fp32_params: Any) -> Any:
    """Parameters as the stage keeps them, from fp32 ones in the optimizer state's layout: the
    working copy cast on each shard (bf16 when mixed, so that it is gathered in bf16, not the
    fp32 master), then put in the parameters' layout (stages 1-2: gathered over `zero`)."""
    params = cast(fp32_params, precision.param_dtype)
    params = lax.with_sharding_constraint(params, layout.update_shardings)
    params = lax.with_sharding_constraint(params, layout.param_shardings)
    return params if layout.stage.shard_parameters else layout.unpad(params)


def make_train_step(
    model: ModelConfig,
    layout: StateLayout,
    tx: optax.GradientTransformation,
    train: TrainConfig,
    state_shardings: TrainState,
    precision: Precision = FLOAT32,
    skip_nonfinite: bool = False,
    steps_per_execution: int = 1,
):
    """The jitted step(state, batch) → (state, StepMetrics); the state is donated.

    The metrics' `nonfinite` is 1 where the step's loss or gradient norm is NaN or Inf; with
    skip_nonfinite such a step leaves parameters and optimizer state as they were (a select
    over the state).

    With steps_per_execution k > 1 one execution takes k steps in a loop (as Keras's
    steps_per_execution and TPUEstimator's iterations_per_loop do): the batch argument holds k
    batches stacked on a leading axis (`stack_batches`) and each metric comes back with k
    values, one per step. The steps are the same as k single ones; what changes is the cost
    around each execution: XLA:CPU maps its temp buffer afresh for every execution, and inside
    the loop the steps reuse it (docs/benchmarks.md).

    Where replicas step on their own (`layout.sync_replicas` False: local SGD, DiLoCo) each
    replica takes the step on its slice of the global batch with its own parameters and
    optimizer state (a leading axis: t5scale/train/replicas.py), and every metric has a value
    per replica.
    """
    if steps_per_execution < 1:
        raise ValueError(f"steps_per_execution must be >= 1, got {steps_per_execution}")
    gradients = gradient_fn(model, layout, precision, train.micro_batches, train.z_loss)
    update = _update_fn(tx, layout, precision, skip_nonfinite)
    if layout.sync_replicas:
        step = _synchronous_step(gradients, update)
    else:
        step = _step_of_each_replica(layout, gradients, update)

    def steps(state: TrainState, batches: Batch):
        return lax.scan(step, state, batches, length=steps_per_execution)

    stacked = steps_per_execution > 1
    per_replica_metrics = () if layout.sync_replicas else ("replica",)
    metrics_spec = P(*((None,) if stacked else ()), *per_replica_metrics)
    return jax.jit(
        steps if stacked else step,
        in_shardings=(state_shardings, batch_sharding(layout, stacked)),
        out_shardings=(state_shardings, NamedSharding(layout.mesh, metrics_spec)),
        donate_argnums=0,
    )


def _update_fn(
    tx: optax.GradientTransformation, layout: StateLayout, precision: Precision, skip: bool
):
    """update(state, grads, sums) → (parameters, optimizer state, metrics) after the update of
    one replica (or all of them, when they step together)."""

    def update(state: TrainState, grads, sums: LossSums, next_fp8=None):
        params, opt_state = apply_update(tx, layout, precision, state, grads)
        metrics = _step_metrics(sums, optax.tree.norm(cast(grads, jnp.float32)))
        finite = metrics.nonfinite == 0
        fp8 = next_fp8  # replaced, never stepped: t5scale/train/fp8.py
        if skip:  # a non-finite step leaves the state as it was

            def keep(new_tree, old_tree):
                return jax.tree.map(
                    lambda new_leaf, old_leaf: jnp.where(finite, new_leaf, old_leaf),
                    new_tree,
                    old_tree,
                )

            params, opt_state = keep(params, state.params), keep(opt_state, state.opt_state)
            fp8 = keep(fp8, state.fp8)
        return TrainState(state.step + 1, params, opt_state, state.outer, fp8), metrics

    return update


def _synchronous_step(gradients, update):
    """step(state, batch) → (state, metrics) of replicas that step together."""

    def step(state: TrainState, batch: Batch):
        grads, next_fp8, sums = gradients(state.params, state.fp8, batch)
        return update(state, grads, sums, next_fp8)

    return step


def _step_of_each_replica(layout: StateLayout, gradients, update):
    """step(state, batch) → (state, metrics) of replicas that step on their own (local SGD,
    DiLoCo): each on its slice of the global batch, a metric per replica."""
    replicas = layout.replicas
    slices_sharding = NamedSharding(layout.mesh, P("replica", "zero"))

    def step(state: TrainState, batch: Batch):
        # Each replica's slice of the global batch on a leading axis (no data moves).
        slices = jax.tree.map(lambda x: x.reshape(replicas, -1, *x.shape[1:]), batch)
        grads, _, sums = gradients(
            state.params, None, lax.with_sharding_constraint(slices, slices_sharding)
        )

        def one_replica(params, opt_state, grads, sums):
            new, metrics = update(TrainState(state.step, params, opt_state), grads, sums)
            return new.params, new.opt_state, metrics

        params, opt_state, metrics = jax.vmap(one_replica, spmd_axis_name="replica")(
            state.params, state.opt_state, grads, sums
        )
        return TrainState(state.step + 1, params, opt_state, state.outer), metrics

    return step


def make_outer_step(
    layout: StateLayout,
    precision: Precision,
    sync: ReplicaSyncConfig,
    outer_tx: optax.GradientTransformation,
    state_shardings: TrainState,
):
    """The jitted outer step(state) → state of local SGD and DiLoCo (t5scale/train/replicas.py):
    Δ reduced over `replica`, the outer optimizer's step on the anchor, every replica restarted
    from it. The state is donated.

    Δ and the outer update are written per device (a shard_map over every axis), so that the one
    collective over `replica` is Δ's all-reduce of each device's shard: left to XLA, tensor-
    parallel tables were also gathered across replicas."""
    stage, replicas = layout.stage, layout.replicas
    outer_specs = jax.tree.map(lambda s: s.spec, state_shardings.outer,
                               is_leaf=lambda x: isinstance(x, NamedSharding))  # fmt: skip
    current_specs = replicas_module.specs_over_replicas(outer_specs.anchor)
    synchronise = jax.shard_map(
        functools.partial(
            replicas_module.outer_step_per_device, outer_tx, jnp.dtype(sync.outer_dtype), replicas
        ),  # fmt: skip
        mesh=layout.mesh,
        in_specs=(outer_specs, current_specs),
        out_specs=(outer_specs, current_specs),
    )
    restarted = functools.partial(working_copy, layout, precision)

    def outer_step(state: TrainState) -> TrainState:
        if precision.mixed:
            current = state.opt_state.master
        elif stage.shard_optimizer_state:
            current = jax.vmap(layout.pad)(state.params)
        else:
            current = state.params
        outer, restart = synchronise(state.outer, current)
        params = jax.vmap(restarted, spmd_axis_name="replica")(restart)
        opt_state = state.opt_state
        if precision.mixed:
            opt_state = opt_state.replace(master=restart)
        return TrainState(state.step, params, opt_state, outer)

    return jax.jit(
        outer_step, in_shardings=(state_shardings,), out_shardings=state_shardings,
        donate_argnums=0,
    )  # fmt: skip


def _step_metrics(sums: LossSums, grad_norm: jax.Array) -> StepMetrics:
    """The step's metrics from the gradient's loss sums (t5scale/train/gradients.py)."""
    tokens = sums.target_tokens
    loss = (sums.cross_entropy + sums.z_loss) / tokens
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    return StepMetrics(
        loss=loss, cross_entropy=sums.cross_entropy / tokens, z_loss=sums.z_loss / tokens,
        target_tokens=tokens, grad_norm=grad_norm, nonfinite=1.0 - finite.astype(jnp.float32),
    )  # fmt: skip


def batch_sharding(layout: StateLayout, stacked: bool = False) -> NamedSharding:
    """A global batch's sharding: split over the data-parallel axes; `stacked`: the layout of
    several batches stacked on a leading (unsharded) axis, for steps_per_execution > 1."""
    return NamedSharding(layout.mesh, P(None, DATA_AXES) if stacked else P(DATA_AXES))


def stack_batches(batches: list[Batch], layout: StateLayout) -> Batch:
    """Global batches stacked on a new leading axis, in batch_sharding(layout, stacked=True)."""
    return _stack(tuple(batches), batch_sharding(layout, stacked=True))


@functools.partial(jax.jit, static_argnums=1)
def _stack(batches: tuple[Batch, ...], sharding: NamedSharding) -> Batch:
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
    return lax.with_sharding_constraint(stacked, sharding)


def gradient_fn_jitted(
    model: ModelConfig, layout: StateLayout, train: TrainConfig, precision: Precision = FLOAT32
) -> jax.stages.Wrapped:
    """The gradient computation alone, (params, batch) → (gradients, LossSums), jitted with
    at-rest shardings (for memory accounting; without FP8)."""
    gradients = gradient_fn(model, layout, precision, train.micro_batches, train.z_loss)

    def grads_and_sums(params, batch: Batch):
        grads, _, sums = gradients(params, None, batch)
        return grads, sums

    return jax.jit(
        grads_and_sums,
        in_shardings=(layout.param_shardings, batch_sharding(layout)),
        out_shardings=(layout.grad_shardings, NamedSharding(layout.mesh, P())),
    )


def make_eval_step(model: ModelConfig, layout: StateLayout, z_loss: float):
    """The jitted eval(params, FP8 state or None, batch) → LossSums: summed losses and target
    tokens (no update; the FP8 matmuls quantize with the state's scales).

    A forward pass only, so it is left to XLA's automatic partitioning: the parameters keep
    their at-rest shardings and XLA gathers what stage 3 shards (and cuts off its padding).
    """
    module = MT5(model, ShardingHooks(kernels=kernels_for(layout.mesh)))

    def evaluate(params, fp8, batch: Batch) -> LossSums:
        params = layout.unpad(params)
        decoded = module.apply(model_variables(params, fp8), *batch.model_inputs(), project=False)
        weights = batch.decoder_loss_weights.astype(jnp.float32)
        _, cross_entropy, z_term = model_loss_sums(
            model, decoded, params[LM_HEAD], batch.decoder_target_tokens, weights, z_loss
        )
        return LossSums(cross_entropy=cross_entropy, z_loss=z_term, target_tokens=jnp.sum(weights))

    return jax.jit(
        evaluate,
        in_shardings=(layout.param_shardings, None, batch_sharding(layout)),
        out_shardings=NamedSharding(layout.mesh, P()),
    )
