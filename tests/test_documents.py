"""Tests for sekv_core.documents (PDF/txt/md loading, page spans, errors)."""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path

import os

import pytest
from pypdf import PdfReader, PdfWriter
from pypdf.generic import DecodedStreamObject, DictionaryObject, NameObject

from sekv_core import documents
from sekv_core.documents import (
    SUPPORTED_SUFFIXES,
    Document,
    PageSpan,
    load_document,
)
from sekv_core.errors import DocumentError, SekvError

SAMPLE_PDF = Path(__file__).resolve().parent.parent / "sample_docs" / "halden_hx40_manual.pdf"
SAMPLE_MD = Path(__file__).resolve().parent.parent / "sample_docs" / "lighthouse_keepers_log.md"


# --------------------------------------------------------------------------
# helpers


def _write_text_pdf(path: Path, pages: list[str | None]) -> Path:
    """A PDF whose pages show the given lines in Helvetica (None = blank page)."""
    writer = PdfWriter()
    font = DictionaryObject(
        {
            NameObject("/Type"): NameObject("/Font"),
            NameObject("/Subtype"): NameObject("/Type1"),
            NameObject("/BaseFont"): NameObject("/Helvetica"),
            NameObject("/Encoding"): NameObject("/WinAnsiEncoding"),
        }
    )
    font_ref = writer._add_object(font)
    for text in pages:
        page = writer.add_blank_page(width=612, height=792)
        if text is None:
            continue
        shown = " ".join(f"({line}) '" for line in text.split("\n"))
        stream = DecodedStreamObject()
        stream.set_data(f"BT /F1 12 Tf 72 740 Td 14 TL {shown} ET".encode("latin-1"))
        page[NameObject("/Contents")] = writer._add_object(stream)
        page[NameObject("/Resources")] = DictionaryObject(
            {NameObject("/Font"): DictionaryObject({NameObject("/F1"): font_ref})}
        )
    with open(path, "wb") as fh:
        writer.write(fh)
    return path


def _error_of(path) -> str:
    with pytest.raises(DocumentError) as info:
        load_document(path)
    msg = str(info.value)
    assert "\n" not in msg and "\r" not in msg, f"message must be one line: {msg!r}"
    assert isinstance(info.value, SekvError)
    return msg


def _check_spans(doc: Document) -> None:
    """Spans are ordered, lie inside the text, and separators are exactly '\\n\\n'."""
    text_spans = [s for s in doc.pages if s.end > s.start]
    assert [s.page for s in doc.pages] == list(range(1, len(doc.pages) + 1))
    assert text_spans, "at least one page has text"
    assert text_spans[0].start == 0
    assert text_spans[-1].end == len(doc.text)
    for a, b in zip(text_spans, text_spans[1:]):
        assert doc.text[a.end:b.start] == documents.PAGE_SEPARATOR
    for s in doc.pages:
        assert 0 <= s.start <= s.end <= len(doc.text)
    for s in text_spans:
        for off in (s.start, (s.start + s.end) // 2, s.end - 1):
            assert doc.page_at(off) == s.page


# --------------------------------------------------------------------------
# the committed sample PDF


def test_sample_pdf_loads_with_pages_and_facts():
    doc = load_document(SAMPLE_PDF)
    assert doc.kind == "pdf"
    assert doc.name == "halden_hx40_manual.pdf"
    assert doc.path == SAMPLE_PDF
    assert doc.sha256 == hashlib.sha256(SAMPLE_PDF.read_bytes()).hexdigest()
    assert 3 <= len(doc.pages) <= 5
    assert len(doc.pages) == len(PdfReader(SAMPLE_PDF).pages)
    _check_spans(doc)

    first, last = doc.pages[0], doc.pages[-1]
    page1 = doc.text[first.start:first.end]
    page_last = doc.text[last.start:last.end]
    assert "Installation and Operation Manual" in page1
    assert "Maximum inlet water pressure: 8.6 bar" in page1
    assert "Storage tank against leaks: 7 years" in page_last
    assert "Storage tank against leaks" not in page1

    # A fact located by offset maps to the page that holds it.
    off = doc.text.index("Every 18 months")
    span = next(s for s in doc.pages if s.start <= off < s.end)
    assert doc.page_at(off) == span.page
    assert span.page not in (1, len(doc.pages))

    # Offsets outside the text clamp to the first/last page.
    assert doc.page_at(-5) == 1
    assert doc.page_at(len(doc.text)) == len(doc.pages)
    assert doc.page_at(len(doc.text) + 10_000) == len(doc.pages)

    # Light normalisation.
    assert "\n\n\n" not in doc.text
    assert "\x00" not in doc.text
    assert all(line == line.rstrip() for line in doc.text.split("\n"))


def test_sample_markdown_loads():
    doc = load_document(SAMPLE_MD)
    assert doc.kind == "md"
    assert doc.pages == (PageSpan(page=1, start=0, end=len(doc.text)),)
    assert "117 steps" in doc.text


# --------------------------------------------------------------------------
# PDFs built on the fly


def test_generated_pdf_spans_and_normalisation(tmp_path):
    pdf = _write_text_pdf(
        tmp_path / "three.pdf",
        ["alpha first page   \nsecond line", "bravo middle page", "charlie last page"],
    )
    doc = load_document(pdf)
    assert len(doc.pages) == 3
    _check_spans(doc)
    for span, word in zip(doc.pages, ["alpha", "bravo", "charlie"]):
        page_text = doc.text[span.start:span.end]
        assert word in page_text
        assert doc.page_at(doc.text.index(word)) == span.page
        others = {"alpha", "bravo", "charlie"} - {word}
        assert not any(o in page_text for o in others)
    # Offsets inside a separator belong to the earlier page.
    assert doc.page_at(doc.pages[0].end) == 1
    assert doc.page_at(doc.pages[0].end + 1) == 1
    assert "first page\n" in doc.text  # trailing spaces stripped


def test_blank_page_in_the_middle_gets_empty_span(tmp_path):
    pdf = _write_text_pdf(tmp_path / "gap.pdf", [None, "alpha words", None, "delta words", None])
    doc = load_document(pdf)
    assert len(doc.pages) == 5
    _check_spans(doc)
    assert [s.end - s.start > 0 for s in doc.pages] == [False, True, False, True, False]
    assert doc.text == "alpha words\n\ndelta words"
    assert doc.page_at(0) == 2
    assert doc.page_at(doc.text.index("delta")) == 4
    assert doc.page_at(doc.pages[1].end) == 2  # first separator char: not blank page 3
    assert doc.page_at(10**9) == 4


def test_empty_password_encrypted_pdf_is_accepted(tmp_path):
    writer = PdfWriter(clone_from=_write_text_pdf(tmp_path / "plain.pdf", ["echo open text"]))
    writer.encrypt(user_password="", owner_password="owner-secret")
    target = tmp_path / "restricted.pdf"
    with open(target, "wb") as fh:
        writer.write(fh)
    assert PdfReader(target).is_encrypted
    doc = load_document(target)
    assert "echo open text" in doc.text


def test_encrypted_pdf(tmp_path):
    writer = PdfWriter(clone_from=_write_text_pdf(tmp_path / "plain.pdf", ["secret text"]))
    writer.encrypt("secret")
    target = tmp_path / "locked.pdf"
    with open(target, "wb") as fh:
        writer.write(fh)
    msg = _error_of(target)
    assert "locked.pdf" in msg
    assert "encrypted" in msg
    assert "decrypt" in msg and "qpdf" in msg


def test_encrypted_pdf_needing_cryptography(tmp_path, monkeypatch):
    from pypdf.errors import DependencyError

    writer = PdfWriter(clone_from=_write_text_pdf(tmp_path / "plain.pdf", ["x"]))
    writer.encrypt("secret")
    target = tmp_path / "aes.pdf"
    with open(target, "wb") as fh:
        writer.write(fh)

    def boom(self, password):
        raise DependencyError("cryptography is required for AES algorithm")

    monkeypatch.setattr(PdfReader, "decrypt", boom)
    msg = _error_of(target)
    assert "aes.pdf" in msg and "encrypted" in msg and "cryptography" in msg


def test_pdf_without_text_suggests_ocr(tmp_path):
    writer = PdfWriter()
    writer.add_blank_page(width=612, height=792)
    writer.add_blank_page(width=612, height=792)
    target = tmp_path / "scan.pdf"
    with open(target, "wb") as fh:
        writer.write(fh)
    msg = _error_of(target)
    assert "scan.pdf" in msg
    assert "no extractable text" in msg
    assert "OCR" in msg and "ocrmypdf" in msg


def test_pdf_suffix_but_not_a_pdf(tmp_path):
    fake = tmp_path / "fake.pdf"
    fake.write_text("just some text, not a PDF\n")
    msg = _error_of(fake)
    assert "fake.pdf" in msg and "not a valid PDF" in msg


def test_truncated_pdf(tmp_path):
    data = SAMPLE_PDF.read_bytes()
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(data[:300])
    msg = _error_of(broken)
    assert "broken.pdf" in msg and "not a valid PDF" in msg


# --------------------------------------------------------------------------
# text and Markdown


@pytest.mark.parametrize("suffix", [".txt", ".md"])
def test_text_with_bom_and_crlf(tmp_path, suffix):
    path = tmp_path / f"notes{suffix}"
    raw = "\ufeff# Title\r\n\r\n\r\n\r\nBody line   \r\nSecond caf\u00e9 line\r\n".encode("utf-8")
    path.write_bytes(raw)
    doc = load_document(path)
    assert doc.kind == suffix[1:]
    assert doc.text == "# Title\n\nBody line\nSecond caf\u00e9 line"
    assert not doc.text.startswith("\ufeff")
    assert doc.pages == (PageSpan(page=1, start=0, end=len(doc.text)),)
    assert doc.page_at(0) == 1 and doc.page_at(10**6) == 1
    assert doc.sha256 == hashlib.sha256(raw).hexdigest()


def test_uppercase_suffix_accepted(tmp_path):
    path = tmp_path / "README.TXT"
    path.write_text("hello world")
    assert load_document(str(path)).kind == "txt"


def test_binary_text_file(tmp_path):
    path = tmp_path / "image.txt"
    path.write_bytes(b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(range(256)))
    msg = _error_of(path)
    assert "image.txt" in msg and "binary" in msg


def test_non_utf8_text_file(tmp_path):
    path = tmp_path / "latin.md"
    path.write_bytes("caf\u00e9 cr\u00e8me br\u00fbl\u00e9e".encode("latin-1"))
    msg = _error_of(path)
    assert "latin.md" in msg and "UTF-8" in msg


@pytest.mark.parametrize("content", [b"", b"  \n\t\r\n \n", b"\xef\xbb\xbf\n"])
def test_empty_text_file(tmp_path, content):
    path = tmp_path / "empty.txt"
    path.write_bytes(content)
    msg = _error_of(path)
    assert "empty.txt" in msg and "empty" in msg.split(":", 1)[1]


# --------------------------------------------------------------------------
# path problems


def test_unknown_suffix(tmp_path):
    path = tmp_path / "report.docx"
    path.write_bytes(b"PK\x03\x04")
    msg = _error_of(path)
    assert "report.docx" in msg and ".docx" in msg
    for suffix in SUPPORTED_SUFFIXES:
        assert suffix in msg


def test_no_suffix(tmp_path):
    path = tmp_path / "Makefile"
    path.write_text("all:\n")
    msg = _error_of(path)
    assert "Makefile" in msg and "no suffix" in msg


def test_missing_file(tmp_path):
    msg = _error_of(tmp_path / "nowhere.pdf")
    assert "nowhere.pdf" in msg and "not found" in msg


def test_directory(tmp_path):
    folder = tmp_path / "folder.md"
    folder.mkdir()
    msg = _error_of(folder)
    assert "folder.md" in msg and "directory" in msg


@pytest.mark.parametrize(
    "exc, expected",
    [(PermissionError(13, "Permission denied"), "permission denied"), (OSError(5, "Input/output error"), "Input/output error")],
)
def test_unreadable_file(tmp_path, monkeypatch, exc, expected):
    path = tmp_path / "private.txt"
    path.write_text("secret")

    def fail(self, *a, **k):
        raise exc

    monkeypatch.setattr(Path, "open", fail)
    msg = _error_of(path)
    assert "private.txt" in msg and "cannot be read" in msg and expected in msg


def test_pypdf_warnings_are_silenced(tmp_path, capsys, caplog):
    broken = tmp_path / "broken.pdf"
    broken.write_bytes(b"%PDF-1.4\ngarbage")
    _error_of(broken)
    assert "EOF marker" not in capsys.readouterr().err
    assert not [r for r in caplog.records if r.name.startswith("pypdf")]
    assert logging.getLogger("pypdf").level == logging.NOTSET  # restored


def test_newline_in_file_name_keeps_message_one_line(tmp_path):
    msg = _error_of(tmp_path / "odd\nname.pdf")  # missing; the name itself has a newline
    assert "odd name.pdf" in msg


# --------------------------------------------------------------------------
# sample_docs/QUESTIONS.md stays in sync with the sample documents


def _questions() -> list[tuple[str, str, str, int, bool]]:
    """(document, question, answer, page, is_demo) rows from QUESTIONS.md."""
    rows, doc_name = [], None
    for line in (SAMPLE_PDF.parent / "QUESTIONS.md").read_text(encoding="utf-8").splitlines():
        if line.startswith("## "):
            doc_name = line[3:].split()[0]
        elif line.startswith("| ") and line[2:3].isdigit():
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows.append((doc_name, cells[1], cells[2], int(cells[3]), "demo" in cells[4]))
    return rows


def test_sample_questions_answers_are_verbatim_on_their_page():
    rows = _questions()
    assert len(rows) == 10
    docs = {name: load_document(SAMPLE_PDF.parent / name) for name in {r[0] for r in rows}}
    assert set(docs) == {"halden_hx40_manual.pdf", "lighthouse_keepers_log.md"}
    for name, doc in docs.items():
        own = [r for r in rows if r[0] == name]
        assert len(own) == 5 and sum(r[4] for r in own) == 1
        low = doc.text.lower()
        for _, question, answer, page, _ in own:
            starts = [i for i in range(len(low)) if low.startswith(answer.lower(), i)]
            assert starts, f"{name}: answer {answer!r} to {question!r} not in text"
            assert page in {doc.page_at(i) for i in starts}, f"{name}: {answer!r} not on page {page}"


def test_non_regular_inputs_are_refused(tmp_path):
    """A FIFO or a device named like a document would block or never end: refused before reading."""
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    assert "not a regular file" in _error_of(fifo)
    link = tmp_path / "zero.txt"
    link.symlink_to("/dev/zero")
    assert "not a regular file" in _error_of(link)


def test_size_limit(tmp_path):
    big = tmp_path / "big.txt"
    big.write_text("word " * 1000)
    with pytest.raises(DocumentError, match="limit; raise it with --max-input-mb"):
        load_document(big, max_bytes=1000)
    assert load_document(big, max_bytes=10000).text.startswith("word")


def test_utf16_with_bom_is_text(tmp_path):
    for enc, bom in (("utf-16-le", b"\xff\xfe"), ("utf-16-be", b"\xfe\xff")):
        p = tmp_path / f"{enc}.txt"
        p.write_bytes(bom + "Grüße, 東京\nzweite Zeile".encode(enc))
        assert load_document(p).text == "Grüße, 東京\nzweite Zeile"
