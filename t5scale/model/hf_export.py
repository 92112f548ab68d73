"""Export t5scale parameters as a Hugging Face mT5 checkpoint: what
`MT5ForConditionalGeneration.save_pretrained` writes, without torch.

- `config.json`: an MT5Config with the model's dimensions, its vocabulary size and an untied
  `lm_head` (t5scale's; `tie_word_embeddings: false`);
- `model.safetensors` (float32), or past `max_shard_bytes` the shards
  `model-0000i-of-0000n.safetensors` with `model.safetensors.index.json`, as transformers
  names them. The tensors are hf_import's plan run backwards (the same names, shapes and
  layouts), so export and import are inverses. `shared.weight` is written once: the stacks'
  `embed_tokens` are tied to it in transformers, as save_pretrained leaves them out;
- with a SentencePiece vocabulary, the tokenizer: `spiece.model` and the config that makes it
  transformers' T5Tokenizer with the run's sentinel count (`extra_ids`), so that ids match
  seqio's (<extra_id_0> is the last id, as in mT5).

Not exported: the optimizer state (AdamW's moments, the step), which only t5scale resumes from.
"""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import numpy as np
from safetensors.numpy import save_file

from t5scale.model.hf_import import check_layout, weight_plan
from t5scale.model.sizes import ModelConfig

# transformers' own default for save_pretrained's max_shard_size (5 GB, decimal).
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9
# The files an export writes; an out_dir holding any of them already holds a model.
MODEL_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json")
TOKENIZER_FILES = ("spiece.model", "tokenizer_config.json", "special_tokens_map.json")
SHARDS = "model-*-of-*.safetensors"


def _save(tensors: dict[str, np.ndarray], path: Path, like: Path) -> None:
    """A safetensors file with the permissions of `like` (config.json, written as the user's
    files are): save_file makes it 0600, which no one else on a cluster could read."""
    save_file(tensors, str(path), metadata={"format": "pt"})  # what transformers requires
    path.chmod(like.stat().st_mode & 0o777)


def remove_export(out_dir: Path) -> list[Path]:
    """The files an earlier export wrote in `out_dir`, removed (the paths): an export over it
    must not leave them beside its own. transformers loads model.safetensors before an index,
    so an old single file beside new shards would be the model it loads."""
    paths = [out_dir / name for name in (*MODEL_FILES, *TOKENIZER_FILES)]
    removed = [path for path in [*paths, *sorted(out_dir.glob(SHARDS))] if path.is_file()]
    for path in removed:
        path.unlink()
    return removed


def hf_config(cfg: ModelConfig) -> dict[str, Any]:
    """config.json of an MT5ForConditionalGeneration with `cfg`'s dimensions."""
    return {
        "architectures": ["MT5ForConditionalGeneration"],
        "model_type": "mt5",
        "is_encoder_decoder": True,
        "vocab_size": cfg.vocab_size,
        "d_model": cfg.d_model,
        "d_ff": cfg.d_ff,
        "d_kv": cfg.d_kv,
        "num_heads": cfg.num_heads,
        "num_layers": cfg.num_encoder_layers,
        "num_decoder_layers": cfg.num_decoder_layers,
        "relative_attention_num_buckets": cfg.relative_attention_num_buckets,
        "relative_attention_max_distance": cfg.relative_attention_max_distance,
        "layer_norm_epsilon": cfg.layer_norm_epsilon,
        "feed_forward_proj": "gated-gelu",
        "dense_act_fn": "gelu_new",
        "is_gated_act": True,
        "tie_word_embeddings": False,
        "dropout_rate": 0.0,  # t5scale trains without dropout
        "initializer_factor": 1.0,
        "pad_token_id": 0,
        "eos_token_id": 1,
        "decoder_start_token_id": 0,
        "use_cache": True,
        "torch_dtype": "float32",
        "tokenizer_class": "T5Tokenizer",
    }


def hf_tensors(cfg: ModelConfig, params: dict[str, Any]) -> dict[str, np.ndarray]:
    """{HF tensor name: float32 array} of `params` (t5scale's tree, numpy or jax leaves)."""
    check_layout(cfg, params)
    tensors: dict[str, np.ndarray] = {}
    for weight in weight_plan(cfg):
        value = params
        for key in weight.path:
            value = value[key]
        value = np.asarray(value, np.float32)
        layers = [value] if weight.layers is None else list(value)
        for name, layer in zip(weight.hf_names(), layers, strict=True):
            tensor = np.ascontiguousarray(weight.to_hf(layer))
            assert tensor.shape == weight.hf_shape, (name, tensor.shape)
            tensors[name] = tensor
    return tensors


def _shards(tensors: dict[str, np.ndarray], max_bytes: int) -> list[dict[str, np.ndarray]]:
    """Tensors in order, a new shard whenever the next one would pass `max_bytes` (one tensor
    larger than that is a shard of its own), as transformers splits them."""
    shards: list[dict[str, np.ndarray]] = [{}]
    size = 0
    for name, tensor in tensors.items():
        if shards[-1] and size + tensor.nbytes > max_bytes:
            shards.append({})
            size = 0
        shards[-1][name] = tensor
        size += tensor.nbytes
    return shards


def write_model(
    out_dir: Path, cfg: ModelConfig, params: dict[str, Any], max_shard_bytes: int
) -> list[Path]:
    """config.json and the safetensors file(s) of `params` in `out_dir`; the files written."""
    out_dir.mkdir(parents=True, exist_ok=True)
    tensors = hf_tensors(cfg, params)
    config_path = out_dir / "config.json"
    config_path.write_text(json.dumps(hf_config(cfg), indent=2) + "\n", encoding="utf-8")
    shards = _shards(tensors, max_shard_bytes)
    if len(shards) == 1:
        path = out_dir / "model.safetensors"
        _save(tensors, path, like=config_path)
        return [config_path, path]
    written, weight_map = [config_path], {}
    for index, shard in enumerate(shards, start=1):
        path = out_dir / f"model-{index:05d}-of-{len(shards):05d}.safetensors"  # SHARDS
        _save(shard, path, like=config_path)
        weight_map |= dict.fromkeys(shard, path.name)
        written.append(path)
    index_path = out_dir / "model.safetensors.index.json"
    total = sum(tensor.nbytes for tensor in tensors.values())
    index_path.write_text(
        json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map}, indent=2) + "\n",
        encoding="utf-8",
    )
    return [*written, index_path]


def write_tokenizer(out_dir: Path, vocabulary: str, extra_ids: int) -> list[Path]:
    """The SentencePiece model as transformers' T5Tokenizer loads it, with `extra_ids`
    sentinels after its pieces (seqio's SentencePieceVocabulary numbers them alike)."""
    spiece = out_dir / "spiece.model"
    shutil.copyfile(vocabulary, spiece)
    sentinels = [f"<extra_id_{i}>" for i in range(extra_ids)]
    special = {"eos_token": "</s>", "unk_token": "<unk>", "pad_token": "<pad>",
               "additional_special_tokens": sentinels}  # fmt: skip
    tokenizer_config = {"tokenizer_class": "T5Tokenizer", "extra_ids": extra_ids,
                        "model_max_length": 1_000_000_000, **special}  # fmt: skip
    written = []
    for name, content in (("tokenizer_config.json", tokenizer_config),
                          ("special_tokens_map.json", special)):  # fmt: skip
        path = out_dir / name
        path.write_text(json.dumps(content, indent=2) + "\n", encoding="utf-8")
        written.append(path)
    return [spiece, *written]


def hf_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """{HF tensor name: shape} of what an export of `cfg` writes."""
    return {name: w.hf_shape for w in weight_plan(cfg) for name in w.hf_names()}


def parameter_count(cfg: ModelConfig) -> int:
    """Parameters of the exported model: every tensor written (shared once)."""
    return sum(math.prod(shape) for shape in hf_shapes(cfg).values())


def parse_size(text: str) -> int:
    """'5GB', '100KB', '2GiB' or a plain byte count → bytes (transformers' units: KB = 1000)."""
    units = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30}  # fmt: skip
    number = text.strip().upper().rstrip("BIKMG")
    unit = text.strip().upper()[len(number) :]
    try:
        value = float(number) * units[unit]
    except (ValueError, KeyError):
        raise ValueError(
            f"max_shard_size: expected e.g. 5GB, 100MB or 2GiB, got {text!r}"
        ) from None
    if value < 1:
        raise ValueError(f"max_shard_size must be positive, got {text!r}")
    return int(value)
