"""seqio tasks and mixtures of the mT5 recipe: span corruption over mC4 or a local corpus.

Each language is one task — text as targets, SentencePiece tokenisation, span corruption
(t5scale/data/span_corruption.py), EOS — and the languages are mixed by temperature sampling,
rate ∝ examples^alpha with alpha = 0.3, as mT5 did. Two sources:

- `mc4.<lang>` over TFDS `c4/multilingual:3.1.0` (mC4), for a TFDS data dir where it is prepared;
- `t5scale_corpus_<id>.<lang>` over `CORPUS/<lang>/*.txt` (t5scale/data/corpus.py), where every
  `holdout_every`-th line of each file is the held-out validation split.

Packing into fixed-length rows is seqio's EncDecFeatureConverter, in the loader.
"""

from __future__ import annotations

import functools
import hashlib

from t5scale.data import span_corruption
from t5scale.data.config import DataConfig
from t5scale.data.corpus import Corpus
from t5scale.data.tf_setup import seqio, tf

MC4_TFDS_NAME = "c4/multilingual:3.1.0"
# The language splits of TFDS c4/multilingual 3.1.0 (mC4), without 'und' (undetermined).
MC4_LANGUAGES = tuple(
    """af am ar az be bg bg-Latn bn ca ceb co cs cy da de el el-Latn en eo es et eu fa fi fil fr
    fy ga gd gl gu ha haw hi hi-Latn hmn ht hu hy id ig is it iw ja ja-Latn jv ka kk km kn ko ku
    ky la lb lo lt lv mg mi mk ml mn mr ms mt my ne nl no ny pa pl ps pt ro ru ru-Latn sd si sk
    sl sm sn so sq sr st su sv sw ta te tg th tr uk ur uz vi xh yi yo zh zh-Latn zu""".split()
)


def vocabulary(config: DataConfig) -> seqio.SentencePieceVocabulary:
    """The SentencePiece vocabulary with mT5's sentinels, from a file that loader.register has
    checked (check_vocabulary) before it imported this module."""
    return seqio.SentencePieceVocabulary(config.vocabulary, extra_ids=config.extra_ids)


def output_features(vocab) -> dict[str, seqio.Feature]:
    return {
        "inputs": seqio.Feature(vocab, add_eos=True, required=False),
        "targets": seqio.Feature(vocab, add_eos=True),
    }


PREPROCESSORS = (
    functools.partial(seqio.preprocessors.rekey, key_map={"inputs": None, "targets": "text"}),
    seqio.preprocessors.tokenize,
    span_corruption.span_corruption,
    seqio.preprocessors.append_eos_after_trim,
)


def _read_lines(path, validation: bool, every: int, max_line_bytes: int):
    """One file's lines of one split as {'text'}: empty, whitespace-only and over-long lines are
    skipped (corpus.py counts them alike)."""

    def in_split(index, line):
        has_text = tf.strings.length(tf.strings.strip(line)) > 0
        wanted = tf.equal(tf.equal(index % every, 0), validation)
        within = tf.strings.length(line) <= max_line_bytes
        return tf.logical_and(wanted, tf.logical_and(has_text, within))

    lines = tf.data.TextLineDataset(path).enumerate().filter(in_split)
    return lines.map(lambda _, line: {"text": line})


class HeldOutLines(seqio.FileDataSource):
    """Lines of text files: every `every`-th line of each file is 'validation', the rest 'train'.

    seqio hands the reader only a file name, not the split, so the reader is chosen per call.
    """

    def __init__(self, files: list[str], every: int, max_line_bytes: int, lines: int):
        self._every, self._max_line_bytes = every, max_line_bytes
        held_out = lines // every
        super().__init__(
            read_file_fn=None,
            split_to_filepattern={"train": files, "validation": files},
            num_input_examples={"train": lines - held_out, "validation": held_out},
        )

    def get_dataset(self, split: str = "train", *args, **kwargs):
        self._reader = functools.partial(
            _read_lines,
            validation=split == "validation",
            every=self._every,
            max_line_bytes=self._max_line_bytes,
        )
        return super().get_dataset(split, *args, **kwargs)


def _add_task(name: str, source, vocab, shuffle_buffer: int | None = None) -> None:
    if name not in seqio.TaskRegistry.names():
        extra = {} if shuffle_buffer is None else {"shuffle_buffer_size": shuffle_buffer}
        seqio.TaskRegistry.add(
            name,
            source=source,
            preprocessors=list(PREPROCESSORS),
            output_features=output_features(vocab),
            metric_fns=[],
            **extra,
        )


def register_corpus(corpus: Corpus, config: DataConfig, vocab) -> str:
    """Register one task per language of `corpus` and their mixture; return the mixture's name."""
    key = repr(
        (
            corpus.files,
            config.vocabulary,
            config.holdout_every,
            config.max_line_bytes,
            config.corpus_shuffle_buffer,
        )
    )
    name = "t5scale_corpus_" + hashlib.sha256(key.encode()).hexdigest()[:12]
    rates = []
    for language, files in corpus.files.items():
        source = HeldOutLines(
            [f.path for f in files],
            config.holdout_every,
            config.max_line_bytes,
            corpus.lines(language),
        )
        _add_task(f"{name}.{language}", source, vocab, config.corpus_shuffle_buffer)
        rates.append((f"{name}.{language}", corpus.lines(language) ** config.mixing_alpha))
    if name not in seqio.MixtureRegistry.names():
        seqio.MixtureRegistry.add(name, rates)
    return name


def register_mc4(config: DataConfig, vocab) -> str:
    """Register `mc4.<lang>` tasks and the temperature-sampled `mc4` mixture; return 'mc4'."""
    languages = config.languages or MC4_LANGUAGES
    names = [mc4_task_name(language) for language in languages]
    for language, name in zip(languages, names, strict=True):
        source = seqio.TfdsDataSource(
            tfds_name=MC4_TFDS_NAME,
            tfds_data_dir=config.tfds_data_dir,
            splits={"train": language, "validation": f"{language}-validation"},
        )
        _add_task(name, source, vocab)
    # Again on each call: an earlier call's languages or alpha must not stand for this one's.
    seqio.MixtureRegistry.remove("mc4")
    rate = functools.partial(seqio.mixing_rate_num_examples, temperature=1.0 / config.mixing_alpha)
    seqio.MixtureRegistry.add("mc4", names, default_rate=rate)
    return "mc4"


def mc4_task_name(language: str) -> str:
    """The seqio task of an mC4 language: seqio's names allow letters, digits, '_', '.' and
    ':' only, so 'bg-Latn' is task mc4.bg_Latn (its TFDS split keeps the '-')."""
    return f"mc4.{language.replace('-', '_')}"
