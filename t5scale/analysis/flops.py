"""Model FLOPs of an mT5 training step: the one formula every report uses (as in MaxText).

A multiply-add is 2 FLOPs. A training step costs 3 forward passes (the forward, and a backward
that computes gradients for both activations and weights). Remat recomputation is not counted,
as MFU requires: the number measures the model, not how it was run.

Per forward pass, with d = d_model, hk = num_heads · d_kv, f = d_ff, V = vocab_size:

- encoder, per input token and layer: q, k, v, o projections 2·4·d·hk; gated-GELU FFN
  (wi_0, wi_1, wo) 2·3·d·f; bidirectional attention scores and weighted values 2·2·L_in·hk;
- decoder, per target token and layer: self-attention projections 2·4·d·hk; causal
  self-attention scores and values 2·2·L_tgt·hk, halved by default since half the matrix is
  masked; cross-attention q and o projections 2·2·d·hk; cross-attention scores and values
  2·2·L_in·hk; FFN 2·3·d·f;
- cross-attention k and v projections run on the encoder's output: 2·2·d·hk per input token
  per decoder layer;
- output projection (untied lm_head) 2·d·V per target token.

Embedding look-ups, relative position bias, norms, softmax and activations count 0.
"""

from __future__ import annotations

from t5scale.model.sizes import ModelConfig


def forward_flops_breakdown(
    model: ModelConfig, input_length: int, target_length: int, causal_attention_halved: bool = True
) -> dict[str, float]:
    """Forward FLOPs of one sequence, by part; the parts sum to `forward_flops_per_sequence`."""
    d, f, hk = model.d_model, model.d_ff, model.num_heads * model.d_kv
    enc, dec = model.num_encoder_layers, model.num_decoder_layers
    lin, ltgt = input_length, target_length
    causal = 0.5 if causal_attention_halved else 1.0
    return {
        "encoder_projections": enc * lin * 2 * 4 * d * hk,
        "encoder_attention": enc * lin * 2 * 2 * lin * hk,
        # self q, k, v, o and cross q, o on target tokens; cross k, v on encoder tokens
        "decoder_projections": dec * (ltgt * 2 * (4 + 2) * d * hk + lin * 2 * 2 * d * hk),
        "decoder_attention": dec * ltgt * 2 * 2 * hk * (causal * ltgt + lin),
        "ffn": (enc * lin + dec * ltgt) * 2 * 3 * d * f,
        "lm_head": ltgt * 2 * d * model.vocab_size,
    }


def forward_flops_per_sequence(
    model: ModelConfig, input_length: int, target_length: int, causal_attention_halved: bool = True
) -> float:
    """Model FLOPs of one forward pass over one (input, target) sequence pair."""
    parts = forward_flops_breakdown(model, input_length, target_length, causal_attention_halved)
    return float(sum(parts.values()))


def training_flops_per_step(
    model: ModelConfig,
    batch_size: int,
    input_length: int,
    target_length: int,
    causal_attention_halved: bool = True,
) -> float:
    """Model FLOPs of one training step over the global batch (all devices together)."""
    forward = forward_flops_per_sequence(
        model, input_length, target_length, causal_attention_halved
    )
    return 3.0 * batch_size * forward


def mfu(
    flops_per_step: float, step_time_s: float, peak_flops_per_s: float, num_devices: int
) -> float:
    """Model FLOPs utilisation: achieved model FLOP/s over the devices' combined peak."""
    if step_time_s <= 0 or peak_flops_per_s <= 0 or num_devices < 1:
        raise ValueError("mfu needs a positive step time, peak FLOP/s and device count")
    return flops_per_step / (step_time_s * peak_flops_per_s * num_devices)
