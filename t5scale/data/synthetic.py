"""Synthetic batches with the exact layout of packed mT5 span-corruption batches.

They carry what seqio's packing encoder-decoder feature converter produces — encoder and decoder
tokens, segment ids and positions, decoder inputs shifted within each segment, and loss weights —
with random token ids, so that speed and memory can be measured with no corpus and no TensorFlow.
"""

from __future__ import annotations

import numpy as np

from t5scale.data.batch import FEATURES, Batch
from t5scale.data.config import DataConfig

__all__ = ["FEATURES", "Batch", "DataConfig", "batch_shapes", "synthetic_batch"]


def _segment_bounds(rng: np.random.Generator, length: int, count: int, fill: float) -> np.ndarray:
    """Start offsets of `count` segments that fill about `fill` of `length` (the rest padding)."""
    used = max(count, int(length * fill))
    cuts = (
        np.sort(rng.choice(np.arange(1, used), size=count - 1, replace=False)) if count > 1 else []
    )
    return np.concatenate([[0], cuts, [used]]).astype(np.int64)


def _packed_row(rng, length: int, bounds: np.ndarray, vocab_size: int):
    tokens = np.zeros(length, np.int32)
    segments = np.zeros(length, np.int32)
    positions = np.zeros(length, np.int32)
    for index, (start, end) in enumerate(zip(bounds[:-1], bounds[1:], strict=True), start=1):
        tokens[start:end] = rng.integers(2, vocab_size, end - start)
        tokens[end - 1] = 1  # EOS closes every packed example
        segments[start:end] = index
        positions[start:end] = np.arange(end - start)
    return tokens, segments, positions


def synthetic_batch(
    config: DataConfig, batch_size: int, vocab_size: int, seed: int, step: int
) -> Batch:
    """The global batch for `step`: the same for a (seed, step) on any mesh or process count."""
    rng = np.random.default_rng([seed, step])
    batch = batch_shapes(config, batch_size).map(lambda shape: np.zeros(shape, np.int32))
    for row in range(batch_size):
        count = int(rng.integers(1, config.max_segments + 1))
        count = min(count, config.target_length // 2, config.input_length // 2)
        fill = rng.uniform(0.85, 1.0)
        enc = _packed_row(
            rng,
            config.input_length,
            _segment_bounds(rng, config.input_length, count, fill),
            vocab_size,
        )
        dec = _packed_row(
            rng,
            config.target_length,
            _segment_bounds(rng, config.target_length, count, fill),
            vocab_size,
        )
        (
            batch.encoder_input_tokens[row],
            batch.encoder_segment_ids[row],
            batch.encoder_positions[row],
        ) = enc
        targets, segments, positions = dec
        batch.decoder_target_tokens[row] = targets
        batch.decoder_segment_ids[row] = segments
        batch.decoder_positions[row] = positions
        # Decoder inputs are the targets shifted right by one within each packed example.
        shifted = np.concatenate([[0], targets[:-1]])
        batch.decoder_input_tokens[row] = np.where(positions == 0, 0, shifted)
        batch.decoder_loss_weights[row] = (segments > 0).astype(np.int32)
    return batch


def batch_shapes(config: DataConfig, batch_size: int) -> Batch:
    """Each feature's [rows, length]: the encoder's features are inputs long, the decoder's
    targets long."""
    return Batch(
        **{
            name: (
                batch_size,
                config.input_length if name.startswith("encoder") else config.target_length,
            )
            for name in FEATURES
        }
    )
