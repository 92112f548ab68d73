"""Hugging Face mT5 checkpoints imported into t5scale give transformers' logits."""

import json
import shutil
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cli_in_process

from t5scale.model.hf_import import model_config_from_hf, params_from_hf
from t5scale.model.mt5 import MT5

VOCAB, D_MODEL, D_FF, HEADS, D_KV = 512, 64, 128, 4, 16
ENCODER_LAYERS, DECODER_LAYERS = 2, 3
BATCH, INPUT_LENGTH, TARGET_LENGTH = 3, 24, 20
ENCODER_PADDING = (0, 7, 15)  # pad tokens at the end of each encoder row


def _hf_config_json(**overrides) -> dict:
    config = {
        "model_type": "mt5",
        "transformers_version": "5.0.0",
        "is_encoder_decoder": True,
        "vocab_size": VOCAB,
        "d_model": D_MODEL,
        "d_ff": D_FF,
        "num_heads": HEADS,
        "d_kv": D_KV,
        "num_layers": ENCODER_LAYERS,
        "num_decoder_layers": DECODER_LAYERS,
        "relative_attention_num_buckets": 32,
        "relative_attention_max_distance": 128,
        "layer_norm_epsilon": 1e-6,
        "feed_forward_proj": "gated-gelu",
        "tie_word_embeddings": False,
    }
    config.update(overrides)
    return config


@pytest.fixture(scope="module")
def hf_checkpoint(tmp_path_factory):
    """A small random MT5ForConditionalGeneration, saved as safetensors: (model, directory)."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.MT5Config(
        vocab_size=VOCAB,
        d_model=D_MODEL,
        d_ff=D_FF,
        num_heads=HEADS,
        d_kv=D_KV,
        num_layers=ENCODER_LAYERS,
        num_decoder_layers=DECODER_LAYERS,
        layer_norm_epsilon=1e-5,
        feed_forward_proj="gated-gelu",
        tie_word_embeddings=False,
    )
    model = transformers.MT5ForConditionalGeneration(config).eval()
    with torch.no_grad():
        # transformers >= 5 ties lm_head to shared whatever the config says; mT5's is separate.
        model.lm_head.weight = torch.nn.Parameter(torch.randn(VOCAB, D_MODEL))
        # Norm scales start at 1: make every one distinct so a swapped norm would show.
        for name, param in model.named_parameters():
            if "layer_norm" in name:
                param.mul_(1.0 + 0.5 * torch.randn_like(param))
    directory = tmp_path_factory.mktemp("hf_mt5")
    model.save_pretrained(directory)
    assert (directory / "model.safetensors").is_file()
    return model, directory


def _inputs() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    encoder = rng.integers(2, VOCAB, size=(BATCH, INPUT_LENGTH))
    for row, padding in enumerate(ENCODER_PADDING):
        encoder[row, INPUT_LENGTH - padding :] = 0
    decoder = rng.integers(2, VOCAB, size=(BATCH, TARGET_LENGTH))
    decoder[:, 0] = 0  # mT5's decoder start token is the pad id
    return encoder.astype(np.int32), decoder.astype(np.int32)


def _transformers_logits(model, encoder: np.ndarray, decoder: np.ndarray) -> np.ndarray:
    """transformers' logits for the batch, the encoder's padding (token 0) masked."""
    import torch

    with torch.no_grad():
        return model(
            input_ids=torch.from_numpy(encoder).long(),
            attention_mask=torch.from_numpy(encoder != 0).long(),
            decoder_input_ids=torch.from_numpy(decoder).long(),
        ).logits.numpy()


def test_imported_model_gives_transformers_logits(hf_checkpoint):
    pytest.importorskip("torch")
    hf_model, directory = hf_checkpoint
    cfg, params = params_from_hf(directory)
    assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (ENCODER_LAYERS, DECODER_LAYERS)
    assert cfg.layer_norm_epsilon == pytest.approx(1e-5)
    encoder, decoder = _inputs()

    expected = _transformers_logits(hf_model, encoder, decoder)

    # Unpacked: t5scale derives the encoder's segment ids from the padding (token 0).
    got = np.asarray(jax.jit(MT5(cfg).apply)({"params": params}, encoder, decoder))
    assert got.shape == expected.shape == (BATCH, TARGET_LENGTH, VOCAB)
    diff = float(np.max(np.abs(got - expected)))
    assert diff < 1e-4, f"max |t5scale - transformers| logit difference {diff:.3g}"
    assert np.std(expected) > 1.0  # the comparison is not between near-zero logits

    # Packed: rows 1 and 2 in one row, told apart by segment ids, give their own logits.
    lengths = [INPUT_LENGTH - padding for padding in ENCODER_PADDING[1:]]
    packed_encoder = np.zeros((1, 2 * INPUT_LENGTH), np.int32)
    encoder_segments = np.zeros_like(packed_encoder)
    packed_encoder[0, : sum(lengths)] = np.concatenate(
        [encoder[1, : lengths[0]], encoder[2, : lengths[1]]]
    )
    encoder_segments[0, : sum(lengths)] = np.repeat([1, 2], lengths)
    packed_decoder = decoder[1:].reshape(1, -1)
    decoder_segments = np.repeat([1, 2], TARGET_LENGTH)[None].astype(np.int32)
    packed = np.asarray(
        jax.jit(MT5(cfg).apply)(
            {"params": params}, packed_encoder, packed_decoder, encoder_segments, decoder_segments
        )
    )
    packed_diff = float(np.max(np.abs(packed.reshape(2, TARGET_LENGTH, VOCAB) - expected[1:])))
    assert packed_diff < 1e-4, f"packed: max logit difference {packed_diff:.3g}"


def test_sharded_checkpoint_imports_the_same(hf_checkpoint, tmp_path):
    hf_model, directory = hf_checkpoint
    hf_model.save_pretrained(tmp_path, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert not (tmp_path / "model.safetensors").exists()
    _, single = params_from_hf(directory)
    _, sharded = params_from_hf(tmp_path)
    assert jax.tree.structure(single) == jax.tree.structure(sharded)
    for a, b in zip(jax.tree.leaves(single), jax.tree.leaves(sharded), strict=True):
        np.testing.assert_array_equal(a, b)


def test_config_maps_every_dimension():
    cfg = model_config_from_hf(_hf_config_json(num_decoder_layers=None), dtype="bfloat16")
    assert (cfg.vocab_size, cfg.d_model, cfg.d_ff, cfg.num_heads, cfg.d_kv) == (
        VOCAB,
        D_MODEL,
        D_FF,
        HEADS,
        D_KV,
    )
    assert (cfg.num_encoder_layers, cfg.num_decoder_layers) == (ENCODER_LAYERS, ENCODER_LAYERS)
    assert (cfg.relative_attention_num_buckets, cfg.relative_attention_max_distance) == (32, 128)
    assert cfg.dtype == "bfloat16"
    # transformers >= 5 writes tie_word_embeddings: true for every mT5; the tensors decide.
    assert model_config_from_hf(_hf_config_json(tie_word_embeddings=True)) == model_config_from_hf(
        _hf_config_json()
    )


@pytest.mark.parametrize(
    "overrides, field",
    [
        ({"feed_forward_proj": "relu"}, "feed_forward_proj"),
        ({"feed_forward_proj": "gated-silu"}, "feed_forward_proj"),
        ({"tie_word_embeddings": True, "transformers_version": "4.46.0"}, "tie_word_embeddings"),
        ({"model_type": "umt5"}, "model_type"),
        ({"is_encoder_decoder": False}, "is_encoder_decoder"),
        ({"d_model": None}, "d_model"),
        ({"num_heads": 0}, "num_heads"),
    ],
)
def test_config_rejects_what_t5scale_cannot_represent(overrides, field):
    with pytest.raises(ValueError, match=field) as error:
        model_config_from_hf(_hf_config_json(**overrides))
    assert "\n" not in str(error.value)


def _edited_checkpoint(directory: Path, destination: Path, edit) -> Path:
    """A copy of the checkpoint with its tensors passed through `edit(dict) -> None`."""
    from safetensors.numpy import load_file, save_file

    tensors = load_file(str(directory / "model.safetensors"))
    edit(tensors)
    destination.mkdir()
    shutil.copy(directory / "config.json", destination / "config.json")
    save_file(tensors, str(destination / "model.safetensors"))
    return destination


CROSS_V = "decoder.block.2.layer.1.EncDecAttention.v.weight"
EXTRA_BIAS = "encoder.block.1.layer.0.SelfAttention.relative_attention_bias.weight"


@pytest.mark.parametrize(
    "edit, message",
    [
        (lambda t: t.pop(CROSS_V), f"missing 1: {CROSS_V}"),
        (lambda t: t.pop("lm_head.weight"), "no lm_head.weight"),
        (lambda t: t.update({"lm_head.weight": t["shared.weight"].copy()}), "equals shared"),
        (lambda t: t.update({EXTRA_BIAS: np.zeros((32, HEADS), np.float32)}), EXTRA_BIAS),
        (lambda t: t.update({CROSS_V: t[CROSS_V][:, :-1].copy()}), r"\(64, 63\), expected"),
        (
            lambda t: t.update({"encoder.embed_tokens.weight": t["shared.weight"] + 1.0}),
            "encoder.embed_tokens.weight differs",
        ),
    ],
    ids=["missing", "tied-absent", "tied-equal", "unexpected", "misshaped", "untied-input"],
)
def test_bad_checkpoints_are_rejected(hf_checkpoint, tmp_path, edit, message):
    pytest.importorskip("safetensors")
    _, directory = hf_checkpoint
    broken = _edited_checkpoint(directory, tmp_path / "broken", edit)
    with pytest.raises(ValueError, match=message) as error:
        params_from_hf(broken)
    assert "\n" not in str(error.value)


def test_aliases_of_shared_are_accepted(hf_checkpoint, tmp_path):
    _, directory = hf_checkpoint

    def add_aliases(tensors):
        for stack in ("encoder", "decoder"):
            tensors[f"{stack}.embed_tokens.weight"] = tensors["shared.weight"].copy()

    _, expected = params_from_hf(directory)
    _, got = params_from_hf(_edited_checkpoint(directory, tmp_path / "aliases", add_aliases))
    np.testing.assert_array_equal(got["embedding"], expected["embedding"])


def _train_two_steps_from(out: Path, stage: int, capsys, steps: int = 2) -> tuple[int, str, str]:
    return cli_in_process(
        ["train", f"--gin_file={out}/model.gin", f"--gin_file=gin/zero/stage{stage}.gin",
         "--gin.DATA_SOURCE=synthetic", "--gin.INPUT_LENGTH=32", "--gin.TARGET_LENGTH=16",
         f"--gin.TRAIN_STEPS={steps}", f"--gin.MODEL_DIR='{out}'"], capsys,
    )  # fmt: skip


@pytest.mark.slow  # CI: convert's fp32 run; mixed precision from fp32 parameters: test_checkpoint
def test_convert_writes_a_mixed_precision_run(hf_checkpoint, tmp_path, capsys):
    """Converted with gin/precision/mixed.gin, the run trains in mixed precision from the
    imported (fp32) parameters: the bf16 working copy cast from them, the fp32 master kept."""
    _, directory = hf_checkpoint
    out = tmp_path / "run"
    convert = ["convert", f"--hf_dir={directory}", "--gin_file=gin/precision/mixed.gin",
               f"--gin.MODEL_DIR='{out}'"]  # fmt: skip
    assert cli_in_process(convert, capsys)[0] == 0
    model_gin = (out / "model.gin").read_text()
    assert "ModelConfig.dtype = 'bfloat16'" in model_gin
    assert "PrecisionConfig.mode = 'mixed'" in model_gin
    code, out_text, err = _train_two_steps_from(out, 2, capsys)
    assert code == 0, err
    assert "resuming from the checkpoint at step 0" in out_text
    analysis = json.loads((out / "step_analysis.json").read_text())
    assert analysis["precision"]["mode"] == "mixed"
    assert analysis["model_state_per_device"]["zero_formula"] == "2Ψ + 14Ψ/N"
    # Exported, the mixed-precision ZeRO-2 run gives its fp32 master, as the checkpoint holds it.
    exported = tmp_path / "exported"
    code, _, err = cli_in_process(["export", f"--gin.MODEL_DIR='{out}'", f"--out_dir={exported}"],
                                  capsys)  # fmt: skip
    assert code == 0, err
    _, params = params_from_hf(exported)
    for a, b in zip(jax.tree.leaves(params), jax.tree.leaves(_trained_params(out, 2)), strict=True):
        assert a.dtype == b.dtype == np.float32
        np.testing.assert_array_equal(a, b)


# ---- export: a run's checkpoint back out as a Hugging Face mT5 ---------------------------------


def _trained_params(run: Path, step: int) -> dict:
    import orbax.checkpoint as ocp

    state = ocp.StandardCheckpointer().restore(run / "checkpoints" / str(step) / "state")
    return jax.tree.map(np.asarray, state["params"])


def test_export_round_trip_gives_transformers_the_trained_model(hf_checkpoint, tmp_path, capsys):
    """transformers' model → convert (checkpoint 0: the imported parameters, exactly) → 3
    steps at ZeRO-3 on 8 devices from it → export → transformers loads it and its logits are
    t5scale's (fp32); exported, then converted again: the same."""
    pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    _, directory = hf_checkpoint
    run, out = tmp_path / "run", tmp_path / "exported"
    convert = ["convert", f"--hf_dir={directory}", f"--gin.MODEL_DIR='{run}'"]
    assert cli_in_process(convert, capsys)[0] == 0
    code, printed, err = _train_two_steps_from(run, 3, capsys, steps=3)
    assert code == 0, err
    assert "resuming from the checkpoint at step 0" in printed  # convert's, below: exactly HF's
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["0", "3"]
    # Converting into a directory that already holds checkpoints would mix two runs.
    code, _, err = cli_in_process(convert, capsys)
    assert code == 2 and "already holds checkpoints" in err
    code, printed, err = cli_in_process(
        ["export", f"--gin.MODEL_DIR='{run}'", f"--out_dir={out}"], capsys
    )
    assert code == 0, err
    assert "step 3" in printed and "no tokenizer" in printed
    modes = {path.name: path.stat().st_mode & 0o777 for path in out.iterdir()}
    assert modes["model.safetensors"] == modes["config.json"], modes  # not safetensors' 0600

    cfg, imported = params_from_hf(directory)
    trained = _trained_params(run, 3)
    assert not np.array_equal(trained["lm_head"], imported["lm_head"])  # training moved it
    model = transformers.MT5ForConditionalGeneration.from_pretrained(out).eval()
    assert model.lm_head.weight.data_ptr() != model.shared.weight.data_ptr()  # untied
    encoder, decoder = _inputs()
    expected = _transformers_logits(model, encoder, decoder)
    got = np.asarray(jax.jit(MT5(cfg).apply)({"params": trained}, encoder, decoder))
    diff = float(np.max(np.abs(got - expected)))
    with capsys.disabled():  # the parity figure, shown with -s
        print(f"export round trip: max |t5scale - transformers| logit difference {diff:.3g}")
    assert diff <= 1e-4, f"max |t5scale - transformers| logit difference {diff:.3g}"
    assert np.std(expected) > 1.0

    _, again = params_from_hf(out)
    for a, b in zip(jax.tree.leaves(again), jax.tree.leaves(trained), strict=True):
        np.testing.assert_array_equal(a, b)

    # Sharded past a size limit, with transformers' index: the same tensors.
    sharded = tmp_path / "sharded"
    code, _, err = cli_in_process(["export", f"--gin.MODEL_DIR='{run}'", f"--out_dir={sharded}",
                                   "--max_shard_size=100KB", "--step=0"], capsys)  # fmt: skip
    assert code == 0, err
    index = json.loads((sharded / "model.safetensors.index.json").read_text())
    assert (
        len(set(index["weight_map"].values())) > 1 and not (sharded / "model.safetensors").exists()
    )
    _, step_zero = params_from_hf(sharded)
    for a, b in zip(jax.tree.leaves(step_zero), jax.tree.leaves(imported), strict=True):
        np.testing.assert_array_equal(a, b)

    # Bad input: one line, exit code 2, nothing written.
    for args, message in (
        ([f"--gin.MODEL_DIR='{tmp_path / 'none'}'", f"--out_dir={tmp_path / 'x'}"],
         "no checkpoint in"),
        ([f"--gin.MODEL_DIR='{run}'", f"--out_dir={tmp_path / 'x'}", "--step=7"],
         "no checkpoint at step 7"),
        ([f"--gin.MODEL_DIR='{run}'", f"--out_dir={directory / 'config.json'}"], "is a file"),
        # under a file: refused before the checkpoint is read (it was a traceback after)
        ([f"--gin.MODEL_DIR='{run}'", f"--out_dir={directory / 'config.json' / 'hf'}"],
         "cannot be made"),
        ([f"--gin.MODEL_DIR='{run}'", f"--out_dir={out}"], "already holds a model"),
    ):  # fmt: skip
        code, _, err = cli_in_process(["export", *args], capsys)
        assert code == 2 and err.count("\n") == 1 and message in err, err
    assert not (tmp_path / "x").exists()
    # --overwrite, in shards over the one file of step 3: nothing of the old export stays
    # (transformers loads a model.safetensors before an index: the old model, before 2026-11-29)
    assert cli_in_process(["export", f"--gin.MODEL_DIR='{run}'", f"--out_dir={out}",
                           "--overwrite", "--max_shard_size=100KB", "--step=0"],
                          capsys)[0] == 0  # fmt: skip
    assert (
        not (out / "model.safetensors").exists() and (out / "model.safetensors.index.json").exists()
    )
    _, overwritten = params_from_hf(out)
    for a, b in zip(jax.tree.leaves(overwritten), jax.tree.leaves(imported), strict=True):
        np.testing.assert_array_equal(a, b)


def test_mt5_small_exports_the_parameters_transformers_counts():
    """mt5_small's export: transformers' MT5 of its config.json (built on torch's meta device,
    nothing allocated) has exactly the tensors, shapes and 300,176,768 parameters it writes."""
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    from t5scale.model.hf_export import hf_config, hf_shapes, parameter_count
    from t5scale.model.sizes import preset

    cfg = preset("mt5_small")
    assert parameter_count(cfg) == 300_176_768
    with torch.device("meta"):
        model = transformers.MT5ForConditionalGeneration(transformers.MT5Config(**hf_config(cfg)))
        # transformers >= 5 ties a freshly built mT5's head to `shared` (loaded from an export,
        # which holds lm_head.weight, it is untied: the round-trip test above)
        model.lm_head.weight = torch.nn.Parameter(torch.empty(cfg.vocab_size, cfg.d_model))
    assert sum(p.numel() for p in model.parameters()) == 300_176_768
    shapes = {name: tuple(p.shape) for name, p in model.state_dict().items()
              if not name.endswith("embed_tokens.weight")}  # fmt: skip
    assert shapes == hf_shapes(cfg)


def test_the_exported_tokenizer_gives_seqio_s_ids(tmp_path):
    """The shipped SentencePiece vocabulary with mT5's 100 sentinels, loaded by transformers:
    the pieces' ids, EOS, and <extra_id_0> as the last id (seqio's numbering)."""
    transformers = pytest.importorskip("transformers")
    import sentencepiece

    from t5scale.data.config import DataConfig
    from t5scale.model.hf_export import write_tokenizer

    data = DataConfig()
    write_tokenizer(tmp_path, data.vocabulary, data.extra_ids)
    tokenizer = transformers.AutoTokenizer.from_pretrained(tmp_path)
    pieces = sentencepiece.SentencePieceProcessor(model_file=data.vocabulary)
    text = "Ein kleiner Test, un petit essai."
    assert tokenizer(text).input_ids == [*pieces.encode(text), 1]
    size = pieces.get_piece_size() + data.extra_ids
    assert len(tokenizer) == size == 4096
    assert tokenizer.convert_tokens_to_ids("<extra_id_0>") == size - 1
    assert tokenizer.convert_tokens_to_ids("<extra_id_99>") == size - 100
