"""`kvzip`: reconstruction scores against an independent transformers reference, selection, budgets, the pack.

The reference recomputes every reconstruction pass with plain transformers (eager attention,
``output_attentions=True``) over the whole sequence document + reconstruction input: the
softmax over the subset S + chunk + reconstruction tokens is the full softmax restricted to
those columns and renormalised, so KVzip's score follows from the model's own attention map.
"""

from __future__ import annotations

import math

import pytest
import torch

from sekv_core import methods, prompt
from sekv_core.documents import load_document
from sekv_core.errors import SekvError
from sekv_core.generate import generate
from sekv_core.ingest import ingest, tokenize_document
from sekv_core.methods import scores as scoremod
from sekv_core.methods.base import DictStore, ModelShape
from sekv_core.methods.kvzip import KVzipParams, RaggedEvictedMemory, kvzip_scores, select_kept
from sekv_core.pack import read_pack
from sekv_core.prefill import prefill
from sekv_core.session import Session

from conftest import SAMPLE_MD

QUESTION = "How many steps does the tower have?"
MAX_NEW = 16


@pytest.fixture(scope="module")
def doc(tmp_path_factory):
    p = tmp_path_factory.mktemp("doc") / "log.md"
    p.write_text(SAMPLE_MD.read_text()[:2200])
    return p


@pytest.fixture(scope="module")
def short_doc(tmp_path_factory):
    p = tmp_path_factory.mktemp("short") / "log.md"
    p.write_text(SAMPLE_MD.read_text()[:500])
    return p


def _prefill(lm, path, chunk=128):
    ids, _ = tokenize_document(lm, load_document(path))
    text = prompt.document_prefix(lm.tokenizer, load_document(path).text)
    pre = prefill(lm.model, torch.tensor(ids), with_surprisal=False, chunk=chunk)
    pre.scores.update(scoremod.text_scores(lm.tokenizer, text, ids, ("kvzip_prompts",)))
    return pre


@pytest.fixture(scope="module")
def captured(lm, doc):
    return _prefill(lm, doc)


# ---------------------------------------------------------------------------- scores vs an independent reference


def _reference_scores(model_dir, tok, ids: list[int], chunk: int, sinks: int, plus: bool) -> list[torch.Tensor]:
    """KVzip scores from transformers' own eager attention maps, one full forward per reconstruction pass."""
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager").eval()
    cfg = hf.config
    n, L, H, Hkv = len(ids), cfg.num_hidden_layers, cfg.num_attention_heads, cfg.num_key_value_heads
    g, d = H // Hkv, cfg.hidden_size // H
    enc = lambda s: tok(s, add_special_tokens=False)["input_ids"]  # noqa: E731
    head = enc("<|im_start|>system\n" + prompt.SYSTEM + "<|im_end|>\n<|im_start|>user\n")  # the tiny ChatML template
    assert ids[: len(head)] == head
    turn_end = enc("<|im_end|>\n<|im_start|>assistant\n")
    out = [torch.zeros(Hkv, n) for _ in range(L)]
    starts = list(range(len(head), n, chunk))
    for i, a in enumerate(starts):
        b = min(n, a + chunk)
        lead = enc("\n\nRepeat the previous context exactly.") if i == 0 else \
            enc("\n\nRepeat the part of the previous context exactly, starting with") + ids[max(len(head), a - 8) : a]
        x = lead + turn_end + ids[a:b]
        q = len(x)
        with torch.no_grad():
            o = hf(input_ids=torch.tensor([ids + x]), output_attentions=True, output_hidden_states=True, use_cache=True)
        s = min(sinks, a)
        cols = list(range(s)) + list(range(a, b)) + list(range(n, n + q))
        for layer in range(L):
            att = o.attentions[layer][0, :, n:, :]  # [H, q, n + q]: the reconstruction queries' full softmax
            sub = att[:, :, cols]
            sub = sub / sub.sum(-1, keepdim=True)
            p = sub[:, :, s : s + (b - a)]  # [H, q, c]
            if plus:
                attn = hf.model.layers[layer].self_attn
                xin = hf.model.layers[layer].input_layernorm(o.hidden_states[layer][0, n:])  # the attention's input
                p = p / xin.norm(dim=-1).view(1, q, 1)
                v = o.past_key_values.layers[layer].values[0, :, a:b]  # [Hkv, c, d]
                w = attn.o_proj.weight  # [hidden, H * d]
                wov = torch.stack([(v[h // g] @ w[:, h * d : (h + 1) * d].T).norm(dim=-1) for h in range(H)])  # [H, c]
                p = p * wov.view(H, 1, -1)
            out[layer][:, a:b] = p.amax(1).view(Hkv, g, -1).amax(1)
    return out


@pytest.mark.parametrize("plus", [False, True])
def test_scores_equal_eager_attention_reference(lm, short_doc, tiny_qwen, plus, monkeypatch):
    from sekv_core.methods import kvzip

    monkeypatch.setattr(kvzip, "_SCORE_BLOCK", 5000)  # several blocks of query rows per pass
    pre = _prefill(lm, short_doc, chunk=50)
    n = pre.n_tokens
    chunk = 60  # several passes, the last one short
    ours = kvzip_scores(pre, KVzipParams(chunk=chunk, sinks=4, plus=plus))
    ref = _reference_scores(str(tiny_qwen), lm.tokenizer, pre.token_ids.tolist(), chunk, 4, plus)
    p = pre.scores["kvzip_prompts"]["context_start"]
    assert 4 < p < n - 2 * chunk
    for o, r in zip(ours, ref):
        assert torch.isinf(o[:, :4]).all()
        assert (o[:, 4:p] == 0).all()  # the template head is never reconstructed
        torch.testing.assert_close(o[:, p:], r[:, p:], rtol=2e-4, atol=1e-6)
        assert (o[:, p:] > 0).all()


def test_compress_leaves_the_prefill_untouched(lm, captured):
    before = [t.clone() for t in captured.keys + captured.values]
    m = methods.get("kvzip")
    m.compress(captured, m.resolve_params({"budget": 0.2}))
    assert all(torch.equal(a, b) for a, b in zip(before, captured.keys + captured.values))


def test_needs_the_model_and_prompts(captured):
    import dataclasses

    m = methods.get("kvzip")
    with pytest.raises(SekvError, match="model"):
        m.compress(dataclasses.replace(captured, model=None), m.resolve_params({}))
    with pytest.raises(SekvError, match="kvzip_prompts"):
        m.compress(dataclasses.replace(captured, scores={}), m.resolve_params({}))


def test_params_are_checked():
    with pytest.raises(SekvError):
        KVzipParams(budget=0.0)
    with pytest.raises(SekvError):
        KVzipParams(level="global")
    with pytest.raises(SekvError):
        KVzipParams(chunk=0)
    assert KVzipParams.of(methods.get("kvzip").resolve_params({"plus": True})) == KVzipParams(plus=True)


# ---------------------------------------------------------------------------- selection


def test_select_kept_levels():
    s0 = torch.tensor([[9.0, 1.0, 8.0, 2.0], [0.5, 7.0, 0.1, 0.2]])
    s1 = torch.tensor([[0.3, 0.4, 6.0, 0.0], [5.0, 0.6, 0.7, 3.0]])
    rows = lambda kept: [[ix.tolist() for ix in layer] for layer in kept]  # noqa: E731
    assert rows(select_kept([s0, s1], 2, "head")) == [[[0, 2], [0, 1]], [[1, 2], [0, 3]]]
    assert rows(select_kept([s0, s1], 2, "layer")) == [[[0, 2, 3], [1]], [[2], [0, 2, 3]]]
    # 8 pairs over everything: 9 8 7 6 5 3 2 1
    assert rows(select_kept([s0, s1], 2, "pair")) == [[[0, 1, 2, 3], [1]], [[2], [0, 3]]]
    assert rows(select_kept([s0, s1], 4, "pair")) == [[[0, 1, 2, 3]] * 2] * 2


@pytest.mark.parametrize("level", ["pair", "layer", "head"])
def test_resident_within_budget_kept_counts_and_rows(level, lm, captured):
    m = methods.get("kvzip")
    shape, n = captured.shape, captured.n_tokens
    per = shape.kv_bytes_per_token()
    q_ids = prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, QUESTION))
    scores = kvzip_scores(captured, KVzipParams())
    for budget in (0.05, 0.2, 0.5):
        params = m.resolve_params({"budget": budget, "level": level})
        tensors = m.compress(captured, params)
        k = math.floor(budget * n + 1e-9)
        counts = tensors["kvzip.counts"]
        assert int(counts.sum()) == shape.n_layers * shape.n_kv_heads * k
        if level != "pair":
            assert (counts.sum(1) == shape.n_kv_heads * k).all()
        if level == "head":
            assert (counts == k).all()
        kept = m.kept_indices(DictStore(tensors), shape.n_layers)
        for layer, idx in enumerate(kept):
            for j, ix in enumerate(idx):
                assert (ix[1:] > ix[:-1]).all() and set(range(4)) <= set(ix.tolist())
                # every kept pair scores at least as high as every evicted pair of the same unit
                out = torch.ones(n, dtype=torch.bool)
                out[ix] = False
                if level == "head" and out.any():
                    assert scores[layer][j, ix].min() >= scores[layer][j, out].max()
            g = torch.cat([captured.keys[layer][j, ix] for j, ix in enumerate(idx)])
            assert torch.equal(tensors[f"kvzip.k.{layer}"], g)
        memory = m.open(DictStore(tensors), params, shape, "cpu")
        ids, stats = generate(lm.model, memory, q_ids, max_new_tokens=4, stop_ids=set())
        appended = memory.n_tokens() - n
        assert appended == len(q_ids) + len(ids) - 1
        assert stats.resident_kv_bytes_peak <= budget * n * per + appended * per


def test_pair_level_threshold_is_global(captured):
    scores = kvzip_scores(captured, KVzipParams())
    k = math.floor(0.1 * captured.n_tokens)
    kept = select_kept(scores, k, "pair")
    allk = torch.cat([s[j, ix] for s, layer in zip(scores, kept) for j, ix in enumerate(layer)])
    mask = torch.ones(torch.stack(scores).shape, dtype=torch.bool)
    for li, layer in enumerate(kept):
        for j, ix in enumerate(layer):
            mask[li, j, ix] = False
    assert allk.min() >= torch.stack(scores)[mask].max()


# ---------------------------------------------------------------------------- the ragged memory


def test_ragged_memory_equals_masked_full_attention():
    torch.manual_seed(0)
    L, H, Hkv, d, n = 1, 4, 2, 8, 12
    shape = ModelShape(L, H, Hkv, d, torch.float32)
    keys, values = torch.randn(Hkv, n, d), torch.randn(Hkv, n, d)
    kept = [torch.tensor([0, 3, 5, 9]), torch.tensor([1, 2, 11])]
    mem = RaggedEvictedMemory([[keys[j, ix] for j, ix in enumerate(kept)]], [[values[j, ix] for j, ix in enumerate(kept)]],
                              n, shape, "cpu", extra=1)  # extra=1: the buffers must grow
    for q in (3, 1, 2):
        query, kn, vn = torch.randn(1, H, q, d), torch.randn(1, Hkv, q, d), torch.randn(1, Hkv, q, d)
        base = mem.n_tokens()
        out = mem.attend(0, query, kn, vn, 0.3)
        if q == 3:
            app_k, app_v = kn[0], vn[0]
        else:
            app_k, app_v = torch.cat([app_k, kn[0]], 1), torch.cat([app_v, vn[0]], 1)
        for h in range(H):
            j = h // 2
            ks, vs = torch.cat([keys[j, kept[j]], app_k[j]]), torch.cat([values[j, kept[j]], app_v[j]])
            logits = query[0, h] @ ks.T * 0.3
            m0 = len(kept[j])
            visible = torch.arange(ks.shape[0])[None, :] <= (m0 + base - n + torch.arange(q))[:, None]
            ref = logits.masked_fill(~visible, float("-inf")).softmax(-1) @ vs
            torch.testing.assert_close(out[0, h], ref, rtol=1e-5, atol=1e-6)
    assert mem.n_tokens() == n + 6
    assert mem.resident_bytes() == (4 + 3 + 2 * 6) * 2 * d * 4
    mem.truncate(n)
    assert mem.n_tokens() == n and mem.resident_bytes() == 7 * 2 * d * 4


def test_ragged_memory_attention_shapes_stay_fixed_between_growths():
    """Each layer's buffer is a multiple of ROW_QUANTUM rows per KV head and every forward attends over all of it (the
    rest masked): 100 single-token steps see the shapes of the first one (kernels that plan per shape re-plan
    only when a buffer grows)."""
    from sekv_core.methods import kvzip

    torch.manual_seed(0)
    L, H, Hkv, d, n = 2, 4, 2, 8, 40
    shape = ModelShape(L, H, Hkv, d, torch.float32)
    kept = [[torch.arange(0, n, 3), torch.arange(5)], [torch.arange(n), torch.arange(0, n, 7)]]
    keys = [[torch.randn(ix.numel(), d) for ix in layer] for layer in kept]
    mem = RaggedEvictedMemory(keys, keys, n, shape, "cpu")
    seen = []
    real = kvzip.F.scaled_dot_product_attention

    def spy(q, k, v, **kw):
        seen.append((tuple(q.shape), tuple(k.shape), tuple(kw["attn_mask"].shape)))
        return real(q, k, v, **kw)

    kvzip.F.scaled_dot_product_attention = spy
    try:
        steps = []
        for _ in range(100):
            seen.clear()
            for layer in range(L):
                mem.attend(layer, torch.randn(1, H, 1, d), torch.randn(1, Hkv, 1, d), torch.randn(1, Hkv, 1, d), 0.3)
            steps.append(list(seen))
    finally:
        kvzip.F.scaled_dot_product_attention = real
    assert all(s == steps[0] for s in steps)
    assert all(k[2] % kvzip.ROW_QUANTUM == 0 for _, k, _ in steps[0])


# ---------------------------------------------------------------------------- ingest, pack, ask


@pytest.fixture(scope="module")
def full_answer(lm, doc, tmp_path_factory):
    pack = tmp_path_factory.mktemp("full") / "doc.sekv"
    ingest(doc, pack, lm=lm, method="full", chunk=128)
    ans = Session.open(pack, lm=lm).ask(QUESTION, max_new_tokens=MAX_NEW)
    assert len(ans.token_ids) > 3
    return ans.token_ids


def test_budget_one_reproduces_full(lm, doc, full_answer, tmp_path):
    pack = tmp_path / "kvzip.sekv"
    ingest(doc, pack, lm=lm, method="kvzip", params={"budget": 1.0}, chunk=128)
    ans = Session.open(pack, lm=lm).ask(QUESTION, max_new_tokens=MAX_NEW)
    assert ans.token_ids == full_answer
    p = read_pack(pack)
    assert methods.get("kvzip").describe(p, methods.get("kvzip").resolve_params(p.params))["kept_fraction"] == 1.0


def test_pack_round_trip_and_ask(lm, doc, captured, tmp_path):
    pack = tmp_path / "kvzip.sekv"
    r = ingest(doc, pack, lm=lm, method="kvzip", params={"budget": 0.2, "chunk": 300}, chunk=128)
    m = methods.get("kvzip")
    p = read_pack(pack)
    assert p.params["chunk"] == 300 and p.params["level"] == "pair"
    # the pack holds what compress() gives for the same prefill (ingest's prefill = the fixture's)
    direct = m.compress(captured, m.resolve_params({"budget": 0.2, "chunk": 300}))
    assert sorted(p.keys()) == sorted(direct)
    for name in direct:
        assert torch.equal(p.get(name), direct[name]), name
    info = m.describe(p, m.resolve_params(p.params))
    assert info["doc_tokens"] == r.n_tokens and abs(info["kept_fraction"] - math.floor(0.2 * r.n_tokens) / r.n_tokens) < 1e-4
    session = Session.open(pack, lm=lm)
    ans = session.ask(QUESTION, max_new_tokens=MAX_NEW)
    assert ans.stats.generated_tokens > 0
    assert session.memory.n_tokens() == r.n_tokens
    assert session.ask(QUESTION, max_new_tokens=MAX_NEW).token_ids == ans.token_ids
    with pytest.raises(SekvError):
        Session.open(pack, lm=lm, params={"budget": 0.1})  # eviction happened at ingest
