"""How model state is kept: fp32 throughout, or DeepSpeed's mixed precision.

Mixed precision, as DeepSpeed's ZeRO keeps it:

- the parameters the forward and backward passes use are a 16-bit (bf16) working copy, laid out
  as the stage says (whole at stages 0-2, sharded at 3);
- their gradients come out in bf16 and are reduced (all-reduce at stages 0-1, reduce-scatter at
  2-3) and accumulated over micro-batches in bf16, in the gradients' layout; `reduce_dtype`
  float32 reduces and accumulates them in fp32 instead;
- the optimizer state holds the fp32 master parameters beside Adam's two moments, sharded over
  `zero` from stage 1. The update runs on the fp32 shard; the new bf16 working copy is cast from
  it (and, at stages 1-2, all-gathered in bf16).

Per device that is 2Ψ + 2Ψ + 12Ψ bytes of model state before the stage divides it (Ψ
parameters): DeepSpeed's 16Ψ, 4Ψ + 12Ψ/N, 2Ψ + 14Ψ/N and 16Ψ/N for stages 0-3. The fp32 mode
keeps fp32 parameters and gradients and no separate master (4Ψ + 4Ψ + 8Ψ with AdamW), for exact
numerics; its compute may still run in bf16 (ModelConfig.dtype).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import flax.struct
import jax
import jax.numpy as jnp

from t5scale.errors import check_field_types

MODES = ("auto", "float32", "mixed", "fp8")
REDUCE_DTYPES = ("bfloat16", "float32")


@dataclasses.dataclass(frozen=True)
class PrecisionConfig:
    """mode: 'mixed' (DeepSpeed's layout, above), 'float32' (fp32 parameters, gradients and
    optimizer state), 'fp8' (mixed, with the layers' matmuls as FP8 GEMMs: t5scale/train/fp8.py),
    or 'auto': mixed when ModelConfig.dtype is bfloat16, else float32.
    reduce_dtype: in mixed mode, the dtype gradients are reduced and accumulated in.
    fp8_amax_history: in fp8 mode, the steps of amax each FP8 scale is made from (delayed
    scaling; 1,024 as Transformer Engine's and flax's default)."""

    mode: str = "auto"
    reduce_dtype: str = "bfloat16"
    fp8_amax_history: int = 1024

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.mode not in MODES:
            raise ValueError(f"PrecisionConfig.mode must be one of {MODES}, got {self.mode!r}")
        if self.reduce_dtype not in REDUCE_DTYPES:
            raise ValueError(
                f"PrecisionConfig.reduce_dtype must be one of {REDUCE_DTYPES}, "
                f"got {self.reduce_dtype!r}"
            )
        if self.fp8_amax_history < 1:
            raise ValueError(
                "PrecisionConfig.fp8_amax_history must be >= 1 (the steps each FP8 scale is made "
                f"from), got {self.fp8_amax_history}"
            )


@dataclasses.dataclass(frozen=True)
class Precision:
    """The dtypes of model state for one run (from PrecisionConfig and the compute dtype)."""

    mixed: bool
    param_dtype: Any  # the parameters the model computes with (the working copy when mixed)
    grad_dtype: Any  # the gradients as reduced and accumulated
    fp8: bool = False  # mixed, with FP8 GEMMs for the layers' matmuls

    @property
    def name(self) -> str:
        return "fp8" if self.fp8 else "mixed" if self.mixed else "float32"


FLOAT32 = Precision(False, jnp.dtype(jnp.float32), jnp.dtype(jnp.float32))


def resolve(config: PrecisionConfig, compute_dtype: str) -> Precision:
    """A ValueError where the two disagree: mixed precision (and fp8's) computes in bf16."""
    if config.mode == "fp8" and compute_dtype != "bfloat16":
        raise ValueError(
            "PrecisionConfig.mode='fp8' runs the rest of the model in bf16: set "
            "ModelConfig.dtype='bfloat16' (gin/precision/fp8.gin does both)"
        )
    mixed = config.mode in ("mixed", "fp8") or (
        config.mode == "auto" and compute_dtype == "bfloat16"
    )
    if mixed and compute_dtype != "bfloat16":
        raise ValueError(
            "PrecisionConfig.mode='mixed' computes with a bf16 working copy: set "
            "ModelConfig.dtype='bfloat16' (gin/precision/mixed.gin does both)"
        )
    if not mixed:
        return FLOAT32
    bf16, reduced = jnp.dtype(jnp.bfloat16), jnp.dtype(config.reduce_dtype)
    return Precision(True, bf16, reduced, fp8=config.mode == "fp8")


class MasterState(flax.struct.PyTreeNode):
    """The optimizer state in mixed precision: the fp32 master parameters and the optimizer's
    own state (Adam's moments), both updated on the master, both laid out as optimizer state."""

    master: Any
    inner: Any


def cast(tree: Any, dtype) -> Any:
    return jax.tree.map(lambda leaf: leaf.astype(dtype), tree)
