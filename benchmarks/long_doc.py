"""One long real document for `sekv bench qa_long`: the GNU Bash Reference Manual, fetched and reduced to text.

The document is not ours and is not in the repository; this script makes it, the same bytes every time, from one
pinned Debian package, and checks the questions (benchmarks/long_doc_questions.md) against it:

    python -m benchmarks.long_doc fetch --out DIR          # DIR/bash_reference_manual.txt (418,005 bytes)
    python -m benchmarks.long_doc check --doc DIR/bash_reference_manual.txt [--model qwen2.5-0.5b]
    SEKV_LONG_DOC=DIR/bash_reference_manual.txt sekv bench qa_long --methods sekv,rag,full --budgets 0.05,0.1 --out RES

``fetch`` downloads ``bash-doc`` 5.2.15-2 (Debian 12 "bookworm", main) from the Debian archive (or takes the .deb
given with ``--deb``), checks its sha256, reads ``usr/share/doc/bash/bashref.html`` out of the package with Python
alone (a .deb is an ``ar`` archive holding ``data.tar.xz``; no dpkg needed), and reduces the HTML to plain text:
headings, paragraphs, examples and tables kept in order; the navigation bars, the table of contents, the chapters'
mini-menus, the GNU Free Documentation License appendix and the indexes after it dropped.  It checks the text's
sha256 against the one recorded here and writes the file atomically.

``check`` confirms that each question's expected answer occurs in the document where the questions file says
(the quoted evidence line, its character offset) and prints the answer's depth in the model's tokens.

The manual: "Bash Reference Manual", Edition 5.2 (19 September 2022), by Chet Ramey and Brian Fox,
Copyright (C) 1988-2022 Free Software Foundation, Inc., under the GNU Free Documentation License 1.3 or later
with no Invariant Sections (its own notice; the package's copyright file lists Bash as GPL-3+).
"""

from __future__ import annotations

import argparse
import hashlib
import html.parser
import io
import lzma
import os
import re
import sys
import tarfile
import tempfile
import urllib.request
from pathlib import Path

PACKAGE = "bash-doc"
VERSION = "5.2.15-2"
DEB_FILE = f"{PACKAGE}_{VERSION}_all.deb"
DEB_URL = f"http://deb.debian.org/debian/pool/main/b/bash/{DEB_FILE}"
DEB_SHA256 = "2c1a353f7004d14ba81db19c253b958d2dd9582027650739c530fd50376a9d8b"
MEMBER = "usr/share/doc/bash/bashref.html"
DOC_NAME = "bash_reference_manual.txt"
#: sha256 of the reduced text (UTF-8) as this script writes it; a different one means the reduction changed
TEXT_SHA256 = "f0fb87fad131fe5c1f6936ac94cf87e42381d2771e47dff3adf4ca6ca5fcb100"
LICENSE = "GNU Free Documentation License 1.3 or later, no Invariant Sections (the manual's notice)"
QUESTIONS = Path(__file__).resolve().parent / "long_doc_questions.md"
STOP_ID = "GNU-Free-Documentation-License"  # the GFDL appendix; the indexes follow it


class DocError(Exception):
    """A one-line reason the document could not be made."""


# ---------------------------------------------------------------------------------------------
# the package


def download(url: str = DEB_URL, timeout: float = 60.0) -> bytes:
    try:
        with urllib.request.urlopen(url, timeout=timeout) as r:
            return r.read()
    except OSError as e:
        raise DocError(f"could not download {url} ({e}); download it elsewhere and pass --deb FILE") from None


def check_sha256(data: bytes, expected: str | None = None) -> None:
    expected = expected or DEB_SHA256
    got = hashlib.sha256(data).hexdigest()
    if got != expected:
        raise DocError(f"{DEB_FILE}: sha256 {got} is not the pinned {expected}")


def ar_members(data: bytes) -> dict[str, bytes]:
    """The members of a Unix ``ar`` archive (a .deb's outer format): name -> bytes."""
    if not data.startswith(b"!<arch>\n"):
        raise DocError("not an ar archive (a .deb file)")
    out, pos = {}, 8
    while pos + 60 <= len(data):
        header = data[pos : pos + 60]
        name = header[:16].decode("ascii", "replace").strip().rstrip("/")
        try:
            size = int(header[48:58].decode("ascii").strip())
        except ValueError:
            raise DocError("a damaged ar archive (member size)") from None
        out[name] = data[pos + 60 : pos + 60 + size]
        pos += 60 + size + (size & 1)  # members are 2-byte aligned
    return out


def read_member(deb: bytes, member: str = MEMBER) -> bytes:
    """One file of a .deb's data.tar.xz, without unpacking anything to disk."""
    data = ar_members(deb).get("data.tar.xz")
    if data is None:
        raise DocError("the package has no data.tar.xz")
    with tarfile.open(fileobj=io.BytesIO(lzma.decompress(data)), mode="r:") as tar:
        for name in (member, "./" + member):
            try:
                f = tar.extractfile(name)
            except KeyError:
                continue
            if f is not None:
                return f.read()
    raise DocError(f"the package has no {member}")


# ---------------------------------------------------------------------------------------------
# HTML -> text


class _Manual(html.parser.HTMLParser):
    """Texinfo's HTML of one manual -> its text, in order: headings, paragraphs, examples (their lines kept), table
    rows (cells separated by two spaces), definition lists.  Dropped: <head>, navigation bars (div.header), the table
    of contents (div.Contents_element), the mini-menus (ul.section-toc), the headings' pilcrow links
    (a.copiable-anchor), and everything from the element whose id is
    STOP_ID on."""

    SKIP_TAGS = {"head", "style", "script"}
    SKIP_CLASSES = {"header", "Contents_element", "section-toc", "copiable-anchor"}
    BLOCK = {"p", "div", "li", "dt", "dd", "tr", "table", "blockquote", "ul", "ol", "dl", "hr"}
    HEADINGS = {"h1", "h2", "h3", "h4", "h5", "h6"}

    def __init__(self):
        super().__init__(convert_charrefs=True)
        self.parts: list[str] = []
        self.skip: list[str] = []  # open tags of a skipped element (its tag, repeated for nested same tags)
        self.pre = 0
        self.stopped = False

    def handle_starttag(self, tag, attrs):
        if self.stopped:
            return
        a = dict(attrs)
        if a.get("id") == STOP_ID:
            self.stopped = True
            return
        if self.skip:
            if tag == self.skip[0]:
                self.skip.append(tag)
            return
        classes = set((a.get("class") or "").split())
        if tag in self.SKIP_TAGS or classes & self.SKIP_CLASSES:
            self.skip.append(tag)
            return
        if tag == "pre":
            self.pre += 1
            self.parts.append("\n\n")
        elif tag in self.HEADINGS:
            self.parts.append("\n\n")
        elif tag in self.BLOCK:
            self.parts.append("\n")
        elif tag == "br":
            self.parts.append("\n")
        elif tag == "td" or tag == "th":
            self.parts.append("  ")

    def handle_endtag(self, tag):
        if self.stopped:
            return
        if self.skip:
            if tag == self.skip[0]:
                self.skip.pop()
            return
        if tag == "pre":
            self.pre = max(0, self.pre - 1)
            self.parts.append("\n\n")
        elif tag in self.HEADINGS:
            self.parts.append("\n\n")
        elif tag in self.BLOCK:
            self.parts.append("\n")

    def handle_data(self, data):
        if self.stopped or self.skip:
            return
        if self.pre:
            self.parts.append(data.replace("\n", "\x00"))  # kept as line breaks below
        else:
            self.parts.append(data)


def html_to_text(raw: str) -> str:
    p = _Manual()
    p.feed(raw)
    p.close()
    text = "".join(p.parts)
    lines = []
    for line in text.split("\n"):
        for piece in line.split("\x00"):  # an example's own lines: trailing space dropped, indentation kept
            lines.append(piece.rstrip() if "\x00" in line else re.sub(r"[ \t\r\f\v]+", " ", piece).strip())
    text = "\n".join(lines)
    return re.sub(r"\n{3,}", "\n\n", text).strip() + "\n"


def make_document(deb: bytes) -> str:
    check_sha256(deb)
    raw = read_member(deb).decode("utf-8")
    return html_to_text(raw)


def write_atomic(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8", newline="\n") as f:
            f.write(text)
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def fetch(out_dir: Path, deb_file: Path | None = None, cut_chars: int | None = None) -> Path:
    """Make out_dir/DOC_NAME from the pinned package (downloaded, or deb_file); returns its path.  cut_chars: also
    write the document's first cut_chars characters (ended at a line end) as out_dir/first_N_chars.txt, for a small
    run whose questions are the ones that fall in it (`sekv bench qa_long` leaves the others out and says so)."""
    if deb_file is not None:
        try:
            deb = deb_file.read_bytes()
        except OSError as e:
            raise DocError(f"cannot read {deb_file}: {e.strerror or e}") from None
    else:
        deb = download()
    text = make_document(deb)
    digest = hashlib.sha256(text.encode("utf-8")).hexdigest()
    if TEXT_SHA256 and digest != TEXT_SHA256:
        raise DocError(f"the reduced text's sha256 {digest} is not the recorded {TEXT_SHA256}: the reduction changed "
                       "(another Python's html.parser?); the questions' offsets may not hold")
    path = out_dir / DOC_NAME
    write_atomic(path, text)
    if cut_chars:
        end = text.rfind("\n", 0, cut_chars)
        write_atomic(out_dir / f"first_{cut_chars}_chars.txt", text[: end if end > 0 else cut_chars] + "\n")
    return path


# ---------------------------------------------------------------------------------------------
# checking the questions against the document


def check(doc: Path, model: str | None) -> int:
    """Each question: its evidence exactly once in the document, at the recorded offset, holding an expected answer;
    its depth in the model's tokens against the recorded one.  Returns the process exit status."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from sekv_core.bench import tasks
    from sekv_core.documents import load_document

    text = load_document(doc).text  # as `sekv bench qa_long` and `sekv ingest` read it
    qs = tasks.parse_long_questions(QUESTIONS.read_text(encoding="utf-8"))
    tok = n_all = None
    if model:
        from benchmarks.ingest_scale import tokenizer_of

        tok = tokenizer_of(model)
        n_all = len(tok(text, add_special_tokens=False)["input_ids"])
        print(f"{doc}: {len(text):,} characters, {n_all:,} tokens of {model}")
    bad = 0
    for q in qs:
        where = [m.start() for m in re.finditer(re.escape(q.evidence), text)]
        holds = any(a.lower() in q.evidence.lower() for a in q.answers)
        ok = where == [q.offset] and holds
        depth = ""
        if tok is not None and where:
            d = 100 * len(tok(text[: where[0]], add_special_tokens=False)["input_ids"]) / n_all
            ok = ok and abs(d - q.depth) < 0.1
            depth = f"  depth {d:5.1f} % (recorded {q.depth:g})"
        print(f"{'ok ' if ok else 'BAD'} Q{q.number:<3} found {len(where)}x at {where[:3]} (recorded {q.offset})"
              f"{'' if holds else ', evidence lacks the answer'}{depth}  {q.answers[0]!r}")
        bad += not ok
    print(f"{len(qs) - bad} of {len(qs)} questions check")
    return 1 if bad else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help=f"download {DEB_FILE}, check it, write DIR/{DOC_NAME}")
    f.add_argument("--out", type=Path, required=True, help="output folder")
    f.add_argument("--deb", type=Path, help=f"a local copy of {DEB_FILE} instead of downloading it")
    f.add_argument("--cut-chars", type=int, help="also write the first N characters as DIR/first_N_chars.txt (small runs)")
    c = sub.add_parser("check", help="check the questions' answers and offsets against the document")
    c.add_argument("--doc", type=Path, required=True)
    c.add_argument("--model", default="qwen2.5-0.5b", help="tokenizer for the depths ('' for none)")
    a = ap.parse_args(argv)
    try:
        if a.cmd == "fetch":
            path = fetch(a.out, a.deb, a.cut_chars)
            text = path.read_text(encoding="utf-8")
            print(f"{path}: {len(text):,} characters, sha256 {hashlib.sha256(text.encode('utf-8')).hexdigest()}")
            return 0
        if not a.doc.is_file():
            raise DocError(f"{a.doc} not found; make it with `python -m benchmarks.long_doc fetch --out DIR`")
        return check(a.doc, a.model or None)
    except DocError as e:
        print(f"long_doc: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
