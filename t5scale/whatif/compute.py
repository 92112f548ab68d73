"""Compute time of one train step on one GPU: a roofline of the step's own operations.

Each matmul runs at the slower of its FLOPs at the GEMM rate (`peak × gemm_efficiency`) and its
bytes (both inputs and the output, once) at the achieved memory bandwidth; each memory-bound
operation (norms, residual adds, the gated activation, softmax, the loss over the vocabulary)
at its bytes read and written. This is what makes efficiency depend on the model: mt5_small's
narrow layers and long attention rows give memory-bound work a larger share than mt5_xxl's, and
the 250k-vocabulary head's logits are a large memory-bound term of their own.

Counted per sequence, with the device's share under tensor parallelism (heads, d_ff and the
vocabulary split over `tensor`):

- forward: the matmuls of mT5's layers (q·k·v·o, the gated FFN's wi_0, wi_1, wo, attention's
  scores and weighted values per head, cross-attention's k and v over the encoder's tokens) and
  the output projection; elementwise: per layer and token one read and write of the hidden
  state per norm and residual add, the gated activation's three d_ff-wide tensors, a read and
  a write of the attention probabilities; the loss reads the logits three times in fp32
  (log-sum-exp, target logit, and the backward's softmax) and writes them once;
- backward: twice the forward's matmul work (input and weight gradients) and twice its
  elementwise bytes (the gradient in and out), plus what the remat policy recomputes there
  (t5scale/model/mt5.py's `remat_policy`): `dots` keeps every matmul output and recomputes the
  elementwise work; `minimal` keeps only the unbatched matmuls' outputs, so attention's scores
  and weighted values are recomputed too; `full` recomputes the layers' whole forward.

The whole is scaled by `ClusterConfig.roofline_fraction`, the share of its roofline a compiled
step reaches, calibrated once on t5scale's own one-GPU measurements (docs/cluster_model.md).

Not counted: embedding look-ups, relative position buckets, kernel launch gaps, the optimizer
(timed separately, memory-bound, in step_time.py).
"""

from __future__ import annotations

import dataclasses

from t5scale.model.sizes import ModelConfig
from t5scale.whatif.hardware import ClusterConfig


@dataclasses.dataclass(frozen=True)
class ComputeTime:
    """Seconds of one step's compute on one GPU, by where it runs."""

    forward_layers: float  # the layer loops' forward
    backward_layers: float  # their backward, remat's recomputation included (it runs there)
    head: float  # output projection and loss, forward and backward
    matmul_flops: float  # per device, forward + backward (+ recomputation)

    @property
    def total(self) -> float:
        return self.forward_layers + self.backward_layers + self.head


@dataclasses.dataclass
class _Pass:
    """Seconds of matmul and of memory-bound work in one forward pass."""

    matmul: float = 0.0
    attention_matmul: float = 0.0  # the batched ones (scores, weighted values), within matmul
    elementwise: float = 0.0
    flops: float = 0.0
    attention_flops: float = 0.0


def step_compute(
    model: ModelConfig,
    sequences: float,
    input_length: int,
    target_length: int,
    cluster: ClusterConfig,
    tensor: int = 1,
) -> ComputeTime:
    """Compute time of one train step over `sequences` sequences on one GPU."""
    float32 = model.dtype == "float32"
    width = 4 if float32 else 2  # bytes per activation value
    peak = (cluster.peak_flops_float32 if float32 else cluster.peak_flops) * cluster.gemm_efficiency
    bandwidth = cluster.memory_bandwidth * cluster.memory_efficiency
    # A compiled step reaches a fraction of its roofline: both rates scale by it.
    peak, bandwidth = peak * cluster.roofline_fraction, bandwidth * cluster.roofline_fraction

    def matmul(into: _Pass, m: float, k: float, n: float, batch: float = 1.0) -> None:
        flops = 2 * batch * m * k * n
        moved = width * batch * (m * k + k * n + m * n)
        seconds = max(flops / peak, moved / bandwidth)
        into.matmul += seconds
        if batch > 1:
            into.attention_matmul += seconds
            into.attention_flops += flops
        into.flops += flops

    def elementwise(into: _Pass, values: float) -> None:
        into.elementwise += width * values / bandwidth

    d, heads = model.d_model, model.num_heads / tensor
    hk, ff = heads * model.d_kv, model.d_ff / tensor
    enc_tokens, dec_tokens = sequences * input_length, sequences * target_length

    def attention(into: _Pass, tokens: float, queries: int, keys: int, with_kv: bool) -> None:
        matmul(into, tokens, d, (3 if with_kv else 1) * hk)  # q (k, v), then o below
        matmul(into, tokens, hk, d)
        matmul(into, queries, model.d_kv, keys, batch=sequences * heads)  # scores
        matmul(into, queries, keys, model.d_kv, batch=sequences * heads)  # weighted values
        elementwise(into, 2 * sequences * heads * queries * keys)  # softmax in, probabilities out

    def block(into: _Pass, tokens: float) -> None:  # norm + residual around each sublayer
        elementwise(into, tokens * d * 5)  # norm: read, write; residual add: two reads, a write

    def feed_forward(into: _Pass, tokens: float) -> None:
        matmul(into, tokens, d, 2 * ff)  # wi_0 and wi_1
        matmul(into, tokens, ff, d)
        elementwise(into, tokens * ff * 3)  # gelu(wi_0 x) * wi_1 x: two reads, one write
        block(into, tokens)

    layers = _Pass()
    for _ in range(model.num_encoder_layers):
        attention(layers, enc_tokens, input_length, input_length, with_kv=True)
        block(layers, enc_tokens)
        feed_forward(layers, enc_tokens)
    for _ in range(model.num_decoder_layers):
        attention(layers, dec_tokens, target_length, target_length, with_kv=True)
        block(layers, dec_tokens)
        matmul(layers, enc_tokens, d, 2 * hk)  # cross-attention's k and v
        attention(layers, dec_tokens, target_length, input_length, with_kv=False)
        block(layers, dec_tokens)
        feed_forward(layers, dec_tokens)

    head = _Pass()
    vocab = model.vocab_size / tensor
    matmul(head, dec_tokens, d, vocab)
    head.elementwise += 4 * 4 * dec_tokens * vocab / bandwidth  # fp32 logits: 3 reads, 1 write

    recompute = {
        "dots": layers.elementwise,
        "minimal": layers.elementwise + layers.attention_matmul,
        "full": layers.matmul + layers.elementwise,
    }
    forward = layers.matmul + layers.elementwise
    recomputed_flops = {"dots": 0.0, "minimal": layers.attention_flops, "full": layers.flops}
    return ComputeTime(
        forward_layers=forward,
        backward_layers=2 * forward + recompute[model.remat],
        head=3 * head.matmul + head.elementwise,
        matmul_flops=3 * (layers.flops + head.flops) + recomputed_flops[model.remat],
    )
