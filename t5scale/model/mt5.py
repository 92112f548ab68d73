"""mT5 (T5 v1.1 architecture) in Flax, top to bottom.

What makes it T5 v1.1: RMS layer norm with a scale and no bias or centring; gated-GELU feed-forward
(wi_0, wi_1, wo); relative position bias (32 buckets, max distance 128; bidirectional in the
encoder, causal in the decoder) computed once per stack and added in every layer; attention logits
without the 1/sqrt(d_kv) factor (it is folded into the query initialisation); no biases anywhere;
an untied output projection; one input embedding shared by encoder and decoder.

Hooks connect the model to the parallel layout without the model knowing about meshes:
`gather_layer(params, path)` is applied to each scanned layer's parameters where the layer runs
(ZeRO stage 3 all-gathers the layer's shards there, in the forward pass and again in the
backward pass), `constrain(array, logical_axes)` to the main activations (tensor parallelism),
`embed(table, tokens, dtype)` looks up the encoder's and decoder's tokens, together (stage 3
looks them up in a table split by vocabulary) and `attend` runs the fused attention with the
kernels the caller names in `kernels` (on each device's heads: t5scale/parallel/attention.py).
They default to the identity, a plain gather and the fused attention on whole arrays.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.linen import fp8_ops
from jax.ad_checkpoint import checkpoint_name

from t5scale.model import attention_vjp
from t5scale.model.fused_attention import Backend, fused_attention
from t5scale.model.sizes import ModelConfig

Axes = tuple[str, ...]
# What a layer's attention gets besides its inputs (Attention.__call__): an array for 'dot',
# (position bias or None, query segments, key segments) for the fused route ('fused',
# 'fused_reference').
AttentionBias = Any
NEG_INF = -1e10
# The parameters of the vocabulary: the input embedding [V, d] and the output projection [d, V]
# (mT5 does not tie them), by their names in the parameter tree.
EMBEDDING, LM_HEAD = "embedding", "lm_head"
ENCODER, DECODER, LAYERS = "encoder", "decoder", "layers"  # module names in the tree
# The collection of the FP8 matmuls' scales and amax histories (flax's fp8_ops): their
# "gradient" is their next value, never a step for the optimizer (t5scale/train/fp8.py).
FP8_STATE = fp8_ops.OVERWRITE_WITH_GRADIENT


def _keep_params(params, path: tuple[str, ...]):
    del path
    return params


def _keep_activation(x: jax.Array, axes: Axes) -> jax.Array:
    del axes
    return x


def look_up_rows(table: jax.Array, ids: jax.Array) -> jax.Array:
    """table[ids], whose gradient, a scatter-add, sums in float32 whatever the table's dtype: a
    bfloat16 scatter-add has no native atomic on GPUs and serialises on repeated ids (the
    tokens of real batches, the relative positions' buckets; docs/benchmarks.md, 2026-11-23
    and the GPU check of 2026-11-27)."""
    if table.dtype == jnp.float32:
        return jnp.take(table, ids, axis=0)
    return _rows_summing_in_float32(table, ids)


@jax.custom_vjp
def _rows_summing_in_float32(table: jax.Array, ids: jax.Array) -> jax.Array:
    return jnp.take(table, ids, axis=0)


def _look_up_forward(table: jax.Array, ids: jax.Array):
    return jnp.take(table, ids, axis=0), (table, ids)


def _look_up_backward(residuals, cotangent: jax.Array):
    table, ids = residuals
    rows = jnp.zeros(table.shape, jnp.float32).at[ids].add(cotangent.astype(jnp.float32))
    return rows.astype(table.dtype), None


_rows_summing_in_float32.defvjp(_look_up_forward, _look_up_backward)


def _look_up(table: jax.Array, tokens: jax.Array, dtype) -> jax.Array:
    return look_up_rows(table, tokens).astype(dtype)


@dataclasses.dataclass(frozen=True)
class ShardingHooks:
    # attend(q, k, v, position bias or None, q segments, k segments, causal, backend): fused
    # attention on this device's heads (fused_attention.Backend: 'reference' for
    # ModelConfig.attention 'fused_reference', `kernels` for 'fused').
    attend: Callable[..., jax.Array] = fused_attention
    # The kernels that compile for the devices, as the caller's target answers it
    # (parallel/attention.kernels_for); the interpreter runs anywhere.
    kernels: Backend = "interpreted"
    # The output layer's kernel where ModelConfig.head_kernel asks for it (model/head.py's
    # HeadLoss.kernel): 'triton' on GPUs whose vocabulary tensor parallelism leaves whole;
    # None, XLA's route (Pallas's interpreter of it is for the kernel's own tests).
    head_kernel: str | None = None
    # gather_layer(one layer's parameters, path of the layer stack): the parameters as used.
    gather_layer: Callable[[Any, tuple[str, ...]], Any] = _keep_params
    # constrain(activation, logical axes): the activation with its sharding pinned.
    constrain: Callable[[jax.Array, Axes], jax.Array] = _keep_activation
    # embed(table, tokens, compute dtype): the tokens' rows of the embedding table.
    embed: Callable[[jax.Array, jax.Array, Any], jax.Array] = _look_up

    def head_kernel_for(self, model: ModelConfig) -> str | None:
        """The output layer's kernel (head.HeadLoss.kernel): the one that compiles here, where
        the model asks for it (ModelConfig.head_kernel)."""
        return self.head_kernel if model.head_kernel else None


class _Module(nn.Module):
    cfg: ModelConfig
    hooks: ShardingHooks = ShardingHooks()

    def weight(self, name: str, init, shape: tuple[int, ...], axes: Axes) -> jax.Array:
        """Declare a float32 parameter with logical axes; return it ready for compute."""
        return self.table(name, init, shape, axes).astype(self.cfg.dtype)

    def table(self, name: str, init, shape: tuple[int, ...], axes: Axes) -> jax.Array:
        """Declare a float32 look-up table, returned in the dtype it is kept in (the rows are
        cast after the look-up, whose gradient sums in float32: `look_up_rows`)."""
        return self.param(name, nn.with_logical_partitioning(init, axes), shape, jnp.float32)

    def constrain(self, x: jax.Array, axes: Axes) -> jax.Array:
        return self.hooks.constrain(x, axes)

    def declaring(self) -> bool:
        """Whether this call only declares the parameters (an init) and may skip the arithmetic:
        the draws do not depend on it (each comes from its module's path and its order there),
        and jit drops that forward pass before lowering anyway, after tracing it (0.1–0.2 s of
        each state's creation). FP8's matmuls declare variables of their own, so with FP8 the
        init runs them."""
        return self.is_initializing() and self.cfg.fp8_amax_history is None

    def matmul(self, name: str, equation: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """x · w by `equation`: in the compute dtype, or with an FP8 amax history an FP8 GEMM with
        delayed scaling (flax's Fp8Einsum, its scales and histories in FP8_STATE under
        `<name>_fp8`): e4m3 operands forward, an e5m2 gradient backward (docs/concepts.md)."""
        if self.cfg.fp8_amax_history is None:
            return jnp.einsum(equation, x, w)
        fp8 = fp8_ops.Fp8Einsum(amax_history_length=self.cfg.fp8_amax_history, name=f"{name}_fp8")
        return fp8(equation, x, w)


def _normal(stddev: float):
    return nn.initializers.normal(stddev=stddev)


class RMSNorm(_Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        scale = self.weight("scale", nn.initializers.ones, (self.cfg.d_model,), ("embed",))
        if self.declaring():
            return x
        x32 = x.astype(jnp.float32)
        normed = x32 * jax.lax.rsqrt(
            jnp.mean(x32 * x32, axis=-1, keepdims=True) + self.cfg.layer_norm_epsilon
        )
        return checkpoint_name(normed.astype(self.cfg.dtype) * scale, "normed")


class Attention(_Module):
    causal: bool = False  # read by the fused kernel; the dot path has it in its mask

    @nn.compact
    def __call__(self, x_q: jax.Array, x_kv: jax.Array, bias) -> jax.Array:
        """`bias`: for 'dot' attention the additive [batch or 1, heads or 1, q, k] bias with
        the masks folded in; for the fused route (position bias by its diagonals [heads, q + k − 1] or None, query
        segment ids, key segment ids)."""
        d, h, k = self.cfg.d_model, self.cfg.num_heads, self.cfg.d_kv
        # T5 folds 1/sqrt(d_kv) into the query's initial scale instead of scaling the logits.
        wq = self.weight("query", _normal((d * k) ** -0.5), (d, h, k), ("embed", "heads", "kv"))
        wk = self.weight("key", _normal(d**-0.5), (d, h, k), ("embed", "heads", "kv"))
        wv = self.weight("value", _normal(d**-0.5), (d, h, k), ("embed", "heads", "kv"))
        wo = self.weight("out", _normal((h * k) ** -0.5), (h, k, d), ("heads", "kv", "embed"))
        if self.declaring():
            return x_q
        head_axes = ("batch", "length", "heads", "kv")
        q = self.constrain(self.matmul("query", "bqd,dhk->bqhk", x_q, wq), head_axes)
        key = self.constrain(self.matmul("key", "bsd,dhk->bshk", x_kv, wk), head_axes)
        value = self.constrain(self.matmul("value", "bsd,dhk->bshk", x_kv, wv), head_axes)
        if self.cfg.fused_route:
            backend = self.hooks.kernels if self.cfg.attention == "fused" else "reference"
            context = self.hooks.attend(q, key, value, *bias, causal=self.causal, backend=backend)
        else:
            logits = jnp.einsum("bqhk,bshk->bhqs", q, key).astype(jnp.float32) + bias
            probs = jax.nn.softmax(logits, axis=-1).astype(self.cfg.dtype)
            context = jnp.einsum("bhqs,bshk->bqhk", probs, value)
        context = self.constrain(context, head_axes)
        return self.matmul("out", "bqhk,hkd->bqd", context, wo)


@jax.custom_vjp
def gated_gelu(both: jax.Array) -> jax.Array:
    """gelu(a) · b (GELU's tanh form) of the pairs both[..., 0] = a, both[..., 1] = b."""
    return jax.nn.gelu(both[..., 0], approximate=True) * both[..., 1]


def _gated_gelu_forward(both: jax.Array):
    return gated_gelu(both), both


def _gated_gelu_backward(both: jax.Array, grad: jax.Array):
    """The pairs' gradients (g·b·gelu′(a), g·gelu(a)), in fp32 from one tanh a pair. In 16 bits
    each pair is written as one 32-bit word: a gradient laid out as two arrays side by side
    made XLA compute the tanh once for each (a kernel of its own, its output read back; the
    profile of 2026-11-28: 11 of mt5_large's 65 ms neither GEMM nor attention)."""
    a, b = both[..., 0].astype(jnp.float32), both[..., 1].astype(jnp.float32)
    grad = grad.astype(jnp.float32)
    slope = np.sqrt(2 / np.pi).astype(np.float32)
    tanh = jnp.tanh(slope * (a + 0.044715 * a**3))
    gelu = 0.5 * a * (1 + tanh)
    d_gelu = 0.5 * (1 + tanh) + 0.5 * a * (1 - tanh * tanh) * slope * (1 + 3 * 0.044715 * a * a)
    d_a, d_b = (grad * b * d_gelu).astype(both.dtype), (grad * gelu).astype(both.dtype)
    if both.dtype.itemsize != 2:
        return (jnp.stack([d_a, d_b], axis=-1),)

    def bits(x: jax.Array) -> jax.Array:
        return jax.lax.bitcast_convert_type(x, jnp.uint16).astype(jnp.uint32)

    # little-endian: the low half is element 0 of the pair
    return (jax.lax.bitcast_convert_type(bits(d_a) | (bits(d_b) << 16), both.dtype),)


gated_gelu.defvjp(_gated_gelu_forward, _gated_gelu_backward)


class GatedGeluMlp(_Module):
    @nn.compact
    def __call__(self, x: jax.Array) -> jax.Array:
        d, f = self.cfg.d_model, self.cfg.d_ff
        wi_0 = self.weight("wi_0", _normal(d**-0.5), (d, f), ("embed", "mlp"))
        wi_1 = self.weight("wi_1", _normal(d**-0.5), (d, f), ("embed", "mlp"))
        wo = self.weight("wo", _normal(f**-0.5), (f, d), ("mlp", "embed"))
        if self.declaring():
            return x
        # Both input projections in one matmul, the two weights' columns interleaved ([d, f, 2]):
        # each (a, b) pair of the product lies together, for gated_gelu's one-word gradient;
        # stacking (not concatenating) keeps `mlp` shardable.
        both = self.matmul("wi", "bld,dft->blft", x, jnp.stack([wi_0, wi_1], axis=-1))
        hidden = gated_gelu(both)
        hidden = self.constrain(checkpoint_name(hidden, "gated_gelu"), ("batch", "length", "mlp"))
        return self.matmul("wo", "blf,fd->bld", hidden, wo)


def relative_position_bucket(
    relative_position: np.ndarray, bidirectional: bool, num_buckets: int, max_distance: int
) -> np.ndarray:
    """T5's bucketing of key_position - query_position: exact for small, log-spaced for large."""
    distance = -relative_position
    bucket = np.zeros_like(distance)
    if bidirectional:
        num_buckets //= 2
        bucket += (distance < 0).astype(distance.dtype) * num_buckets
        distance = np.abs(distance)
    else:
        distance = np.maximum(distance, 0)
    max_exact = num_buckets // 2
    log_ratio = np.log(np.maximum(distance, 1).astype(np.float32) / max_exact) / np.log(
        max_distance / max_exact
    )
    large = max_exact + (log_ratio * (num_buckets - max_exact)).astype(distance.dtype)
    large = np.minimum(large, num_buckets - 1)
    return bucket + np.where(distance < max_exact, distance, large)


class RelativePositionBias(_Module):
    bidirectional: bool = True

    @nn.compact
    def __call__(self, q_len: int, k_len: int) -> jax.Array:
        buckets = self.cfg.relative_attention_num_buckets
        table = self.table(
            "rel_embedding",
            _normal(1.0),
            (self.cfg.num_heads, buckets),
            ("heads", "relpos_buckets"),
        )
        if self.cfg.fused_route:  # by its diagonals k − q: the kernels read no [q, k] array
            relative = np.arange(-(q_len - 1), k_len)
        else:
            relative = np.arange(k_len)[None, :] - np.arange(q_len)[:, None]
        index = relative_position_bucket(
            relative, self.bidirectional, buckets, self.cfg.relative_attention_max_distance
        )
        # A gather whose gradient sums the updates into `buckets` rows: in float32, as the
        # embedding's (a bf16 working copy made it a serialised bf16 scatter-add on GPUs).
        rows = look_up_rows(table.T, index).astype(jnp.float32)  # [q + k − 1 or q, k, heads]
        if self.cfg.fused_route:
            return rows.T  # [heads, q + k − 1]
        return rows.transpose(2, 0, 1)[None]  # [1, heads, q, k]


class EncoderLayer(_Module):
    @nn.compact
    def __call__(self, x: jax.Array, bias: AttentionBias) -> tuple[jax.Array, None]:
        h = RMSNorm(self.cfg, self.hooks, name="pre_attention_norm")(x)
        x = x + Attention(self.cfg, self.hooks, name="attention")(h, h, bias)
        h = RMSNorm(self.cfg, self.hooks, name="pre_mlp_norm")(x)
        x = x + GatedGeluMlp(self.cfg, self.hooks, name="mlp")(h)
        return self.constrain(x, ("batch", "length", "embed")), None


class DecoderLayer(_Module):
    @nn.compact
    def __call__(
        self, y: jax.Array, encoded: jax.Array, self_bias: AttentionBias, cross_bias: AttentionBias
    ) -> tuple[jax.Array, None]:
        h = RMSNorm(self.cfg, self.hooks, name="pre_self_attention_norm")(y)
        self_attention = Attention(self.cfg, self.hooks, causal=True, name="self_attention")
        y = y + self_attention(h, h, self_bias)
        h = RMSNorm(self.cfg, self.hooks, name="pre_cross_attention_norm")(y)
        y = y + Attention(self.cfg, self.hooks, name="cross_attention")(h, encoded, cross_bias)
        h = RMSNorm(self.cfg, self.hooks, name="pre_mlp_norm")(y)
        y = y + GatedGeluMlp(self.cfg, self.hooks, name="mlp")(h)
        return self.constrain(y, ("batch", "length", "embed")), None


# What remat "dots" also keeps when the layers are unrolled (remat_policy), by checkpoint_name.
KEPT_UNROLLED = ("normed", "gated_gelu")


def remat_policy(name: str, unrolled: bool = False):
    """The checkpoint policy of a remat option: dots, minimal or full.

    "dots" keeps every matmul's output (the fused attention's output and log-sum-exp among
    them) and recomputes only the cheap elementwise work (GELU, norms) in the backward pass:
    keeping everything instead (everything_saveable) stacks a dozen more per-layer buffers out
    of the scan, was slower on the CPU, and about doubles the peak of XLA's GPU program for the
    same GEMMs (docs/benchmarks.md, "What remat 'dots' keeps"; bench/remat_policies_gpu.py).
    With the layers `unrolled` a kept value is no copy into a stack, only memory, so "dots" also
    keeps the norms' outputs and the gated GELU's product (KEPT_UNROLLED), which the backward
    pass would read twice and write once to make again. "minimal" keeps the
    matmuls without batch dimensions (the projections, not attention's scores and mixing),
    "full" nothing. Under ZeRO-3 a layer's gathered parameters must never be kept for the
    backward pass (it gathers them again); they are made by all-gathers, reshapes and casts,
    never by matmuls, so no policy here keeps them.
    """
    policies = jax.checkpoint_policies
    if name == "dots":
        names = (attention_vjp.KEPT, *(KEPT_UNROLLED if unrolled else ()))
        return policies.save_from_both_policies(
            policies.dots_saveable, policies.save_only_these_names(*names)
        )
    if name == "minimal":
        return policies.dots_with_no_batch_dims_saveable
    # "full", and "auto" before the train step chooses (t5scale/train/setup.py): the forward
    # passes that meet it (initialisation, evaluation) have no backward pass to keep for.
    return policies.nothing_saveable


def _stack(layer_cls: type[_Module], module: _Module, num_layers: int, broadcast_args: int):
    """The layers under one scan (stacked parameters), as a loop or unrolled (cfg.scan_layers)."""
    if module.hooks.gather_layer is not _keep_params and not module.is_initializing():
        path = (*module.scope.path, "layers")
        layer_cls = nn.map_variables(
            layer_cls, "params", trans_in_fn=lambda p: module.hooks.gather_layer(p, path)
        )
    unrolled = not module.cfg.scan_layers
    policy = remat_policy(module.cfg.remat, unrolled)
    # In a loop, XLA cannot merge a layer's recomputed forward with the first one, so CSE may
    # stay on (it saves copies); unrolled, it would merge them and undo the remat.
    rematted = nn.remat(layer_cls, policy=policy, prevent_cse=unrolled)
    return nn.scan(
        rematted,
        variable_axes={"params": 0, FP8_STATE: 0},
        split_rngs={"params": True},
        in_axes=(nn.broadcast,) * broadcast_args,
        length=num_layers,
        unroll=num_layers if unrolled else 1,
        metadata_params={nn.PARTITION_NAME: "layers"},
    )


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def project_to_vocab(x: jax.Array, w: jax.Array, logits_dtype: str | None = None) -> jax.Array:
    """x @ w for the output projection ([..., d_model] @ [d_model, vocab]), written by the
    matmul in `logits_dtype` (None: the inputs' dtype), with a backward pass written so that
    both of its matmuls are in the row-major form fast CPU kernels take.

    Left to autodiff, w's gradient is x^T @ g contracted over the tokens, the leading dimension
    of both: XLA:CPU then transposes the [tokens, vocab] gradient and runs the product through
    its generic Eigen path, slower than its YNNPACK matmuls (docs/benchmarks.md). Here x is
    transposed instead (tokens × d_model, far smaller than tokens × vocab), behind an
    optimization barrier so that XLA cannot fold the transpose back.
    """
    return jnp.matmul(x, w, preferred_element_type=logits_dtype)


def _project_forward(x: jax.Array, w: jax.Array, logits_dtype: str | None):
    return project_to_vocab(x, w, logits_dtype), (x, w)


def _project_backward(logits_dtype: str | None, residuals, g: jax.Array):
    del logits_dtype
    x, w = residuals
    g = g.astype(x.dtype)  # the gradient in the compute dtype, as autodiff's of a plain matmul
    rows = x.reshape(-1, x.shape[-1])
    x_t = jax.lax.optimization_barrier(rows.T)  # [d_model, tokens], laid out row-major
    dw = (x_t @ g.reshape(-1, g.shape[-1])).astype(w.dtype)
    dx = (g @ w.T).astype(x.dtype)
    return dx, dw


project_to_vocab.defvjp(_project_forward, _project_backward)


def _mask_to_bias(mask: jax.Array) -> jax.Array:
    return jnp.where(mask, 0.0, NEG_INF).astype(jnp.float32)[:, None]  # [batch, 1, q, k]


def encoder_attention_bias(
    cfg: ModelConfig, position_bias: jax.Array, segment_ids: jax.Array
) -> AttentionBias:
    """What each encoder layer's attention takes besides its inputs (Attention.__call__)."""
    if cfg.fused_route:  # the kernel masks by segment: no [b, q, k] mask
        return (position_bias, segment_ids, segment_ids)
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    return _mask_to_bias(same_segment & (segment_ids[:, None, :] > 0)) + position_bias


def decoder_attention_biases(
    cfg: ModelConfig,
    position_bias: jax.Array,
    segment_ids: jax.Array,
    encoder_segment_ids: jax.Array,
) -> tuple[AttentionBias, AttentionBias]:
    """(self-attention's, cross-attention's) biases of each decoder layer."""
    if cfg.fused_route:  # the kernel masks by segment and position
        cross = (None, segment_ids, encoder_segment_ids)
        return (position_bias, segment_ids, segment_ids), cross
    length = segment_ids.shape[1]
    causal = np.tril(np.ones((length, length), dtype=bool))[None]
    same_segment = segment_ids[:, :, None] == segment_ids[:, None, :]
    self_bias = _mask_to_bias(causal & same_segment & (segment_ids[:, None, :] > 0)) + position_bias
    cross_mask = (segment_ids[:, :, None] == encoder_segment_ids[:, None, :]) & (
        encoder_segment_ids[:, None, :] > 0
    )
    return self_bias, _mask_to_bias(cross_mask)


class Encoder(_Module):
    """The encoder; its parts (position bias, layers, final norm) are methods of their own, so
    that a pipeline stage applies `num_layers` of the layers alone (t5scale/train/pipeline.py)."""

    num_layers: int | None = None  # None: the config's

    def setup(self) -> None:
        count = self.cfg.num_encoder_layers if self.num_layers is None else self.num_layers
        self.relpos_bias = RelativePositionBias(self.cfg, self.hooks, True)
        self.layers = _stack(EncoderLayer, self, count, 1)(self.cfg, self.hooks)
        self.final_norm = RMSNorm(self.cfg, self.hooks)

    def position_bias(self, length: int) -> jax.Array:
        return self.relpos_bias(length, length)

    def run_layers(self, x: jax.Array, bias: AttentionBias) -> jax.Array:
        return self.layers(x, bias)[0]

    def finish(self, x: jax.Array) -> jax.Array:
        return self.final_norm(x)

    def __call__(self, x: jax.Array, segment_ids: jax.Array) -> jax.Array:
        # The parts' own calls, not the methods: flax names a method's ops "encoder.run_layers",
        # and the layer loop is read from the program by its name (whatif/step_time.py).
        length = x.shape[1]
        bias = encoder_attention_bias(self.cfg, self.relpos_bias(length, length), segment_ids)
        return self.final_norm(self.layers(x, bias)[0])


def _made_once(encoded: jax.Array) -> jax.Array:
    """The encoder's output as one array that every decoder layer reads. Without the barrier,
    with the layers unrolled, XLA:GPU made the final norm's last multiply (by its scale) again
    in front of each layer's cross-attention projections, forward and backward: 48 kernels and
    6 GB of mt5_large's step (the H200's profile, twenty-third session)."""
    return jax.lax.optimization_barrier(encoded)


class Decoder(_Module):
    """The decoder, in parts as the Encoder."""

    num_layers: int | None = None  # None: the config's

    def setup(self) -> None:
        count = self.cfg.num_decoder_layers if self.num_layers is None else self.num_layers
        self.relpos_bias = RelativePositionBias(self.cfg, self.hooks, False)
        self.layers = _stack(DecoderLayer, self, count, 3)(self.cfg, self.hooks)
        self.final_norm = RMSNorm(self.cfg, self.hooks)

    def position_bias(self, length: int) -> jax.Array:
        return self.relpos_bias(length, length)

    def run_layers(
        self, y: jax.Array, encoded: jax.Array, self_bias: AttentionBias, cross_bias: AttentionBias
    ) -> jax.Array:
        return self.layers(y, _made_once(encoded), self_bias, cross_bias)[0]

    def finish(self, y: jax.Array) -> jax.Array:
        return self.final_norm(y)

    def __call__(
        self,
        y: jax.Array,
        encoded: jax.Array,
        segment_ids: jax.Array,
        encoder_segment_ids: jax.Array,
    ) -> jax.Array:
        length = y.shape[1]  # the parts' own calls, as in Encoder.__call__
        self_bias, cross_bias = decoder_attention_biases(
            self.cfg, self.relpos_bias(length, length), segment_ids, encoder_segment_ids
        )
        return self.final_norm(self.layers(y, _made_once(encoded), self_bias, cross_bias)[0])


class MT5(_Module):
    """Encoder-decoder returning the decoder's logits over the vocabulary (float32; written by
    the projection in ModelConfig.logits_dtype), or with
    project=False its output before the projection (vocabulary-parallel losses project it)."""

    @nn.compact
    def __call__(
        self,
        encoder_input_tokens: jax.Array,
        decoder_input_tokens: jax.Array,
        encoder_segment_ids: jax.Array | None = None,
        decoder_segment_ids: jax.Array | None = None,
        project: bool = True,
    ) -> jax.Array:
        cfg = self.cfg
        if encoder_segment_ids is None:  # unpacked: every non-padding token is segment 1
            encoder_segment_ids = (encoder_input_tokens > 0).astype(jnp.int32)
        if decoder_segment_ids is None:
            decoder_segment_ids = jnp.ones_like(decoder_input_tokens, dtype=jnp.int32)
        embedding = self.table(
            EMBEDDING, _normal(1.0), (cfg.vocab_size, cfg.d_model), ("vocab", "embed")
        )

        # One look-up for both stacks' tokens: one collective where the table is split.
        tokens = jnp.concatenate([encoder_input_tokens, decoder_input_tokens], axis=1)
        rows = self.hooks.embed(embedding, tokens, cfg.dtype)
        input_length = encoder_input_tokens.shape[1]
        x = self.constrain(rows[:, :input_length], ("batch", "length", "embed"))
        y = self.constrain(rows[:, input_length:], ("batch", "length", "embed"))
        encoded = Encoder(cfg, self.hooks, name=ENCODER)(x, encoder_segment_ids)
        decoded = Decoder(cfg, self.hooks, name=DECODER)(
            y, encoded, decoder_segment_ids, encoder_segment_ids
        )
        if not project:
            return decoded
        lm_head = self.weight(
            LM_HEAD, _normal(cfg.d_model**-0.5), (cfg.d_model, cfg.vocab_size), ("embed", "vocab")
        )
        if self.declaring():
            return decoded
        logits = project_to_vocab(decoded, lm_head, cfg.logits_dtype).astype(jnp.float32)
        return self.constrain(logits, ("batch", "length", "vocab"))


def model_variables(params: Any, fp8: Any = None) -> dict[str, Any]:
    """What `MT5.apply` takes: the parameters, and the FP8 matmuls' state where they have one."""
    return {"params": params} if fp8 is None else {"params": params, FP8_STATE: fp8}


# Once per configuration: the abstract model is asked for by the layout, the state's shapes and
# the FP8 state, and tracing the model's init is a second or more each time.
@functools.lru_cache(maxsize=32)
def _abstract_variables(cfg: ModelConfig) -> dict[str, Any]:
    tokens = jax.ShapeDtypeStruct((1, 8), jnp.int32)
    return jax.eval_shape(MT5(cfg).init, jax.random.key(0), tokens, tokens)


def abstract_params(cfg: ModelConfig):
    """Parameter shapes with their logical axes (flax LogicallyPartitioned boxes), nothing allocated."""
    return _abstract_variables(cfg)["params"]


def abstract_fp8_state(cfg: ModelConfig) -> Any:
    """The FP8 matmuls' scales and amax histories (jax.ShapeDtypeStruct, stacked by layer as the
    parameters are); None without FP8."""
    if cfg.fp8_amax_history is None:
        return None
    return _abstract_variables(cfg)[FP8_STATE]


def fresh_fp8_state(cfg: ModelConfig, full: Callable = np.full) -> Any:
    """The FP8 state as flax's Fp8Einsum starts it, made by `full` (np.full: in host memory;
    jnp.full inside a jit); None without FP8."""
    shapes = abstract_fp8_state(cfg)
    return None if shapes is None else fp8_state_like(shapes, full)


def fp8_state_like(shapes: Any, full: Callable = np.full) -> Any:
    """A fresh FP8 state of these shapes: scales 1, amax histories 0."""

    def start(path, leaf: jax.ShapeDtypeStruct):
        fill = 1.0 if str(path[-1].key).endswith("_scale") else 0.0
        return full(leaf.shape, fill, leaf.dtype)

    return jax.tree_util.tree_map_with_path(start, shapes)


# The parameter tree's layout, for code outside model/ (flax names each part after its module).


def encoder_params(params: Any) -> Any:
    return params[ENCODER]


def decoder_params(params: Any) -> Any:
    return params[DECODER]


def layer_stacks(params: Any) -> tuple[Any, Any]:
    """The encoder's and the decoder's stacked layers (a leading layer axis each)."""
    return encoder_params(params)[LAYERS], decoder_params(params)[LAYERS]


def vocabulary_tables(params: Any) -> tuple[Any, Any]:
    """The embedding table and the output layer."""
    return params[EMBEDDING], params[LM_HEAD]


def init_params(cfg: ModelConfig, rng: jax.Array) -> Any:
    """Fresh parameters, unboxed (no logical axes). Made by the layer loop also for unrolled
    layers: the same draws (tests/test_model.py), where compiling the unrolled init
    took XLA:GPU minutes for mt5_large (docs/benchmarks.md)."""
    tokens = jnp.zeros((1, 8), jnp.int32)
    looped = dataclasses.replace(cfg, scan_layers=True)
    return nn.meta.unbox(MT5(looped).init(rng, tokens, tokens)["params"])
