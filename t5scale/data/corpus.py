"""A directory of text files, checked before TensorFlow ever reads it.

Layout: `CORPUS/<language>/*.txt`, one document per line, UTF-8 (the shipped corpus in data/corpus
is one). A language directory becomes one seqio task; the languages are mixed by temperature
sampling. The scan runs in Python at start-up, so that bad input is reported in plain words
rather than as a TensorFlow error in the middle of a run:

- a missing or unreadable corpus path, or one with no usable text for training at all:
  `DataError` (the CLI prints one line and exits 2);
- an empty file, one of whitespace alone, or one that is not valid UTF-8: skipped, counted and
  named in one warning; so is a language whose lines all fall to the validation split (a file
  of one line: its first line is held out);
- a line longer than `max_line_bytes` (a 10 MB line is a broken file, not a document): skipped
  by the pipeline, counted here.
"""

from __future__ import annotations

import codecs
import dataclasses
import functools
import logging
import os
from pathlib import Path

from t5scale.errors import DataError

log = logging.getLogger(__name__)

_CHUNK = 1 << 22  # files are checked 4 MiB at a time, never whole in memory


@dataclasses.dataclass(frozen=True)
class TextFile:
    path: str
    lines: int  # lines with text (not empty, not whitespace alone)
    long_lines: int  # lines over the limit, which the pipeline skips
    training_lines: int  # lines with text within the limit that the training split reads


@dataclasses.dataclass(frozen=True)
class Corpus:
    root: str
    files: dict[str, tuple[TextFile, ...]]  # language → usable files
    skipped: tuple[str, ...]  # "path (reason)" for each file left out

    @property
    def languages(self) -> tuple[str, ...]:
        return tuple(self.files)

    def lines(self, language: str) -> int:
        return sum(f.lines for f in self.files[language])

    def long_lines(self) -> int:
        return sum(f.long_lines for files in self.files.values() for f in files)


@dataclasses.dataclass
class _LineCounter:
    """Counts a file's lines chunk by chunk, as the pipeline (tasks.py, `_read_lines`) reads
    them: every `holdout_every`-th line of the file (by its index, empty lines included) is the
    validation split's, and lines that are empty, whitespace alone or over `limit` bytes are
    skipped."""

    limit: int
    holdout_every: int
    lines: int = 0
    long_lines: int = 0
    training_lines: int = 0
    index: int = 0  # of the open line
    open_bytes: int = 0
    open_has_text: bool = False

    def feed(self, chunk: bytes) -> None:
        start = 0
        while (end := chunk.find(b"\n", start)) != -1:
            self._extend(chunk[start:end])
            self._close()
            start = end + 1
        self._extend(chunk[start:])

    def finish(self) -> None:
        if self.open_bytes:  # a last line without a newline
            self._close()

    def _extend(self, part: bytes) -> None:
        self.open_bytes += len(part)
        self.open_has_text = self.open_has_text or bool(part.strip())

    def _close(self) -> None:
        if self.open_has_text:
            self.lines += 1
            long = self.open_bytes > self.limit
            self.long_lines += long
            self.training_lines += not long and self.index % self.holdout_every != 0
        self.index += 1
        self.open_bytes, self.open_has_text = 0, False


def _check_file(path: Path, max_line_bytes: int, holdout_every: int) -> TextFile | str:
    """The file's line counts, or why it is skipped."""
    try:
        if path.stat().st_size == 0:
            return "empty"
        decoder = _Utf8Checker()
        counter = _LineCounter(max_line_bytes, holdout_every)
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                if not decoder.feed(chunk):
                    return "not valid UTF-8"
                counter.feed(chunk)
        counter.finish()
        if not decoder.finish():
            return "not valid UTF-8"
    except OSError as error:
        return f"unreadable: {error.strerror or error}"
    if counter.lines == 0:
        return "no text: its lines are empty or whitespace"
    return TextFile(str(path), counter.lines, counter.long_lines, counter.training_lines)


class _Utf8Checker:
    """Incremental UTF-8 validation (a character may straddle two chunks)."""

    def __init__(self) -> None:
        self._decoder = codecs.getincrementaldecoder("utf-8")("strict")

    def feed(self, chunk: bytes) -> bool:
        try:
            self._decoder.decode(chunk)
        except UnicodeDecodeError:
            return False
        return True

    def finish(self) -> bool:
        try:
            self._decoder.decode(b"", final=True)
        except UnicodeDecodeError:
            return False
        return True


def scan_corpus(
    root: str,
    languages: tuple[str, ...] = (),
    max_line_bytes: int = 1 << 20,
    holdout_every: int = 50,
) -> Corpus:
    """Check every `root/<language>/*.txt`; raise DataError if nothing usable is left. A language
    whose lines all fall to the validation split (DataConfig.holdout_every) is left out.

    Scanned once while its files stay as they are (names, sizes, changes): the training and the
    validation stream of a run read the same corpus, and each scan reads every file whole and
    warns of what it skips."""
    unchanged = tuple(_state(f) for f in sorted(Path(root).glob("*/*.txt")))
    return _scan(root, tuple(languages), max_line_bytes, holdout_every, unchanged)


def _state(path: Path) -> tuple[str, int | None, int | None]:
    """A file's name, size and last change (ctime: a chmod too); a broken link: None, None."""
    try:
        stat = path.stat()
    except OSError:
        return str(path), None, None
    return str(path), stat.st_size, stat.st_ctime_ns


@functools.lru_cache(maxsize=8)
def _scan(
    root: str,
    languages: tuple[str, ...],
    max_line_bytes: int,
    holdout_every: int,
    unchanged: tuple[tuple[str, int | None, int | None], ...],
) -> Corpus:
    base = Path(root)
    if not base.is_dir():
        raise DataError(f"corpus directory {root!r} does not exist or is not a directory")
    if not os.access(base, os.R_OK | os.X_OK):
        raise DataError(f"corpus directory {root!r} is not readable")
    found = sorted(p.name for p in base.iterdir() if p.is_dir())
    missing = [lang for lang in languages if lang not in found]
    if missing:
        raise DataError(f"corpus {root!r} has no language directory for {', '.join(missing)}")
    files, skipped = {}, []
    for language in languages or found:
        usable = []
        for path in sorted((base / language).glob("*.txt")):
            checked = _check_file(path, max_line_bytes, holdout_every)
            if isinstance(checked, str):
                skipped.append(f"{path} ({checked})")
            else:
                usable.append(checked)
        if usable and not any(f.training_lines for f in usable):
            lines = sum(f.lines for f in usable)
            skipped.append(
                f"{base / language} ({lines} line(s) of text, none for training: one line "
                f"in {holdout_every} of each file, its first included, is held out)"
            )
        elif usable:
            files[language] = tuple(usable)
    if not files:
        raise DataError(
            f"corpus {root!r} holds no usable text for training (<language>/*.txt: "
            + ("; ".join(skipped) if skipped else "none found")
            + ")"
        )
    corpus = Corpus(str(base), files, tuple(skipped))
    if skipped:
        log.warning("corpus: skipped %d file(s): %s", len(skipped), "; ".join(skipped))
    if corpus.long_lines():
        log.warning(
            "corpus: %d line(s) longer than %d bytes will be skipped",
            corpus.long_lines(),
            max_line_bytes,
        )
    return corpus
