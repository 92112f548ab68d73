"""Compute time of one train step on one GPU: a roofline of the step's own operations
(docs/cluster_model.md, "Compute, per model size"), so that efficiency depends on the model: narrow
layers, long attention rows and the 250k-vocabulary head's logits make memory-bound work.

Each matmul runs at the slower of its FLOPs at `peak × gemm_efficiency` and its bytes (both inputs
and the output, once) at the achieved memory bandwidth; each memory-bound operation at its bytes
read and written. Counted per sequence, at the device's share under tensor parallelism (heads, d_ff
and the vocabulary split over `tensor`):

- forward: the matmuls of mT5's layers (q·k·v·o, the gated FFN's wi_0, wi_1, wo, attention's scores
  and weighted values per head, cross-attention's k and v over the encoder's tokens) and the output
  projection; elementwise: per layer and token one read and write of the hidden state per norm and
  residual add, the gated activation's three d_ff-wide tensors, a read and a write of the attention
  probabilities; the loss reads the logits twice in fp32 (the log-sum-exp with the target logit
  in one pass, t5scale/model/head.py; the backward's softmax) and writes them once;
- backward: twice the forward's matmul work (input and weight gradients) and twice its elementwise
  bytes (the gradient in and out), plus what the remat policy recomputes there
  (t5scale/model/mt5.py's `remat_policy`): `dots` the elementwise work; `minimal` attention's scores
  and weighted values too; `full` the layers' whole forward.

The whole is scaled by `ClusterConfig.roofline_fraction`, calibrated once on t5scale's own one-GPU
measurements (docs/cluster_model.md).

Not counted: embedding look-ups, relative position buckets, kernel launch gaps, the optimizer
(step_time.py times it).
"""

from __future__ import annotations

import dataclasses

from t5scale.model.sizes import ModelConfig
from t5scale.whatif.figures import GpuFigures


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
    """Seconds of matmul and of memory-bound work in one forward pass, at a roofline: `peak`
    FLOP/s and `bandwidth` bytes/s, activations of `width` bytes."""

    peak: float
    bandwidth: float
    width: int
    matmul_s: float = 0.0
    attention_matmul_s: float = 0.0  # the batched ones (scores, weighted values), within matmul
    elementwise_s: float = 0.0
    flops: float = 0.0
    attention_flops: float = 0.0

    def matmul(self, m: float, k: float, n: float, batch: float = 1.0) -> None:
        flops = 2 * batch * m * k * n
        moved = self.width * batch * (m * k + k * n + m * n)
        seconds = max(flops / self.peak, moved / self.bandwidth)
        self.matmul_s += seconds
        if batch > 1:
            self.attention_matmul_s += seconds
            self.attention_flops += flops
        self.flops += flops

    def elementwise(self, values: float) -> None:
        self.elementwise_s += self.width * values / self.bandwidth


def _layers(
    into: _Pass, model: ModelConfig, sequences: float, lengths: tuple[int, int], tensor: int
) -> None:
    """The encoder's and decoder's layers, forward, added to `into`."""
    d, heads = model.d_model, model.num_heads / tensor
    hk, ff = heads * model.d_kv, model.d_ff / tensor
    input_length, target_length = lengths
    enc_tokens, dec_tokens = sequences * input_length, sequences * target_length

    def attention(tokens: float, queries: int, keys: int, with_kv: bool) -> None:
        into.matmul(tokens, d, (3 if with_kv else 1) * hk)  # q (k, v), then o below
        into.matmul(tokens, hk, d)
        into.matmul(queries, model.d_kv, keys, batch=sequences * heads)  # scores
        into.matmul(queries, keys, model.d_kv, batch=sequences * heads)  # weighted values
        into.elementwise(2 * sequences * heads * queries * keys)  # softmax in, probabilities out

    def block(tokens: float) -> None:  # norm + residual around each sublayer
        into.elementwise(tokens * d * 5)  # norm: read, write; residual add: two reads, a write

    def feed_forward(tokens: float) -> None:
        into.matmul(tokens, d, 2 * ff)  # wi_0 and wi_1
        into.matmul(tokens, ff, d)
        into.elementwise(tokens * ff * 3)  # gelu(wi_0 x) * wi_1 x: two reads, one write
        block(tokens)

    for _ in range(model.num_encoder_layers):
        attention(enc_tokens, input_length, input_length, with_kv=True)
        block(enc_tokens)
        feed_forward(enc_tokens)
    for _ in range(model.num_decoder_layers):
        attention(dec_tokens, target_length, target_length, with_kv=True)
        block(dec_tokens)
        into.matmul(enc_tokens, d, 2 * hk)  # cross-attention's k and v
        attention(dec_tokens, target_length, input_length, with_kv=False)
        block(dec_tokens)
        feed_forward(dec_tokens)


def step_compute(
    model: ModelConfig,
    sequences: float,
    input_length: int,
    target_length: int,
    cluster: GpuFigures,
    tensor: int = 1,
) -> ComputeTime:
    """Compute time of one train step over `sequences` sequences on one GPU."""
    float32 = model.dtype == "float32"
    peak = (cluster.peak_flops_float32 if float32 else cluster.peak_flops) * cluster.gemm_efficiency
    bandwidth = cluster.memory_bandwidth * cluster.memory_efficiency
    # A compiled step reaches a fraction of its roofline: both rates scale by it.
    roofline = (peak * cluster.roofline_fraction, bandwidth * cluster.roofline_fraction)
    width = 4 if float32 else 2  # bytes per activation value
    layers, head = _Pass(*roofline, width), _Pass(*roofline, width)
    _layers(layers, model, sequences, (input_length, target_length), tensor)
    dec_tokens, vocab = sequences * target_length, model.vocab_size / tensor
    head.matmul(dec_tokens, model.d_model, vocab)
    head.elementwise_s += (
        3 * 4 * dec_tokens * vocab / head.bandwidth
    )  # fp32 logits: 2 reads, 1 write

    recompute = {
        "dots": layers.elementwise_s,
        "minimal": layers.elementwise_s + layers.attention_matmul_s,
        "full": layers.matmul_s + layers.elementwise_s,
    }
    forward = layers.matmul_s + layers.elementwise_s
    recomputed_flops = {"dots": 0.0, "minimal": layers.attention_flops, "full": layers.flops}
    return ComputeTime(
        forward_layers=forward,
        backward_layers=2 * forward + recompute[model.remat],
        head=3 * head.matmul_s + head.elementwise_s,
        matmul_flops=3 * (layers.flops + head.flops) + recomputed_flops[model.remat],
    )
