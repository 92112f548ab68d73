"""A directory of text files, checked before TensorFlow ever reads it.

Layout: `CORPUS/<language>/*.txt`, one document per line, UTF-8 (the shipped corpus in data/corpus
is one). A language directory becomes one seqio task; the languages are mixed by temperature
sampling. The scan runs in Python at start-up, so that bad input is reported in plain words
rather than as a TensorFlow error in the middle of a run:

- a missing or unreadable corpus path, or one with no usable text at all: `DataError` (the CLI
  prints one line and exits 2);
- an empty file, or one that is not valid UTF-8: skipped, counted and named in one warning;
- a line longer than `max_line_bytes` (a 10 MB line is a broken file, not a document): skipped
  by the pipeline, counted here.
"""

from __future__ import annotations

import codecs
import dataclasses
import logging
import os
from pathlib import Path

from t5scale.errors import DataError

log = logging.getLogger(__name__)

_CHUNK = 1 << 22  # files are checked 4 MiB at a time, never whole in memory


@dataclasses.dataclass(frozen=True)
class TextFile:
    path: str
    lines: int  # non-empty lines
    long_lines: int  # lines over the limit, which the pipeline skips


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


def _check_file(path: Path, max_line_bytes: int) -> TextFile | str:
    """The file's line counts, or why it is skipped."""
    try:
        if path.stat().st_size == 0:
            return "empty"
        decoder = _Utf8Checker()
        lines = long_lines = current = 0
        with path.open("rb") as f:
            while chunk := f.read(_CHUNK):
                if not decoder.feed(chunk):
                    return "not valid UTF-8"
                lines, long_lines, current = _count_lines(
                    chunk, lines, long_lines, current, max_line_bytes
                )
        if current:  # last line without a newline
            lines += 1
            long_lines += current > max_line_bytes
        if not decoder.finish():
            return "not valid UTF-8"
    except OSError as error:
        return f"unreadable: {error.strerror or error}"
    if lines == 0:
        return "no text"
    return TextFile(str(path), lines, long_lines)


def _count_lines(
    chunk: bytes, lines: int, long_lines: int, current: int, limit: int
) -> tuple[int, int, int]:
    """Advance (non-empty lines, long lines, length of the open line) over one chunk."""
    start = 0
    while (end := chunk.find(b"\n", start)) != -1:
        length = current + end - start
        if length:
            lines += 1
            long_lines += length > limit
        current, start = 0, end + 1
    return lines, long_lines, current + len(chunk) - start


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
    root: str, languages: tuple[str, ...] = (), max_line_bytes: int = 1 << 20
) -> Corpus:
    """Check every `root/<language>/*.txt`; raise DataError if nothing usable is left."""
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
            checked = _check_file(path, max_line_bytes)
            if isinstance(checked, str):
                skipped.append(f"{path} ({checked})")
            else:
                usable.append(checked)
        if usable:
            files[language] = tuple(usable)
    if not files:
        raise DataError(f"corpus {root!r} holds no usable text files (<language>/*.txt)")
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
