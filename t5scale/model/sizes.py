"""mT5 model sizes: the configuration dataclass and the published sizes, in one place.

The sizes are the dimensions of the released mT5 checkpoints (T5 v1.1 architecture, vocabulary
of 250,112 SentencePiece pieces), plus mt5_tiny for tests and quick runs. `ModelConfig(name=...)`
takes a size's dimensions; gin/models/<name>.gin only names it, so the numbers live here alone.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal, get_args

import jax

from t5scale.errors import ConfigError, check_field_types

RematPolicy = Literal["dots", "minimal", "full", "auto"]
# Cheapest first: what `remat = 'auto'` tries until the compiled step fits (t5scale/train/setup.py).
REMAT_LADDER: tuple[str, ...] = ("dots", "minimal", "full")
# Policies by an earlier name: refused as input, read as the new name in files written before
# (results.jsonl, step_analysis.json, a checkpoint's run). 'none' was never "no remat".
RENAMED_REMATS = {"none": "dots"}
DType = Literal["float32", "bfloat16"]
AttentionKind = Literal["dot", "fused", "fused_reference", "auto"]
ATTENTION_KINDS: tuple[str, ...] = get_args(AttentionKind)


def _mt5(d_model: int, d_ff: int, num_heads: int, layers: int) -> dict[str, int]:
    return {
        "vocab_size": 250112, "d_model": d_model, "d_ff": d_ff, "num_heads": num_heads,
        "d_kv": 64, "num_encoder_layers": layers, "num_decoder_layers": layers,
    }  # fmt: skip


SIZES: dict[str, dict[str, int]] = {
    "mt5_tiny": {
        "vocab_size": 4096,
        "d_model": 64,
        "d_ff": 128,
        "num_heads": 4,
        "d_kv": 16,
        "num_encoder_layers": 2,
        "num_decoder_layers": 2,
    },  # fmt: skip
    "mt5_small": _mt5(d_model=512, d_ff=1024, num_heads=6, layers=8),
    "mt5_base": _mt5(d_model=768, d_ff=2048, num_heads=12, layers=12),
    "mt5_large": _mt5(d_model=1024, d_ff=2816, num_heads=16, layers=24),
    "mt5_xl": _mt5(d_model=2048, d_ff=5120, num_heads=32, layers=24),
    "mt5_xxl": _mt5(d_model=4096, d_ff=10240, num_heads=64, layers=24),
}

DIMENSIONS = tuple(SIZES["mt5_tiny"])  # what a size fixes, and a custom model must give


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """Dimensions and numerics of one encoder-decoder model.

    `name` picks a size of SIZES; each dimension left unset (None) comes from it, and one set
    here overrides the size's. A custom model says so explicitly: a name of its own and every
    dimension (a misspelt size must not train another model).
    """

    name: str = "mt5_tiny"
    vocab_size: int | None = None
    d_model: int | None = None
    d_ff: int | None = None
    num_heads: int | None = None
    d_kv: int | None = None
    num_encoder_layers: int | None = None
    num_decoder_layers: int | None = None
    relative_attention_num_buckets: int = 32
    relative_attention_max_distance: int = 128
    layer_norm_epsilon: float = 1e-6
    # Activations and matmuls run in `dtype`. How parameters, gradients and optimizer state are
    # kept is PrecisionConfig's (t5scale/train/precision.py): fp32, or with bf16 compute by
    # default DeepSpeed's mixed precision (a bf16 working copy, an fp32 master).
    dtype: DType = "float32"
    # What the layers keep for the backward pass (t5scale/model/mt5.py, remat_policy): 'dots'
    # every matmul's output, 'minimal' fewer, 'full' nothing; 'auto': the first of REMAT_LADDER
    # whose compiled step fits the device, chosen at compile time.
    remat: RematPolicy = "dots"
    # Target tokens per chunk of the output projection and loss (t5scale/model/head.py): None
    # chooses (a 256 MiB block of logits), 0 takes all tokens at once (the untiled reference).
    loss_chunk_tokens: int | None = None
    # The dtype the output projection's GEMM writes the logits in (t5scale/model/head.py):
    # 'float32' (as t5x's mT5 network), or in bf16 compute 'bfloat16', as MaxText's default (the
    # loss is computed from them in fp32 either way): half the bytes of the head's largest
    # array, written once and read twice, for logits rounded to bf16's 8 bits.
    logits_dtype: DType = "float32"
    # The output projection and the loss's reduction over the vocabulary in one kernel
    # (t5scale/model/head_kernel.py: the fp32 logits are never written, 6 bytes of traffic a
    # logit instead of 14) on GPUs, where tensor parallelism does not split the vocabulary;
    # elsewhere (and in the eval step, and with loss_chunk_tokens 0 on the dense path), or
    # False, XLA's GEMM and reductions (logits_dtype applies to those alone).
    head_kernel: bool = False
    # How attention is computed (t5scale/model/mt5.py): 'dot', einsums and a softmax over the
    # [batch, heads, q, k] scores; 'fused', one kernel per pass that never forms them
    # (t5scale/model/attention_kernels.py, by Triton on GPUs; attention_tpu.py, by Mosaic on
    # TPUs; Pallas's interpreter of the Triton kernels without a mesh on other devices);
    # 'fused_reference', the fused route (segment ids
    # in place of masks, each device's heads: t5scale/parallel/attention.py) with the kernels'
    # arithmetic as einsums in their place (t5scale/model/attention_reference.py), which is what
    # 'fused' becomes where the step is built for devices the kernels do not compile for (CPUs:
    # `attention_for`); 'auto', fused on GPUs and TPUs in bf16, dot elsewhere, decided there too
    # (docs/attention.md: what one H200 measured of each, 2026-11-27).
    attention: AttentionKind = "auto"
    # The layers as one loop (True: compile time does not grow with depth) or unrolled (False:
    # XLA:GPU then needs a quarter fewer copies and fusions around the layers' GEMMs, at about
    # six times the compile time; docs/benchmarks.md, "The layer loop"). Parameters are stacked
    # on a leading layer axis either way, so checkpoints do not depend on it.
    scan_layers: bool = True
    # FP8 GEMMs for the layers' matmuls (t5scale/model/mt5.py, `Matmul`) with delayed scaling
    # over this many steps of amax history; None: the matmuls run in `dtype`. Set by the run from
    # PrecisionConfig (mode 'fp8', gin/precision/fp8.gin), not by hand.
    fp8_amax_history: int | None = None

    def __post_init__(self) -> None:
        # before the type check, whose line would not say what the old name became
        if isinstance(self.remat, str) and self.remat in RENAMED_REMATS:
            raise ConfigError(
                f"ModelConfig.remat {self.remat!r} is now {RENAMED_REMATS[self.remat]!r} (it "
                "keeps the matmuls' outputs and recomputes the elementwise work); 'full' and "
                "'minimal' recompute more"
            )
        check_field_types(self)
        size = SIZES.get(self.name)
        if size is None:
            size = dict.fromkeys(DIMENSIONS)
            missing = [field for field in DIMENSIONS if getattr(self, field) is None]
            if missing:
                raise ValueError(
                    f"ModelConfig.name {self.name!r} is not a known size ({', '.join(SIZES)}); "
                    f"a custom model gives every dimension, missing: {', '.join(missing)}"
                )
        for field, value in size.items():
            if getattr(self, field) is None:
                object.__setattr__(self, field, value)
        if self.remat not in (*REMAT_LADDER, "auto"):
            raise ValueError(
                f"ModelConfig.remat must be dots, minimal, full or auto, got {self.remat!r}"
            )
        if self.loss_chunk_tokens is not None and self.loss_chunk_tokens < 0:
            raise ValueError(
                f"ModelConfig.loss_chunk_tokens must be None, 0 or positive, got "
                f"{self.loss_chunk_tokens}"
            )
        if self.attention not in ATTENTION_KINDS:
            raise ValueError(
                f"ModelConfig.attention must be dot, fused, fused_reference or auto, got "
                f"{self.attention!r}"
            )
        if self.fp8_amax_history is not None and self.fp8_amax_history < 1:
            raise ValueError(
                f"ModelConfig.fp8_amax_history must be None or >= 1, got {self.fp8_amax_history}"
            )
        if self.dtype not in ("float32", "bfloat16"):
            raise ValueError(f"ModelConfig.dtype must be float32 or bfloat16, got {self.dtype!r}")
        if self.logits_dtype not in ("float32", self.dtype):
            raise ValueError(
                f"ModelConfig.logits_dtype must be float32 or the compute dtype "
                f"(ModelConfig.dtype, {self.dtype}), got {self.logits_dtype!r}"
            )
        for field in DIMENSIONS:
            value = getattr(self, field)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"ModelConfig.{field} must be a positive integer, got {value!r}")
        if self.head_kernel and self.d_model % 16:  # Triton's dot: an inner step of >= 16
            raise ValueError(
                f"ModelConfig.head_kernel needs d_model a multiple of 16, got {self.d_model}"
            )
        self._check_numerics()

    @property
    def fused_route(self) -> bool:
        """Whether attention takes the fused route ('fused' or 'fused_reference'): segment ids
        in place of a [batch, q, k] mask, and the `attend` hook in place of the einsums."""
        return self.attention in ("fused", "fused_reference")

    def _check_numerics(self) -> None:
        buckets, distance = (
            self.relative_attention_num_buckets,
            self.relative_attention_max_distance,
        )
        # Half the buckets are exact offsets, the rest log-spaced up to max_distance (mt5.py).
        if buckets < 2:
            raise ValueError(
                f"ModelConfig.relative_attention_num_buckets must be >= 2, got {buckets}"
            )
        if distance <= buckets // 2:
            raise ValueError(
                f"ModelConfig.relative_attention_max_distance must be > num_buckets // 2 "
                f"({buckets // 2}), got {distance}"
            )
        if not self.layer_norm_epsilon > 0:
            raise ValueError(
                f"ModelConfig.layer_norm_epsilon must be > 0, got {self.layer_norm_epsilon}"
            )


PRESETS: dict[str, ModelConfig] = {name: ModelConfig(name=name) for name in SIZES}


def preset(name: str) -> ModelConfig:
    """The published configuration called `name` (mt5_tiny … mt5_xxl)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; known: {', '.join(PRESETS)}")
    return PRESETS[name]


def parameter_breakdown(params_shapes) -> dict[str, int]:
    """Parameter count per top-level part ('encoder', 'decoder', 'shared', …) of a params tree.

    Works on abstract shapes (jax.ShapeDtypeStruct), so nothing is allocated.
    """
    counts: dict[str, int] = {}
    for path, leaf in jax.tree_util.tree_flatten_with_path(params_shapes)[0]:
        part = "/".join(str(getattr(key, "key", key)) for key in path[:2])
        counts[part] = counts.get(part, 0) + math.prod(leaf.shape)
    return counts


def attention_for(model: ModelConfig, fused_kernels: bool) -> ModelConfig:
    """`model` with its attention named as its compile target runs it: 'auto' is 'fused' where
    the fused kernels compile (GPUs, TPUs) and the compute is bf16, 'dot' elsewhere (the kernels'
    fp32, exact where the einsums' is TF32, ran 48× slower on an H200: docs/attention.md);
    'fused' where they do not compile is 'fused_reference' (the fused route, with the
    kernels' arithmetic as einsums)."""
    if model.attention == "auto":
        fused = fused_kernels and model.dtype == "bfloat16"
        return dataclasses.replace(model, attention="fused" if fused else "dot")
    if model.attention == "fused" and not fused_kernels:
        return dataclasses.replace(model, attention="fused_reference")
    return model
