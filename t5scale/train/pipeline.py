"""Pipeline parallelism for the encoder-decoder: the loss of a step's micro-batches, run through the
`pipeline` mesh axis as a GPipe schedule inside the gradient's shard_map (docs/concepts.md,
"Pipeline stages", says why this layout and schedule).

Each stage holds 1/PP of the encoder's layers and 1/PP of the decoder's, so every stage works in
both phases; everything outside the stacks is replicated over `pipeline` and its gradients summed
over it. Each phase runs M + PP − 1 ticks: in tick t stage s works on micro-batch t − s, and in the
fill and drain on what it holds, the result dropped. Activations move only by collective permutes
around the ring of stages; the wrap-around brings each micro-batch's encoder output back to stage 0,
and in the decoder phase it travels beside the decoder's activations for cross-attention. Stage 0
then sends M/PP decoder outputs to each other stage, so that the 250k-vocabulary head is split over
the stages instead of computed PP times.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from t5scale.data.batch import Batch
from t5scale.model.head import model_loss_sums
from t5scale.model.mt5 import (
    DECODER,
    EMBEDDING,
    ENCODER,
    LM_HEAD,
    Decoder,
    Encoder,
    ShardingHooks,
    decoder_attention_biases,
    decoder_params,
    encoder_attention_bias,
    encoder_params,
    model_variables,
)
from t5scale.model.sizes import ModelConfig
from t5scale.parallel.collectives import to_varying
from t5scale.train import fp8 as fp8_state

AXIS = "pipeline"


def bubble_fraction(stages: int, micro_batches: int, repeats: int = 1) -> float:
    """The share of ticks a stage idles in a GPipe (repeats = 1) or circular schedule."""
    return (stages - 1) / (repeats * micro_batches + stages - 1)


def ticks(stages: int, micro_batches: int) -> int:
    """Ticks of one phase of the GPipe schedule: every micro-batch through every stage."""
    return micro_batches + stages - 1


def _ring(stages: int) -> list[tuple[int, int]]:
    return [(stage, (stage + 1) % stages) for stage in range(stages)]


def run_schedule(
    block: Callable[[Any, jax.Array, Any], Any],
    inputs: Any,
    stages: int,
    manual_axes: tuple[str, ...],
    keep: Callable[[Any], Any] = lambda out: out,
    fp8: Any = None,
) -> Any:
    """GPipe over `pipeline`: each of the M micro-batches of `inputs` (a tree of [M, ...]
    arrays, read on stage 0) through `block(stage's input, micro-batch index, FP8 state)` on
    every stage in turn. Returns `keep(output)` of every micro-batch, [M, ...], on stage 0
    (what other stages return is not used). `fp8`: the stage's FP8 state or None, given to each
    tick's block as its own copy, so that its next value is the max over the ticks
    (t5scale/train/fp8.py).

    The micro-batches go in as the scan's inputs and come out as its outputs, never in its
    carry: a [M, ...] buffer in the carry was copied whole in every tick of XLA:GPU's program
    (mt5_xl, 64 micro-batches: 129 GiB of copies a step)."""
    micro_batches = jax.tree.leaves(inputs)[0].shape[0]
    stage = lax.axis_index(AXIS)
    first = stage == 0

    def tick(held, ticked):
        t, fresh, fp8_now = ticked
        index = jnp.clip(t - stage, 0, micro_batches - 1)
        taken = jax.tree.map(lambda a, b: jnp.where(first, a, b), fresh, held)
        passed = lax.ppermute(block(taken, index, fp8_now), AXIS, _ring(stages))
        # Stage 0 now holds what the last stage finished in this tick (micro-batch t − PP + 1).
        return passed, keep(passed)

    drain = stages - 1  # ticks after the last micro-batch went in
    padded = jax.tree.map(lambda x: jnp.pad(x, [(0, drain)] + [(0, 0)] * (x.ndim - 1)), inputs)
    held = jax.tree.map(lambda x: to_varying(jnp.zeros_like(x[0]), manual_axes), inputs)
    steps = ticks(stages, micro_batches)
    per_tick = None if fp8 is None else fp8_state.spread_over_ticks(fp8, steps)
    ticked = (jnp.arange(steps), padded, per_tick)
    _, outputs = lax.scan(tick, held, ticked)
    return jax.tree.map(lambda x: x[drain:], outputs)


def spread_from_first(x: jax.Array, stages: int) -> jax.Array:
    """[M, ...] on stage 0 → stage s's M/PP of them ([M/PP, ...]), by collective permutes."""
    share = x.shape[0] // stages
    stage = lax.axis_index(AXIS)
    mine = jnp.where(stage == 0, x[:share], jnp.zeros_like(x[:share]))
    for other in range(1, stages):
        part = lax.slice_in_dim(x, other * share, (other + 1) * share)
        mine = mine + lax.ppermute(part, AXIS, [(0, other)])
    return mine


def pipelined_loss_sums(
    model: ModelConfig,
    hooks: ShardingHooks,
    params: Any,
    fp8: Any,
    batch: Batch,
    z_loss: float,
    micro_batches: int,
    stages: int,
    manual_axes: tuple[str, ...],
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(loss, cross-entropy sum, z-loss sum) of this stage's share of the local batch's
    micro-batches, the model run as a pipeline; summed over `pipeline` they are the batch's.
    `params`: this stage's layers of each stack, and the rest whole; `fp8`: the FP8 state of
    this stage's layers, or None."""
    micro = batch.map(lambda x: x.reshape(micro_batches, -1, *x.shape[1:]))
    input_length = micro.encoder_input_tokens.shape[-1]
    target_length = micro.decoder_input_tokens.shape[-1]

    # Every stage looks the tokens up (a gather; stage 0's rows are the ones used).
    tokens = jnp.concatenate([micro.encoder_input_tokens, micro.decoder_input_tokens], axis=-1)
    rows = hooks.embed(params[EMBEDDING], tokens, model.dtype)
    encoder_rows, decoder_rows = rows[..., :input_length, :], rows[..., input_length:, :]

    # The model's own encoder and decoder, each with this stage's share of its layers.
    encoder = Encoder(model, hooks, num_layers=model.num_encoder_layers // stages)
    decoder = Decoder(model, hooks, num_layers=model.num_decoder_layers // stages)
    encoder_tree, decoder_tree = (
        {"params": encoder_params(params)},
        {"params": decoder_params(params)},
    )
    encoder_position = encoder.apply(encoder_tree, input_length, method=Encoder.position_bias)
    decoder_position = decoder.apply(decoder_tree, target_length, method=Decoder.position_bias)

    def encoder_block(x: jax.Array, index: jax.Array, fp8_now: Any) -> jax.Array:
        segments = lax.dynamic_index_in_dim(micro.encoder_segment_ids, index, keepdims=False)
        bias = encoder_attention_bias(model, encoder_position, segments)
        variables = model_variables(encoder_params(params), fp8_now)
        return encoder.apply(variables, x, bias, method=Encoder.run_layers)

    def decoder_block(carried: tuple[jax.Array, jax.Array], index: jax.Array, fp8_now: Any):
        y, encoded = carried
        segments, encoder_segments = (
            lax.dynamic_index_in_dim(ids, index, keepdims=False)
            for ids in (micro.decoder_segment_ids, micro.encoder_segment_ids)
        )
        biases = decoder_attention_biases(model, decoder_position, segments, encoder_segments)
        variables = model_variables(decoder_params(params), fp8_now)
        return decoder.apply(variables, y, encoded, *biases, method=Decoder.run_layers), encoded

    encoder_fp8, decoder_fp8 = (None, None) if fp8 is None else (fp8[ENCODER], fp8[DECODER])
    encoded = run_schedule(encoder_block, encoder_rows, stages, manual_axes, fp8=encoder_fp8)
    encoded = encoder.apply(encoder_tree, encoded, method=Encoder.finish)
    decoded = run_schedule(
        decoder_block, (decoder_rows, encoded), stages, manual_axes, keep=lambda out: out[0],
        fp8=decoder_fp8,
    )  # fmt: skip
    decoded = decoder.apply(decoder_tree, decoded, method=Decoder.finish)
    return _my_share_of_the_loss(model, hooks, params, micro, decoded, z_loss, stages)


def _my_share_of_the_loss(
    model: ModelConfig, hooks: ShardingHooks, params: Any, micro: Batch, decoded: jax.Array,
    z_loss: float, stages: int,
) -> tuple[jax.Array, jax.Array, jax.Array]:  # fmt: skip
    """The loss sums of this stage's M/PP of the micro-batches, from the last stage's output."""
    micro_batches, target_length = (
        micro.decoder_input_tokens.shape[0],
        micro.decoder_input_tokens.shape[-1],
    )
    mine = spread_from_first(decoded, stages)
    share = micro_batches // stages
    start = lax.axis_index(AXIS) * share

    def my_share(x: jax.Array) -> jax.Array:
        return lax.dynamic_slice_in_dim(x, start, share)

    return model_loss_sums(
        model,
        mine.reshape(-1, *mine.shape[2:]),
        params[LM_HEAD],
        my_share(micro.decoder_target_tokens).reshape(-1, target_length),
        my_share(micro.decoder_loss_weights).reshape(-1, target_length),
        z_loss,
        constrain=hooks.constrain,
        kernel=hooks.head_kernel_for(model),
    )
