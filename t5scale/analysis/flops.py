"""Model FLOPs of an mT5 training step: the one function every report uses (as in MaxText).

A multiply-add is 2 FLOPs; a training step is 3 forward passes' worth (forward, and backward
for activations and for weights); remat recomputation is not counted, as MFU requires.

Per forward pass, with d = d_model, hk = heads · d_kv, f = d_ff, V = vocab:
- encoder, per input token and layer: q, k, v, o projections 8·d·hk; gated-GELU FFN 6·d·f;
  bidirectional attention scores and weighted values 4·L_in·hk;
- decoder, per target token and layer: self-attention projections 8·d·hk; causal self-attention
  4·L_tgt·hk (halved by default: half the matrix is masked); cross-attention q and o 4·d·hk;
  cross-attention scores and values 4·L_in·hk; FFN 6·d·f;
- cross-attention k and v run on the encoder's output: 4·d·hk per input token per decoder layer;
- output projection 2·d·V per target token.
Embedding look-ups, norms and softmax are not counted.
"""

from __future__ import annotations

from t5scale.model.sizes import ModelConfig


def forward_flops_per_sequence(
    model: ModelConfig, input_length: int, target_length: int, causal_attention_halved: bool = True
) -> float:
    d, f, hk = model.d_model, model.d_ff, model.num_heads * model.d_kv
    encoder_layer = input_length * (8 * d * hk + 6 * d * f + 4 * input_length * hk)
    causal = 4 * target_length * hk * (0.5 if causal_attention_halved else 1.0)
    decoder_layer = target_length * (
        8 * d * hk + causal + 4 * d * hk + 4 * input_length * hk + 6 * d * f
    )
    cross_kv = input_length * 4 * d * hk
    return (
        model.num_encoder_layers * encoder_layer
        + model.num_decoder_layers * (decoder_layer + cross_kv)
        + target_length * 2 * d * model.vocab_size
    )


def training_flops_per_step(
    model: ModelConfig,
    batch_size: int,
    input_length: int,
    target_length: int,
    causal_attention_halved: bool = True,
) -> float:
    """Model FLOPs of one training step over a global batch (all devices together)."""
    forward = forward_flops_per_sequence(
        model, input_length, target_length, causal_attention_halved
    )
    return 3.0 * batch_size * forward


def mfu(
    flops_per_step: float, step_time_s: float, peak_flops_per_s: float, num_devices: int
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    return flops_per_step / (step_time_s * peak_flops_per_s * num_devices)
