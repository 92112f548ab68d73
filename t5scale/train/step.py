"""One training step: gradients in a data-parallel shard_map, then the sharded optimizer update.

The gradient computation is manual over the data-parallel axes (`replica`, `zero`) and automatic
over `tensor`. Inside it the stage's collectives are written out, because XLA on the CPU does not
turn all-reduce + slice into reduce-scatter by itself:

- stages 0 and 1 sum gradients locally over micro-batches, then all-reduce them once;
- stage 2 reduce-scatters each micro-batch's gradients into a 1/N accumulator;
- stage 3 receives parameter shards and all-gathers each layer's where the layer runs (forward,
  and again in the backward pass: they are never kept); the transpose of each all-gather is the
  gradient reduce-scatter. The embedding and output projection, split by vocabulary, are used
  where they lie while moving the batch's activations instead costs less
  (t5scale/parallel/vocab.py).

The update then runs in the optimizer state's layout; parameters go back to their own layout,
which for stages 1 and 2 is the all-gather after the update.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
import optax
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from t5scale.model.mt5 import MT5, ShardingHooks
from t5scale.model.sizes import ModelConfig
from t5scale.parallel import collectives, rules, vocab
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
    return _weighted_sums(log_z, target_logit, weights, z_loss)


def _weighted_sums(log_z: jax.Array, target_logit: jax.Array, weights: jax.Array, z_loss: float):
    cross_entropy = jnp.sum((log_z - target_logit) * weights)
    z_term = jnp.sum(z_loss * jnp.square(log_z) * weights)
    return cross_entropy, z_term


def _layout_at(layouts: Any, path: tuple[str, ...]) -> Any:
    node = layouts
    for key in path:
        node = node[key]
    return node


def _is_layout(x: Any) -> bool:
    return isinstance(x, LeafLayout)


def _constrain(x: jax.Array, axes: tuple) -> jax.Array:
    return lax.with_sharding_constraint(x, rules.activation_spec(axes))


def _to_varying(x: jax.Array) -> jax.Array:
    """Mark a value as differing across data-parallel devices, so that its gradient stays local
    and every gradient collective is one this module writes."""
    missing = tuple(a for a in DATA_AXES if a not in jax.typeof(x).manual_axis_type.varying)
    return lax.pcast(x, missing, to="varying") if missing else x


def _map_selected(tree: Any, layouts: Any, select, transform) -> Any:
    """Replace the leaves whose layout `select` picks by `transform(leaves, layouts)`."""
    leaves, treedef = jax.tree.flatten(tree)
    lays = jax.tree.leaves(layouts, is_leaf=_is_layout)
    chosen = [i for i, lay in enumerate(lays) if select(lay)]
    new = transform([leaves[i] for i in chosen], [lays[i] for i in chosen])
    for i, value in zip(chosen, new, strict=True):
        leaves[i] = value
    return jax.tree.unflatten(treedef, leaves)


def make_gradient_fn(model: ModelConfig, plan: StatePlan, micro_batches: int, loss: LossConfig):
    """(params, batch) → (gradients in their at-rest layout, summed metrics), as a shard_map.

    Under ZeRO-3 parameters enter as `zero` shards: the scanned layers' are all-gathered layer
    by layer where they run, the small rest (final norms, position tables) once per micro-batch
    before the model runs, and the embedding and output projection, split by vocabulary, are
    used where they lie (or, where that would move more, gathered with the rest). Every
    explicit collective is ordered (see t5scale/parallel/collectives.py); the embedding's comes
    last, so the encoder cannot start, and in the backward pass the reverse chain cannot begin,
    while any other runs.
    """
    stage, zero_size = plan.stage, plan.mesh.shape["zero"]

    def scattered(layout: LeafLayout) -> bool:
        return stage.shard_gradients and layout.zero_dim is not None

    def gather(leaves, lays, dim_offset: int = 0, start=None):
        def all_gather(i: int, x: jax.Array) -> jax.Array:
            return lax.all_gather(x, "zero", axis=lays[i].zero_dim - dim_offset, tiled=True)

        return collectives.in_order(leaves, all_gather, start=start)

    def gather_layer(layer_params, stack_path: tuple[str, ...]):
        # Inside the layer scan a parameter has lost its leading `layers` axis.
        layouts = _layout_at(plan.layouts, stack_path)
        return _map_selected(
            layer_params, layouts, lambda lay: lay.zero_dim is not None,
            lambda x, lays: gather(x, lays, dim_offset=1),
        )  # fmt: skip

    def gather_outside_layers(params, start, kept_split: bool):
        """The parameters with those outside the layer stacks gathered (but the tables split by
        vocabulary if `kept_split`), and the last gather's result (or `start`)."""
        leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
        lays = jax.tree.leaves(plan.layouts, is_leaf=_is_layout)
        names = [jax.tree_util.keystr(path) for path, _ in leaves]
        chosen = [
            i
            for i, name in enumerate(names)
            if "layers" not in name
            and lays[i].zero_dim is not None
            and not (kept_split and lays[i].split_by_vocabulary)
        ]
        chosen.sort(key=lambda i: "embedding" in names[i])  # the embedding last
        values = [leaf for _, leaf in leaves]
        done = gather([values[i] for i in chosen], [lays[i] for i in chosen], start=start)
        for i, value in zip(chosen, done, strict=True):
            values[i] = value
        return jax.tree.unflatten(treedef, values), (done[-1] if done else start)

    hooks = ShardingHooks(constrain=_constrain)
    if stage.shard_parameters:
        hooks = dataclasses.replace(hooks, gather_layer=gather_layer)
    module = MT5(model, hooks)

    def scatter_micro_batch(grads):
        """Stage 2: reduce-scatter this micro-batch's gradients into the 1/N accumulator, once
        the whole backward pass is done. (Stage 3's are the transposes of its all-gathers.)"""
        if stage.shard_parameters or not stage.shard_gradients:
            return grads

        def scatter(g, lays):
            def reduce_scatter(i: int, x: jax.Array) -> jax.Array:
                return lax.psum_scatter(x, "zero", scatter_dimension=lays[i].zero_dim, tiled=True)

            return collectives.in_order(g, reduce_scatter, start=jax.tree.leaves(grads))

        return _map_selected(grads, plan.layouts, scattered, scatter)

    def reduce_at_end(grads):
        leaves, treedef = jax.tree.flatten(grads)
        lays = jax.tree.leaves(plan.layouts, is_leaf=_is_layout)

        def all_reduce(i: int, g: jax.Array) -> jax.Array:
            return lax.psum(g, ("replica",) if scattered(lays[i]) else DATA_AXES)

        return jax.tree.unflatten(treedef, collectives.in_order(leaves, all_reduce))

    def zero_accumulator(layout: LeafLayout):
        shape = list(layout.shape)  # `tensor` is automatic: only `zero` shrinks local shapes
        if scattered(layout):
            shape[layout.zero_dim] //= zero_size
        return _to_varying(jnp.zeros(shape, jnp.float32))

    def model_inputs(mb: Batch) -> tuple:
        return (
            mb["encoder_input_tokens"],
            mb["decoder_input_tokens"],
            mb["encoder_segment_ids"],
            mb["decoder_segment_ids"],
        )

    def split_vocabulary_loss_sums(p, mb: Batch, after_this):
        """The model and loss with the tables used where they lie (t5scale/parallel/vocab.py)."""

        def embed(table, tokens, dtype):
            return vocab.embed(table, tokens, dtype, after_this)

        # The model sees its device's slice of the vocabulary.
        sliced = dataclasses.replace(model, vocab_size=model.vocab_size // zero_size)
        sliced_module = MT5(sliced, dataclasses.replace(module.hooks, embed=embed))
        decoded = sliced_module.apply({"params": p}, *model_inputs(mb), project=False)
        log_z, target_logit = vocab.log_z_and_target_logit(
            decoded,
            p["lm_head"].astype(model.dtype),
            mb["decoder_target_tokens"],
            lambda x: _constrain(x, ("batch", "length", "vocab")),
        )
        return _weighted_sums(log_z, target_logit, mb["decoder_loss_weights"], loss.z_loss)

    def local_gradients(params, batch: Batch):
        weights = batch["decoder_loss_weights"].astype(jnp.float32)
        total_weight = jnp.maximum(lax.psum(jnp.sum(weights), DATA_AXES), 1.0)
        params = jax.tree.map(_to_varying, params)

        def micro_loss(p, mb: Batch):
            local_batch, input_length = mb["encoder_input_tokens"].shape
            split = plan.vocabulary_parallel and vocab.pays_off(
                local_batch * zero_size,
                input_length,
                mb["decoder_input_tokens"].shape[1],
                model.vocab_size,
            )
            last_collective = total_weight
            if stage.shard_parameters:
                p, last_collective = gather_outside_layers(p, total_weight, kept_split=split)
            if split:
                ce, z = split_vocabulary_loss_sums(p, mb, last_collective)
            else:
                logits = module.apply({"params": p}, *model_inputs(mb))
                ce, z = loss_sums(
                    logits, mb["decoder_target_tokens"], mb["decoder_loss_weights"], loss.z_loss
                )
            return (ce + z) / total_weight, (ce, z)

        def accumulate(acc, mb: Batch):
            (_, sums), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, mb)
            return jax.tree.map(jnp.add, acc, scatter_micro_batch(grads)), sums

        micro = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)
        acc0 = jax.tree.map(zero_accumulator, plan.layouts, is_leaf=_is_layout)
        grads, (ce, z) = lax.scan(accumulate, acc0, micro)
        grads = reduce_at_end(grads)
        # Ordered after the gradients: see t5scale/parallel/collectives.py.
        sums = lax.psum(collectives.after(jnp.stack([jnp.sum(ce), jnp.sum(z)]), grads), DATA_AXES)
        metrics = {
            "cross_entropy_sum": sums[0],
            "z_loss_sum": sums[1],
            "target_tokens": total_weight,
        }
        return grads, metrics

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
    skip_nonfinite: bool = False,
    steps_per_execution: int = 1,
):
    """The jitted step(state, batch) → (state, metrics); the state is donated.

    With skip_nonfinite, a step whose loss or gradient norm is NaN or Inf leaves parameters and
    optimizer state as they were (metrics["skipped"] = 1); it costs a select over the state.

    With steps_per_execution k > 1 one execution takes k steps in a loop (as Keras's
    steps_per_execution and TPUEstimator's iterations_per_loop do): the batch argument holds k
    batches stacked on a leading axis (`stack_batches`) and each metric comes back with k
    values, one per step. The steps are the same as k single ones; what changes is the cost
    around each execution. XLA:CPU maps its temp buffer (3.9 GB for mt5_small at batch 8)
    afresh for every execution and the kernel zeroes every page of it on first touch; inside
    the loop the steps reuse it.
    """
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
        new = TrainState(state.step + 1, params, opt_state)
        if skip_nonfinite:
            finite = jnp.isfinite(metrics["loss"]) & jnp.isfinite(metrics["grad_norm"])

            def keep(new_tree, old_tree):
                return jax.tree.map(lambda n, o: jnp.where(finite, n, o), new_tree, old_tree)

            new = new.replace(
                params=keep(new.params, state.params),
                opt_state=keep(new.opt_state, state.opt_state),
            )
            metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        return new, metrics

    if steps_per_execution < 1:
        raise ValueError(f"steps_per_execution must be >= 1, got {steps_per_execution}")

    def steps(state: TrainState, batches: Batch):
        return lax.scan(step, state, batches, length=steps_per_execution)

    stacked = steps_per_execution > 1
    return jax.jit(
        steps if stacked else step,
        in_shardings=(state_shardings, batch_sharding(plan, stacked)),
        out_shardings=(state_shardings, NamedSharding(plan.mesh, P())),
        donate_argnums=0,
    )


def batch_sharding(plan: StatePlan, stacked: bool = False) -> NamedSharding:
    """A global batch's sharding: split over the data-parallel axes; `stacked`: the layout of
    several batches stacked on a leading (unsharded) axis, for steps_per_execution > 1."""
    return NamedSharding(plan.mesh, P(None, DATA_AXES) if stacked else P(DATA_AXES))


def stack_batches(batches: list[Batch], plan: StatePlan) -> Batch:
    """Global batches stacked on a new leading axis, in batch_sharding(plan, stacked=True)."""
    return _stack(tuple(batches), batch_sharding(plan, stacked=True))


@functools.partial(jax.jit, static_argnums=1)
def _stack(batches: tuple[Batch, ...], sharding: NamedSharding) -> Batch:
    stacked = jax.tree.map(lambda *xs: jnp.stack(xs), *batches)
    return lax.with_sharding_constraint(stacked, sharding)


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


def make_eval_step(model: ModelConfig, plan: StatePlan, loss: LossConfig = LossConfig()):
    """The jitted eval(params, batch) → summed losses and target tokens (no update).

    A forward pass only, so it is left to XLA's automatic partitioning: the parameters keep
    their at-rest shardings and XLA gathers what stage 3 shards.
    """
    module = MT5(model)

    def evaluate(params, batch: Batch):
        logits = module.apply(
            {"params": params},
            batch["encoder_input_tokens"],
            batch["decoder_input_tokens"],
            batch["encoder_segment_ids"],
            batch["decoder_segment_ids"],
        )
        weights = batch["decoder_loss_weights"].astype(jnp.float32)
        ce, z = loss_sums(logits, batch["decoder_target_tokens"], weights, loss.z_loss)
        return {"cross_entropy_sum": ce, "z_loss_sum": z, "target_tokens": jnp.sum(weights)}

    return jax.jit(
        evaluate,
        in_shardings=(plan.param_shardings, batch_sharding(plan)),
        out_shardings=NamedSharding(plan.mesh, P()),
    )
