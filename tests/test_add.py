"""`sekv add PACK DOC...` (sekv_core/add.py, sekv/append.py): documents appended to a pack without reading the others.

References: the token ids built by hand from the prompt's text; the pack before the add (its part must be unchanged,
bit for bit); a windowed ingest's window of the added part at the same positions (prefill_window + compress_window,
the path tests/test_windows.py checks against one prefill); plain transformers' KV cache of the joined text (full);
the file's bytes (atomicity)."""

from __future__ import annotations

import hashlib
import json

import pytest
import torch

from conftest import SAMPLE_MD  # noqa: F401  (the fixtures' sample documents)

from sekv_core import prompt, windows
from sekv_core.add import add
from sekv_core.documents import load_corpus
from sekv_core.errors import SekvError
from sekv_core.ingest import WINDOW_ENV, ingest
from sekv_core.pack import read_pack
from sekv_core.prefill import prefill_window
from sekv_core.sekv import codec, compress, layout, lexical, scout
from sekv_core.sekv import factorize as fz
from sekv_core.sekv.params import SekvParams
from sekv_core.session import Session
from test_cli import assert_one_line_error, run

EXACT = {"store_dtype": "model", "factor_bits": 8}
B = "Notes on the harbour.\n\nThe pier is 300 metres long. The gate code is 4417."
C = "Tide table for June: high water at 06:12."


@pytest.fixture
def docs(tmp_path):
    from conftest import ROOT

    (tmp_path / "a.txt").write_text((ROOT / "sample_docs" / "lighthouse_keepers_log.md").read_text()[:2500])
    (tmp_path / "b.md").write_text(B)
    (tmp_path / "c.txt").write_text(C)
    return tmp_path


def _tensors(path) -> dict[str, torch.Tensor]:
    p = read_pack(path)
    try:
        return {k: p.get(k) for k in p.keys()}
    finally:
        p.close()


def _added_ids(lm, docs) -> list[int]:
    joined = f"## file: {docs / 'b.md'}\n\n{B}\n\n## file: {docs / 'c.txt'}\n\n{C}"  # by hand, not by load_corpus
    return lm.tokenizer("<document>\n" + joined + "\n</document>\n\n", add_special_tokens=False)["input_ids"]


def _per_head(f: fz.Factors, span_len: torch.Tensor, d: int) -> list[dict[str, torch.Tensor]]:
    """Each KV head's run of the packed factors (us, vt, us_scale, vt_scale), split by hand."""
    r = f.rank.long()
    sizes = {"us": (r * span_len.view(1, -1)).sum(1), "vt": r.sum(1) * d, "us_scale": span_len.sum().expand(r.shape[0]), "vt_scale": r.sum(1)}
    parts = {k: torch.split(getattr(f, k), v.tolist()) for k, v in sizes.items()}
    return [{k: parts[k][h] for k in sizes} for h in range(r.shape[0])]


def _window_piece(lm, ids: list[int], n_old: int, params: SekvParams, cfg: dict):
    """The added part as windowed ingest compresses a window at [n_old, n): header + carried tokens (the pack's
    document tokens, all of them) + its own part."""
    header = len(lm.tokenizer(prompt.document_header(lm.tokenizer), add_special_tokens=False)["input_ids"])
    w = windows.Window(1, 2, n_old, len(ids), n_old - header, header)  # the whole text fits: every pack token carried
    r = prefill_window(lm.model, ids, header, w, with_surprisal=True, capture=("obs_queries",), obs_window=scout.PROFILE_QUERIES)
    p = params.__class__.from_dict(params.to_dict() | {"min_span": cfg["min_span"], "max_span": cfg["max_span"], "window": cfg["window"]}, "sekv")
    return compress.compress_window(r, p)


@pytest.mark.parametrize("coded", [False, True], ids=["int8", "4-bit"])
def test_sekv_add_keeps_the_pack_and_appends_a_window_of_the_added_part(docs, lm, coded):
    pack = docs / "p.sekv"
    params = EXACT | ({"factor_bits": 4} if coded else {})
    ingest(docs / "a.txt", pack, lm=lm, method="sekv", params=params)
    before, m0 = _tensors(pack), read_pack(pack).manifest
    r = add(pack, load_corpus([docs / "b.md", docs / "c.txt"], headings=True), lm=lm)
    after, m1 = _tensors(pack), read_pack(pack).manifest
    new = _added_ids(lm, docs)
    n_old, n = m0["n_tokens"], m0["n_tokens"] + len(new)
    assert m1["token_ids"] == m0["token_ids"] + new and r.n_tokens == n == m1["n_tokens"] and r.windows == 1
    assert m1["windows"] == [[0, n_old], [n_old, n]]
    cfg = layout.read_config(after)
    assert cfg["n_tokens"] == n and [cfg[k] for k in ("min_span", "max_span", "window")] == [layout.read_config(before)[k] for k in ("min_span", "max_span", "window")]
    S0, F0, L, d = before["sekv.span_start"].numel(), before["sekv.full_idx"].numel(), cfg["n_layers"], cfg["head_dim"]
    piece = _window_piece(lm, m1["token_ids"], n_old, SekvParams.from_dict(params, "sekv"), cfg)
    # the pack's part: unchanged, bit for bit
    for k in ("span_start", "span_end", "full_idx"):
        assert torch.equal(after[f"sekv.{k}"][: before[f"sekv.{k}"].numel()], before[f"sekv.{k}"])
    assert torch.equal(after["sekv.lex.terms"][:n_old], before["sekv.lex.terms"])
    assert torch.equal(after["sekv.scout.profile"][:S0], before["sekv.scout.profile"])
    # the added part: the window's spans at global indices, its tensors
    seg = piece.seg
    assert torch.equal(after["sekv.span_start"][S0:], seg.span_start + n_old) and torch.equal(after["sekv.full_idx"][F0:], seg.full_idx + n_old)
    assert int(seg.span_start.numel()) > 0
    assert torch.equal(after["sekv.lex.terms"][n_old:], lexical.document_terms(lm.tokenizer, lm.tokenizer.decode(new)).to(torch.int32))
    assert torch.allclose(after["sekv.scout.profile"][S0:], piece.tensors["scout.profile"])
    span_old = (before["sekv.span_end"] - before["sekv.span_start"]).long()
    span_new = seg.span_len
    for li in range(L):
        for kv in "kv":
            assert torch.equal(after[f"sekv.full.{kv}.{li}"][:, :F0], before[f"sekv.full.{kv}.{li}"])
            assert torch.equal(after[f"sekv.full.{kv}.{li}"][:, F0:], piece.tensors[f"full.{kv}.{li}"])
            assert torch.equal(after[f"sekv.coarse.{kv}.{li}"][:, :S0], before[f"sekv.coarse.{kv}.{li}"])
            assert torch.allclose(after[f"sekv.coarse.{kv}.{li}"][:, S0:], piece.tensors[f"coarse.{kv}.{li}"].float())
        assert torch.equal(after[f"sekv.router.w.{li}"], before[f"sekv.router.w.{li}"])  # the pack's projection kept
        assert torch.equal(after[f"sekv.router.norm.{li}"][:, :S0], before[f"sekv.router.norm.{li}"])
        for kind in ("fk", "fv"):
            prefix = f"sekv.{kind}.{li}"
            fa = layout.read_factors(_Store(after), set(after), prefix)
            fb = layout.read_factors(_Store(before), set(before), prefix)
            mine = fz.Factors(*(piece.tensors[f"{kind}.{li}.{k}"] if f"{kind}.{li}.{k}" in piece.tensors else None for k in ("us", "vt", "rank", "us_scale", "vt_scale")))
            if coded:  # the added factors coded on their own (a segment), as a pack of them alone would hold them
                kc = codec.kind_config(_Store(after), set(after), kind)
                mine = codec.decode_factors(codec.encode_factors(mine, span_new, d, **kc), span_new, d, **kc)
                for part in (codec.code_names(kc["levels"])[0], "vt.lead"):  # the pack's own codes: the same bytes
                    assert torch.equal(after[f"{prefix}.{part}"], before[f"{prefix}.{part}"])
            assert torch.equal(fa.rank, torch.cat([fb.rank, mine.rank], 1))
            for h, (ha, hb, hn) in enumerate(zip(_per_head(fa, torch.cat([span_old, span_new]), d), _per_head(fb, span_old, d), _per_head(mine, span_new, d))):
                for k in ha:
                    assert torch.equal(ha[k], torch.cat([hb[k], hn[k]])), (li, kind, h, k)
    if coded:
        assert after[codec.SEGMENTS].tolist() == [0, S0, S0 + int(span_new.numel())]
    s = Session.open(pack, lm=lm)  # the pack's checks pass; an ask reads it
    assert s.ask("What is the gate code?", max_new_tokens=3).stats.generated_tokens >= 1


class _Store:
    def __init__(self, t):
        self.t = t

    def keys(self):
        return list(self.t)

    def get(self, k):
        return self.t[k]


def test_sekv_add_twice_in_windows(docs, lm, monkeypatch):
    """A forced small window: the added part is read in several windows, each opened by the header; a second add
    makes a third segment; the pack's documents, inspect and the evidence name them."""
    pack = docs / "p.sekv"
    ingest(docs / "a.txt", pack, lm=lm, method="sekv")
    monkeypatch.setenv(WINDOW_ENV, "384")
    (docs / "long.txt").write_text(" ".join(f"Line {i}: the harbour master logged ship {i * 7} at dawn." for i in range(24)))
    r = add(pack, load_corpus([docs / "long.txt"], headings=True), lm=lm)
    assert r.windows > 1
    r2 = add(pack, load_corpus([docs / "b.md"], headings=True), lm=lm)
    m = read_pack(pack).manifest
    wins = m["windows"]
    assert wins[0] == [0, r.n_tokens - r.added_tokens] and wins[-1][1] == r2.n_tokens and all(a[1] == b[0] for a, b in zip(wins, wins[1:]))
    assert len(wins) == 1 + r.windows + r2.windows
    parts = m["document"]["parts"]
    assert [q["name"] for q in parts] == ["a.txt", str(docs / "long.txt"), str(docs / "b.md")]
    assert m["document"]["kind"] == "corpus" and m["document"]["n_pages"] == 3
    for q in parts:  # each part's tokens hold its text
        text = lm.tokenizer.decode(m["token_ids"][q["token_start"]:q["token_end"]])
        assert {"a.txt": "skarvholm", str(docs / "long.txt"): "harbour master", str(docs / "b.md"): "gate code"}[q["name"]] in text.lower()
    assert len(_tensors(pack)[codec.SEGMENTS]) == 4
    code, out, err = run("inspect", pack, "--json")
    assert code == 0, err
    assert [q["name"] for q in json.loads(out)["document"]["parts"]] == [q["name"] for q in parts]


def test_sekv_add_gives_the_added_tokens_the_kv_of_one_prefill(docs, lm, tiny_qwen):
    """A pack and added documents that fit the model's window: the added tokens' full-resolution keys and values
    are plain transformers' KV of one prefill of the joined text (they attend to every pack token, not only the
    last carried ones), and an ask of the pack reads them."""
    from transformers import AutoModelForCausalLM

    pack = docs / "p.sekv"
    ingest(docs / "a.txt", pack, lm=lm, method="sekv", params=EXACT)
    n_old = read_pack(pack).manifest["n_tokens"]
    assert n_old > windows.CARRY_TOKENS + 100  # more pack tokens than a carry of the last ones would hold
    r = add(pack, load_corpus([docs / "b.md", docs / "c.txt"], headings=True), lm=lm)
    assert r.windows == 1
    ids = read_pack(pack).manifest["token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        o = hf(input_ids=torch.tensor([ids]), use_cache=True)
    t = _tensors(pack)
    full = t["sekv.full_idx"].long()
    mine = torch.nonzero(full >= n_old).flatten()
    assert mine.numel() > 0
    for li in range(hf.config.num_hidden_layers):
        ref_k, ref_v = o.past_key_values.layers[li].keys[0], o.past_key_values.layers[li].values[0]
        assert torch.allclose(t[f"sekv.full.k.{li}"][:, mine], ref_k[:, full[mine]], atol=1e-4, rtol=1e-4), li
        assert torch.allclose(t[f"sekv.full.v.{li}"][:, mine], ref_v[:, full[mine]], atol=1e-4, rtol=1e-4), li


def test_full_add_continues_the_prefill(docs, lm, tiny_qwen):
    """`full`: the KV cache after add equals plain transformers' KV of one prefill of the joined text."""
    from transformers import AutoModelForCausalLM

    pack = docs / "p.sekv"
    ingest(docs / "a.txt", pack, lm=lm, method="full")
    add(pack, load_corpus([docs / "b.md", docs / "c.txt"], headings=True), lm=lm)
    ids = read_pack(pack).manifest["token_ids"]
    hf = AutoModelForCausalLM.from_pretrained(str(tiny_qwen), dtype=torch.float32, attn_implementation="sdpa")
    with torch.no_grad():
        o = hf(input_ids=torch.tensor([ids]), use_cache=True)
    t = _tensors(pack)
    for li in range(hf.config.num_hidden_layers):
        assert torch.allclose(t[f"full.k.{li}"], o.past_key_values.layers[li].keys[0], atol=1e-4, rtol=1e-4)
        assert torch.allclose(t[f"full.v.{li}"], o.past_key_values.layers[li].values[0], atol=1e-4, rtol=1e-4)


def test_rag_add_appends_chunks_and_retrieves_from_them(docs, lm):
    from sekv_core.methods import bm25
    from sekv_core.methods.rag import chunk_bounds

    pack = docs / "p.sekv"
    ingest(docs / "a.txt", pack, lm=lm, method="rag")
    before = _tensors(pack)
    add(pack, load_corpus([docs / "b.md", docs / "c.txt"], headings=True), lm=lm)
    after, m = _tensors(pack), read_pack(pack).manifest
    c0 = before["rag.chunks"].numel()
    assert torch.equal(after["rag.chunks"][:c0], before["rag.chunks"])  # the pack's chunks kept
    assert torch.equal(after["rag.post_chunk"][: before["rag.post_chunk"].numel()], before["rag.post_chunk"])
    end = m["document"]["parts"][-1]["token_end"]
    assert after["rag.doc"].tolist() == [int(before["rag.doc"][0]), end] and int(after["rag.chunks"][-1]) == end
    want = chunk_bounds(lm.tokenizer.batch_decode([[t] for t in m["token_ids"]]), int(before["rag.doc"][1]), end, 128)
    assert after["rag.chunks"][c0 - 1 :].tolist() == want
    s = Session.open(pack, lm=lm)
    s.ask("What is the gate code 4417?", max_new_tokens=1)
    a, b = s.memory.spans()[s.memory.order[0]]  # the best-scoring chunk: the added document with the words
    part = m["document"]["parts"][1]
    assert a < part["token_end"] and part["token_start"] < b and "4417" in lm.tokenizer.decode(m["token_ids"][a:b])
    assert bm25.Index  # the index opened (Session.open validated the postings)


def test_eviction_add_reads_the_whole_text_again_and_kvzip_is_refused(docs, lm):
    pack = docs / "p.sekv"
    ingest(docs / "c.txt", pack, lm=lm, method="snapkv")
    r = add(pack, load_corpus([docs / "b.md"], headings=True), lm=lm)
    assert "read again" in r.note and read_pack(pack).manifest["n_tokens"] == r.n_tokens
    Session.open(pack, lm=lm)
    ingest(docs / "c.txt", pack, lm=lm, method="kvzip")
    raw = pack.read_bytes()
    with pytest.raises(SekvError, match="cannot be extended"):
        add(pack, load_corpus([docs / "b.md"], headings=True), lm=lm)
    assert pack.read_bytes() == raw


# -- atomicity and errors ---------------------------------------------------------------------------------------


@pytest.mark.parametrize("when", ["compress", "write"])
def test_an_interrupted_add_leaves_the_pack_as_it_was(docs, lm, monkeypatch, when):
    pack = docs / "p.sekv"
    ingest(docs / "a.txt", pack, lm=lm, method="sekv")
    digest = hashlib.sha256(pack.read_bytes()).hexdigest()

    def boom(*a, **k):
        raise KeyboardInterrupt

    import sekv_core.add as add_mod
    from sekv_core.sekv import append as append_mod

    monkeypatch.setattr(*((append_mod, "append", boom) if when == "compress" else (add_mod, "write_pack", boom)))
    with pytest.raises(KeyboardInterrupt):
        add(pack, load_corpus([docs / "b.md"], headings=True), lm=lm)
    assert hashlib.sha256(pack.read_bytes()).hexdigest() == digest
    assert sorted(p.name for p in docs.iterdir() if p.name.startswith(".")) == []  # no temporary file left


@pytest.mark.parametrize("case", ["missing doc", "not a pack", "no pack", "same file twice", "pack as document"])
def test_add_errors_are_one_line_and_change_nothing(docs, tiny_qwen, case):
    pack = docs / "p.sekv"
    code, _, err = run("ingest", docs / "a.txt", "-o", pack, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    (docs / "notes.txt").write_text("not a pack")
    args, needle = {
        "missing doc": ([pack, docs / "nope.md"], "nope.md: file not found"),
        "not a pack": ([docs / "notes.txt", docs / "b.md"], "notes.txt"),
        "no pack": ([docs / "none.sekv", docs / "b.md"], "no such pack"),
        "same file twice": ([pack, docs / "a.txt"], "already in"),
        "pack as document": ([pack, pack], "unsupported file type"),
    }[case]
    raw = pack.read_bytes()
    code, out, err = run("add", *args, "--model", tiny_qwen, "-q")
    assert_one_line_error(code, err, needle)
    assert pack.read_bytes() == raw and not list(docs.glob(".*tmp"))


def test_add_keeps_the_permissions_and_refuses_a_pack_changed_meanwhile(docs, lm, monkeypatch):
    import os

    from sekv_core.sekv import append as append_mod

    pack = docs / "p.sekv"
    ingest(docs / "c.txt", pack, lm=lm, method="sekv")
    os.chmod(pack, 0o640)
    add(pack, load_corpus([docs / "b.md"], headings=True), lm=lm)
    assert pack.stat().st_mode & 0o777 == 0o640
    real = append_mod.append

    def meanwhile(*a, **k):  # another writer replaces the pack while this add compresses
        out = real(*a, **k)
        ingest(docs / "c.txt", pack, lm=lm, method="sekv")
        return out

    monkeypatch.setattr(append_mod, "append", meanwhile)
    with pytest.raises(SekvError, match="changed while"):
        add(pack, load_corpus([docs / "a.txt"], headings=True), lm=lm)
    assert read_pack(pack).manifest["document"]["name"] == "c.txt"  # the other writer's pack stays


def test_the_python_api_adds_and_limits_documents(docs, lm):
    """pack.add / sekv.add / with_docs as a user calls them; the evidence of an added PDF names it and the page its
    text is on, found by searching the PDF's own pages (load_document), not the manifest."""
    import shutil

    import sekv
    from conftest import SAMPLE_PDF
    from sekv_core.documents import load_document
    from sekv_core.evidence import evidence_rows

    pack = docs / "p.sekv"
    shutil.copy(SAMPLE_PDF, docs / "m.pdf")
    ingest(docs / "c.txt", pack, lm=lm, method="sekv")
    p = sekv.open(pack, model=lm)
    p2 = p.add(docs / "b.md", docs / "m.pdf")
    assert p2.documents == ["c.txt", str(docs / "b.md"), str(docs / "m.pdf")] and p2.n_tokens > p.n_tokens
    pages = ["".join(t.split()) for t in (lambda d: [d.text[x.start:x.end] for x in d.pages])(load_document(docs / "m.pdf"))]
    rows = evidence_rows(p2.session, {i: 1 for i in range(len(p2.session.memory.spans()))}, limit=10**6)
    checked = 0
    for r in rows:
        t = "".join(r["text"].split())
        on = [i for i, text in enumerate(pages, 1) if t in text]
        if len(on) == 1 and len(t) > 12:
            assert r["file"] == str(docs / "m.pdf") and r["page"] == on[0], r
            checked += 1
    assert checked >= 10 and {r["page"] for r in rows if r.get("file") == str(docs / "m.pdf")} == {1, 2, 3, 4, 5}
    only = p2.with_docs(["b.md"])
    r = only.ask("What is the gate code?", max_new_tokens=2)
    assert r.evidence and {e.file for e in r.evidence} == {str(docs / "b.md")}
    with pytest.raises(SekvError, match="no such document"):
        p2.with_docs(["d.md"])
    (docs / "d.md").write_text("The ferry leaves at noon.")
    r = sekv.add(pack, docs / "d.md", model=lm)
    assert r.documents == 1 and sekv.open(pack, model=lm, docs=["d.md"]).documents[-1] == str(docs / "d.md")


def test_add_takes_folders_with_glob_and_stdin(docs, tiny_qwen):
    from typer.testing import CliRunner

    from sekv_cli.app import app

    pack = docs / "p.sekv"
    code, _, err = run("ingest", docs / "c.txt", "-o", pack, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    (docs / "notes").mkdir()
    (docs / "notes" / "x.txt").write_text("The boathouse is red.")
    (docs / "notes" / "y.md").write_text("The jetty is grey.")
    code, out, err = run("add", pack, docs / "notes", "--glob", "*.txt", "--model", tiny_qwen, "-q")
    assert code == 0, err
    r = CliRunner().invoke(app, ["add", str(pack), "-", "--model", str(tiny_qwen), "-q"], input="Read from standard input: the bell rings at six.")
    assert r.exit_code == 0, r.stderr
    parts = read_pack(pack).manifest["document"]["parts"]
    assert [q["name"] for q in parts] == ["c.txt", str(docs / "notes" / "x.txt"), "stdin"]


@pytest.mark.parametrize("n_old,n,header,cap", [(500, 501, 100, 384), (500, 2000, 100, 384), (130, 900, 120, 512), (500, 900, 100, 0),
                                                 (500, 900, 100, 900)])
def test_plan_append_windows_continue_the_pack(n_old, n, header, cap):
    plan = windows.plan_append(n_old, n, header, cap, after=3)
    assert plan[0].start == n_old and plan[-1].end == n and all(a.end == b.start for a, b in zip(plan, plan[1:]))
    ids = list(range(n))
    fits = not cap or n <= cap
    for i, w in enumerate(plan):
        assert w.index == 3 + i and w.count == 3 + len(plan) and w.header == header
        local = w.local_ids(ids, header)
        assert local[:header] == ids[:header] and local[header : header + w.carry] == ids[w.start - w.carry : w.start]
        assert local[-w.n :] == ids[w.start : w.end] and (not cap or len(local) <= cap)
        if fits:  # one window: the whole text, read as one prefill reads it (native positions)
            assert len(plan) == 1 and local == ids and w.offset == 0
        else:
            assert w.carry == min(windows.CARRY_TOKENS, cap // 4, w.start - header)
    assert windows.plan_append(n, n, header, cap, after=1) == []
