"""A packed mT5 span-corruption batch: the eight features seqio's packing encoder-decoder feature
converter produces, as one record.

The data pipeline speaks seqio's dict of features; `Batch.of_features` turns it into this record
at the data edge, and everything past it (loader, step, loss) reads fields. A `Batch` is a JAX
pytree, so `jax.tree.map`, `jit` and one sharding for the whole batch work on it as on a dict.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from typing import Any

import jax

__all__ = ["FEATURES", "Batch"]


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    """Rows of packed examples, [rows, length] each (numpy or JAX arrays; shapes or shardings
    alike). Fields are in their names' order, the order JAX flattened the batch when it was a
    dict: the compiled step takes its arguments in the same order as before it was a record."""

    decoder_input_tokens: Any  # the targets shifted right by one within each packed example
    decoder_loss_weights: Any  # 1 where a target token counts, 0 on padding
    decoder_positions: Any
    decoder_segment_ids: Any  # 1, 2, … per packed example, 0 on padding
    decoder_target_tokens: Any
    encoder_input_tokens: Any
    encoder_positions: Any
    encoder_segment_ids: Any

    @classmethod
    def of_features(cls, features: Mapping[str, Any]) -> Batch:
        """The record of seqio's features (extra features, such as a task's own, are left)."""
        return cls(**{name: features[name] for name in FEATURES})

    def features(self) -> dict[str, Any]:
        """seqio's dict of features, keyed by name."""
        return {name: getattr(self, name) for name in FEATURES}

    def map(self, fn: Callable[[Any], Any]) -> Batch:
        """fn(feature) for every feature."""
        return Batch(**{name: fn(getattr(self, name)) for name in FEATURES})

    @property
    def rows(self) -> int:
        return len(self.encoder_input_tokens)

    def model_inputs(self) -> tuple[Any, ...]:
        """The model's positional inputs (t5scale/model/mt5.py): encoder and decoder tokens,
        then their segment ids."""
        return (
            self.encoder_input_tokens,
            self.decoder_input_tokens,
            self.encoder_segment_ids,
            self.decoder_segment_ids,
        )


FEATURES = tuple(field.name for field in dataclasses.fields(Batch))
