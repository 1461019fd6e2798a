"""The paper's baselines (StreamingLLM, H2O, SnapKV, PyramidKV, ChunkKV, SentenceKV) as cache methods.

One shared matrix runs every baseline through ingest + Session.ask on a tiny random
model; budget 1.0 must reproduce `full` token for token; resident bytes stay within
budget * full + the appended tokens; kept-set sizes are exact; and small hand-checked
cases pin each scoring rule.
"""

from __future__ import annotations

import math

import pytest
import torch

from sekv_core import methods, prompt
from sekv_core.errors import SekvError
from sekv_core.generate import generate
from sekv_core.ingest import ingest
from sekv_core.methods import scores as scoremod
from sekv_core.methods.base import DictStore, ModelShape, PrefillResult
from sekv_core.methods.chunkkv import chunk_positions
from sekv_core.methods.h2o import h2o_positions
from sekv_core.methods.pyramidkv import pyramid_budgets
from sekv_core.methods.scores import select_with_window, snapkv_scores, window_attention
from sekv_core.methods.sentencekv import SentenceMemory, merge_to_fit, sentence_bounds
from sekv_core.methods.streamingllm import streaming_positions
from sekv_core.pack import read_pack
from sekv_core.prefill import prefill
from sekv_core.session import Session

from conftest import SAMPLE_MD

QUESTION = "How many steps does the tower have?"
EVICTION = ["streamingllm", "h2o", "snapkv", "pyramidkv", "chunkkv"]
BASELINES = EVICTION + ["sentencekv"]
MAX_NEW = 16


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    """A shorter document (~1000 tiny-tokenizer tokens) so the matrix stays fast."""
    p = tmp_path_factory.mktemp("doc") / "log.md"
    p.write_text(SAMPLE_MD.read_text()[:2200])
    return p


@pytest.fixture(scope="module")
def full_answer(lm, doc, tmp_path_factory):
    pack = tmp_path_factory.mktemp("full") / "doc.sekv"
    ingest(doc, pack, lm=lm, method="full", chunk=128)
    ans = Session.open(pack, lm=lm).ask(QUESTION, max_new_tokens=MAX_NEW)
    assert len(ans.token_ids) > 3
    return ans.token_ids


@pytest.fixture(scope="module")
def captured(lm, doc):
    """One prefill of the document with every statistic captured (observation window 32)."""
    from sekv_core.ingest import tokenize_document
    from sekv_core.documents import load_document

    ids, _ = tokenize_document(lm, load_document(doc))
    res = prefill(lm.model, torch.tensor(ids), with_surprisal=False, chunk=128, capture=("obs_queries", "attn_mass"), obs_window=32)
    res.scores["token_text"] = lm.tokenizer.batch_decode([[t] for t in ids])
    return res


def _bytes_per_token(shape: ModelShape) -> int:
    return shape.kv_bytes_per_token()


# ---------------------------------------------------------------------------- the shared matrix


@pytest.mark.parametrize("budget", [0.1, 0.3])
@pytest.mark.parametrize("method", BASELINES)
def test_matrix_ingest_and_ask(method, budget, lm, doc, tmp_path):
    pack = tmp_path / f"{method}.sekv"
    r = ingest(doc, pack, lm=lm, method=method, params={"budget": budget}, chunk=128)
    session = Session.open(pack, lm=lm)
    assert session.method == method and session.params.budget == budget
    ans = session.ask(QUESTION, max_new_tokens=MAX_NEW)
    assert ans.stats.generated_tokens > 0 and ans.stats.stop_reason
    n_doc = r.n_tokens
    appended = ans.stats.question_tokens + ans.stats.generated_tokens
    per = _bytes_per_token(session.memory.shape)
    assert 0 < ans.stats.resident_kv_bytes_peak <= budget * n_doc * per + appended * per
    assert session.memory.n_tokens() == n_doc  # truncated back to the pack state
    assert session.ask(QUESTION, max_new_tokens=MAX_NEW).token_ids == ans.token_ids
    p = read_pack(pack)
    info = methods.get(method).describe(p, methods.get(method).resolve_params(p.params))
    assert info["doc_tokens"] == n_doc


@pytest.mark.parametrize("method", EVICTION)
def test_budget_one_reproduces_full(method, lm, doc, full_answer, tmp_path):
    pack = tmp_path / f"{method}.sekv"
    ingest(doc, pack, lm=lm, method=method, params={"budget": 1.0}, chunk=128)
    ans = Session.open(pack, lm=lm).ask(QUESTION, max_new_tokens=MAX_NEW)
    assert ans.token_ids == full_answer


def test_sentencekv_with_room_for_every_sentence_reproduces_full(lm, doc, full_answer, tmp_path):
    pack = tmp_path / "s.sekv"
    ingest(doc, pack, lm=lm, method="sentencekv", params={"budget": 1.0}, chunk=128)
    # budget is an ask-time parameter for sentencekv: 2.0 leaves room for the means + every sentence
    session = Session.open(pack, lm=lm, params={"budget": 2.0})
    ans = session.ask(QUESTION, max_new_tokens=MAX_NEW)
    assert ans.token_ids == full_answer
    assert ans.stats.extra["fetched_tokens_mean"] == session.memory.n_doc


def test_eviction_budget_is_ingest_time(lm, doc, tmp_path):
    pack = tmp_path / "s.sekv"
    ingest(doc, pack, lm=lm, method="snapkv", params={"budget": 0.2}, chunk=128)
    with pytest.raises(SekvError):
        Session.open(pack, lm=lm, params={"budget": 0.1})


def test_prefill_capture_keeps_kv_bit_identical(lm, captured):
    plain = prefill(lm.model, captured.token_ids, with_surprisal=False, chunk=128)
    for a, b in zip(plain.keys + plain.values, captured.keys + captured.values):
        assert torch.equal(a, b)
    assert plain.scores == {}


# ---------------------------------------------------------------------------- budgets and kept sets (property)


BUDGETS = [0.05, 0.1, 0.15, 0.2, 0.35, 0.5]


@pytest.mark.parametrize("method", BASELINES)
def test_resident_within_budget_and_kept_sizes_exact(method, lm, captured):
    m = methods.get(method)
    shape, n = captured.shape, captured.n_tokens
    per = _bytes_per_token(shape)
    q_ids = prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, QUESTION))
    for budget in BUDGETS:
        params = m.resolve_params({"budget": budget})
        tensors = m.compress(captured, params)
        memory = m.open(DictStore(tensors), params, shape, "cpu")
        assert memory.n_tokens() == n
        ids, stats = generate(lm.model, memory, q_ids, max_new_tokens=4, stop_ids=set())
        appended = memory.n_tokens() - n
        assert appended == len(q_ids) + len(ids) - 1
        assert stats.resident_kv_bytes_peak <= budget * n * per + appended * per, (method, budget)
        k = math.floor(budget * n + 1e-9)
        if method == "sentencekv":
            s = tensors["sentencekv.bounds"].numel() - 1
            assert s <= k  # the means never take more than half the budget
            assert max(memory.fetched) <= k - math.ceil(s / 2)
            continue
        idx = m.kept_indices(DictStore(tensors), shape.n_layers)
        sizes = [int(ix.shape[1]) for ix in idx]
        if method == "pyramidkv":
            assert sum(sizes) == shape.n_layers * k and sizes == sorted(sizes, reverse=True)
        else:
            assert sizes == [k] * shape.n_layers
        for ix in idx:
            assert ix.shape[0] == shape.n_kv_heads
            assert (ix[:, 1:] > ix[:, :-1]).all() and ix.min() >= 0 and ix.max() < n  # distinct, increasing
        # the stored K/V are the kept rows of the full cache
        g = idx[0].unsqueeze(-1).expand(-1, -1, shape.head_dim)
        assert torch.equal(tensors[f"{method}.k.0"], captured.keys[0].gather(1, g))


def test_budget_must_be_a_fraction(captured):
    m = methods.get("snapkv")
    with pytest.raises(SekvError):
        m.compress(captured, m.resolve_params({"budget": 0.0}))
    with pytest.raises(SekvError):
        m.compress(captured, m.resolve_params({"budget": 1.5}))


# ---------------------------------------------------------------------------- hand-checked cases


def test_streamingllm_keeps_exactly_sinks_and_recent(captured):
    m = methods.get("streamingllm")
    n = captured.n_tokens
    k = math.floor(0.1 * n)
    idx = m.kept_indices(DictStore(m.compress(captured, m.resolve_params({"budget": 0.1}))), captured.shape.n_layers)
    expected = list(range(4)) + list(range(n - (k - 4), n))
    for ix in idx:
        for row in ix.tolist():
            assert row == expected
    assert streaming_positions(100, 3).tolist() == [0, 1, 2]
    assert streaming_positions(100, 6).tolist() == [0, 1, 2, 3, 98, 99]


def _planted(n=120, w=8, d=16, hkv=2, g=2, planted=((10, 40, 70), (20, 50, 90))):
    """Keys ~ small noise; planted keys of KV head j point along e_j; its group's window queries along e_j."""
    gen = torch.Generator().manual_seed(0)
    keys = 0.01 * torch.randn(hkv, n, d, generator=gen)
    q = 0.01 * torch.randn(hkv * g, w, d, generator=gen)
    for j, ps in enumerate(planted):
        for p in ps:
            keys[j, p, j] = 8.0
        q[j * g : (j + 1) * g, :, j] = 8.0
    return q, keys


def test_snapkv_picks_planted_tokens():
    q, keys = _planted()
    n, w = keys.shape[1], q.shape[1]
    shape = ModelShape(1, 4, 2, 16, torch.float32)
    res = PrefillResult(torch.zeros(n, dtype=torch.long), [keys], [keys.clone()], None, shape,
                        scores={"obs_queries": [q], "obs_window": w, "scaling": 16**-0.5})
    m = methods.get("snapkv")
    # kernel 1 = no pooling: budget for window + 3 tokens picks exactly the planted ones
    budget = (w + 3) / n
    idx = m.select(res, m.resolve_params({"budget": budget, "window": w, "kernel": 1}))[0]
    window = list(range(n - w, n))
    assert idx[0].tolist() == [10, 40, 70] + window
    assert idx[1].tolist() == [20, 50, 90] + window
    # max pooling with kernel 7 spreads each spike over +-3 neighbours: they tie with it
    pooled = snapkv_scores(q, keys, 16**-0.5, kernel=7, pooling="max")
    for p in (10, 40, 70):
        assert torch.allclose(pooled[0, p - 3 : p + 4], pooled[0, p].expand(7))
        assert pooled[0, p - 4] < pooled[0, p]


def test_snapkv_scores_match_explicit_computation():
    q, keys = _planted()
    h, w, d = q.shape
    hkv, n = keys.shape[0], keys.shape[1]
    scale = d**-0.5
    ref = torch.zeros(h, n - w)
    for head in range(h):
        kv = keys[head // (h // hkv)]
        for j in range(w):
            pos = n - w + j
            att = torch.softmax((kv[: pos + 1] @ q[head, j]) * scale, 0)
            ref[head] += att[: n - w] / w
    for kernel, pooling in ((5, "avg"), (7, "max")):
        pool = torch.nn.functional.avg_pool1d if pooling == "avg" else torch.nn.functional.max_pool1d
        r = pool(ref[:, None], kernel, 1, kernel // 2)[:, 0].view(hkv, h // hkv, n - w).mean(1)
        torch.testing.assert_close(snapkv_scores(q, keys, scale, kernel, pooling), r, atol=1e-6, rtol=1e-5)
    assert window_attention(q, keys, scale).sum(-1).allclose(torch.ones(h, w))


def test_attn_mass_equals_explicit_softmax_sum(lm, monkeypatch):
    ids = torch.tensor(prompt.encode(lm.tokenizer, SAMPLE_MD.read_text()[:500]))
    recorded: dict[int, list[torch.Tensor]] = {}
    orig = scoremod.ScoreMemory.attend

    def attend(self, layer, query, key, value, scaling):
        recorded.setdefault(layer, []).append(query[0].clone())
        return orig(self, layer, query, key, value, scaling)

    monkeypatch.setattr(scoremod.ScoreMemory, "attend", attend)
    monkeypatch.setattr(scoremod, "_MASS_BLOCK", 3000)  # several row blocks per chunk
    res = prefill(lm.model, ids, with_surprisal=False, chunk=37, capture=("attn_mass", "obs_queries"), obs_window=50)
    n, shape = res.n_tokens, res.shape
    g = shape.n_heads // shape.n_kv_heads
    causal = torch.ones(n, n, dtype=torch.bool).tril()
    for layer in range(shape.n_layers):
        qall = torch.cat(recorded[layer], dim=1)  # [H, N, d]
        k = res.keys[layer].repeat_interleave(g, 0)
        p = torch.softmax((qall @ k.transpose(1, 2) * res.scores["scaling"]).masked_fill(~causal, float("-inf")), -1)
        torch.testing.assert_close(res.scores["attn_mass"][layer], p.sum(1), atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(res.scores["obs_queries"][layer], qall[:, -50:])
    # each query row sums to one: the total mass is the number of queries per head
    assert torch.allclose(res.scores["attn_mass"][0].sum(-1), torch.full((shape.n_heads,), float(n)), rtol=1e-4)


def test_h2o_keeps_heavy_hitters_and_recent_half():
    mass = torch.zeros(2, 40)
    mass[0, [3, 11, 17]] = torch.tensor([5.0, 9.0, 7.0])
    mass[1, [0, 25, 30]] = torch.tensor([4.0, 6.0, 8.0])
    mass[:, 37:] = 100.0  # the recent window is kept whatever its mass
    mass[1, 38] = 0.0
    idx = h2o_positions(mass, k=6, heavy_ratio=0.5)  # 3 heavy + 3 recent
    assert idx[0].tolist() == [3, 11, 17, 37, 38, 39]
    assert idx[1].tolist() == [0, 25, 30, 37, 38, 39]
    idx = h2o_positions(mass, k=7)  # odd k: the recent window gets the extra token
    assert idx[0].tolist() == [3, 11, 17, 36, 37, 38, 39] and idx.shape == (2, 7)


def test_h2o_selection_uses_group_sum(captured):
    m = methods.get("h2o")
    shape, n = captured.shape, captured.n_tokens
    idx = m.select(captured, m.resolve_params({"budget": 0.2}))
    k = math.floor(0.2 * n)
    g = shape.n_heads // shape.n_kv_heads
    for layer, ix in enumerate(idx):
        mass = captured.scores["attn_mass"][layer].view(shape.n_kv_heads, g, n).sum(1)
        recent = k - k // 2
        assert ix[:, -recent:].tolist() == [list(range(n - recent, n))] * shape.n_kv_heads
        for h in range(shape.n_kv_heads):
            heavy = ix[h, : k // 2]
            older = torch.ones(n - recent, dtype=torch.bool)
            older[heavy] = False
            assert mass[h, heavy].min() >= mass[h, : n - recent][older].max()


def test_chunkkv_keeps_whole_top_chunks():
    s = torch.zeros(50)  # prefix of 50 tokens = 5 chunks of 10; window 10 after it
    s[20:30] = 3.0
    s[40:50] = 2.0
    s[5] = 10.0  # chunk sums: chunk 2 = 30, chunk 4 = 20, chunk 0 = 10, others 0
    pos = chunk_positions(s, n=60, k=10 + 20, chunk=10).tolist()
    assert pos == list(range(20, 30)) + list(range(40, 50)) + list(range(50, 60))
    # 5 slots left over after whole chunks: the best remaining tokens fill them
    pos = chunk_positions(s, n=60, k=10 + 25, chunk=10).tolist()
    assert len(pos) == 35 and 5 in pos and set(range(20, 30)) <= set(pos)
    # k smaller than the window: the last k tokens
    assert chunk_positions(s, n=60, k=4, chunk=10).tolist() == [56, 57, 58, 59]


def test_chunkkv_same_chunks_in_every_head_and_layer_reuse(captured):
    m = methods.get("chunkkv")
    idx = m.select(captured, m.resolve_params({"budget": 0.2, "reuse": 2}))
    assert all(torch.equal(ix[0], ix[1]) for ix in idx)
    assert torch.equal(idx[0], idx[1])  # layer 1 reuses layer 0's chunks


def test_pyramid_budgets():
    b = pyramid_budgets(100, 1000, 8, beta=20)
    assert sum(b) == 800 and b == sorted(b, reverse=True)
    assert b[0] == math.floor(200 - 5) and b[-1] == 5
    b = pyramid_budgets(900, 1000, 4)  # the bottom would exceed N: capped
    assert sum(b) == 3600 and max(b) == 1000
    assert pyramid_budgets(1000, 1000, 24) == [1000] * 24
    assert pyramid_budgets(7, 10, 1) == [7]


def test_select_with_window():
    scores = torch.tensor([[0.0, 5.0, 1.0, 4.0]])
    assert select_with_window(scores, 7, 5).tolist() == [[1, 3, 4, 5, 6]]
    assert select_with_window(scores, 7, 2).tolist() == [[5, 6]]


def test_sentence_bounds():
    toks = ["The", " pressure", " is", " 8", ".", "6", " bar", ".", " Check", " it", " daily", "!", "\n", "#", " Notes", " here", ".", " Ok", "."]
    b = sentence_bounds(toks, min_len=2, max_len=64)
    # "8.6" is not a sentence end; the 1-token "\n" sentence merges into the next one
    assert b == [0, 8, 12, 17, 19]
    assert sentence_bounds(["a"] * 10, min_len=1, max_len=4) == [0, 4, 8, 10]
    assert merge_to_fit([0, 2, 4, 6, 8, 10], 2) == [0, 8, 10]
    assert merge_to_fit([0, 2, 4, 6, 8, 10], 5) == [0, 2, 4, 6, 8, 10]


def test_sentencekv_fetches_the_sentence_the_query_points_at():
    d, hkv, h = 8, 1, 2
    shape = ModelShape(1, h, hkv, d, torch.float32)
    n = 12
    gen = torch.Generator().manual_seed(0)
    keys = 0.01 * torch.randn(hkv, n, d, generator=gen)
    keys[0, 4:8, 0] = 1.0  # sentence 1 (tokens 4..7) points along e_0
    values = torch.randn(hkv, n, d, generator=gen)
    bounds = torch.tensor([0, 4, 8, 12])
    means = [torch.stack([keys[0, a:b].mean(0) for a, b in ((0, 4), (4, 8), (8, 12))])[None]]
    # budget: floor(b*12) - ceil(3/2) = 4 tokens = one sentence
    mem = SentenceMemory([keys], [values], means, bounds, 6 / 12, shape, "cpu")
    assert mem.capacity == 4
    q = torch.zeros(1, h, 1, d)
    q[..., 0] = 3.0
    k_new, v_new = torch.randn(1, hkv, 1, d, generator=gen), torch.randn(1, hkv, 1, d, generator=gen)
    out = mem.attend(0, q, k_new, v_new, d**-0.5)
    assert mem.fetched == [4]
    ks = torch.cat([keys[:, 4:8], k_new[0]], 1)[None]
    vs = torch.cat([values[:, 4:8], v_new[0]], 1)[None]
    ref = torch.nn.functional.scaled_dot_product_attention(q, ks.expand(1, h, 5, d), vs.expand(1, h, 5, d), scale=d**-0.5)
    torch.testing.assert_close(out, ref)
    per_tok_layer = 2 * hkv * d * 4
    assert mem.resident_bytes() == 3 * hkv * d * 4 + 4 * per_tok_layer + 1 * per_tok_layer
    assert mem.n_tokens() == 13
    mem.truncate(12)
    assert mem.n_tokens() == 12
    with pytest.raises(SekvError):
        SentenceMemory([keys], [values], means, bounds, 1 / 12, shape, "cpu")


def test_sentencekv_multi_head_padding_matches_masked_reference():
    """Two KV heads pick sentences of different lengths: the padded gather is masked out exactly."""
    d, hkv, h = 4, 2, 4
    shape = ModelShape(1, h, hkv, d, torch.float32)
    gen = torch.Generator().manual_seed(1)
    keys, values = torch.randn(hkv, 10, d, generator=gen), torch.randn(hkv, 10, d, generator=gen)
    bounds = torch.tensor([0, 2, 6, 10])
    means = [torch.stack([torch.stack([keys[j, a:b].mean(0) for a, b in ((0, 2), (2, 6), (6, 10))]) for j in range(hkv)])]
    mem = SentenceMemory([keys], [values], means, bounds, 0.6, shape, "cpu")  # 6 - 2 = 4 tokens
    q = torch.randn(1, h, 3, d, generator=gen)
    kn, vn = torch.randn(1, hkv, 3, d, generator=gen), torch.randn(1, hkv, 3, d, generator=gen)
    idx, valid = mem.select(0, q)
    out = mem.attend(0, q, kn, vn, 0.5)
    for head in range(h):
        j = head // 2
        sel = idx[j][valid[j]]
        ks = torch.cat([keys[j, sel], kn[0, j]])
        vs = torch.cat([values[j, sel], vn[0, j]])
        t = ks.shape[0]
        mask = torch.ones(3, t, dtype=torch.bool).tril(diagonal=t - 3)
        ref = torch.softmax((q[0, head] @ ks.T * 0.5).masked_fill(~mask, float("-inf")), -1) @ vs
        torch.testing.assert_close(out[0, head], ref, atol=1e-5, rtol=1e-5)


def test_methods_are_registered_and_full_stays_default():
    for name in BASELINES:
        assert methods.get(name).name == name
    assert methods.DEFAULT_METHOD in methods.REGISTRY
    assert methods.get("snapkv").needs_scores == ("obs_queries",)
    assert methods.get("h2o").needs_scores == ("attn_mass",)
    assert methods.get("streamingllm").needs_scores == ()
    assert methods.get("full").needs_scores == ()
