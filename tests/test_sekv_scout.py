"""Scout routing (sekv_core/sekv/scout.py): the question's span ranking, checked against full-KV attention."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.prefill import prefill
from sekv_core.sekv import scout

from test_sekv_method import EXACT, Store, tiny

QUESTION = [5, 17, 42, 99, 7, 250]


def _memory(kind="qwen2", n=500, capture=True, device="cpu", **params):
    model = tiny(kind)
    runtime.install(model)
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(1))
    kw = {"capture": ("obs_queries",), "obs_window": scout.PROFILE_QUERIES} if capture else {}
    res = prefill(model, ids, with_surprisal=True, chunk=128, **kw)
    m = methods.get("sekv")
    p = m.resolve_params({"routing": "scout", **params})
    store = Store(m.compress(res, p))
    if device != "cpu":
        model = model.to(device)
    return model, res, store, p, m.open(store, p, res.shape, device)


def _reference_sum(queries: dict, keys: dict, res, spans: list[tuple[int, int]]) -> torch.Tensor:
    """Sum over layers of z-scored span masses, from full-KV keys, one (head, token) softmax at a time."""
    d = res.shape.head_dim
    group = res.shape.n_heads // res.shape.n_kv_heads
    total = torch.zeros(len(spans), dtype=torch.float64)
    for layer, q in queries.items():  # q [H, T, d]
        k_all = torch.cat([res.keys[layer].double(), keys[layer].double()], 1)  # document + question [Hkv, N+T, d]
        best = torch.zeros(len(spans), dtype=torch.float64)
        for h in range(q.shape[0]):
            for t in range(q.shape[1]):
                p = torch.softmax(k_all[h // group] @ q[h, t].double() * d**-0.5, 0)
                best = torch.maximum(best, torch.tensor([float(p[a:b].sum()) for a, b in spans], dtype=torch.float64))
        total += (best - best.mean()) / best.std()
    return total


def _spy(mem):
    queries, keys = {}, {}
    inner = mem._attend

    def spy(layer, query, key, value, scaling):
        if mem.ranking.scouting:
            queries[layer], keys[layer] = query[0].float().clone(), key[0].float().clone()
        return inner(layer, query, key, value, scaling)

    mem._attend = spy
    return queries, keys


def _blocks(mem) -> list[tuple[int, int]]:
    return list(zip(mem.res.block_start.tolist(), (mem.res.block_start + mem.res.block_len).tolist()))


@pytest.mark.parametrize("kind,unit,batched", [("qwen2", 16, False), ("llama", 16, False), ("qwen2", 3, False), ("qwen2", 3, True), ("llama", 16, True)])
def test_scout_masses_equal_full_kv_attention(kind, unit, batched):
    """With exact factors the scout's per-layer masses are full-KV attention's: its ranking is the reference's
    sum of z-scored masses of the zoom blocks (softmax over document + question keys), minus the document profile.
    ``batched``: the accelerators' step (fixed-size rows, those of no block dropped by layer_mass), run on the CPU."""
    model, res, store, p, mem = _memory(kind, capture=False, **{**EXACT, "zoom": "router", "budget": 0.5, "zoom_unit": unit})
    mem.batched = batched
    assert (mem.res.n_blocks > 2 * mem.res.n_spans) == (unit == 3)
    queries, keys = _spy(mem)
    q = torch.tensor([QUESTION])
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    assert mem.n_tokens() == res.n_tokens  # the scout's tokens are gone again
    assert mem.res.scout_profile is not None and not mem.res.scout_profile.any()  # no recorded queries: a zero profile
    ref = _reference_sum(queries, keys, res, _blocks(mem))
    assert torch.allclose(mem.ranking.prio.double(), ref, atol=1e-3), (mem.ranking.prio.double() - ref).abs().max()


@pytest.mark.parametrize("chunk", ["pairs", "layers", "rotations"])
def test_batched_scout_in_chunks_equals_full_kv_attention(chunk, monkeypatch):
    """The batched step scores every layer after the question's forward, several layers at once or one layer's
    (group, span) pairs a few at a time (long contexts): either way the full-KV reference's ranking."""
    from sekv_core.sekv import gpu_step

    model, res, store, p, mem = _memory("qwen2", capture=False, **{**EXACT, "zoom": "router", "budget": 0.5, "zoom_unit": 3})
    mem.batched = True
    seen = []

    def chunking(self, n_pairs, per_pair):
        seen.append(n_pairs)
        return (5, 1) if chunk != "layers" else (2 * n_pairs, 2)

    monkeypatch.setattr(gpu_step.BatchedStep, "_scout_chunk", chunking)
    if chunk == "rotations":  # a pass's rotations too large to make at once: each chunk makes its own
        monkeypatch.setattr(gpu_step, "SCOUT_CHUNK_BYTES", 1)
    queries, keys = _spy(mem)
    q = torch.tensor([QUESTION])
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    assert seen and seen[0] > 5 and mem.shape.n_layers == 2  # several chunks of pairs; both layers in one chunk
    ref = _reference_sum(queries, keys, res, _blocks(mem))
    assert torch.allclose(mem.ranking.prio.double(), ref, atol=1e-3), (mem.ranking.prio.double() - ref).abs().max()


def test_document_profile_is_the_document_ends_masses():
    """The pack's profiles of spans and of the zoom blocks it was made for; at ask time another unit falls back to
    each block's span profile."""
    model, res, store, p, mem = _memory(**{**EXACT, "zoom": "router", "budget": 0.5, "zoom_unit": 3})
    qs = res.scores["obs_queries"]
    assert qs[0].shape[1] == scout.PROFILE_QUERIES
    d, group = res.shape.head_dim, res.shape.n_heads // res.shape.n_kv_heads

    def reference(ranges):
        ref = torch.zeros(len(ranges), dtype=torch.float64)
        for layer, q in enumerate(qs):
            best = torch.zeros(len(ranges), dtype=torch.float64)
            for h in range(q.shape[0]):
                for t in range(q.shape[1]):
                    pr = torch.softmax(res.keys[layer][h // group].double() @ q[h, t].double() * d**-0.5, 0)
                    best = torch.maximum(best, torch.tensor([float(pr[a:b].sum()) for a, b in ranges], dtype=torch.float64))
            ref += (best - best.mean()) / best.std()
        return ref

    spans = reference(mem.spans())
    assert torch.allclose(store["sekv.scout.profile"].double(), spans, atol=1e-3)
    assert torch.allclose(mem.res.scout_profile.double(), reference(_blocks(mem)), atol=1e-3)
    other = methods.get("sekv").open(store, p.replace(zoom_unit=5), res.shape, "cpu")
    assert torch.allclose(other.res.scout_profile.double(), spans[other.res.block_span], atol=1e-3)


def test_scout_ranking_is_shared_by_every_layer_within_the_budget():
    model, res, store, p, mem = _memory(n=600, budget=0.3, min_span=10, window=16)
    from sekv_core.generate import generate

    held = []
    out, stats = generate(model, mem, QUESTION, max_new_tokens=5, stop_ids=set(), on_step=lambda m: held.append([h[0].clone() if h else None for h in m.step.held]))
    prof = mem.ranking.prio + mem.res.scout_profile  # the question's own sum
    assert float(prof.abs().sum()) > 0
    for step in held:  # every layer keeps the same spans (equal caps), the best-ranked ones
        assert step[0] is not None and all(torch.equal(k, step[0]) for k in step)
        kept = step[0].any(0)
        ranked = torch.argsort(mem.ranking.prio, descending=True)
        assert bool(kept[ranked[0]])
    x = mem.step_stats()
    # the question's and answer's tokens are resident on top of b x the document's KV (reported apart)
    assert x.resident_bytes - x.extra["appended_bytes"] <= x.extra["budget_bytes"]
    assert stats.resident_kv_bytes_peak <= x.extra["budget_bytes"] + x.extra["appended_bytes"]


def test_per_layer_routing_has_no_shared_ranking():
    model, res, store, p, mem = _memory(n=400, routing="per_layer", budget=0.3, min_span=10, window=16)
    assert mem.ranking is None
    calls = []
    mem.prepare_question(lambda: calls.append(1))
    assert calls == []  # no scout pass


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_scout_on_cuda_matches_cpu():
    """The batched CUDA step reads the same shared ranking (a fixed buffer inside its graphs)."""
    from sekv_core.generate import generate

    model, res, store, p, mem = _memory(n=600, budget=0.3, min_span=10, window=16)
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)
    gmem = methods.get("sekv").open(store, p, res.shape, "cuda")
    assert gmem.batched
    a, _ = generate(model, mem, QUESTION, max_new_tokens=6, stop_ids=set())
    b, _ = generate(gmodel, gmem, QUESTION, max_new_tokens=6, stop_ids=set())
    assert torch.allclose(mem.ranking.prio, gmem.ranking.prio.cpu(), atol=1e-2)
    assert a == b


def test_a_forward_without_a_scout_pass_routes_per_layer():
    """Only the ask that follows prepare_question() uses its ranking; other forwards route as per_layer does."""
    model, res, store, p, mem = _memory(n=600, budget=0.3, min_span=10, window=16)
    per_layer = methods.get("sekv").open(store, p.replace(routing="per_layer"), res.shape, "cpu")
    q = torch.tensor([QUESTION])
    a = runtime.forward_logits(model, q, mem.n_tokens(), mem)
    b = runtime.forward_logits(model, q, per_layer.n_tokens(), per_layer)
    assert torch.equal(a, b)
    mem.truncate(600)
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    c = runtime.forward_logits(model, q, mem.n_tokens(), mem)  # this ask uses the scout's ranking
    assert mem.ranking.ready
    mem.truncate(600)
    d = runtime.forward_logits(model, q, mem.n_tokens(), mem)  # the next ask has had no scout pass
    assert not mem.ranking.ready and torch.equal(d, b)
    assert c.shape == a.shape


def _ask_logits(model, mem, question, steps):
    """What generate() does, keeping every step's logits: scout pass, question, greedy steps."""
    ids = torch.tensor([question])
    mem.prepare_question(lambda: runtime.forward_hidden(model, ids, mem.n_tokens(), mem))
    out, h2d = [], []
    for _ in range(steps):
        out.append(runtime.forward_logits(model, ids, mem.n_tokens(), mem))
        h2d.append(mem.step_stats().extra["h2d_bytes_step"])
        ids = out[-1].argmax(-1)
    return torch.cat(out, 1), h2d


def test_fixed_set_is_fetched_once_and_reused_exactly(monkeypatch):
    """Batched step under scout routing: the question's forward fills the slots, later steps reuse them (nothing
    fetched), with the same logits as a decoder that refills every step, and the reference step's tokens."""
    from sekv_core.sekv import fixed_set

    model, res, store, p, ref = _memory(n=600, budget=0.5, min_span=10, window=16)

    def batched():
        m = methods.get("sekv").open(store, p, res.shape, "cpu")
        m.batched = True
        return m

    reuse, refill = batched(), batched()
    a, h2d = _ask_logits(model, reuse, QUESTION, 6)
    assert h2d[0] > 0 and h2d[1:] == [0] * 5  # fetched for the question's forward only
    assert all(k == reuse.step.fixed_key() for k in reuse.step.fixed.filled_for) and reuse.step.fixed_key()[1] == reuse.ranking.version
    x = reuse.step_stats().extra
    monkeypatch.setattr(fixed_set.FixedSets, "key", lambda self, u: None if not self.ranking.ranks() else object())  # never the same
    b, h2d = _ask_logits(model, refill, QUESTION, 6)
    assert all(n > 0 for n in h2d)
    assert torch.allclose(a, b, atol=1e-6, rtol=1e-6), (a - b).abs().max()
    y = refill.step_stats().extra
    for k in ("zoom_spans_total", "span_zoom_counts"):
        assert x[k] == y[k], k
    assert x["zoom_rate_per_layer"] == pytest.approx(y["zoom_rate_per_layer"])
    assert 0 < x["zoom_spans_total"] < reuse.res.n_spans  # the cap binds
    _ask_logits(model, ref, QUESTION, 6)
    # the batched scout pass (factor blocks) ranks like the reference one (CPU factor gather), and each group keeps
    # the top of that ranking, as many zoom blocks as its rows hold (the reference step's cap is wider than the
    # batched step's slots, which reserve the tail's capacity: test_fixed_set_attention_equals_reference_step gives
    # both the same cap and compares their logits)
    assert torch.allclose(reuse.ranking.prio, ref.ranking.prio, atol=1e-3), (reuse.ranking.prio - ref.ranking.prio).abs().max()
    order = torch.argsort(ref.ranking.prio, descending=True, stable=True)
    for layer, keep in enumerate(reuse.step.fixed.keep):
        k = int(keep[0].sum())
        assert k > 0 and bool(keep[0][order[:k]].all()) and torch.equal(keep[0], keep[1])
        assert int(reuse.res.block_len[keep[0]].sum()) <= reuse.step.U // reuse.shape.n_kv_heads < int(reuse.res.block_len[order[: k + 1]].sum())
    # a new question (a new ranking) refills
    monkeypatch.undo()
    reuse.truncate(600)
    _, h2d = _ask_logits(model, reuse, QUESTION[::-1], 2)
    assert h2d[0] > 0 and h2d[1] == 0


@pytest.mark.parametrize("kind,unit", [("qwen2", 16), ("llama", 16), ("qwen2", 4)])
def test_fixed_set_attention_equals_reference_step(kind, unit, monkeypatch):
    """The batched fixed-set path (per-group share of the cap, rows in the annex, one SDPA over resident memory
    and rows) against the reference step (CPU, per-pair cap, explicit mixed mask) given the same ranking and the
    cap that keeps the same pairs: same logits, same spans."""
    from sekv_core.sekv import cpu_step

    model, res, store, p, ref = _memory(kind, n=600, budget=0.5, min_span=10, window=16, zoom_unit=unit)
    fast = methods.get("sekv").open(store, p, res.shape, "cpu")
    fast.batched = True
    ids = torch.tensor([QUESTION])
    fast.prepare_question(lambda: runtime.forward_hidden(model, ids, fast.n_tokens(), fast))
    ref.prepare_question(lambda: runtime.forward_hidden(model, ids, ref.n_tokens(), ref))  # the reference step's scout pass
    assert torch.allclose(fast.ranking.prio, ref.ranking.prio, atol=1e-3), (fast.ranking.prio - ref.ranking.prio).abs().max()
    ref.ranking.prio.copy_(fast.ranking.prio)  # the same ranking (the two scout passes differ by ~1e-4)
    ref.ranking.ready, ref.ranking.version = True, fast.ranking.version
    a = [runtime.forward_logits(model, ids, fast.n_tokens(), fast, last_only=False)]
    per_group = fast.step.fixed.n[0]
    assert 0 < int(per_group.min()) and int(per_group.max()) < fast.step.U // fast.shape.n_kv_heads + 1
    assert all(torch.equal(n, per_group) for n in fast.step.fixed.n)
    if unit == 4:  # several blocks of one span in the set: its factor block fetched once, read by each of them
        assert int(torch.bincount(fast.res.block_span[fast.step.fixed.keep[0][0].cpu()]).max()) >= 2
    cap_bytes = int(per_group.sum()) * ref.res.entry_bytes  # the reference keeps (g0, i1), (g1, i1), (g0, i2), ... to here
    monkeypatch.setattr(cpu_step.CpuStep, "begin_forward", lambda self, n_new: setattr(self, "cap", cap_bytes))
    b = [runtime.forward_logits(model, ids, ref.n_tokens(), ref, last_only=False)]
    for _ in range(4):
        nxt = b[-1][:, -1:].argmax(-1)
        a.append(runtime.forward_logits(model, nxt, fast.n_tokens(), fast))
        b.append(runtime.forward_logits(model, nxt, ref.n_tokens(), ref))
    for x, y in zip(a, b):
        assert torch.allclose(x, y, atol=1e-5, rtol=1e-5), (x - y).abs().max()
    sx, sy = fast.step_stats().extra, ref.step_stats().extra
    assert sx["span_zoom_counts"] == sy["span_zoom_counts"] and 0 < sx["zoom_spans_total"] < fast.res.n_spans
    assert sx["h2d_bytes_step"] == 0 and sy["h2d_bytes_step"] >= 0
