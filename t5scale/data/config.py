"""What the training step is fed: the data source and its lengths, as one frozen dataclass.

Pure Python, no TensorFlow: the synthetic source never imports it, and the corpus sources import
it only when a run asks for them (t5scale/data/loader.py).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from t5scale.errors import DataError, check_field_types

#: The shipped corpus and vocabulary, beside the package in a checkout or an editable install.
REPO_DATA = Path(__file__).resolve().parents[2] / "data"
SOURCES = ("synthetic", "corpus", "mc4")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """The data source and batch lengths (mT5 pretraining: 1024 inputs, 229 targets).

    source: 'synthetic' (random tokens in the packed layout, no TensorFlow), 'corpus' (span
    corruption over a directory of text files, one sub-directory per language; the shipped
    multilingual corpus by default) or 'mc4' (span corruption over TFDS c4/multilingual, for
    those who have prepared it in `tfds_data_dir`).
    """

    source: str = "synthetic"
    input_length: int = 1024
    target_length: int = 229
    max_segments: int = 4  # synthetic: packed examples per row, at most
    corpus_dir: str = str(REPO_DATA / "corpus")
    languages: tuple[str, ...] = ()  # () = every language found (corpus) / mT5's 101 (mc4)
    vocabulary: str = str(REPO_DATA / "vocab" / "multilingual_4k.model")
    extra_ids: int = 100  # sentinels for span corruption, as in mT5
    mixing_alpha: float = 0.3  # temperature sampling of languages: rate ∝ examples^alpha
    holdout_every: int = 50  # corpus: every 50th line of each file is the validation split
    max_line_bytes: int = 1 << 20  # corpus: longer lines are skipped (and counted)
    # corpus: examples shuffled per language. seqio's default, 1,000, would replay a small
    # language's text many times over before its first batch (mC4 keeps seqio's default).
    corpus_shuffle_buffer: int = 128
    tfds_data_dir: str | None = None  # mc4
    prefetch: int = 4  # batches prepared ahead on a background thread
    validation_every: int = 0  # steps between validation losses (0: none)
    validation_batches: int = 2

    def __post_init__(self) -> None:
        check_field_types(self)
        if self.source not in SOURCES:
            raise ValueError(
                f"data source must be one of {', '.join(SOURCES)}, got {self.source!r}"
            )
        if self.input_length < 2 or self.target_length < 2:
            raise ValueError("input_length and target_length must be at least 2")
        if not 0 < self.mixing_alpha <= 1:
            raise ValueError(f"mixing_alpha must be in (0, 1], got {self.mixing_alpha}")
        if self.holdout_every < 2 or self.prefetch < 1 or self.validation_every < 0:
            raise ValueError("holdout_every must be >= 2, prefetch >= 1, validation_every >= 0")
        for name, low in (("max_segments", 1), ("corpus_shuffle_buffer", 1),
                          ("max_line_bytes", 1), ("extra_ids", 0), ("validation_batches", 1)):  # fmt: skip
            if getattr(self, name) < low:
                raise ValueError(f"DataConfig.{name} must be >= {low}, got {getattr(self, name)}")
        object.__setattr__(self, "languages", tuple(self.languages))


def check_vocabulary(path: str) -> None:
    """A SentencePiece model file that loads and has pieces, else one DataError: checked before
    a corpus run imports TensorFlow (seconds), so that a wrong path says so at once."""
    import sentencepiece  # a small native module, only for runs that read text

    file = Path(path)
    if file.is_dir():
        raise DataError(f"vocabulary {path!r} is a directory, not a SentencePiece model file")
    if not file.is_file():
        raise DataError(f"vocabulary file {path!r} does not exist")
    try:
        processor = sentencepiece.SentencePieceProcessor(model_file=path)
    except (OSError, RuntimeError) as error:
        raise DataError(f"vocabulary {path!r} is not a SentencePiece model ({error})") from None
    if processor.get_piece_size() < 3:
        raise DataError(f"vocabulary {path!r} has only {processor.get_piece_size()} pieces")
