"""What an ask read of document tokens (sekv_core/sekv/coverage.py, ZoomMemory.token_coverage), against kept sets
known by construction: the pack's own full-resolution positions and spans, a ranking and cap set by hand."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.generate import generate
from sekv_core.prefill import prefill

from test_sekv_method import EXACT, Store, tiny

QUESTION = [5, 17, 42, 99, 7, 250]
N = 400


def _memory(**params):
    model = tiny("qwen2")
    runtime.install(model)
    ids = torch.randint(0, 300, (N,), generator=torch.Generator().manual_seed(1))
    res = prefill(model, ids, with_surprisal=True, chunk=128)
    m = methods.get("sekv")
    p = m.resolve_params(params)
    store = Store(m.compress(res, p))
    return model, store, p, res, m


def _open(m, store, p, res, batched=False):
    mem = m.open(store, p, res.shape, "cpu")
    mem.batched = batched
    mem.record_kept = True
    return mem


def _pack_tables(store):
    """The full-resolution positions and the spans [start, end) as the pack stores them."""
    full = set(store["sekv.full_idx"].tolist())
    spans = list(zip(store["sekv.span_start"].tolist(), store["sekv.span_end"].tolist()))
    return full, spans


@pytest.mark.parametrize("batched", [False, True])
def test_zoom_all_reads_every_span_token_zoomed(batched):
    """zoom "all" (every block ranked alike, no cap): every span token is zoomed, from the factors (no tier), every
    full-resolution token exact; the end window's tokens are among the exact ones."""
    model, store, p, res, m = _memory(**EXACT)
    mem = _open(m, store, p, res, batched)
    generate(model, mem, QUESTION, max_new_tokens=2, stop_ids=set())
    full, spans = _pack_tables(store)
    in_span = {t for a, b in spans for t in range(a, b)}
    assert full and in_span and not (full & in_span) and full | in_span == set(range(N))
    cov = mem.token_coverage(range(N + 3))
    for t in range(N):
        assert cov["resolution"][t] == ("exact" if t in full else "zoomed"), t
        assert cov["zoom_source"][t] == (None if t in full else "factors")
        assert cov["hidden"][t] is False
    assert cov["resolution"][N:] == ["outside"] * 3  # appended positions are no document token
    assert all(r == "exact" for r in cov["resolution"][N - p.window : N])  # the end window
    assert cov["zoomed_per_layer"] == [len(in_span)] * res.shape.n_layers
    assert mem.token_resolution([0, N - 1]) == ["exact", "exact"]  # the sinks, the last token


def test_no_room_reads_every_span_token_coarse():
    """A budget below the persistent part: nothing zoomed, every span token read through its coarse entry."""
    model, store, p, res, m = _memory(budget=0.02, min_span=10, window=16, router="untrained")
    mem = _open(m, store, p, res)
    generate(model, mem, QUESTION, max_new_tokens=2, stop_ids=set())
    full, _ = _pack_tables(store)
    cov = mem.token_coverage(range(N))
    assert cov["resolution"] == ["exact" if t in full else "coarse" for t in range(N)]
    assert cov["kept_blocks"] == [0, 0] and cov["zoomed_per_layer"] == [0] * res.shape.n_layers
    assert all(s is None for s in cov["zoom_source"])


def test_without_recording_span_tokens_are_unknown():
    model, store, p, res, m = _memory(budget=0.3, min_span=10, window=16, router="untrained")
    mem = m.open(store, p, res.shape, "cpu")
    generate(model, mem, QUESTION, max_new_tokens=2, stop_ids=set())
    full, _ = _pack_tables(store)
    assert mem.token_resolution(range(N)) == ["exact" if t in full else "unknown" for t in range(N)]


@pytest.mark.parametrize("batched,split", [(False, False), (True, False), (False, True)])
def test_hand_ranking_and_cap_give_the_kept_blocks(batched, split, monkeypatch):
    """A ranking set by hand (blocks i1 then i2 first) and a cap that holds both for every KV group: their tokens are
    zoomed (from the pack's int8 zoom tier), ranks 0 and 1; every other span token coarse; two full-resolution
    tokens hidden by hand are flagged.  ``split`` (the reference step's flat cap): the cap holds i2 for one group
    only, so its tokens are partly zoomed (half of the (layer, group) pairs; the batched step gives every group the
    same share)."""
    from sekv_core.sekv import cpu_step, gpu_step

    model, store, p, res, m = _memory(budget=0.3, min_span=10, window=16, router="untrained", zoom_unit=4)
    mem = _open(m, store, p, res, batched)
    r = mem.res
    assert r.zoom_tier is not None and r.zoom_tier.int8
    q = torch.tensor([QUESTION])
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    i1, i2 = 3, r.n_blocks // 2
    prio = torch.linspace(0.0, -1.0, r.n_blocks)  # every other block below both
    prio[i1], prio[i2] = 2.0, 1.0
    mem.ranking.prio.copy_(prio)
    mem.ranking.version += 1
    n1, n2 = int(r.block_len[i1]), int(r.block_len[i2])
    hkv = res.shape.n_kv_heads
    if batched:  # slots per layer: each group's rows hold n1 + n2
        monkeypatch.setattr(gpu_step.BatchedStep, "_slots", lambda self: hkv * (n1 + n2))
    else:  # (g0, i1), (g1, i1), (g0, i2), (g1, i2) in that order, cut after (g0, i2) when split
        cap = (hkv * n1 + (1 if split else hkv) * n2) * r.entry_bytes
        monkeypatch.setattr(cpu_step.CpuStep, "begin_forward", lambda self, n_new: setattr(self, "cap", cap))
    hid = torch.tensor([0, r.n_full - 1])
    r.hidden.set(hid)
    logits = runtime.forward_logits(model, q, mem.n_tokens(), mem)
    # a decode step under another ranking (i1, i2 last) and no hidden columns: the first forward's are reported
    mem.ranking.prio.copy_(-prio)
    mem.ranking.version += 1
    r.hidden.set(None)
    runtime.forward_logits(model, logits.argmax(-1), mem.n_tokens(), mem)
    now = mem.step.kept(0)
    assert not bool(now[:, i1].any()) and bool(now.any())  # the step now holds other blocks

    full, spans = _pack_tables(store)
    z1 = set(range(int(r.block_start[i1]), int(r.block_start[i1]) + n1))
    z2 = set(range(int(r.block_start[i2]), int(r.block_start[i2]) + n2))
    hidden_pos = {int(store["sekv.full_idx"][i]) for i in hid}
    cov = mem.token_coverage(range(N))
    for t in range(N):
        want = "exact" if t in full else "zoomed" if t in z1 or (t in z2 and not split) else "partly zoomed" if t in z2 else "coarse"
        assert cov["resolution"][t] == want, t
        assert cov["hidden"][t] == (t in hidden_pos), t
        if want in ("zoomed", "partly zoomed"):
            assert cov["zoom_source"][t] == "tier int8"
            assert cov["zoom_share"][t] == (0.5 if want == "partly zoomed" else 1.0)
    span_of = {t: s for s, (a, b) in enumerate(spans) for t in range(a, b)}
    for t in z1 | z2:
        assert cov["span"][t] == span_of[t]
        assert cov["block_rank"][t] == (0 if t in z1 else 1)
    assert cov["blocks"][i1]["rank"] == 0 and cov["blocks"][i2]["rank"] == 1
    assert cov["blocks"][i1]["layers_held"] == res.shape.n_layers
    assert cov["zoomed_per_layer"] == [n1 + (0 if split else n2)] * res.shape.n_layers
    assert cov["kept_blocks"] == ([1, 2] if split else [2, 2])
