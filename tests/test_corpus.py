"""Several documents in one pack: `sekv ingest a.md notes/ -o corpus.sekv` joins them, each under a `## file: NAME`
line, and the manifest records where each one's tokens lie (document.parts)."""

from __future__ import annotations

import json

import pytest

from sekv_core import prompt
from sekv_core.documents import load_corpus
from sekv_core.errors import DocumentError
from sekv_core.pack import read_pack
from test_cli import assert_one_line_error, run

A = "The lighthouse has 114 steps.\nIts lamp was lit in 1871."
B = "Notes on the harbour.\n\nThe pier is 300 metres long."
C = "Tide table for June: high water at 06:12."


@pytest.fixture
def corpus(tmp_path):
    (tmp_path / "notes" / "sub").mkdir(parents=True)
    (tmp_path / "notes" / "b.md").write_text(B)
    (tmp_path / "notes" / "sub" / "c.txt").write_text(C)
    (tmp_path / "notes" / "skip.json").write_text("{}")  # not a supported kind: the default --glob leaves it
    (tmp_path / "a.txt").write_text(A)
    return tmp_path


def test_folder_and_file_make_one_pack(corpus, lm, tiny_qwen):
    pack = corpus / "corpus.sekv"
    a, notes = corpus / "a.txt", corpus / "notes"
    code, out, err = run("ingest", a, notes, "-o", pack, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    names = [str(a), str(notes / "b.md"), str(notes / "sub" / "c.txt")]
    joined = "\n\n".join(f"## file: {n}\n\n{t}" for n, t in zip(names, (A, B, C)))  # built by hand, not by load_corpus
    want = lm.tokenizer(prompt.document_prefix(lm.tokenizer, joined), add_special_tokens=False)["input_ids"]
    p = read_pack(pack)
    m = p.manifest
    assert m["token_ids"] == want
    parts = m["document"]["parts"]
    assert [q["name"] for q in parts] == names and [q["kind"] for q in parts] == ["txt", "md", "txt"]
    assert m["document"]["kind"] == "corpus" and m["document"]["n_pages"] == 3
    assert 0 < parts[0]["token_start"] and all(x["token_end"] == y["token_start"] for x, y in zip(parts, parts[1:]))
    assert parts[-1]["token_end"] < m["n_tokens"]  # the prompt's closing follows the last document
    for q, text in zip(parts, (A, B, C)):
        piece = lm.tokenizer.decode(want[q["token_start"]:q["token_end"]])
        assert piece.strip().startswith(f"## file: {q['name']}") and text.split()[-1] in piece
    code, out, err = run("inspect", pack, "--json")
    assert code == 0, err
    assert [q["name"] for q in json.loads(out)["document"]["parts"]] == names


def test_one_file_alone_is_the_single_document(corpus):
    doc = load_corpus([corpus / "a.txt"])
    assert doc.parts == () and doc.text == A and doc.kind == "txt"


def test_glob_picks_the_folder_files(corpus):
    doc = load_corpus([corpus / "notes"], glob="*.txt")
    assert [q.name for q in doc.parts] == [str(corpus / "notes" / "sub" / "c.txt")]
    with pytest.raises(DocumentError, match="no file matching"):
        load_corpus([corpus / "notes"], glob="*.pdf")


@pytest.mark.parametrize("case", ["missing", "two stdin", "no -o", "folder without -o"])
def test_bad_corpus_inputs(case, corpus, tiny_qwen):
    a, notes, pack = corpus / "a.txt", corpus / "notes", corpus / "x.sekv"
    args, needle = {
        "missing": ([a, corpus / "nope.md", notes, "-o", pack], "nope.md: file not found"),
        "two stdin": (["-", a, "-", "-o", pack], "standard input (-) can be read only once"),
        "no -o": ([a, notes / "b.md"], "-o PACK"),
        "folder without -o": ([notes], "-o PACK"),
    }[case]
    code, out, err = run("ingest", *args, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 2
    assert_one_line_error(code, err, needle)
    assert not list(corpus.rglob("*.sekv"))


def _flat(s: str) -> str:
    return "".join(s.split())


def test_evidence_names_the_file_and_its_page(tmp_path, tiny_qwen, lm):
    """Every zoomable passage of a two-document pack (Markdown, then a 5-page PDF), as evidence: the file and page it
    names are where its text is, found by searching the documents' own texts (load_document), not the manifest."""
    import shutil

    from conftest import SAMPLE_MD, SAMPLE_PDF
    from sekv_core.documents import load_document
    from sekv_core.evidence import evidence_rows, label
    from sekv_core.session import Session

    shutil.copy(SAMPLE_MD, tmp_path / "log.md")
    shutil.copy(SAMPLE_PDF, tmp_path / "manual.pdf")
    pack = tmp_path / "c.sekv"
    code, out, err = run("ingest", tmp_path / "log.md", tmp_path / "manual.pdf", "-o", pack, "--model", tiny_qwen, "-q")
    assert code == 0, err
    pdf = load_document(tmp_path / "manual.pdf")
    log = _flat(load_document(SAMPLE_MD).text)
    pdf_pages = [_flat(pdf.text[s.start:s.end]) for s in pdf.pages]
    s = Session.open(pack, lm=lm)
    rows = evidence_rows(s, {i: 1 for i in range(len(s.memory.spans()))}, limit=10**6)
    checked = {"a": 0, "pdf": 0}
    for r in rows:
        t = _flat(r["text"])
        if "file:" in t or len(t) < 12:
            continue
        if t in log:
            assert r["file"] == str(tmp_path / "log.md") and r["page"] == 1, r
            checked["a"] += 1
        on = [p for p, text in enumerate(pdf_pages, 1) if t in text]
        if len(on) == 1:
            assert r["file"] == str(tmp_path / "manual.pdf") and r["page"] == on[0], r
            assert label(r).startswith(f"#{r['rank']} {tmp_path / 'manual.pdf'} page {on[0]} (")
            checked["pdf"] += 1
    assert checked["a"] >= 10 and checked["pdf"] >= 10, checked
    assert {r["page"] for r in rows if r["file"].endswith("manual.pdf")} == {1, 2, 3, 4, 5}
    s.pack.close()


def test_inspect_prints_document_names_escaped(tmp_path, tiny_qwen, monkeypatch):
    monkeypatch.chdir(tmp_path)  # names as given: short enough for one table row
    (tmp_path / "a.txt").write_text(A)
    crafted = "[bold red]x[link=y]\x1b[31m.md"
    (tmp_path / crafted).write_text(B)
    pack = tmp_path / "c.sekv"
    code, out, err = run("ingest", "a.txt", crafted, "-o", pack, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    code, out, err = run("inspect", pack)
    assert code == 0, err
    assert "\x1b" not in out and "[bold red]x[link=y]\\x1b[31m.md" in out and "a.txt" in out
    assert "2 documents" in out, out


def test_a_pack_whose_parts_are_out_of_range_is_refused(corpus, tiny_qwen):
    """document.parts is checked on read like the other fields: types, ranges inside [0, n_tokens) in order, pages."""
    from sekv_core.errors import PackError
    from sekv_core.pack import check_manifest

    pack = corpus / "c.sekv"
    code, _, err = run("ingest", corpus / "a.txt", corpus / "notes", "-o", pack, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    p = read_pack(pack)
    check_manifest(p)
    good = json.loads(json.dumps(p.manifest["document"]["parts"]))
    n = p.n_tokens()

    def edit(i, **kw):
        return [dict(q, **kw) if j == i else q for j, q in enumerate(good)]

    for bad in ([], "x", [1], edit(0, token_start=-1), edit(2, token_end=n + 1), edit(1, token_start=good[0]["token_start"]),
                edit(0, token_end=good[0]["token_start"]), edit(0, n_pages=2), edit(0, kind="exe"), edit(1, name=7),
                edit(0, sha256="z"), [{k: v for k, v in good[0].items() if k != "token_end"}] + good[1:]):
        p.manifest["document"]["parts"] = bad
        with pytest.raises(PackError, match="document.parts|documents"):
            check_manifest(p)
    p.close()
