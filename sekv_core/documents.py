"""Loading documents (PDF, plain text, Markdown) into one text with page spans.

:func:`load_document` is the only entry point.  It returns a :class:`Document`
whose ``text`` is what the model reads, and whose ``pages`` map character
offsets in that text back to 1-based page numbers (for citations).

Every problem a user can cause raises :class:`~sekv_core.errors.DocumentError`
with a one-line message that names the file and says what to do.
"""

from __future__ import annotations

import bisect
import hashlib
import contextlib
import io
import logging
import re
import stat
from dataclasses import dataclass
from pathlib import Path

from .errors import DocumentError

SUPPORTED_SUFFIXES = (".pdf", ".txt", ".md")

PAGE_SEPARATOR = "\n\n"
"""Inserted between the texts of consecutive (non-empty) PDF pages."""

_BINARY_SNIFF_BYTES = 8192
_UTF8_BOM = b"\xef\xbb\xbf"
_CONTROL_RE = re.compile(r"[\x00-\x08\x0e-\x1f\x7f]")  # NUL & co; keeps \t \n \r
_TRAILING_SPACE_RE = re.compile(r"[ \t]+$", re.MULTILINE)
_MANY_NEWLINES_RE = re.compile(r"\n{3,}")


@dataclass(frozen=True)
class PageSpan:
    """Where one page's text lies in :attr:`Document.text`."""

    page: int  # 1-based page number
    start: int  # char offset in Document.text (inclusive)
    end: int  # char offset (exclusive)


@dataclass(frozen=True)
class Document:
    """A loaded document: normalised text plus page spans.

    For PDFs, ``text`` is the pages' texts joined with ``"\\n\\n"`` and
    ``text[span.start:span.end]`` is exactly the (normalised) text of page
    ``span.page``; the separators lie between spans.  A page without text has
    an empty span.  For txt/md there is a single page 1 covering all text.
    """

    path: Path | None  # None: read from standard input
    name: str  # file name
    kind: str  # "pdf" | "txt" | "md"
    text: str
    sha256: str  # hex sha256 of the file's bytes
    pages: tuple[PageSpan, ...]
    parts: tuple["Part", ...] = ()  # a corpus (load_corpus): the documents it joins, in order; () for one document

    def page_at(self, char_offset: int) -> int:
        """Page number containing ``char_offset`` (binary search over spans).

        Offsets in the separator between two pages belong to the earlier
        page; offsets past the end give the last page with text, negative
        offsets the first.  Pages without text (empty spans) are skipped
        unless every page is empty.
        """
        pages = self.pages
        if not pages:
            return 1
        i = bisect.bisect_right(pages, char_offset, key=_span_start) - 1
        i = max(i, 0)
        # Step off empty pages: back to the previous page with text, else forward.
        j = i
        while j >= 0 and pages[j].end <= pages[j].start:
            j -= 1
        if j < 0:
            j = i
            while j < len(pages) and pages[j].end <= pages[j].start:
                j += 1
            if j == len(pages):
                j = i
        return pages[j].page


@dataclass(frozen=True)
class Part:
    """One document of a corpus: where its heading line and text lie in the corpus's text, and its pages there
    (numbered on through the corpus: this part's page p is the corpus's page ``first_page + p - 1``)."""

    path: Path | None
    name: str  # as the heading line shows it: the path as given, on one line
    kind: str
    sha256: str
    n_pages: int
    first_page: int
    start: int  # char offset of the heading line in the corpus text
    end: int  # char offset where the document's text ends


def _span_start(span: PageSpan) -> int:
    return span.start


#: the largest document file read by default (a 1,000-page PDF is ~10-50 MB; text past the model's window is refused later)
DEFAULT_MAX_BYTES = 256 << 20
STDIN = "-"


def load_document(path: str | Path, max_bytes: int = DEFAULT_MAX_BYTES) -> Document:
    """Read a .pdf, .txt or .md file (or ``-``: standard input, PDF or text); raise DocumentError on any problem.

    Only regular files are read (a FIFO or a device named like a document is refused: it could block or never
    end), at most ``max_bytes`` of them."""
    if str(path) == STDIN:
        import sys

        data = _read_limited(sys.stdin.buffer, max_bytes, "standard input")
        kind = "pdf" if data[:1024].lstrip().startswith(b"%PDF-") else "txt"
        return _document(None, "stdin", kind, data, "standard input")
    p = Path(path).expanduser()
    shown = str(path)

    try:
        st = p.stat()
    except FileNotFoundError:
        raise _error(shown, "file not found; check the path") from None
    except OSError as exc:
        raise _error(shown, f"cannot be read ({exc.strerror or type(exc).__name__}); check that the file is accessible") from None
    if stat.S_ISDIR(st.st_mode):
        raise _error(shown, "is a directory, not a file; pass a .pdf, .txt or .md file")
    if not stat.S_ISREG(st.st_mode):
        raise _error(shown, "is not a regular file (a FIFO, device or socket); pass a file, or - to read standard input")
    suffix = p.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        got = f"'{p.suffix}'" if p.suffix else "no suffix"
        raise _error(
            shown,
            f"unsupported file type ({got}); supported: {', '.join(SUPPORTED_SUFFIXES)}"
            " (convert the document to PDF or plain text first)",
        )
    if st.st_size > max_bytes:
        raise _error(shown, f"is {_size(st.st_size)}, more than the {_size(max_bytes)} limit; raise it with --max-input-mb")
    try:
        with p.open("rb") as f:
            data = _read_limited(f, max_bytes, shown)
    except PermissionError:
        raise _error(shown, "cannot be read (permission denied); check the file's permissions") from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise _error(shown, f"cannot be read ({reason}); check that the file is accessible") from None
    return _document(p, p.name, suffix[1:], data, shown)


def _read_limited(f, max_bytes: int, shown: str) -> bytes:
    data = f.read(max_bytes + 1)
    if len(data) > max_bytes:
        raise _error(shown, f"is more than the {_size(max_bytes)} limit; raise it with --max-input-mb")
    return data


def _size(n: int) -> str:
    return f"{n / 2**20:.0f} MiB" if n >= 2**20 else f"{n:,} bytes"


def _document(p: Path | None, name: str, kind: str, data: bytes, shown: str) -> Document:
    if kind == "pdf":
        text, pages = _read_pdf(data, shown)
    else:
        text = _read_text(data, shown)
        pages = (PageSpan(page=1, start=0, end=len(text)),)

    return Document(
        path=p,
        name=name,
        kind=kind,
        text=text,
        sha256=hashlib.sha256(data).hexdigest(),
        pages=pages,
    )


# --------------------------------------------------------------------------
# helpers


def _one_line(s: str) -> str:
    return " ".join(s.split())


def _error(shown_path: str, message: str) -> DocumentError:
    # The path can contain anything (even newlines); keep the message one line.
    name = shown_path.replace("\r", " ").replace("\n", " ")
    return DocumentError(f"{name}: {_one_line(message)}")


def _normalise(text: str) -> str:
    """Light whitespace clean-up applied to each page (or the whole text file)."""
    text = _CONTROL_RE.sub("", text)
    text = text.replace("\r\n", "\n").replace("\r", "\n")
    text = text.replace("\f", "\n").replace("\v", "\n")
    text = _TRAILING_SPACE_RE.sub("", text)
    text = _MANY_NEWLINES_RE.sub("\n\n", text)
    # Leading/trailing blank lines only; keep the first line's indentation.
    text = text.strip("\n")
    return text


_UTF16_32_BOMS = ((b"\xff\xfe\x00\x00", "utf-32-le"), (b"\x00\x00\xfe\xff", "utf-32-be"), (b"\xff\xfe", "utf-16-le"), (b"\xfe\xff", "utf-16-be"))


def _read_text(data: bytes, shown: str) -> str:
    for bom, enc in _UTF16_32_BOMS:  # UTF-16 / UTF-32 text announces itself with a byte order mark
        if data.startswith(bom):
            try:
                data = data[len(bom):].decode(enc).encode("utf-8")
            except UnicodeDecodeError:
                raise _error(shown, f"starts with a {enc.upper()} byte order mark but is not valid {enc.upper()}; convert it to UTF-8 first") from None
            break
    if b"\x00" in data[:_BINARY_SNIFF_BYTES]:
        raise _error(shown, "looks like a binary file, not text; pass a UTF-8 text or Markdown file")
    if data.startswith(_UTF8_BOM):
        data = data[len(_UTF8_BOM):]
    try:
        raw = data.decode("utf-8")
    except UnicodeDecodeError:
        raise _error(
            shown,
            "is not valid UTF-8 text (binary, or another encoding); "
            "convert it to UTF-8 first (e.g. iconv -f latin1 -t utf-8)",
        ) from None
    text = _normalise(raw)
    if not text.strip():
        raise _error(shown, "the document is empty (no text); pass a file with content")
    return text


@contextlib.contextmanager
def _quiet_pypdf():
    """Hide pypdf's warnings (e.g. "EOF marker not found") while reading.

    Problems that matter become a DocumentError; the rest is noise on the
    CLI's stderr.  Restores the logger level afterwards.
    """
    logger = logging.getLogger("pypdf")
    old = logger.level
    logger.setLevel(logging.ERROR)
    try:
        yield
    finally:
        logger.setLevel(old)


def _read_pdf(data: bytes, shown: str) -> tuple[str, tuple[PageSpan, ...]]:
    with _quiet_pypdf():
        return _read_pdf_quietly(data, shown)


def _read_pdf_quietly(data: bytes, shown: str) -> tuple[str, tuple[PageSpan, ...]]:
    from pypdf import PdfReader  # imported lazily: only needed for PDFs
    from pypdf.errors import DependencyError, FileNotDecryptedError

    not_pdf = "not a valid PDF (damaged, or not a PDF despite its suffix); re-export or repair it (e.g. qpdf in.pdf out.pdf)"
    if b"%PDF-" not in data[:1024]:
        raise _error(shown, not_pdf)
    try:
        reader = PdfReader(io.BytesIO(data))
    except Exception:
        raise _error(shown, not_pdf) from None

    encrypted = (
        "is an encrypted (password-protected) PDF; decrypt it first "
        "(e.g. qpdf --decrypt --password=PASSWORD in.pdf out.pdf)"
    )
    try:
        is_encrypted = reader.is_encrypted
    except Exception:
        raise _error(shown, not_pdf) from None
    if is_encrypted:
        # PDFs with an empty user password (only "owner" restrictions) open fine.
        try:
            ok = reader.decrypt("")
        except DependencyError:
            raise _error(
                shown,
                "is an encrypted PDF whose cipher needs the 'cryptography' package; "
                "pip install cryptography, or decrypt it first (e.g. qpdf --decrypt in.pdf out.pdf)",
            ) from None
        except Exception:
            raise _error(shown, encrypted) from None
        if not ok:
            raise _error(shown, encrypted)

    try:
        n_pages = len(reader.pages)
    except FileNotDecryptedError:
        raise _error(shown, encrypted) from None
    except Exception:
        raise _error(shown, not_pdf) from None
    if n_pages == 0:
        raise _error(shown, "the document is empty (the PDF has no pages); pass a PDF with content")

    parts: list[str] = []
    spans: list[PageSpan] = []
    pos = 0
    for number in range(1, n_pages + 1):
        try:
            raw = reader.pages[number - 1].extract_text() or ""
        except FileNotDecryptedError:
            raise _error(shown, encrypted) from None
        except Exception as exc:
            raise _error(
                shown,
                f"text of page {number} cannot be extracted ({type(exc).__name__}); "
                "the PDF may be damaged: re-export or repair it (e.g. qpdf in.pdf out.pdf)",
            ) from None
        page_text = _normalise(raw)
        if not page_text.strip():
            # No text on this page (blank or scanned): empty span, no separator.
            spans.append(PageSpan(page=number, start=pos, end=pos))
            continue
        if parts:
            parts.append(PAGE_SEPARATOR)
            pos += len(PAGE_SEPARATOR)
        parts.append(page_text)
        spans.append(PageSpan(page=number, start=pos, end=pos + len(page_text)))
        pos += len(page_text)

    text = "".join(parts)
    if not text.strip():
        raise _error(
            shown,
            "the PDF has no extractable text (probably scanned images); "
            "run OCR on it first (e.g. ocrmypdf in.pdf out.pdf)",
        )
    return text, tuple(spans)


# --------------------------------------------------------------------------
# several documents: one corpus

DEFAULT_GLOB = ",".join("*" + s for s in SUPPORTED_SUFFIXES)
PART_HEADING = "## file: "
"""Each document of a corpus is introduced by a line ``## file: NAME`` so the model can tell them apart."""
PART_SEPARATOR = "\n\n"


def corpus_files(inputs: list[str | Path], glob: str = DEFAULT_GLOB) -> list[str | Path]:
    """The files several inputs name, in order: a file as given, a folder's files matching ``glob`` (comma-separated
    patterns, matched on file names; subfolders read recursively, symlinked folders not followed) sorted by path,
    ``-`` (standard input) at most once.  DocumentError for a folder with no matching file or a second ``-``."""
    import fnmatch
    import os

    patterns = [g.strip() for g in glob.split(",") if g.strip()]
    if not patterns:
        raise DocumentError(f"--glob {glob!r}: give at least one pattern, e.g. {DEFAULT_GLOB}")
    files: list[str | Path] = []
    if sum(str(i) == STDIN for i in inputs) > 1:
        raise DocumentError("standard input (-) can be read only once; name it once among the inputs")
    for item in inputs:
        p = Path(item).expanduser() if str(item) != STDIN else None
        if p is None or not p.is_dir():
            files.append(item)
            continue
        found = []
        for root, dirs, names in os.walk(p):
            dirs.sort()
            found += [Path(root) / n for n in names if any(fnmatch.fnmatch(n, g) for g in patterns)]
        if not found:
            raise _error(str(item), f"is a folder with no file matching {','.join(patterns)}; pass files, or another --glob")
        files += sorted(found, key=lambda f: f.relative_to(p).parts)
    return files


def load_corpus(inputs: list[str | Path], glob: str = DEFAULT_GLOB, max_bytes: int = DEFAULT_MAX_BYTES, headings: bool = False) -> Document:
    """Several inputs (files, folders, ``-``) as one document: each file read by :func:`load_document` (its limits
    and refusals), introduced by a line ``## file: NAME``, joined in order; pages numbered on through the corpus
    and each document's place in :attr:`Document.parts`.  One file given alone is :func:`load_document`'s document.
    At most ``max_bytes`` a file, and of joined text.  ``headings``: a corpus even of one file (its heading line
    and parts; what `sekv add` appends)."""
    if not headings and len(inputs) == 1 and (str(inputs[0]) == STDIN or not Path(inputs[0]).expanduser().is_dir()):
        return load_document(inputs[0], max_bytes=max_bytes)
    files = corpus_files(inputs, glob)
    texts: list[str] = []
    pages: list[PageSpan] = []
    parts: list[Part] = []
    pos = total = 0
    for f in files:
        d = load_document(f, max_bytes=max_bytes)
        total += len(d.text.encode())
        if total > max_bytes:
            raise _error(str(f), f"brings the inputs past the {_size(max_bytes)} limit in all; raise it with --max-input-mb")
        name = "stdin" if d.path is None else _one_line(str(f)) or d.name
        if texts:
            texts.append(PART_SEPARATOR)
            pos += len(PART_SEPARATOR)
        heading = f"{PART_HEADING}{name}\n\n"
        start, body = pos, pos + len(heading)
        texts += [heading, d.text]
        pos = body + len(d.text)
        first = len(pages) + 1
        pages += [PageSpan(first + i, body + s.start, body + s.end) for i, s in enumerate(d.pages)]
        parts.append(Part(d.path, name, d.kind, d.sha256, len(d.pages), first, start, pos))
    digest = hashlib.sha256("".join(f"{q.sha256} {q.name}\n" for q in parts).encode()).hexdigest()
    label = f"{parts[0].name} and {len(parts) - 1} more" if len(parts) > 1 else parts[0].name
    return Document(None, label, "corpus", "".join(texts), digest, tuple(pages), tuple(parts))
