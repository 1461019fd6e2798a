"""Several documents in one pack: `sekv ingest a.md notes/ -o corpus.sekv` joins them, each under a `## file: NAME`
line, and the manifest records where each one's tokens lie (document.parts)."""

from __future__ import annotations

import json
import re

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


# -- --doc: questions limited to some documents ------------------------------------------------------------------


@pytest.fixture(scope="module")
def three_docs(tmp_path_factory, tiny_qwen):
    """A sekv pack of three documents (the sample log's three parts), made through the CLI."""
    from conftest import SAMPLE_MD

    d = tmp_path_factory.mktemp("three")
    text = SAMPLE_MD.read_text()
    third = len(text) // 3
    for i, name in enumerate(("one.md", "two.md", "three.md")):
        (d / name).write_text(text[i * third : (i + 1) * third])
    pack = d / "c.sekv"
    code, _, err = run("ingest", d / "one.md", d / "two.md", d / "three.md", "-o", pack, "--model", tiny_qwen, "--budget", "0.3", "-q")
    assert code == 0, err
    return d, pack


@pytest.mark.parametrize("zoom,batched", [("router", False), ("router", True), ("all", False)], ids=["scout", "scout-batched", "zoom-all"])
def test_doc_zooms_and_cites_only_the_chosen_document(three_docs, lm, zoom, batched):
    """Property: under --doc, every zoomed span holds tokens of the chosen document and every evidence row lies in
    it; with zoom "all" (every candidate block expanded), exactly the blocks of that document are."""
    from sekv_core.evidence import evidence_rows
    from sekv_core.session import Session

    d, pack = three_docs
    if zoom == "all":  # the exactness setting (a parameter of the pack)
        from sekv_core.ingest import ingest

        pack = d / "all.sekv"
        if not pack.exists():
            ingest(load_corpus([d / "one.md", d / "two.md", d / "three.md"]), pack, lm=lm, params={"zoom": "all", "budget": 0.3})
    s = Session.open(pack, lm=lm, params={"budget": 0.9 if batched else 0.3})  # 0.9: room for more than the chosen document
    s.memory.batched = batched  # the accelerators' step (its fixed zoom sets), run on the CPU
    s.restrict(["two.md"])
    part = next(q for q in s.pack.manifest["document"]["parts"] if q["name"].endswith("two.md"))
    a, b = part["token_start"], part["token_end"]
    spans = s.memory.spans()
    for question in ("When was the lamp lit?", "What did the keeper write about the storm?"):
        ans = s.ask(question, max_new_tokens=3)
        counts = ans.stats.extra["span_zoom_counts"]
        assert counts, "nothing was zoomed"
        for sid in counts:
            x, y = spans[int(sid)]
            assert x < b and a < y, (sid, (x, y), (a, b))
        if zoom == "all":  # every span of the chosen document, none else
            assert {int(i) for i in counts} == {i for i, (x, y) in enumerate(spans) if x < b and a < y}
        rows = evidence_rows(s, counts, span_order=ans.stats.extra.get("span_order"), limit=100)
        assert rows and all(a <= r["tokens"][0] < r["tokens"][1] <= b and r["file"] == part["name"] for r in rows)
    s.restrict(None)  # all documents again: the other documents are zoomed too
    counts = s.ask("When was the lamp lit?", max_new_tokens=3).stats.extra["span_zoom_counts"]
    assert any(not (spans[int(i)][0] < b and a < spans[int(i)][1]) for i in counts)
    s.pack.close()


def test_doc_names_and_errors(three_docs, tiny_qwen, lm):
    from sekv_core.errors import SekvError
    from sekv_core.session import Session, pick_documents

    d, pack = three_docs
    m = read_pack(pack).manifest
    names = [q["name"] for q in m["document"]["parts"]]
    assert [q["name"] for q in pick_documents(m, ["three.md,one.md"])] == [names[0], names[2]]  # pack order, file names
    assert [q["name"] for q in pick_documents(m, [names[1], "two.md"])] == [names[1]]  # the path as listed, once
    with pytest.raises(SekvError, match="no such document"):
        pick_documents(m, ["four.md"])
    code, out, err = run("ask", pack, "q?", "--doc", "four.md", "--model", tiny_qwen, "-q")
    assert_one_line_error(code, err, "--doc four.md: no such document", names[0], names[2])
    full = d / "full.sekv"
    code, _, err = run("ingest", d / "one.md", d / "two.md", "-o", full, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    code, out, err = run("ask", full, "q?", "--doc", "one.md", "--model", tiny_qwen, "-q")
    assert_one_line_error(code, err, "--method full attends to every document")
    code, out, err = run("ask", pack, "When was the lamp lit?", "--doc", "two.md", "--model", tiny_qwen, "--json", "-n", "2")
    assert code == 0, err
    ev = json.loads(out)["evidence"]
    assert ev and {e["file"] for e in ev} == {names[1]}


def test_doc_limits_rag_retrieval(three_docs, tiny_qwen, lm):
    from sekv_core.session import Session

    d, _ = three_docs
    pack = d / "rag.sekv"
    code, _, err = run("ingest", d / "one.md", d / "two.md", d / "three.md", "-o", pack, "--model", tiny_qwen, "--method", "rag", "-q")
    assert code == 0, err
    s = Session.open(pack, lm=lm)
    part = s.pack.manifest["document"]["parts"][2]
    s.restrict(["three.md"])
    s.ask("When was the lamp lit?", max_new_tokens=1)
    chunks = s.memory.spans()
    assert s.memory.order and all(chunks[c][0] < part["token_end"] and part["token_start"] < chunks[c][1] for c in s.memory.order)
    s.pack.close()


def test_chat_takes_doc_and_the_doc_command(three_docs):
    from test_chat import chat

    d, pack = three_docs
    one, two = str(d / "one.md"), str(d / "two.md")
    script = "/doc\n/doc one.md\nWhen was the lamp lit?\n/doc all\n/doc nope.md\n/quit\n"
    out, err = chat(pack, script, "--doc", "two.md", "--show-evidence")
    said = [ln for ln in err.splitlines() if ln.startswith("questions about")]
    assert said == [f"questions about {two} only (--doc)", f"questions about {two} only", f"questions about {one} only",
                    "questions about every document"], err
    cited = re.findall(r"#\d+ (\S+) page", out + err)
    assert cited and set(cited) == {one}
    assert "--doc nope.md: no such document" in err
