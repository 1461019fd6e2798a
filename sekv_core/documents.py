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

    path: Path
    name: str  # file name
    kind: str  # "pdf" | "txt" | "md"
    text: str
    sha256: str  # hex sha256 of the file's bytes
    pages: tuple[PageSpan, ...]

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


def _span_start(span: PageSpan) -> int:
    return span.start


def load_document(path: str | Path) -> Document:
    """Read a .pdf, .txt or .md file; raise DocumentError on any problem."""
    p = Path(path).expanduser()
    shown = str(path)

    if not p.exists():
        raise _error(shown, "file not found; check the path")
    if p.is_dir():
        raise _error(shown, "is a directory, not a file; pass a .pdf, .txt or .md file")
    suffix = p.suffix.lower()
    if suffix not in SUPPORTED_SUFFIXES:
        got = f"'{p.suffix}'" if p.suffix else "no suffix"
        raise _error(
            shown,
            f"unsupported file type ({got}); supported: {', '.join(SUPPORTED_SUFFIXES)}"
            " (convert the document to PDF or plain text first)",
        )
    try:
        data = p.read_bytes()
    except PermissionError:
        raise _error(shown, "cannot be read (permission denied); check the file's permissions") from None
    except OSError as exc:
        reason = exc.strerror or type(exc).__name__
        raise _error(shown, f"cannot be read ({reason}); check that the file is accessible") from None

    kind = suffix[1:]
    if kind == "pdf":
        text, pages = _read_pdf(data, shown)
    else:
        text = _read_text(data, shown)
        pages = (PageSpan(page=1, start=0, end=len(text)),)

    return Document(
        path=p,
        name=p.name,
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


def _read_text(data: bytes, shown: str) -> str:
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
