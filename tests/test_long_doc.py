"""`sekv bench qa_long`: one long real document as one context (its questions file, the task, the runner past the
window, the missing-document errors) and benchmarks/long_doc.py, which makes the document from a pinned package."""

from __future__ import annotations

import hashlib
import io
import lzma
import re
import tarfile

import pytest
import torch
from typer.testing import CliRunner

from conftest import ROOT
from benchmarks import long_doc
from sekv_cli.app import app
from sekv_core import prompt
from sekv_core.bench import runner, scoring, tasks
from sekv_core.errors import SekvError

cli = CliRunner()


# ---------------------------------------------------------------------------------------------
# the questions file


HAND = """# title

| # | Question | Expected answer | Offset | Depth % | Evidence |
|---|---|---|---|---|---|
| 2 | What is ‘\\|&’ short for? | 2>&1 \\| | 1,200 | 40.5 | it is shorthand for 2>&1 \\|. |
| 1 | Which escape? | \\A | 30 | 3 | \\A ⏎ ⏎ The time, in HH:MM format. |
| x | not a question row | a | 1 | 1 | a |

Notes:

- Q2: accept "2>&1"; a wrapped note line is read too:
  accept "2>&1|" but not this "quote".
- Q9: accept "nothing" (no such question)
"""


def test_parse_long_questions_hand_case():
    qs = tasks.parse_long_questions(HAND)
    assert [q.number for q in qs] == [1, 2]  # sorted by number; the non-numeric row is not a question
    q1, q2 = qs
    assert q1.question == "Which escape?" and q1.answers == ["\\A"] and (q1.offset, q1.depth) == (30, 3.0)
    assert q1.evidence == "\\A\n\nThe time, in HH:MM format."  # ⏎ is a line break, spaces around it dropped
    assert q2.question == "What is ‘|&’ short for?" and q2.evidence == "it is shorthand for 2>&1 |."
    assert q2.offset == 1200 and q2.depth == 40.5
    assert q2.answers == ["2>&1 |", "2>&1", "2>&1|"]  # notes: only accept "..." counts; Q9 is no question


def test_parse_long_questions_rejects_a_bad_offset():
    with pytest.raises(SekvError, match="question 3: offset 'abc'"):
        tasks.parse_long_questions("| 3 | q | a | abc | 5 | a |")


def test_repository_questions_are_spread_and_hold_their_answers():
    """benchmarks/long_doc_questions.md: 12-16 questions, evidence in document order from <10 % to >90 % of the
    document, each evidence holding an expected answer as the scorer matches it (whole word)."""
    qs = tasks.parse_long_questions(tasks.long_questions_file().read_text(encoding="utf-8"))
    assert 12 <= len(qs) <= 16 and [q.number for q in qs] == list(range(1, len(qs) + 1))
    assert [q.offset for q in qs] == sorted(q.offset for q in qs) and len({q.offset for q in qs}) == len(qs)
    assert [q.depth for q in qs] == sorted(q.depth for q in qs)
    assert qs[0].depth < 10 and qs[-1].depth > 90
    assert max(b.depth - a.depth for a, b in zip(qs, qs[1:])) < 15  # no long stretch without a question
    for q in qs:
        probe = tasks.Probe("", q.question, q.answers, whole_word=True)
        assert scoring.score(q.evidence, probe)[0], q.number


# ---------------------------------------------------------------------------------------------
# the task


FACTS = [("frobnicate limit", "7341"), ("quux timeout", "250 ms"), ("widget colour", "teal")]


def _doc_and_questions(tmp_path, filler_paragraphs: int = 12):
    """A document of filler with three planted facts (early, middle, late) and its questions file."""
    filler = (ROOT / "sample_docs" / "lighthouse_keepers_log.md").read_text(encoding="utf-8").split("\n\n")
    paras = [p for p in filler if len(p) > 80][:filler_paragraphs]
    at = {1: 0, len(paras) // 2: 1, len(paras) - 1: 2}
    parts = []
    for i, p in enumerate(paras):
        parts.append(p)
        if i in at:
            name, value = FACTS[at[i]]
            parts.append(f"The {name} is {value}.")
    text = "\n\n".join(parts)
    rows = []
    for n, (name, value) in enumerate(FACTS, 1):
        ev = f"The {name} is {value}."
        rows.append(f"| {n} | What is the {name}? | {value} | {text.index(ev)} | {100 * text.index(ev) / len(text):.1f} | {ev} |")
    doc = tmp_path / "long.txt"
    doc.write_text(text, encoding="utf-8")
    qfile = tmp_path / "questions.md"
    qfile.write_text("| # | Question | Expected answer | Offset | Depth % | Evidence |\n|---|---|---|---|---|---|\n" + "\n".join(rows) + "\n"
                     "\n- Q2: accept \"250\"\n", encoding="utf-8")
    return doc, qfile, text


@pytest.fixture
def questions(tmp_path, monkeypatch):
    doc, qfile, text = _doc_and_questions(tmp_path)
    monkeypatch.setattr(tasks, "long_questions_file", lambda: qfile)
    monkeypatch.delenv(tasks.LONG_DOC_ENV, raising=False)
    return doc, text


def test_qa_long_is_one_context_with_every_question(tiny_qwen, questions, monkeypatch):
    from transformers import AutoTokenizer

    doc, text = questions
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    [ctx] = tasks.generate("qa_long", tok, lengths=[4096], depths=[0], seed=0, doc_file=doc)  # lengths/depths: not used
    assert ctx.task == "qa_long" and ctx.depth is None and ctx.document == text
    assert ctx.n_tokens == ctx.length == len(prompt.encode(tok, prompt.document_prefix(tok, text)))
    assert [p.item for p in ctx.probes] == [f"Q{n}@{100 * text.index(f'The {a} is {v}.') / len(text):.0f}%" for n, (a, v) in enumerate(FACTS, 1)]
    assert [p.expected for p in ctx.probes] == [["7341"], ["250 ms", "250"], ["teal"]]
    assert all(p.whole_word for p in ctx.probes) and ctx.meta["left_out"] == 0 and "note" not in ctx.meta
    monkeypatch.setenv(tasks.LONG_DOC_ENV, str(doc))  # the environment variable names it too
    assert tasks.generate("qa_long", tok, lengths=[1], depths=[0], seed=0)[0].document == text
    assert "qa_long" not in tasks.expand_tasks("all") and tasks.expand_tasks("qa_long") == ["qa_long"]


def test_qa_long_document_cut_short_keeps_the_questions_it_holds(tiny_qwen, questions, tmp_path):
    from transformers import AutoTokenizer

    doc, text = questions
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    cut = tmp_path / "cut.txt"
    cut.write_text(text[: text.index("The widget colour") - 5], encoding="utf-8")
    [ctx] = tasks.generate("qa_long", tok, lengths=[1], depths=[0], seed=0, doc_file=cut)
    assert [p.expected[0] for p in ctx.probes] == ["7341", "250 ms"]
    assert ctx.meta["left_out"] == 1 and "1 of 3 questions left out" in ctx.meta["note"]
    cut.write_text(text[:20], encoding="utf-8")
    with pytest.raises(SekvError, match="ends before the evidence of every question"):
        tasks.generate("qa_long", tok, lengths=[1], depths=[0], seed=0, doc_file=cut)


def test_qa_long_wrong_or_missing_document_is_one_line(tiny_qwen, questions, tmp_path, monkeypatch):
    from transformers import AutoTokenizer

    doc, text = questions
    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    other = tmp_path / "other.txt"
    other.write_text(text.replace("7341", "7342"), encoding="utf-8")
    with pytest.raises(SekvError, match=r"question 1's evidence is not at character \d+: not the document"):
        tasks.generate("qa_long", tok, lengths=[1], depths=[0], seed=0, doc_file=other)
    with pytest.raises(SekvError, match="pass --doc-file FILE or set SEKV_LONG_DOC"):
        tasks.generate("qa_long", tok, lengths=[1], depths=[0], seed=0)
    monkeypatch.setenv(tasks.LONG_DOC_ENV, str(tmp_path / "nope.txt"))
    with pytest.raises(SekvError, match="nope.txt not found"):
        tasks.generate("qa_long", tok, lengths=[1], depths=[0], seed=0)


def _one_line_error(result, *needles):
    assert result.exit_code == 2, result.stderr
    lines = [ln for ln in result.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("sekv: error: "), result.stderr
    for n in needles:
        assert n in lines[0]


def test_cli_qa_long_without_its_document_is_one_line_before_the_model_loads(tmp_path, monkeypatch):
    monkeypatch.delenv(tasks.LONG_DOC_ENV, raising=False)
    missing = tmp_path / "no_such_model"  # never loaded: the document is checked first
    args = ["bench", "qa_long", "--model", str(missing), "--out", str(tmp_path / "o")]
    _one_line_error(cli.invoke(app, args), "qa_long needs its document", "--doc-file", "SEKV_LONG_DOC")
    _one_line_error(cli.invoke(app, args + ["--doc-file", str(tmp_path / "gone.txt")]), "gone.txt not found", "benchmarks.long_doc fetch")
    _one_line_error(cli.invoke(app, args, env={tasks.LONG_DOC_ENV: str(tmp_path / "env.txt")}), "env.txt not found")
    assert not (tmp_path / "o").exists()


@pytest.fixture(scope="module")
def lm512(tmp_path_factory):
    from conftest import make_tiny_model
    from sekv_core import models

    return models.load(str(make_tiny_model(tmp_path_factory.mktemp("tiny512"), "qwen2", max_positions=512)), device="cpu", dtype=torch.float32)


def test_qa_long_past_the_window_runs_every_method_on_one_context(lm512, tmp_path, monkeypatch):
    """A document past a 512-position model's window: one context; full reads it with YaRN, sekv in windows, rag
    natively (as `niah` past the window); every question asked of each; the run resumes without re-running."""
    doc, qfile, text = _doc_and_questions(tmp_path, filler_paragraphs=8)
    monkeypatch.setattr(tasks, "long_questions_file", lambda: qfile)
    cfg = runner.BenchConfig(tasks=["qa_long"], methods=["full", "sekv", "rag"], budgets=[0.5], lengths=[1], depths=[0],
                             max_new_tokens=4, doc_file=doc)
    [ctx] = runner.plan_contexts(lm512.tokenizer, cfg)
    assert 512 < ctx.n_tokens <= 4 * 512 - 512  # past the window, within what YaRN x4 carries with ingest's reserve
    out = tmp_path / "res"
    o = runner.run(lm512, cfg, out)
    assert o.errors == [] and o.added == 3 * 3 and o.prefills == 2  # one YaRN prefill (full), one windowed (sekv, rag)
    recs = runner.read_results(out / runner.RESULTS_FILE)
    assert {(r["method"], r["item"]) for r in recs} == {(m, p.item) for m in ("full", "sekv", "rag") for p in ctx.probes}
    by = {r["method"]: r for r in recs}
    assert by["full"]["rope_factor"] in (2.0, 3.0, 4.0) and by["sekv"]["rope_factor"] is None and by["rag"]["rope_factor"] is None
    assert by["sekv"]["prefill_with"][-1].endswith("windows") and all(r["n_tokens"] == ctx.n_tokens for r in recs)
    assert runner.run(lm512, cfg, out).added == 0


# ---------------------------------------------------------------------------------------------
# benchmarks/long_doc.py: the package and the reduction


PAGE = """<html><head><title>T</title><style>p {x}</style></head><body>
<h1 class="settitle">Manual</h1>
<div class="Contents_element" id="SEC_Contents"><h2>Table of Contents</h2><div class="contents"><ul><li>1 Intro</li></ul></div></div>
<div class="chapter" id="Intro"><div class="header"><p>Next: <a href="#x">X</a></p></div>
<h2 class="chapter">1 Intro<a class="copiable-anchor" href="#Intro"> &para;</a></h2>
<ul class="section-toc"><li><a href="#a">menu entry</a></li></ul>
<p>The   <code>HISTSIZE</code> default
is 500 &amp; more.</p>
<pre class="example">if x; then
    echo  "two  spaces"
fi
</pre>
<table><tr><td>a</td><td>b</td></tr></table>
<dl><dt>term</dt><dd>definition</dd></dl>
</div>
<div class="appendix" id="GNU-Free-Documentation-License"><h2>Appendix C GNU Free Documentation License</h2><p>licence text</p></div>
<div class="appendix" id="Indexes"><p>index text</p></div>
</body></html>"""


def test_html_to_text_keeps_the_manual_and_drops_navigation_contents_and_licence():
    text = long_doc.html_to_text(PAGE)
    assert text == ("Manual\n\n1 Intro\n\nThe HISTSIZE default\nis 500 & more.\n\n"
                    "if x; then\n    echo  \"two  spaces\"\nfi\n\na b\n\nterm\n\ndefinition\n")
    for gone in ("Table of Contents", "Next:", "menu entry", "¶", "licence text", "index text", "p {x}"):
        assert gone not in text


def _deb(files: dict[str, bytes]) -> bytes:
    """A minimal .deb: an ar archive of debian-binary, control.tar.xz and data.tar.xz (odd-sized members padded)."""
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w") as tar:
        for name, data in files.items():
            info = tarfile.TarInfo("./" + name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    members = [("debian-binary", b"2.0\n"), ("control.tar.xz", lzma.compress(b"x")), ("data.tar.xz", lzma.compress(buf.getvalue()))]
    out = b"!<arch>\n"
    for name, data in members:
        out += f"{name + '/':<16}{0:<12}{0:<6}{0:<6}{'100644':<8}{len(data):<10}`\n".encode("ascii") + data + (b"\n" if len(data) % 2 else b"")
    return out


def test_deb_member_is_read_and_checked_without_dpkg(monkeypatch):
    deb = _deb({"usr/share/doc/other.txt": b"odd", long_doc.MEMBER: PAGE.encode("utf-8")})
    assert long_doc.read_member(deb) == PAGE.encode("utf-8")
    with pytest.raises(long_doc.DocError, match="sha256 .* is not the pinned"):
        long_doc.make_document(deb)
    monkeypatch.setattr(long_doc, "DEB_SHA256", hashlib.sha256(deb).hexdigest())
    assert long_doc.make_document(deb) == long_doc.html_to_text(PAGE)
    with pytest.raises(long_doc.DocError, match="no usr/share/doc/bash/bashref.html"):
        long_doc.read_member(_deb({"usr/share/doc/other.txt": b"odd"}))
    with pytest.raises(long_doc.DocError, match="not an ar archive"):
        long_doc.read_member(b"PK\x03\x04")


def test_fetch_writes_the_document_atomically_and_its_cut(tmp_path, monkeypatch):
    deb = _deb({long_doc.MEMBER: PAGE.encode("utf-8")})
    monkeypatch.setattr(long_doc, "DEB_SHA256", hashlib.sha256(deb).hexdigest())
    (tmp_path / "pkg.deb").write_bytes(deb)
    text = long_doc.html_to_text(PAGE)
    monkeypatch.setattr(long_doc, "TEXT_SHA256", "0" * 64)  # a reduction that changed: nothing is written
    assert long_doc.main(["fetch", "--out", str(tmp_path / "d"), "--deb", str(tmp_path / "pkg.deb")]) == 2
    assert not (tmp_path / "d" / long_doc.DOC_NAME).exists()
    monkeypatch.setattr(long_doc, "TEXT_SHA256", hashlib.sha256(text.encode("utf-8")).hexdigest())
    assert long_doc.main(["fetch", "--out", str(tmp_path / "d"), "--deb", str(tmp_path / "pkg.deb"), "--cut-chars", "30"]) == 0
    assert (tmp_path / "d" / long_doc.DOC_NAME).read_text(encoding="utf-8") == text
    cut = (tmp_path / "d" / "first_30_chars.txt").read_text(encoding="utf-8")
    assert text.startswith(cut.rstrip("\n")) and len(cut) <= 31 and cut.endswith("\n")
    assert sorted(p.name for p in (tmp_path / "d").iterdir()) == [long_doc.DOC_NAME, "first_30_chars.txt"]  # no temporaries


def test_pinned_constants_agree_with_the_questions_file():
    md = tasks.long_questions_file().read_text(encoding="utf-8")
    assert long_doc.DEB_SHA256 in md and long_doc.TEXT_SHA256 in md and long_doc.DEB_FILE in md and long_doc.DEB_URL in md
    assert re.search(r"[0-9a-f]{64}", long_doc.TEXT_SHA256)
