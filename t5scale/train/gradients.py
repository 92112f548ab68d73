"""The gradient computation of one train step: a shard_map manual over the data-parallel axes
(`replica`, `zero`) and automatic over `tensor`, with the stage's collectives written out, because
XLA on the CPU does not turn all-reduce + slice into reduce-scatter by itself (docs/concepts.md,
"The step", walks through the stages).

In the order a step runs them: stage 3's gathers (`gather_layer` where each scanned layer runs,
forward and again backward; `gather_outside_layers` once per micro-batch), the loss
(`dense_loss_sums`, or `vocabulary_parallel_loss_sums` at stage 3 while that moves less:
t5scale/parallel/vocab.py), accumulation over micro-batches (`accumulate_gradients`; stage 2
reduce-scatters each micro-batch's, `reduce_scatter_micro_batch`) and the reduction after the last
(`all_reduce_gradients`). Where replicas step on their own (local SGD, DiLoCo:
t5scale/train/replicas.py) nothing is reduced over `replica`: each replica's parameters, gradients
and loss sums travel on a leading axis split over it.

Gradients are reduced and accumulated in the precision's gradient dtype
(t5scale/train/precision.py). A tree the stage scatters over `zero` is padded
(t5scale/parallel/layout.py): gathers cut the padding off, and gradients are padded before they are
reduce-scattered. Where the mesh spans the slow network each gradient reduction moves its leaf as
one flat buffer (collectives.as_flat_buffer).

Every explicit collective is ordered (t5scale/parallel/collectives.py); the embedding's gather comes
last, so the encoder cannot start, and in the backward pass the reverse chain cannot begin, while
any other runs.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from t5scale.data.batch import Batch
from t5scale.model.head import loss_sums, model_loss_sums
from t5scale.model.mt5 import EMBEDDING, LM_HEAD, MT5, ShardingHooks, model_variables
from t5scale.model.sizes import ModelConfig
from t5scale.parallel import collectives, rules, vocab
from t5scale.parallel.attention import attend_on_mesh, kernels_for
from t5scale.parallel.layout import LeafLayout, StateLayout, is_leaf_layout
from t5scale.parallel.mesh import DATA_AXES
from t5scale.train import fp8 as fp8_state
from t5scale.train import pipeline
from t5scale.train.metrics import LossSums
from t5scale.train.precision import Precision
from t5scale.train.replicas import specs_over_replicas


def _constrain(x: jax.Array, axes: tuple) -> jax.Array:
    return lax.with_sharding_constraint(x, rules.activation_spec(axes))


def _replace_selected(tree: Any, leaf_layouts: Any, select, transform) -> Any:
    """`tree` with the leaves whose layout `select` picks replaced by `transform(leaves, layouts)`."""
    values, treedef = jax.tree.flatten(tree)
    layouts = jax.tree.leaves(leaf_layouts, is_leaf=is_leaf_layout)
    chosen = [index for index, layout in enumerate(layouts) if select(layout)]
    new = transform([values[index] for index in chosen], [layouts[index] for index in chosen])
    for index, value in zip(chosen, new, strict=True):
        values[index] = value
    return jax.tree.unflatten(treedef, values)


# ---- stage 3: parameters gathered where they are used -------------------------------------


@functools.partial(jax.custom_vjp, nondiff_argnums=(1, 2))
def _all_gather_as(x: jax.Array, axis: int, dtype) -> jax.Array:
    """x cast to `dtype` and all-gathered over `zero`; its transpose reduce-scatters in x's own
    dtype (mixed precision that reduces in fp32: the gather moves bf16, the reduction fp32)."""
    return lax.all_gather(x.astype(dtype), "zero", axis=axis, tiled=True)


def _all_gather_as_forward(x: jax.Array, axis: int, dtype):
    return _all_gather_as(x, axis, dtype), jnp.zeros((), x.dtype)


def _all_gather_as_backward(axis: int, dtype, like: jax.Array, cotangent: jax.Array):
    del dtype
    scattered = lax.psum_scatter(cotangent.astype(like.dtype), "zero", scatter_dimension=axis,
                                 tiled=True)  # fmt: skip
    return (scattered,)


_all_gather_as.defvjp(_all_gather_as_forward, _all_gather_as_backward)


def gather_over_zero(
    values: list[jax.Array], layouts: list[LeafLayout], dtype, leading: int = 0, start=None
) -> list[jax.Array]:
    """Each value all-gathered whole over `zero` in `dtype`, its padding cut off, one after
    another (and after `start`); `leading`: dimensions the values lack in front of their
    layouts' (a scanned layer's parameter inside the scan).

    In the leaves' own shapes, not as flat buffers (collectives.as_flat_buffer): in the layer
    loop a flat buffer's copies cost more than the padding it saves between slices (mt5_large
    on 2 × v5e-64, the TPU path: 0.402 against 0.387 s a step; docs/cluster_model.md)."""

    def all_gather(index: int, x: jax.Array) -> jax.Array:
        axis = layouts[index].zero_dim - leading
        if x.dtype == dtype:
            whole = lax.all_gather(x, "zero", axis=axis, tiled=True)
        else:
            whole = _all_gather_as(x, axis, dtype)
        return layouts[index].unpad(whole, leading)

    return collectives.in_order(values, all_gather, start=start)


def gather_layer(layout: StateLayout, dtype, layer_params: Any, stack_path: tuple[str, ...]) -> Any:
    """One scanned layer's parameters, gathered (the model's `gather_layer` hook)."""
    stack_layouts = functools.reduce(lambda node, key: node[key], stack_path, layout.leaves)
    return _replace_selected(
        layer_params, stack_layouts, lambda leaf: leaf.over_zero,
        lambda values, layouts: gather_over_zero(values, layouts, dtype, leading=1),
    )  # fmt: skip


def gather_outside_layers(
    params: Any, layout: StateLayout, dtype, start: jax.Array, keep_vocabulary_split: bool
) -> tuple[Any, jax.Array]:
    """The parameters with those outside the layer stacks gathered (but the tables split by
    vocabulary if `keep_vocabulary_split`), and the last gather's result (or `start`)."""
    leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
    layouts = jax.tree.leaves(layout.leaves, is_leaf=is_leaf_layout)
    names = [jax.tree_util.keystr(path) for path, _ in leaves]
    chosen = [
        index
        for index, name in enumerate(names)
        if "layers" not in name
        and layouts[index].over_zero
        and not (keep_vocabulary_split and layouts[index].split_by_vocabulary)
    ]
    chosen.sort(key=lambda index: EMBEDDING in names[index])  # the embedding last
    values = [leaf for _, leaf in leaves]
    done = gather_over_zero(
        [values[index] for index in chosen], [layouts[index] for index in chosen], dtype,
        start=start,
    )  # fmt: skip
    for index, value in zip(chosen, done, strict=True):
        values[index] = value
    return jax.tree.unflatten(treedef, values), (done[-1] if done else start)


def model_hooks(layout: StateLayout, precision: Precision) -> ShardingHooks:
    """Activations pinned for tensor parallelism; at stage 3, each layer gathered where it runs,
    in the parameters' dtype."""
    kernels = kernels_for(layout.mesh)
    whole_vocabulary = layout.mesh.shape["tensor"] == 1
    hooks = ShardingHooks(
        constrain=_constrain,
        attend=functools.partial(attend_on_mesh, layout.mesh),
        kernels=kernels,
        head_kernel="triton" if kernels == "triton" and whole_vocabulary else None,
    )
    if layout.stage.shard_parameters:
        gather = functools.partial(gather_layer, layout, precision.param_dtype)
        hooks = dataclasses.replace(hooks, gather_layer=gather)
    return hooks


# ---- the loss of one micro-batch ------------------------------------------------------------


def dense_loss_sums(
    model: ModelConfig, hooks: ShardingHooks, params: Any, fp8: Any, batch: Batch, z_loss: float
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, cross-entropy sum, z-loss sum) with the whole output projection on every device,
    in chunks of tokens (t5scale/model/head.py), or with loss_chunk_tokens = 0 from the whole
    logits (the untiled reference)."""
    targets, weights = batch.decoder_target_tokens, batch.decoder_loss_weights
    module = MT5(model, hooks)
    if model.loss_chunk_tokens == 0:
        logits = module.apply(model_variables(params, fp8), *batch.model_inputs())
        cross_entropy, z_term = loss_sums(logits, targets, weights, z_loss)
        return cross_entropy + z_term, cross_entropy, z_term
    decoded = module.apply(model_variables(params, fp8), *batch.model_inputs(), project=False)
    return model_loss_sums(
        model, decoded, params[LM_HEAD], targets, weights, z_loss, constrain=_constrain,
        kernel=hooks.head_kernel_for(model),
    )  # fmt: skip


def vocabulary_parallel_loss_sums(
    model: ModelConfig,
    hooks: ShardingHooks,
    params: Any,
    fp8: Any,
    batch: Batch,
    z_loss: float,
    slice_size: int,
    after_this: jax.Array,
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """The same with the embedding and output projection used where they lie, each device
    holding its `slice_size` rows of the (padded) vocabulary (t5scale/parallel/vocab.py); their
    first collective runs after `after_this`."""

    def embed(table, tokens, dtype):
        return vocab.embed(table, tokens, dtype, after_this)

    sliced = dataclasses.replace(model, vocab_size=slice_size)
    module = MT5(sliced, dataclasses.replace(hooks, embed=embed))
    decoded = module.apply(model_variables(params, fp8), *batch.model_inputs(), project=False)
    return vocab.loss_sums(
        model, decoded, params[LM_HEAD], batch, z_loss, _constrain, hooks.head_kernel_for(model)
    )


def micro_batch_loss(
    model: ModelConfig,
    layout: StateLayout,
    precision: Precision,
    z_loss: float,
    total_weight: jax.Array,
    params: Any,
    fp8: Any,
    batch: Batch,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(this micro-batch's share of the step's mean loss, its (cross-entropy, z-loss) sums);
    `fp8`: the FP8 matmuls' state (t5scale/train/fp8.py), or None."""
    local_batch, input_length = batch.encoder_input_tokens.shape
    split = layout.vocabulary_parallel and vocab.pays_off(
        local_batch * layout.zero_size,
        input_length,
        batch.decoder_input_tokens.shape[1],
        model.vocab_size,
    )
    hooks = model_hooks(layout, precision)
    last_collective = total_weight
    if layout.stage.shard_parameters:
        params, last_collective = gather_outside_layers(
            params, layout, precision.param_dtype, total_weight, keep_vocabulary_split=split
        )
    if split:
        slice_size = layout.leaves[LM_HEAD].padded[1] // layout.zero_size
        sums = vocabulary_parallel_loss_sums(
            model, hooks, params, fp8, batch, z_loss, slice_size, last_collective
        )
    else:
        sums = dense_loss_sums(model, hooks, params, fp8, batch, z_loss)
    loss, cross_entropy, z_term = sums
    return loss / total_weight, (cross_entropy, z_term)


def pipelined_loss(
    model: ModelConfig,
    layout: StateLayout,
    precision: Precision,
    z_loss: float,
    total_weight: jax.Array,
    micro_batches: int,
    params: Any,
    fp8: Any,
    batch: Batch,
) -> tuple[jax.Array, tuple[jax.Array, jax.Array]]:
    """(this stage's share of the step's mean loss, its (cross-entropy, z-loss) sums): every
    micro-batch through the pipeline's stages (t5scale/train/pipeline.py)."""
    loss, cross_entropy, z_term = pipeline.pipelined_loss_sums(
        model, model_hooks(layout, precision), params, fp8, batch, z_loss, micro_batches,
        layout.pipeline_stages, layout.manual_axes,
    )  # fmt: skip
    return loss / total_weight, (cross_entropy, z_term)


# ---- accumulation and reduction -------------------------------------------------------------


def _scattered(layout: StateLayout, leaf: LeafLayout) -> bool:
    """Whether this leaf's gradient is kept as a `zero` shard."""
    return layout.stage.shard_gradients and leaf.over_zero


def _flat(layout: StateLayout, leaf: LeafLayout) -> bool:
    """Whether this leaf's collectives move it as a flat buffer (collectives.as_flat_buffer):
    where the mesh spans the slow network, which the flat buffer is for (inside one slice or
    node it only costs a copy: mt5_small's stage 0 on one v5e-16 slice, 0.7 GB more a chip),
    and no `tensor` split of the leaf would have to move."""
    if not layout.spans_slow_network:
        return False
    return layout.mesh.shape["tensor"] == 1 or not any(rules.tensor_axes(leaf.axes))


def zero_accumulator(layout: StateLayout, dtype, leaf: LeafLayout) -> jax.Array:
    """A zero gradient in the accumulator's local shape (padded where it is scattered)."""
    scattered = _scattered(layout, leaf)
    shape = list(leaf.at_rest(scattered))  # `tensor` is automatic: only `zero` shrinks shapes
    if scattered:
        shape[leaf.zero_dim] //= layout.zero_size
    return collectives.to_varying(jnp.zeros(shape, dtype), DATA_AXES)


def reduce_scatter_micro_batch(grads: Any, layout: StateLayout) -> Any:
    """Stage 2: this micro-batch's gradients reduce-scattered into the 1/N accumulator, once the
    whole backward pass is done. (Stage 3's are the transposes of its all-gathers.)"""
    stage = layout.stage
    if stage.shard_parameters or not stage.shard_gradients:
        return grads

    def scatter(values, layouts):
        def reduce_scatter(index: int, x: jax.Array) -> jax.Array:
            leaf = layouts[index]
            padded = leaf.pad(x)
            if _flat(layout, leaf):
                scatter = functools.partial(
                    lax.psum_scatter, axis_name="zero", scatter_dimension=0, tiled=True
                )
                return collectives.as_flat_buffer(padded, leaf.zero_dim, layout.zero_size, scatter)
            return lax.psum_scatter(padded, "zero", scatter_dimension=leaf.zero_dim, tiled=True)

        return collectives.in_order(values, reduce_scatter, start=jax.tree.leaves(grads))

    return _replace_selected(grads, layout.leaves, functools.partial(_scattered, layout), scatter)


def all_reduce_gradients(grads: Any, layout: StateLayout) -> Any:
    """The accumulated gradients summed over the devices that still hold partial sums."""
    values, treedef = jax.tree.flatten(grads)
    layouts = jax.tree.leaves(layout.leaves, is_leaf=is_leaf_layout)

    def all_reduce(index: int, g: jax.Array) -> jax.Array:
        if _scattered(layout, layouts[index]):  # `zero` already reduced it
            axes = tuple(a for a in layout.data_axes if a != "zero")
        else:
            axes = layout.data_axes
        if layout.pipeline_stages > 1 and not layouts[index].pipelined:
            axes = (*axes, "pipeline")  # used by every stage: each holds a part of its gradient
        if not axes:
            return g
        if _flat(layout, layouts[index]):
            return collectives.as_flat_buffer(g, 0, 1, lambda flat: lax.psum(flat, axes))
        return lax.psum(g, axes)

    return jax.tree.unflatten(treedef, collectives.in_order(values, all_reduce))


def accumulate_gradients(
    loss_fn: Callable,
    params: Any,
    fp8: Any,
    batch: Batch,
    layout: StateLayout,
    micro_batches: int,
    dtype,
) -> tuple[Any, Any, tuple[jax.Array, jax.Array]]:
    """(gradients summed over the micro-batches in `dtype`, the next FP8 state (their max, or
    None), their per-micro-batch loss sums), in a scan; one micro-batch without one.

    Why not a scan of length 1: XLA:TPU's expensive-invariant-code-motion pass hoists the layer
    loops out of such a loop before the loop is simplified away, and copies of them stay: the
    compiled mt5_small step ran 1.7x the model's matmul FLOPs on a v5p (docs/cluster_model.md)."""

    def accumulate(accumulator, micro_batch: Batch):
        summed, next_fp8 = accumulator
        (_, sums), (grads, fp8_now) = jax.value_and_grad(loss_fn, argnums=(0, 1), has_aux=True)(
            params, fp8, micro_batch
        )
        grads = reduce_scatter_micro_batch(grads, layout)
        return (jax.tree.map(jnp.add, summed, grads), fp8_state.merge(next_fp8, fp8_now)), sums

    start = (
        layout.map(functools.partial(zero_accumulator, layout, dtype)),
        jax.tree.map(
            lambda x: collectives.to_varying(x, layout.manual_axes), fp8_state.lowest_like(fp8)
        ),
    )
    if micro_batches == 1:
        (grads, next_fp8), sums = accumulate(start, batch)
        return grads, next_fp8, jax.tree.map(lambda x: x[None], sums)
    micro = jax.tree.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]), batch)
    (grads, next_fp8), sums = lax.scan(accumulate, start, micro)
    return grads, next_fp8, sums


# ---- the shard_map ----------------------------------------------------------------------------


def _local_gradients(
    model: ModelConfig,
    layout: StateLayout,
    precision: Precision,
    micro_batches: int,
    z_loss: float,
    params,
    fp8,
    batch,
) -> tuple[Any, Any, LossSums]:
    weights = batch.decoder_loss_weights.astype(jnp.float32)
    total_weight = jnp.maximum(lax.psum(jnp.sum(weights), layout.data_axes), 1.0)
    # Gradients come out in the dtype of what is differentiated: the parameters themselves, or
    # an fp32 view of the bf16 working copy when mixed precision reduces in fp32 (the model
    # casts each weight to its compute dtype where it is used; stage 3 gathers it in bf16).
    # Varying before they are differentiated, so that JAX reduces none of the gradients itself.
    manual = layout.manual_axes
    params = jax.tree.map(
        lambda leaf: collectives.to_varying(leaf.astype(precision.grad_dtype), manual), params
    )
    fp8 = jax.tree.map(lambda leaf: collectives.to_varying(leaf, manual), fp8)
    if layout.pipeline_stages > 1:
        loss_fn = functools.partial(
            pipelined_loss, model, layout, precision, z_loss, total_weight, micro_batches
        )
        (_, (cross_entropy, z_term)), (grads, next_fp8) = jax.value_and_grad(
            loss_fn, argnums=(0, 1), has_aux=True
        )(params, fp8, batch)
    else:
        loss_fn = functools.partial(
            micro_batch_loss, model, layout, precision, z_loss, total_weight
        )
        grads, next_fp8, (cross_entropy, z_term) = accumulate_gradients(
            loss_fn, params, fp8, batch, layout, micro_batches, precision.grad_dtype
        )
    grads = all_reduce_gradients(grads, layout)
    next_fp8 = fp8_state.max_over_devices(next_fp8, layout.data_axes, after=grads)
    # Ordered after the gradients: see t5scale/parallel/collectives.py.
    sums = jnp.stack([jnp.sum(cross_entropy), jnp.sum(z_term)])
    over = (*layout.data_axes, "pipeline") if layout.pipeline_stages > 1 else layout.data_axes
    sums = lax.psum(collectives.ordered_after(sums, (grads, next_fp8)), over)
    return (
        grads,
        next_fp8,
        LossSums(cross_entropy=sums[0], z_loss=sums[1], target_tokens=total_weight),
    )


def gradient_fn(
    model: ModelConfig, layout: StateLayout, precision: Precision, micro_batches: int, z_loss: float
):
    """(params, FP8 state or None, batch) → (gradients in their at-rest layout and
    precision.grad_dtype, the next FP8 state, LossSums over the global batch), as a shard_map;
    where replicas step on their own (no FP8 there), everything has a leading replica axis."""
    local = functools.partial(_local_gradients, model, layout, precision, micro_batches, z_loss)
    param_specs, grad_specs = layout.manual_param_specs, layout.manual_grad_specs
    fp8_spec = fp8_state.spec(layout.pipeline_stages)
    if layout.sync_replicas:
        return jax.shard_map(
            local, mesh=layout.mesh, in_specs=(param_specs, fp8_spec, P(DATA_AXES)),
            out_specs=(grad_specs, fp8_spec, P()), axis_names=set(layout.manual_axes),
        )  # fmt: skip

    def one_replica(params, fp8, batch):
        squeeze = functools.partial(jax.tree.map, lambda x: x[0])
        unsqueeze = functools.partial(jax.tree.map, lambda x: x[None])
        grads, _, sums = local(squeeze(params), None, squeeze(batch))
        return unsqueeze(grads), None, unsqueeze(sums)

    return jax.shard_map(
        one_replica, mesh=layout.mesh,
        in_specs=(specs_over_replicas(param_specs), P(), P("replica", "zero")),
        out_specs=(specs_over_replicas(grad_specs), P(), P("replica")), axis_names=set(DATA_AXES),
    )  # fmt: skip
