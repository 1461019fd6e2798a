"""`rag`: BM25 over text chunks, the best prefilled at ask time.

References: BM25 scores computed by hand from the formula; plain transformers (SDPA, its own cache) greedy over
[header + chosen chunks + tail + question]; `full`'s answer when every chunk fits.
"""

from __future__ import annotations

import math

import pytest
import torch
from transformers import AutoModelForCausalLM

from sekv_core import methods, models, prompt
from sekv_core.api import result_of
from sekv_core.errors import SekvError
from sekv_core.ingest import ingest
from sekv_core.methods import bm25
from sekv_core.methods.rag import RagParams, chunk_bounds
from sekv_core.pack import read_pack
from sekv_core.session import Session, inspect_pack

from conftest import SAMPLE_MD, make_tiny_model

NEEDLE = "The secret passphrase of the lighthouse is marmalade zebra."
QUESTION = "What is the secret passphrase of the lighthouse?"


def test_bm25_scores_equal_a_hand_computed_case():
    # terms: a=1, b=2, c=3; chunk 0 = tokens 0-4 "a _ a b" (a twice: two occurrences), chunk 1 = "b c c" where the
    # two c tokens are one word (a run), chunk 2 = "c"
    terms = torch.tensor([1, -1, 1, 2, 2, 3, 3, -1, 3], dtype=torch.int32)
    # chunk 1 starts at token 4: its b follows chunk 0's b but is a new occurrence (a chunk's first token)
    bounds = [0, 4, 7, 9]
    chunk, term, tf = bm25.postings(bounds, terms)
    assert list(zip(chunk.tolist(), term.tolist(), tf.tolist())) == [(0, 1, 2), (0, 2, 1), (1, 2, 1), (1, 3, 1), (2, 3, 1)]
    idx = bm25.Index.of(chunk, term, tf, 3)
    lens = [3, 2, 1]
    avg = 2.0
    k1, b = 1.2, 0.75

    def part(tf, df, n):
        return math.log(1 + (3 - df + 0.5) / (df + 0.5)) * tf * (k1 + 1) / (tf + k1 * (1 - b + b * n / avg))

    want = [part(2, 1, 3) + part(1, 2, 3), part(1, 2, 2), 0.0]  # query {a, b}
    assert idx.scores({1, 2}).tolist() == pytest.approx(want, rel=1e-6)
    want_c = [0.0, part(1, 2, 2), part(1, 2, 1)]
    assert idx.scores([3, 3]).tolist() == pytest.approx(want_c, rel=1e-6)
    assert idx.scores({99}).tolist() == [0.0, 0.0, 0.0] and idx.scores(set()).tolist() == [0.0, 0.0, 0.0]


def test_chunks_cover_the_document_in_whole_sentences(lm):
    text = SAMPLE_MD.read_text()
    pre = prompt.document_prefix(lm.tokenizer, text)
    ids = prompt.encode(lm.tokenizer, pre)
    tt = lm.tokenizer.batch_decode([[t] for t in ids])
    start, end = prompt.document_token_range(lm.tokenizer, pre)
    assert lm.tokenizer.decode(ids[start:end]).strip() == text.strip()
    for size in (64, 256):
        b = chunk_bounds(tt, start, end, size)
        assert b[0] == start and b[-1] == end and all(y > x for x, y in zip(b, b[1:]))
        assert max(y - x for x, y in zip(b, b[1:])) <= size
        ends = [x - start for x in b[1:-1]]
        from sekv_core.methods.sentencekv import sentence_bounds

        assert set(ends) <= set(sentence_bounds(tt[start:end], min_len=4, max_len=size))  # cut only between sentences
    with pytest.raises(SekvError):
        RagParams(chunk_tokens=4)
    with pytest.raises(SekvError):
        RagParams(budget=1.5)


@pytest.fixture(scope="module")
def needle_doc(tmp_path_factory):
    text = SAMPLE_MD.read_text()
    cut = text.index("\n\n", len(text) // 2) + 2
    p = tmp_path_factory.mktemp("rag") / "doc.md"
    p.write_text(text[:cut] + NEEDLE + "\n\n" + text[cut:])
    return p


def _plain_greedy(model_dir, ids: list[int], n: int, stop: set[int]) -> list[int]:
    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").eval()
    out = m.generate(torch.tensor([ids]), max_new_tokens=n, do_sample=False, eos_token_id=sorted(stop), pad_token_id=0)
    gen = out[0, len(ids):].tolist()
    return [t for t in gen if t not in stop]


def test_rag_picks_the_needle_and_answers_as_a_plain_prefill_of_its_context(lm, tiny_qwen, needle_doc, tmp_path):
    pack = tmp_path / "doc.sekv"
    r = ingest(needle_doc, pack, lm=lm, method="rag", params={"budget": 0.1, "chunk_tokens": 128})
    assert set(read_pack(pack).keys()) == {"rag.tokens", "rag.doc", "rag.chunks", "rag.post_chunk", "rag.post_term", "rag.post_tf"}
    s = Session.open(pack, lm=lm)
    ans = s.ask(QUESTION, max_new_tokens=12)
    mem = s.memory
    chosen = mem.chosen
    ids = s.pack.token_ids
    spans = mem.spans()
    texts = [lm.tokenizer.decode(ids[a:b]) for a, b in spans]
    needle = [i for i, t in enumerate(texts) if "marmalade" in t]
    assert len(needle) == 1 and needle[0] == mem.order[0] and needle[0] in chosen
    ctx = mem.context_ids(chosen)
    assert len(ctx) <= 0.1 * r.n_tokens and ans.stats.extra["rag_context_tokens"] == len(ctx)
    assert chosen == sorted(chosen)
    q_ids = prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, QUESTION))
    assert len(ans.token_ids) > 3 and ans.token_ids == _plain_greedy(tiny_qwen, ctx + q_ids, 12, s.stop_ids)
    assert mem.n_tokens() == r.n_tokens  # back to the pack's state
    # evidence: the chunks read, the best first
    res = result_of(s, ans, QUESTION)
    assert res.evidence and "marmalade" in res.evidence[0].text and len(res.evidence) == len(chosen)
    # resident KV: the prefilled context + question + answer, within budget x document + appended
    per = s.memory.shape.kv_bytes_per_token()
    assert ans.stats.resident_kv_bytes_peak == (len(ctx) + len(q_ids) + ans.stats.generated_tokens - 1) * per


def test_rag_with_room_for_everything_answers_as_full(lm, needle_doc, tmp_path):
    ingest(needle_doc, tmp_path / "full.sekv", lm=lm, method="full")
    ingest(needle_doc, tmp_path / "rag.sekv", lm=lm, method="rag")
    want = Session.open(tmp_path / "full.sekv", lm=lm).ask(QUESTION, max_new_tokens=10).token_ids
    s = Session.open(tmp_path / "rag.sekv", lm=lm, params={"budget": 1.0})  # budget is an ask-time parameter
    assert s.ask(QUESTION, max_new_tokens=10).token_ids == want
    assert s.memory.context_ids(s.memory.chosen) == s.pack.token_ids


@pytest.fixture(scope="module")
def tiny_1k(tmp_path_factory):
    """A tiny model with a 1024-token window: the sample document (~2,900 tokens) is longer."""
    return make_tiny_model(tmp_path_factory.mktemp("tiny_1k"), "qwen2", max_positions=1024)


def test_rag_ingests_a_document_longer_than_the_window(tiny_1k, needle_doc, tmp_path):
    lm = models.load(str(tiny_1k), device="cpu", dtype=torch.float32)
    pack = tmp_path / "long.sekv"
    r = ingest(needle_doc, pack, lm=lm, method="rag", params={"budget": 0.5})
    assert r.n_tokens > 1024
    assert read_pack(pack).manifest["model"]["rope_scaling"] is None  # rag stays native: it never prefills past the window
    s = Session.open(pack, lm=lm)
    ans = s.ask(QUESTION, max_new_tokens=8)
    ctx = ans.stats.extra["rag_context_tokens"]
    assert ctx <= 1024 - 512  # capped by the window less the question / answer reserve, not 0.5 x the document
    assert ans.stats.generated_tokens > 0
    _, info = inspect_pack(pack)
    assert info["chunks"] > 1 and info["doc_tokens"] < r.n_tokens
    # full cannot hold it in one window with native RoPE
    with pytest.raises(SekvError, match="sekv"):
        ingest(needle_doc, tmp_path / "full.sekv", lm=lm, method="full", rope_scaling="none")


def test_rag_is_registered_and_in_bench():
    from sekv_cli.cmd_bench import parse_methods

    assert methods.get("rag").name == "rag" and "rag" in parse_methods("all")
    assert methods.get("rag").needs_prefill is False and methods.get("full").needs_prefill is True


def test_rag_runs_in_the_benchmark_with_budget_one_as_full(lm, haystack, tmp_path):
    """The runner's path (compress on a shared prefill, a DictStore, generate): at budget 1 every chunk is read, so
    rag's answers are full's."""
    import json

    from sekv_core.bench import runner

    cfg = runner.BenchConfig(tasks=["niah"], methods=["full", "rag"], budgets=[1.0], lengths=[300], depths=[50], seed=0, haystack=haystack)
    o = runner.run(lm, cfg, tmp_path)
    assert not o.errors
    recs = [json.loads(x) for x in (tmp_path / runner.RESULTS_FILE).read_text().splitlines()]
    rag = [r for r in recs if r["method"] == "rag"]
    assert rag and all(r["identical_to_full"] for r in rag) and all(0 < r["resident_fraction"] <= 1.0 for r in rag)
