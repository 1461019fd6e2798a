"""Build sample_docs/halden_hx40_manual.pdf from halden_hx40_manual.md.

The PDF is committed to the repository, so users and tests do NOT need to run
this script (or install anything for it).  It is kept only so the PDF can be
regenerated after editing the Markdown source.

Requirements: reportlab (written against reportlab 5.1.0; any 4.x/5.x should
work).  It is deliberately not a dependency of sekv; use a throwaway venv:

    python3 -m venv /tmp/pdfgen
    /tmp/pdfgen/bin/pip install "reportlab>=4,<6"
    /tmp/pdfgen/bin/python sample_docs/make_sample_pdf.py

Only a small Markdown subset is understood, enough for the manual: "#", "##"
and "###" headings, paragraphs separated by blank lines, "- " bullet lists,
"1. " numbered lists and **bold**.  Bullets are drawn as "-" because
reportlab's bullet glyph extracts as U+007F with pypdf.  Output uses the standard Helvetica fonts
(no embedding) so pypdf can extract the text, and reportlab's "invariant"
mode so that regenerating from unchanged source gives a byte-identical file.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path
from xml.sax.saxutils import escape

from reportlab import rl_config

rl_config.invariant = 1  # no timestamps / random IDs: reproducible output

from reportlab.lib.pagesizes import A4  # noqa: E402
from reportlab.lib.styles import ParagraphStyle, getSampleStyleSheet  # noqa: E402
from reportlab.lib.units import mm  # noqa: E402
from reportlab.platypus import (  # noqa: E402
    BaseDocTemplate, Frame, PageTemplate, Paragraph, Spacer,
)

HERE = Path(__file__).resolve().parent
SOURCE = HERE / "halden_hx40_manual.md"
OUTPUT = HERE / "halden_hx40_manual.pdf"
FOOTER = "Halden HX-40 Installation and Operation Manual (HX40-IOM rev. C)"


def _styles() -> dict[str, ParagraphStyle]:
    base = getSampleStyleSheet()
    body = ParagraphStyle(
        "Body", parent=base["Normal"], fontName="Helvetica", fontSize=10.5,
        leading=14, spaceAfter=6,
    )
    return {
        "title": ParagraphStyle(
            "Title", parent=body, fontName="Helvetica-Bold", fontSize=17,
            leading=21, spaceAfter=12,
        ),
        "h2": ParagraphStyle(
            "H2", parent=body, fontName="Helvetica-Bold", fontSize=13.5,
            leading=17, spaceBefore=10, spaceAfter=6,
        ),
        "h3": ParagraphStyle(
            "H3", parent=body, fontName="Helvetica-Bold", fontSize=11.5,
            leading=15, spaceBefore=6, spaceAfter=4,
        ),
        "body": body,
        "item": ParagraphStyle(
            "Item", parent=body, leftIndent=16, bulletIndent=4, spaceAfter=3,
        ),
    }


def _inline(text: str) -> str:
    """Escape for reportlab's mini-markup, then turn **x** into bold."""
    return re.sub(r"\*\*(.+?)\*\*", r"<b>\1</b>", escape(text))


def markdown_to_flowables(source: str) -> list:
    st = _styles()
    out: list = []
    for block in re.split(r"\n\s*\n", source.strip()):
        lines = [ln.rstrip() for ln in block.strip().splitlines()]
        first = lines[0]
        if first.startswith("### "):
            out.append(Paragraph(_inline(first[4:]), st["h3"]))
        elif first.startswith("## "):
            out.append(Paragraph(_inline(first[3:]), st["h2"]))
        elif first.startswith("# "):
            out.append(Paragraph(_inline(first[2:]), st["title"]))
        elif all(ln.startswith("- ") for ln in lines):
            for ln in lines:
                out.append(Paragraph(_inline(ln[2:]), st["item"], bulletText="-"))
            out.append(Spacer(1, 4))
        elif all(re.match(r"\d+\. ", ln) for ln in lines):
            for ln in lines:
                num, rest = ln.split(" ", 1)
                out.append(Paragraph(_inline(rest), st["item"], bulletText=num))
            out.append(Spacer(1, 4))
        else:
            out.append(Paragraph(_inline(" ".join(lines)), st["body"]))
    return out


def _footer(canvas, doc) -> None:
    canvas.saveState()
    canvas.setFont("Helvetica", 8.5)
    canvas.drawString(20 * mm, 12 * mm, FOOTER)
    canvas.drawRightString(A4[0] - 20 * mm, 12 * mm, f"Page {doc.page}")
    canvas.restoreState()


def build(source: Path = SOURCE, output: Path = OUTPUT) -> None:
    doc = BaseDocTemplate(
        str(output), pagesize=A4,
        leftMargin=20 * mm, rightMargin=20 * mm, topMargin=20 * mm, bottomMargin=22 * mm,
        title="Halden HX-40 Heat Pump Water Heater - Installation and Operation Manual",
        author="sekv project (fictional sample document)",
        subject="Sample document for sekv; CC0",
    )
    frame = Frame(doc.leftMargin, doc.bottomMargin, doc.width, doc.height, id="body")
    # Footer drawn at page END so text extraction yields it after the page body.
    doc.addPageTemplates([PageTemplate(id="page", frames=[frame], onPageEnd=_footer)])
    doc.build(markdown_to_flowables(source.read_text(encoding="utf-8")))


if __name__ == "__main__":
    src = Path(sys.argv[1]) if len(sys.argv) > 1 else SOURCE
    dst = Path(sys.argv[2]) if len(sys.argv) > 2 else OUTPUT
    build(src, dst)
    print(f"wrote {dst}")
