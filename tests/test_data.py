"""The corpus pipeline: span corruption, seqio tasks over real text, the loader, bad input."""

from __future__ import annotations

import json
import os
from pathlib import Path

import jax
import numpy as np
import pytest
from conftest import cli_in_process

from t5scale.data.config import REPO_DATA, DataConfig
from t5scale.data.corpus import scan_corpus
from t5scale.data.synthetic import FEATURES

CORPUS = REPO_DATA / "corpus"
VOCAB = REPO_DATA / "vocab" / "multilingual_4k.model"
# Two languages, Latin and CJK, and a short shuffle buffer keep the pipeline's start-up short
# (a mixture still; each language's buffer fills before the first batch).
SMALL = DataConfig(
    source="corpus",
    input_length=128,
    target_length=29,
    prefetch=2,
    languages=("en", "zh"),
    corpus_shuffle_buffer=16,
)
SCRIPTS = {"Latin", "Cyrillic", "Arabic", "Devanagari", "CJK"}


def test_shipped_corpus_is_real_multilingual_text():
    corpus = scan_corpus(str(CORPUS))
    assert not corpus.skipped
    assert len(corpus.languages) >= 12
    total = sum(Path(f.path).stat().st_size for fs in corpus.files.values() for f in fs)
    assert total >= 1_000_000
    text = "".join(Path(fs[-1].path).read_text("utf-8")[:2000] for fs in corpus.files.values())
    seen = {
        "Latin": any("a" <= c <= "z" for c in text),
        "Cyrillic": any("\u0400" <= c <= "\u04ff" for c in text),
        "Arabic": any("\u0600" <= c <= "\u06ff" for c in text),
        "Devanagari": any("\u0900" <= c <= "\u097f" for c in text),
        "CJK": any("\u4e00" <= c <= "\u9fff" for c in text),
    }
    assert {name for name, present in seen.items() if present} == SCRIPTS


def test_span_lengths_give_the_mt5_pretraining_lengths():
    from t5scale.data.span_corruption import span_lengths

    assert (span_lengths(1024).raw, span_lengths(1024).targets) == (1137, 229)
    assert span_lengths(512).targets == 114
    assert span_lengths(1024).inputs == 1024


def _merge(inputs: list[int], targets: list[int], vocab_size: int) -> list[int]:
    """Undo span corruption: put each target span back in place of its sentinel."""
    spans, current = {}, None
    for token in targets:
        if token >= vocab_size - 100:
            current = token
            spans[current] = []
        else:
            spans[current].append(token)
    out = []
    for token in inputs:
        out += spans[token] if token >= vocab_size - 100 else [token]
    return out


def test_span_corruption_hides_15_percent_in_spans_of_3_and_is_reversible():
    from t5scale.data.span_corruption import corrupt
    from t5scale.data.tf_setup import tf

    vocab_size, noise, spans = 4096, 0, 0
    for example in range(20):
        tokens = np.random.default_rng(example).integers(3, 3000, 1137).astype(np.int32)
        seeds = tf.constant([[example, 1], [example, 2]])
        out = {
            k: v.numpy().tolist() for k, v in corrupt(tokens, seeds, vocab_size, 0.15, 3.0).items()
        }
        assert _merge(out["inputs"], out["targets"], vocab_size) == tokens.tolist()
        assert len(out["inputs"]) == 1023  # + EOS = 1024
        sentinels = [t for t in out["inputs"] if t >= vocab_size - 100]
        assert sentinels == list(range(vocab_size - 1, vocab_size - 1 - len(sentinels), -1))
        noise += len(out["targets"]) - len(sentinels) - 1
        spans += len(sentinels)
        again = corrupt(tokens, seeds, vocab_size, 0.15, 3.0)["inputs"].numpy().tolist()
        assert again == out["inputs"]  # same seeds, same corruption
    assert noise / (20 * 1137) == pytest.approx(0.15, abs=0.002)
    assert noise / spans == pytest.approx(3.0, abs=0.05)


def _take(dataset, n: int) -> list[dict]:
    return [b for _, b in zip(range(n), dataset.as_numpy_iterator(), strict=False)]


def test_packed_batches_are_deterministic_and_host_sharded():
    from t5scale.data.loader import seqio_dataset

    def batches(seed: int, shard=(0, 1), split="train"):
        return _take(seqio_dataset(SMALL, 8, seed, split, 4096, shard), 2)

    first = batches(0)
    assert set(first[0]) >= set(FEATURES)
    assert first[0]["encoder_input_tokens"].shape == (8, 128)
    assert first[0]["decoder_target_tokens"].shape == (8, 29)
    assert all(b["decoder_loss_weights"].sum() > 0 for b in first)
    for a, b in zip(first, batches(0), strict=True):
        assert all(np.array_equal(a[k], b[k]) for k in FEATURES)
    assert not np.array_equal(
        first[0]["encoder_input_tokens"], batches(1)[0]["encoder_input_tokens"]
    )
    shard0, shard1 = batches(0, (0, 2)), batches(0, (1, 2))
    assert shard0[0]["encoder_input_tokens"].shape == (4, 128)
    assert not np.array_equal(shard0[0]["encoder_input_tokens"], shard1[0]["encoder_input_tokens"])
    held_out = batches(0, split="validation")
    train_rows = {r.tobytes() for b in first for r in b["decoder_target_tokens"]}
    assert not train_rows & {r.tobytes() for b in held_out for r in b["decoder_target_tokens"]}


def test_loader_gives_global_arrays_and_resumes_at_a_position():
    from t5scale.data.loader import Batches

    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Auto,))
    sharding = jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec("data"))
    loader = Batches(SMALL, 8, 0, 4096, sharding)
    stream = [next(loader) for _ in range(4)]
    assert loader.position == 4
    loader.close()
    assert stream[0].encoder_input_tokens.sharding == sharding
    resumed = Batches(SMALL, 8, 0, 4096, sharding, start=2)
    again = next(resumed)
    resumed.close()
    assert resumed.position == 3
    for name in FEATURES:
        np.testing.assert_array_equal(
            np.asarray(getattr(again, name)), np.asarray(getattr(stream[2], name))
        )


def _train_args(*bindings: str) -> list[str]:
    return [
        "train",
        "--gin_file=gin/models/mt5_tiny.gin",
        "--gin.TRAIN_STEPS=2",
        "--gin.INPUT_LENGTH=64",
        "--gin.TARGET_LENGTH=16",
        "--gin.DATA_SOURCE=corpus",
        *bindings,
    ]


def _write_corpus(root: Path, files: dict[str, bytes]) -> Path:
    """A corpus of real text (one language of the shipped one) plus the given files."""
    good = root / "xx"
    good.mkdir(parents=True)
    good.joinpath("good.txt").write_bytes((CORPUS / "de" / "udhr.txt").read_bytes())
    for name, content in files.items():
        root.joinpath("xx", name).write_bytes(content)
    return root


@pytest.mark.parametrize(
    "bad, reason",
    [
        ({"empty.txt": b""}, "empty"),
        ({"latin1.txt": "Grüße aus Köln\n".encode("latin-1") * 50}, "not valid UTF-8"),
        # the pipeline would tokenize it to nothing, its stream repeating nothing for ever
        ({"blank.txt": b"   \n\t\n" * 5000}, "no text: its lines are empty or whitespace"),
    ],
)
def test_bad_files_are_skipped_with_a_counted_warning(tmp_path, caplog, bad, reason):
    corpus = scan_corpus(str(_write_corpus(tmp_path, bad)))
    assert [s.endswith(f"({reason})") for s in corpus.skipped] == [True]
    assert "skipped 1 file(s)" in caplog.text
    assert [Path(f.path).name for f in corpus.files["xx"]] == ["good.txt"]


def test_a_corpus_is_scanned_once_while_its_files_stay_as_they_are(tmp_path, caplog):
    # A run's training and validation streams each register the corpus: one scan, one warning
    # (two, the second in another format, before 2026-11-30).
    root = str(_write_corpus(tmp_path, {"empty.txt": b""}))
    first = scan_corpus(root)
    assert scan_corpus(root) is first and caplog.text.count("skipped 1 file(s)") == 1
    Path(root, "xx", "empty.txt").write_text("eine Zeile\n" * 200)  # mended: scanned again
    mended = scan_corpus(root)
    assert mended.skipped == () and len(mended.files["xx"]) == 2


def test_a_10mb_line_is_counted_and_skipped_not_read_into_a_batch(tmp_path, caplog):
    from t5scale.data.loader import seqio_dataset

    root = _write_corpus(tmp_path, {"huge.txt": b"\xce\xa9" * (5 << 20) + b"\n"})  # 'Ω' × 5M
    corpus = scan_corpus(str(root))
    assert corpus.long_lines() == 1
    assert "1 line(s) longer than" in caplog.text
    config = DataConfig(source="corpus", corpus_dir=str(root), input_length=64, target_length=16)
    batches = _take(seqio_dataset(config, 4, 0, "train", 4096, (0, 1)), 20)
    from t5scale.data.tasks import vocabulary

    omega = vocabulary(config).encode("Ω")
    tokens = np.concatenate([b["encoder_input_tokens"].ravel() for b in batches])
    assert len(batches) == 20 and not np.isin(omega[-1:], tokens).any()


def _missing(root: Path) -> Path:
    return root / "nowhere"


def _a_file(root: Path) -> Path:
    root.joinpath("file.txt").write_text("text")
    return root / "file.txt"


def _only_bad_files(root: Path) -> Path:
    _write_corpus(root, {})
    root.joinpath("xx", "good.txt").write_bytes(b"")
    return root


def _whitespace_alone(root: Path) -> Path:
    root.joinpath("xx").mkdir(parents=True)
    root.joinpath("xx", "blank.txt").write_bytes(b"    \n\t\n" * 5000)
    return root


def _one_line(root: Path) -> Path:
    root.joinpath("xx").mkdir(parents=True)
    root.joinpath("xx", "one.txt").write_text("hello world\n")
    return root


@pytest.mark.parametrize(
    "make, message",
    [
        (_missing, "does not exist"),
        (_a_file, "not a directory"),
        (_only_bad_files, "no usable text"),
        (_whitespace_alone, "no usable text for training"),  # it hung before (2026-11-29)
        # its one line is the validation split's: training ended at once (a traceback before)
        (_one_line, "1 line(s) of text, none for training: one line in 50 of each file"),
    ],
)
def test_unusable_corpus_stops_at_start_with_one_line(tmp_path, capsys, make, message):
    code, _, err = cli_in_process(
        _train_args(f"--gin.DataConfig.corpus_dir='{make(tmp_path)}'"), capsys
    )
    err = err.strip().splitlines()
    assert code == 2
    assert len(err) == 1 and message in err[0] and err[0].startswith("t5scale: error:")


@pytest.mark.parametrize(
    "content, message",
    [(None, "does not exist"), (os.urandom(2000), "is not a SentencePiece model")],
)
def test_missing_or_corrupt_vocabulary_stops_at_start(tmp_path, capsys, content, message):
    path = tmp_path / "vocab.model"
    if content is not None:
        path.write_bytes(content)
    code, _, err = cli_in_process(_train_args(f"--gin.DataConfig.vocabulary='{path}'"), capsys)
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1 and message in err[0]


def test_mc4_tasks_without_prepared_data_stop_with_one_line(tmp_path, capsys):
    """The mc4 tasks register and read TFDS c4/multilingual; an unprepared data dir is one line."""
    code, _, err = cli_in_process(
        ["data-bench", "--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/data/mc4.gin",
         f"--gin.DataConfig.tfds_data_dir='{tmp_path}'", "--gin.DataConfig.languages=('en','ru')",
         "--gin.INPUT_LENGTH=128", "--gin.TARGET_LENGTH=29", "--batches=1"], capsys,
    )  # fmt: skip
    err = err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert "mC4 (c4/multilingual:3.1.0) is not prepared" in err[0] and str(tmp_path) in err[0]


def test_mc4_registers_its_default_languages_with_seqio_task_names(tmp_path):
    """seqio refuses '-' in a task name: 'bg-Latn' is task mc4.bg_Latn, reading split bg-Latn."""
    import seqio

    from t5scale.data.tasks import MC4_LANGUAGES, register_mc4, vocabulary

    config = DataConfig(source="mc4", tfds_data_dir=str(tmp_path))
    assert register_mc4(config, vocabulary(config)) == "mc4"
    tasks = [task.name for task in seqio.get_mixture_or_task("mc4").tasks]
    assert len(tasks) == len(MC4_LANGUAGES) and "mc4.bg_Latn" in tasks
    # seqio keeps the TFDS split map privately: the only place to read the split names from
    splits = seqio.get_mixture_or_task("mc4.bg_Latn").source.tfds_dataset._split_map
    assert splits == {"train": "bg-Latn", "validation": "bg-Latn-validation"}


@pytest.mark.slow  # about 2 minutes: out of CI's budget, run with -m slow
def test_learning_is_real_on_the_shipped_corpus(tmp_path, capsys):
    """mt5_tiny on the shipped corpus: the loss falls; validation loss is logged every N steps."""
    model_dir = tmp_path / "run"
    code, _, _ = cli_in_process(
        [
            "train",
            "--gin_file=gin/models/mt5_tiny.gin",
            "--gin_file=gin/zero/stage2.gin",
            "--gin.TRAIN_STEPS=300",
            "--gin.BATCH_SIZE=16",
            "--gin.INPUT_LENGTH=128",
            "--gin.TARGET_LENGTH=29",
            "--gin.DATA_SOURCE=corpus",
            # Eight of the 21 languages, in six scripts: a third of the pipeline start-up.
            "--gin.DataConfig.languages=('en','ru','el','ar','hi','zh','ja','ko')",
            "--gin.DataConfig.validation_every=100",
            "--gin.OptimizerConfig.learning_rate=0.01",
            "--gin.OptimizerConfig.warmup_steps=100",
            f"--gin.MODEL_DIR='{model_dir}'",
        ],
        capsys,
    )
    assert code == 0
    records = [json.loads(line) for line in (model_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records]
    assert len(losses) == 300
    assert np.mean(losses[-20:]) <= 0.6 * np.mean(losses[:20])
    validation = [(r["step"], r["validation_loss"]) for r in records if "validation_loss" in r]
    assert [step for step, _ in validation] == [100, 200, 300]
    assert validation[-1][1] < validation[0][1]


@pytest.mark.slow  # out of CI's budget
def test_data_bench_reports_tokens_per_second(capsys):
    code, out, _ = cli_in_process(
        ["data-bench", "--gin_file=gin/models/mt5_tiny.gin", "--batches=5",
         "--gin.DATA_SOURCE=corpus", "--gin.INPUT_LENGTH=128", "--gin.TARGET_LENGTH=29"], capsys,
    )  # fmt: skip
    assert code == 0 and "corpus: 5 batches of 8" in out and "tokens/s" in out


@pytest.mark.slow  # two 300-step runs: out of CI's budget, run with -m slow
def test_mixed_precision_learns_as_fp32_does_on_the_shipped_corpus(tmp_path, capsys):
    """300 steps of mt5_tiny on the shipped corpus, ZeRO-2 on 8 devices: mixed precision (bf16
    working copy and gradients, fp32 master) ends within 2% of the fp32 run's loss."""
    ends = {}
    for precision in ("fp32", "mixed"):
        model_dir = tmp_path / precision
        code, out, err = cli_in_process(
            ["train", "--gin_file=gin/models/mt5_tiny.gin", "--gin_file=gin/zero/stage2.gin",
             f"--gin_file=gin/precision/{precision}.gin", "--gin.TRAIN_STEPS=300",
             "--gin.BATCH_SIZE=16", "--gin.INPUT_LENGTH=128", "--gin.TARGET_LENGTH=29",
             "--gin.DATA_SOURCE=corpus",
             "--gin.DataConfig.languages=('en','ru','el','ar','hi','zh','ja','ko')",
             "--gin.DataConfig.validation_every=300", "--gin.OptimizerConfig.learning_rate=0.01",
             "--gin.OptimizerConfig.warmup_steps=100", f"--gin.MODEL_DIR='{model_dir}'"],
            capsys,
        )  # fmt: skip
        assert code == 0, err
        lines = (model_dir / "metrics.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        ends[precision] = (np.mean([r["loss"] for r in records[-20:]]),
                           records[-1]["validation_loss"])  # fmt: skip
    print(f"last 20 steps' mean loss and validation loss at 300: {ends}")
    for fp32, mixed in zip(ends["fp32"], ends["mixed"], strict=True):
        assert abs(mixed / fp32 - 1) <= 0.02, ends
