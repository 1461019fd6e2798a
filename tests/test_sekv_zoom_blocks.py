"""Zoom blocks (parts of spans as the budget's unit) and the scout's lexical evidence, against independent
references: full-KV logits, a hand-computed mixed softmax, the budget as a property, hand-computed BM25."""

from __future__ import annotations

import math
import random

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.sekv import lexical
from sekv_core.sekv.segment import zoom_blocks

from test_sekv_attention import hand_mixed_attention, open_memory, synthetic_prefill
from test_sekv_method import EXACT, _setup


def test_zoom_blocks_cover_every_span_token_once():
    rng = random.Random(0)
    for _ in range(50):
        lens = [rng.randint(1, 90) for _ in range(rng.randint(1, 12))]
        gaps = [rng.randint(0, 3) for _ in lens]
        start, pos = [], 0
        for n, g in zip(lens, gaps):
            pos += g
            start.append(pos)
            pos += n
        s = torch.tensor(start)
        e = s + torch.tensor(lens)
        unit = rng.randint(1, 40)
        span, b0, b1 = zoom_blocks(s, e, unit)
        assert bool((b1 > b0).all()) and bool((b1 - b0 <= unit).all())
        for i, (a, b) in enumerate(zip(s.tolist(), e.tolist())):
            mine = span == i
            got = torch.cat([torch.arange(x, y) for x, y in zip(b0[mine].tolist(), b1[mine].tolist())])
            assert got.tolist() == list(range(a, b))  # contiguous, in order, each token once
            n_i = (b1 - b0)[mine]
            assert int(n_i.max() - n_i.min()) <= 1 and n_i.numel() == math.ceil((b - a) / unit)
    span, b0, b1 = zoom_blocks(s, e, 0)  # unit 0: the spans themselves
    assert torch.equal(b0, s) and torch.equal(b1, e) and torch.equal(span, torch.arange(s.numel()))


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_every_block_expanded_equals_full_kv(kind):
    """Blocks of 3 tokens rebuilt from their spans' rows at their own positions (pre-RoPE keys): full-KV logits."""
    model, ref, ids, res, store, p, mem, full = _setup(kind, **{**EXACT, "zoom_unit": 3, "routing": "scout"})
    assert mem.res.n_blocks > 2 * mem.res.n_spans and not mem.res.whole_spans and mem.res.pre_rope
    q = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(4))
    a = runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)
    b = runtime.forward_logits(model, q, full.n_tokens(), full, last_only=False)
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    for _ in range(2):
        nxt = b[:, -1:].argmax(-1)
        a = runtime.forward_logits(model, nxt, mem.n_tokens(), mem)
        b = runtime.forward_logits(model, nxt, full.n_tokens(), full)
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4)
    assert mem.step_stats().extra["zoom_spans_step"] == mem.res.n_spans


def test_some_blocks_expanded_equals_hand_computed_mixed_softmax():
    """A few blocks of some spans at full resolution: each span's coarse entry stands for its other tokens with
    + log(n_i - m_i), and disappears when every block of it is expanded."""
    pf = synthetic_prefill(n=260)
    m, params, store, mem = open_memory(pf, budget=1.0, zoom_unit=5, key_space="post_rope", factors_8bit=False,
                                        factor_dtype="float32", energy_k=1.0, energy_v=1.0, rank_max=64, router="untrained",
                                        zoom_tier="factors")
    S, B = mem.res.n_spans, mem.res.n_blocks
    first = [int((mem.res.block_span == i).nonzero()[0]) for i in range(S)]
    chosen = {first[1], first[1] + 1, first[3]} | {b for b in range(B) if int(mem.res.block_span[b]) == 5}  # span 5 whole
    mem.ranking.ready = True  # a scout ranking for this ask: the chosen blocks first, no other candidate
    prio = torch.full((B,), float("-inf"))
    prio[list(chosen)] = 1.0
    mem.ranking.prio.copy_(prio)
    H, hkv, d = 4, 2, 16
    g = torch.Generator().manual_seed(1)
    query, key, value = torch.randn(1, H, 2, d, generator=g), torch.randn(1, hkv, 2, d, generator=g), torch.randn(1, hkv, 2, d, generator=g)
    scale = d**-0.5
    mem.attend(0, query, key, value, scale)
    out = mem.attend(1, query, key, value, scale)
    assert bool(mem.step.held[1][0][0, sorted(chosen)].all()) and int(mem.step.held[1][0].sum()) == hkv * len(chosen)

    full_idx = store["sekv.full_idx"].tolist()
    spans = list(zip(store["sekv.span_start"].tolist(), store["sekv.span_end"].tolist()))
    expanded_tok = {t for b in chosen for t in range(int(mem.res.block_start[b]), int(mem.res.block_start[b] + mem.res.block_len[b]))}
    for h in range(H):
        for t in range(2):
            want = hand_mixed_attention(query[0, h, t], h // (H // hkv), pf.keys[1], pf.values[1], pf.surprisal, full_idx, spans,
                                        key[0, :, : t + 1], value[0, :, : t + 1], scale, expanded_tok)
            assert torch.allclose(out[0, h, t].double(), want, atol=1e-4), (h, t, (out[0, h, t].double() - want).abs().max())


def test_blocks_under_a_scout_ranking_never_exceed_the_budget():
    """Random documents, budgets, units and rankings: the kept blocks are the ranking's longest prefix that fits
    each layer's cap, and each step's resident bytes stay within the budget (the question's tokens on top)."""
    for seed in range(10):
        rng = random.Random(seed)
        n = rng.randint(200, 700)
        pf = synthetic_prefill(n=n, seed=seed)
        budget = rng.choice([0.1, 0.2, 0.3])
        m, params, store, mem = open_memory(pf, budget=budget, zoom_unit=rng.randint(2, 12), min_span=rng.randint(6, 20), window=rng.randint(0, 30))
        mem.ranking.ready = True
        mem.ranking.prio.copy_(torch.randn(mem.res.n_blocks, generator=torch.Generator().manual_seed(seed)))
        order = torch.argsort(mem.ranking.prio, descending=True, stable=True).tolist()
        g = torch.Generator().manual_seed(seed)
        for step in range(3):
            q_new = rng.choice([1, 4])
            for layer in range(pf.shape.n_layers):
                mem.attend(layer, torch.randn(1, 4, q_new, 16, generator=g), torch.randn(1, 2, q_new, 16, generator=g), torch.randn(1, 2, q_new, 16, generator=g), 0.25)
            st = mem.step_stats()
            if mem.resident_bytes() - st.extra["appended_bytes"] <= st.extra["budget_bytes"]:
                assert st.resident_bytes - st.extra["appended_bytes"] <= st.extra["budget_bytes"], (seed, step)
            else:  # the document's persistent part alone is over budget: nothing may be expanded
                assert st.resident_bytes == mem.resident_bytes() and all(h is None for h in mem.step.held)
            cost = (mem.res.block_len * mem.res.entry_bytes).tolist()
            # (group, block) pairs in the cap's order: by the ranking, a block's two groups one after the other
            pairs = [(gi, int(b)) for b in order for gi in range(2)]
            for held in mem.step.held:
                if held is None:
                    continue
                keep = held[0]
                k = int(keep.sum())
                assert all(bool(keep[gi, b]) for gi, b in pairs[:k])  # a prefix of that order
                used = sum(cost[b] for _, b in pairs[:k])
                assert used <= mem.step.cap and (k == len(pairs) or used + cost[pairs[k][1]] > mem.step.cap)


def test_terms_of_words_not_tokens():
    text = "Maximum inlet water pressure: 8.6 bar. The tank is descaled every 18 months; error E6."
    # characters of three 'tokens' that split words: "Maxim|um inlet| wa"
    offsets = [(0, 5), (5, 14), (14, 17)]
    t = lexical.token_terms(text, offsets)
    assert t.tolist() == [lexical.term_id("maximum"), lexical.term_id("maximum"), lexical.term_id("water")]
    q = lexical.text_terms("How often should the tank be DESCALED? What does E6 mean?")
    want = {lexical.term_id(w) for w in ("often", "tank", "descale", "e6", "mean")}
    assert q == want  # stop words (how, should, the, be, what, does) have none; descaled meets descale
    assert lexical.term_id("a") is None and lexical.term_id("the") is None and lexical.term_id("8") is None


def test_lexicon_scores_are_hand_computed_bm25_idf():
    # 4 blocks of 10 tokens, window 8: a block sees its own tokens and 8 on either side
    terms = torch.full((40,), -1, dtype=torch.int32)
    a, b, c = (lexical.term_id(w) for w in ("pressure", "inlet", "warranty"))
    terms[3], terms[12], terms[25], terms[38] = a, b, a, c
    lex = lexical.Lexicon(terms, torch.tensor([0, 10, 20, 30]), torch.tensor([10, 10, 10, 10]))
    # windows: [0,18) [2,28) [12,38) [22,40)
    assert lex.block_terms == [{a, b}, {a, b}, {a, b}, {a, c}]
    idf = lambda df: math.log(1 + (4 - df + 0.5) / (df + 0.5))  # noqa: E731
    got = lex.scores("What is the inlet pressure?")
    want = [idf(4) + idf(3)] * 3 + [idf(4)]
    assert torch.allclose(got, torch.tensor(want))
    assert lex.scores("nothing here matches").abs().sum() == 0


def test_lexical_weight_ranks_the_matching_block_first():
    """The scout's rank adds lexical_weight x z(lexical score): a large weight puts a block holding the question's
    words first; weight 0 (or a question with no document word) leaves the attention ranking."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=500, budget=0.3, min_span=10, window=16, zoom_unit=8)
    word = lexical.term_id("passphrase")
    terms = torch.full((500,), -1, dtype=torch.int32)
    target = mem.res.n_blocks // 2
    t0 = int(mem.res.block_start[target])
    terms[t0 + 2] = word
    store["sekv.lex.terms"] = terms
    q = torch.tensor([[5, 6, 7, 8]])
    prio = {}
    for name, w, question in (("attn", 0.0, "the passphrase?"), ("lex", 50.0, "the passphrase?"), ("miss", 50.0, "nothing")):
        m = methods.get("sekv").open(store, p.replace(lexical_weight=w), res.shape, "cpu")
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m), question)
        prio[name] = m.ranking.prio.clone()
    top = int(prio["lex"].argmax())
    assert abs(int(mem.res.block_start[top]) - t0) <= lexical.WINDOW + int(mem.res.block_len.max())  # its window holds the word
    assert torch.equal(torch.argsort(prio["attn"]), torch.argsort(prio["miss"]))
    assert not torch.equal(torch.argsort(prio["attn"]), torch.argsort(prio["lex"]))
