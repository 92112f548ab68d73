"""mT5 model sizes: the configuration dataclass, the published presets and parameter counts.

The presets are the dimensions of the released mT5 checkpoints (T5 v1.1 architecture, vocabulary
of 250,112 SentencePiece pieces). `gin/models/<name>.gin` binds the same numbers for the CLI; a
test keeps the two in step.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

RematPolicy = Literal["none", "minimal", "full"]
DType = Literal["float32", "bfloat16"]


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions and numerics of one encoder-decoder model."""

    name: str = "mt5_tiny"
    vocab_size: int = 4096
    d_model: int = 64
    d_ff: int = 128
    num_heads: int = 4
    d_kv: int = 16
    num_encoder_layers: int = 2
    num_decoder_layers: int = 2
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    # Activations and matmuls run in `dtype`; parameters (and so gradients and optimizer state)
    # are kept in float32.
    dtype: DType = "float32"
    remat: RematPolicy = "none"

    def __post_init__(self) -> None:
        if self.remat not in ("none", "minimal", "full"):
            raise ValueError(f"ModelConfig.remat must be none, minimal or full, got {self.remat!r}")
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ModelConfig.dtype must be float32 or bfloat16, got {self.dtype!r}")
        for field in ("vocab_size", "d_model", "d_ff", "num_heads", "d_kv"):
            if getattr(self, field) < 1:
                raise ValueError(f"ModelConfig.{field} must be positive")


def _mt5(name: str, d_model: int, d_ff: int, num_heads: int, layers: int) -> ModelConfig:
    return ModelConfig(
        name=name,
        vocab_size=250112,
        d_model=d_model,
        d_ff=d_ff,
        num_heads=num_heads,
        d_kv=64,
        num_encoder_layers=layers,
        num_decoder_layers=layers,
    )


PRESETS: dict[str, ModelConfig] = {
    "mt5_tiny": ModelConfig(),
    "mt5_small": _mt5("mt5_small", d_model=512, d_ff=1024, num_heads=6, layers=8),
    "mt5_base": _mt5("mt5_base", d_model=768, d_ff=2048, num_heads=12, layers=12),
    "mt5_large": _mt5("mt5_large", d_model=1024, d_ff=2816, num_heads=16, layers=24),
    "mt5_xl": _mt5("mt5_xl", d_model=2048, d_ff=5120, num_heads=32, layers=24),
    "mt5_xxl": _mt5("mt5_xxl", d_model=4096, d_ff=10240, num_heads=64, layers=24),
}


def preset(name: str) -> ModelConfig:
    """The published configuration called `name` (mt5_tiny … mt5_xxl)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def parameter_breakdown(params_shapes) -> dict[str, int]:
    """Parameter count per top-level part ('encoder', 'decoder', 'shared', …) of a params tree.

    Works on abstract shapes (jax.ShapeDtypeStruct), so nothing is allocated.
    """
    import jax

    counts: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params_shapes)[0]:
        part = "/".join(str(getattr(key, "key", key)) for key in path[:2])
        counts[part] = counts.get(part, 0) + math.prod(leaf.shape)
    return counts
