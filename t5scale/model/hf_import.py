"""Import Hugging Face mT5 checkpoints (config.json + safetensors) as t5scale parameters.

The checkpoint is what `MT5ForConditionalGeneration.save_pretrained` writes: `config.json` and
either `model.safetensors` or shards listed in `model.safetensors.index.json`. Tensors are read
with safetensors' numpy API one at a time (no torch), converted to float32 and laid out as
`mt5.MT5` declares its parameters:

- torch Linear weights are [out, in]; t5scale keeps [in, out], with attention projections split
  into heads: q/k/v [h*k, d] -> [d, h, k] and o [d, h*k] -> [h, k, d] (HF's head-major order);
- per-layer weights are stacked on a leading layer axis (the layers run under nn.scan);
- the relative position bias, which HF stores in block 0 of each stack as [buckets, heads], is
  t5scale's one table per stack, [heads, buckets];
- `shared` is the input embedding of both stacks, `lm_head` the untied output projection.

The numerics already agree with HF's MT5: no 1/sqrt(d_kv) on the attention logits, RMS norm
with a scale only, tanh-approximated GELU in the gated feed-forward, the same position buckets.

Tying. transformers >= 5 writes `tie_word_embeddings: true` into every mT5 config.json and ties
`lm_head` to `shared` only when the checkpoint has no `lm_head.weight` (and never rescales the
decoder output); transformers 4 honoured the flag (tied, and the decoder output scaled by
d_model**-0.5). t5scale's lm_head is untied, so a tied checkpoint is rejected: by the config
when it was written by transformers < 5, and by the tensors (no `lm_head.weight`, or one equal
to `shared.weight`) otherwise.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy, so bf16 checkpoints load)
import numpy as np
from safetensors import SafetensorError, safe_open

from t5scale.model.mt5 import EMBEDDING, LM_HEAD, abstract_params
from t5scale.model.sizes import ModelConfig

# feed_forward_proj values whose activation is GELU's tanh approximation, t5scale's only one
# (transformers maps "gated-gelu" to gelu_new; gelu_pytorch_tanh is the same function).
_GATED_TANH_GELU = ("gated-gelu", "gated-gelu_new", "gated-gelu_pytorch_tanh")

# Tensors a checkpoint may hold that t5scale does not need: the stacks' embeddings alias
# `shared` (checked equal to it), and transformers itself ignores a cross-attention relative
# bias that old checkpoints carry (MT5's cross-attention has no position bias).
_ALIASES_OF_SHARED = ("encoder.embed_tokens.weight", "decoder.embed_tokens.weight")
_IGNORED = ("decoder.block.0.layer.1.EncDecAttention.relative_attention_bias.weight",)


def _field(config_json: dict[str, Any], name: str, default: Any = None) -> Any:
    value = config_json.get(name, default)
    if value is None:
        raise ValueError(f"HF config: {name} is missing")
    return value


def _positive_int(config_json: dict[str, Any], name: str, default: int | None = None) -> int:
    value = _field(config_json, name, default)
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"HF config: {name} must be a positive integer, got {value!r}")
    return value


def _written_by_transformers_4_or_older(config_json: dict[str, Any]) -> bool:
    version = str(config_json.get("transformers_version", "0"))
    try:
        return int(version.split(".")[0]) < 5
    except ValueError:
        return True


def model_config_from_hf(
    config_json: dict[str, Any], dtype: str = "float32", name: str = "hf_mt5"
) -> ModelConfig:
    """t5scale's ModelConfig for an HF MT5Config (config.json); ValueError if not representable.

    `dtype` is t5scale's compute dtype (parameters are float32 either way).
    """
    model_type = config_json.get("model_type")
    if model_type != "mt5":
        raise ValueError(f"HF config: model_type must be 'mt5', got {model_type!r}")
    if not config_json.get("is_encoder_decoder", True):
        raise ValueError("HF config: is_encoder_decoder is false; t5scale is an encoder-decoder")
    if config_json.get("is_decoder", False):
        raise ValueError("HF config: is_decoder is true; t5scale needs the encoder-decoder model")
    feed_forward = config_json.get("feed_forward_proj", "gated-gelu")
    if feed_forward not in _GATED_TANH_GELU:
        raise ValueError(
            f"HF config: feed_forward_proj {feed_forward!r} is not supported; t5scale has only "
            "the gated tanh-GELU feed-forward ('gated-gelu')"
        )
    if config_json.get("tie_word_embeddings", False) and _written_by_transformers_4_or_older(
        config_json
    ):
        raise ValueError(
            "HF config: tie_word_embeddings is true (lm_head tied to shared, decoder output "
            "scaled by d_model**-0.5); t5scale has an untied lm_head"
        )
    num_layers = _positive_int(config_json, "num_layers")
    decoder_layers = config_json.get("num_decoder_layers")
    return ModelConfig(
        name=name,
        vocab_size=_positive_int(config_json, "vocab_size"),
        d_model=_positive_int(config_json, "d_model"),
        d_ff=_positive_int(config_json, "d_ff"),
        num_heads=_positive_int(config_json, "num_heads"),
        d_kv=_positive_int(config_json, "d_kv"),
        num_encoder_layers=num_layers,
        num_decoder_layers=num_layers
        if decoder_layers is None
        else _positive_int(config_json, "num_decoder_layers"),
        relative_attention_num_buckets=_positive_int(
            config_json, "relative_attention_num_buckets", 32
        ),
        relative_attention_max_distance=_positive_int(
            config_json, "relative_attention_max_distance", 128
        ),
        layer_norm_epsilon=float(_field(config_json, "layer_norm_epsilon", 1e-6)),
        dtype=dtype,  # type: ignore[arg-type]  (ModelConfig checks it)
    )


Layout = Callable[[np.ndarray], np.ndarray]


@dataclass(frozen=True)
class Weight:
    """One t5scale parameter: where it goes, which HF tensor(s) fill it and how (both ways)."""

    path: tuple[str, ...]  # in the t5scale params tree
    hf_name: str  # with "{i}" for the layer index when stacked
    hf_shape: tuple[int, ...]  # of each HF tensor
    layouts: tuple[Layout, Layout]  # HF tensor -> t5scale's layout, and back
    layers: int | None = None  # stacked over this many layers, else a single tensor

    def hf_names(self) -> list[str]:
        if self.layers is None:
            return [self.hf_name]
        return [self.hf_name.format(i=i) for i in range(self.layers)]

    def convert(self, hf_tensor: np.ndarray) -> np.ndarray:
        return self.layouts[0](hf_tensor)

    def to_hf(self, value: np.ndarray) -> np.ndarray:
        return self.layouts[1](value)


def _same(weight: np.ndarray) -> np.ndarray:
    return weight


def _transpose(weight: np.ndarray) -> np.ndarray:
    return weight.T


def weight_plan(cfg: ModelConfig) -> list[Weight]:
    """Every t5scale parameter with its HF source, for MT5ForConditionalGeneration's names."""
    d, f, h, k = cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.d_kv
    same, transpose = (_same, _same), (_transpose, _transpose)
    # q, k, v: [h*k, d] <-> [d, h, k]; o: [d, h*k] <-> [h, k, d] (HF's head-major order)
    to_heads = (lambda w: w.T.reshape(d, h, k), lambda w: w.reshape(d, h * k).T)
    from_heads = (lambda w: w.T.reshape(h, k, d), lambda w: w.reshape(h * k, d).T)

    def attention(path: tuple[str, ...], hf: str, layers: int) -> list[Weight]:
        return [
            Weight((*path, "query"), f"{hf}.q.weight", (h * k, d), to_heads, layers),
            Weight((*path, "key"), f"{hf}.k.weight", (h * k, d), to_heads, layers),
            Weight((*path, "value"), f"{hf}.v.weight", (h * k, d), to_heads, layers),
            Weight((*path, "out"), f"{hf}.o.weight", (d, h * k), from_heads, layers),
        ]

    def mlp(path: tuple[str, ...], hf: str, layers: int) -> list[Weight]:
        return [
            Weight((*path, "wi_0"), f"{hf}.wi_0.weight", (f, d), transpose, layers),
            Weight((*path, "wi_1"), f"{hf}.wi_1.weight", (f, d), transpose, layers),
            Weight((*path, "wo"), f"{hf}.wo.weight", (d, f), transpose, layers),
        ]

    def norm(path: tuple[str, ...], hf: str, layers: int | None = None) -> Weight:
        return Weight((*path, "scale"), f"{hf}.weight", (d,), same, layers)

    def relpos(stack: str) -> Weight:
        return Weight(
            (stack, "relpos_bias", "rel_embedding"),
            f"{stack}.block.0.layer.0.SelfAttention.relative_attention_bias.weight",
            (cfg.relative_attention_num_buckets, h),
            transpose,
        )

    enc, enc_layers = ("encoder", "layers"), cfg.num_encoder_layers
    dec, dec_layers = ("decoder", "layers"), cfg.num_decoder_layers
    eb, db = "encoder.block.{i}.layer", "decoder.block.{i}.layer"
    return [
        Weight((EMBEDDING,), "shared.weight", (cfg.vocab_size, d), same),
        Weight((LM_HEAD,), "lm_head.weight", (cfg.vocab_size, d), transpose),
        relpos("encoder"),
        norm((*enc, "pre_attention_norm"), f"{eb}.0.layer_norm", enc_layers),
        *attention((*enc, "attention"), f"{eb}.0.SelfAttention", enc_layers),
        norm((*enc, "pre_mlp_norm"), f"{eb}.1.layer_norm", enc_layers),
        *mlp((*enc, "mlp"), f"{eb}.1.DenseReluDense", enc_layers),
        norm(("encoder", "final_norm"), "encoder.final_layer_norm"),
        relpos("decoder"),
        norm((*dec, "pre_self_attention_norm"), f"{db}.0.layer_norm", dec_layers),
        *attention((*dec, "self_attention"), f"{db}.0.SelfAttention", dec_layers),
        norm((*dec, "pre_cross_attention_norm"), f"{db}.1.layer_norm", dec_layers),
        *attention((*dec, "cross_attention"), f"{db}.1.EncDecAttention", dec_layers),
        norm((*dec, "pre_mlp_norm"), f"{db}.2.layer_norm", dec_layers),
        *mlp((*dec, "mlp"), f"{db}.2.DenseReluDense", dec_layers),
        norm(("decoder", "final_norm"), "decoder.final_layer_norm"),
    ]


def _json_object(path: Path) -> dict[str, Any]:
    """The JSON object in `path`, or a ValueError that names the file."""
    try:
        value = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise ValueError(f"{path}: not valid JSON ({error})") from None
    if not isinstance(value, dict):
        raise ValueError(f"{path}: expected a JSON object, got {type(value).__name__}")
    return value


def _checkpoint_files(model_dir: Path) -> list[Path]:
    single = model_dir / "model.safetensors"
    index = model_dir / "model.safetensors.index.json"
    if single.is_file():
        return [single]
    if index.is_file():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict) or not all(
            isinstance(name, str) for name in weight_map.values()
        ):
            raise ValueError(f"{index}: no weight_map of tensor names to shard files")
        return [model_dir / name for name in sorted(set(weight_map.values()))]
    raise ValueError(
        f"{model_dir}: neither model.safetensors nor model.safetensors.index.json "
        "(only safetensors checkpoints are read)"
    )


@contextlib.contextmanager
def _open_tensors(model_dir: Path) -> Iterator[dict[str, Any]]:
    """{tensor name: the open safetensors file that holds it}, over all shards."""
    with contextlib.ExitStack() as stack:
        where: dict[str, Any] = {}
        for path in _checkpoint_files(model_dir):
            if not path.is_file():
                raise ValueError(f"{path}: shard listed in the index is missing")
            try:
                handle = stack.enter_context(safe_open(str(path), framework="np"))
            except SafetensorError as error:
                raise ValueError(f"{path}: not a safetensors file ({error})") from None
            for name in handle.keys():
                if name in where:
                    raise ValueError(f"{model_dir}: tensor {name} is in more than one shard")
                where[name] = handle
        yield where


def _short_list(names: list[str], limit: int = 5) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def _read(where: dict[str, Any], name: str, shape: tuple[int, ...]) -> np.ndarray:
    tensor = where[name].get_tensor(name)
    if tuple(tensor.shape) != shape:
        raise ValueError(f"HF tensor {name} has shape {tuple(tensor.shape)}, expected {shape}")
    return np.asarray(tensor, dtype=np.float32)


def _set(tree: dict[str, Any], path: tuple[str, ...], value: np.ndarray) -> None:
    for key in path[:-1]:
        tree = tree.setdefault(key, {})
    tree[path[-1]] = value


def check_layout(cfg: ModelConfig, params: dict[str, Any]) -> None:
    """The tree must be exactly the model's: same paths, same shapes (guards model changes)."""
    expected = jax.tree_util.tree_flatten_with_path(nn.meta.unbox(abstract_params(cfg)))[0]
    got = jax.tree_util.tree_flatten_with_path(params)[0]
    want = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in expected}
    have = {jax.tree_util.keystr(p): tuple(x.shape) for p, x in got}
    if want != have:
        diff = sorted(set(want.items()) ^ set(have.items()))
        raise RuntimeError(f"hf_import does not lay out t5scale's parameters: {diff[:5]}")


def params_from_hf(
    model_dir: str | Path, dtype: str = "float32"
) -> tuple[ModelConfig, dict[str, Any]]:
    """Read an HF mT5 checkpoint directory: t5scale's ModelConfig and float32 params (numpy).

    `dtype` is the ModelConfig's compute dtype; the params are float32 whatever the checkpoint's.
    The params have exactly the structure and shapes of `nn.meta.unbox(abstract_params(cfg))`.
    ValueError (one line) for a config t5scale cannot represent, or a missing, unexpected or
    mis-shaped tensor.
    """
    model_dir = Path(model_dir)
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        raise ValueError(f"{model_dir}: no config.json")
    cfg = model_config_from_hf(_json_object(config_path), dtype)
    plan = weight_plan(cfg)
    with _open_tensors(model_dir) as where:
        wanted = [name for weight in plan for name in weight.hf_names()]
        missing = [name for name in wanted if name not in where]
        if missing == ["lm_head.weight"]:
            raise ValueError(
                "HF checkpoint has no lm_head.weight: its output projection is tied to "
                "shared.weight, and t5scale's lm_head is untied"
            )
        if missing:
            raise ValueError(f"HF checkpoint is missing {len(missing)}: {_short_list(missing)}")
        known = set(wanted) | set(_ALIASES_OF_SHARED) | set(_IGNORED)
        unexpected = sorted(name for name in where if name not in known)
        if unexpected:
            raise ValueError(
                f"HF checkpoint has {len(unexpected)} tensors t5scale has no place for: "
                f"{_short_list(unexpected)}"
            )

        params: dict[str, Any] = {}
        for weight in plan:
            if weight.layers is None:
                value = weight.convert(_read(where, weight.hf_name, weight.hf_shape))
            else:
                value = None
                for i, name in enumerate(weight.hf_names()):
                    layer = weight.convert(_read(where, name, weight.hf_shape))
                    if value is None:
                        value = np.empty((weight.layers, *layer.shape), np.float32)
                    value[i] = layer
            _set(params, weight.path, np.ascontiguousarray(value))

        shared = params[EMBEDDING]
        for alias in _ALIASES_OF_SHARED:
            if alias in where and not np.array_equal(_read(where, alias, shared.shape), shared):
                raise ValueError(
                    f"HF tensor {alias} differs from shared.weight; t5scale has one embedding"
                )
        if np.array_equal(params[LM_HEAD].T, shared):
            raise ValueError(
                "HF lm_head.weight equals shared.weight (tied output projection); "
                "t5scale's lm_head is untied"
            )
    check_layout(cfg, params)
    return cfg, params
