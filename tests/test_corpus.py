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
