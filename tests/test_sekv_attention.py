"""sekv mixed-resolution attention against hand-written loops; the budget cap as a property."""

from __future__ import annotations

import math
import random

import torch

from sekv_core import methods
from sekv_core.methods.base import ModelShape, PrefillResult
from sekv_core.sekv.attention import build_mask, mixed_attention, place, route, select


class Store(dict):
    def get(self, name):  # the TensorStore protocol
        return self[name]


def synthetic_prefill(n=300, hkv=2, h=4, d=16, layers=2, seed=0) -> PrefillResult:
    g = torch.Generator().manual_seed(seed)
    shape = ModelShape(layers, h, hkv, d, torch.float32, 10000.0, tuple((1.0 / 10000 ** (torch.arange(0, d, 2).float() / d)).tolist()), 1.0)
    keys = [torch.randn(hkv, n, d, generator=g) for _ in range(layers)]
    values = [torch.randn(hkv, n, d, generator=g) for _ in range(layers)]
    s = torch.rand(n, generator=g) * 4
    s[torch.randint(0, n, (n // 8,), generator=g)] += 8
    s[0] = 0
    return PrefillResult(torch.arange(n), keys, values, s, shape)


def open_memory(pf: PrefillResult, **overrides):
    m = methods.get("sekv")
    params = m.resolve_params({"min_span": 12, "window": 20, "store_dtype": "model", **overrides})  # float32 at rest: exact references
    store = Store(m.compress(pf, params))
    return m, params, store, m.open(store, params, pf.shape, "cpu")


def hand_mixed_attention(qv, kv, K, V, s, full_idx, spans, new_k, new_v, scale, expanded=frozenset()):
    """The mixed-resolution softmax written out for one query vector of KV group kv: the full-resolution tokens,
    per span its coarse entry (the surprisal-weighted mean key / value, + log of its tokens not in ``expanded``,
    absent when all are) and its expanded tokens at full resolution, then the new tokens new_k / new_v [Hkv, u, d]."""
    scores, vals = [], []
    for j in full_idx:
        scores.append(float(qv @ K[kv, j]) * scale)
        vals.append(V[kv, j])
    for a, b in spans:
        w = [max(float(s[p]), 1e-6) for p in range(a, b)]
        kbar = sum(wi * K[kv, p] for wi, p in zip(w, range(a, b))) / sum(w)
        vbar = sum(wi * V[kv, p] for wi, p in zip(w, range(a, b))) / sum(w)
        rest = sum(1 for p in range(a, b) if p not in expanded)
        if rest:
            scores.append(float(qv @ kbar) * scale + math.log(rest))
            vals.append(vbar)
        for p in range(a, b):
            if p in expanded:
                scores.append(float(qv @ K[kv, p]) * scale)
                vals.append(V[kv, p])
    for u in range(new_k.shape[1]):  # the new tokens (the caller passes the causal prefix)
        scores.append(float(qv @ new_k[kv, u]) * scale)
        vals.append(new_v[kv, u])
    p = torch.softmax(torch.tensor(scores, dtype=torch.float64), 0)
    return sum(float(pi) * vi.double() for pi, vi in zip(p, vals))


def test_no_expansion_equals_hand_computed_mixed_softmax():
    pf = synthetic_prefill()
    m, params, store, mem = open_memory(pf, zoom="none", factors_8bit=False)
    full_idx = store["sekv.full_idx"].tolist()
    starts, ends = store["sekv.span_start"].tolist(), store["sekv.span_end"].tolist()
    s = pf.surprisal
    H, hkv, d, n = 4, 2, 16, pf.n_tokens
    g = torch.Generator().manual_seed(1)
    q_new = 3
    query = torch.randn(1, H, q_new, d, generator=g)
    key = torch.randn(1, hkv, q_new, d, generator=g)
    value = torch.randn(1, hkv, q_new, d, generator=g)
    scale = d**-0.5
    layer = 1
    mem.attend(0, query, key, value, scale)  # layer 0 first (starts the step)
    out = mem.attend(layer, query, key, value, scale)

    for h in range(H):
        for t in range(q_new):
            want = hand_mixed_attention(query[0, h, t], h // (H // hkv), pf.keys[layer], pf.values[layer], s, full_idx,
                                        zip(starts, ends), key[0, :, : t + 1], value[0, :, : t + 1], scale)
            assert torch.allclose(out[0, h, t].double(), want, atol=1e-5), (h, t)


def test_per_head_mixed_expansion_matches_loop():
    """Random per-head expansion patterns: batched place + mask + SDPA == explicit per-head loop."""
    rng = random.Random(0)
    for trial in range(8):
        g = torch.Generator().manual_seed(trial)
        H, hkv, d = rng.choice([(4, 2, 8), (6, 3, 8), (4, 4, 8), (8, 1, 8)])
        S, F, A, q = rng.randint(1, 7), rng.randint(1, 9), rng.randint(1, 4), rng.randint(1, 3)
        A = max(A, q)
        lens = torch.tensor([rng.randint(1, 6) for _ in range(S)])
        tokens_k = [torch.randn(hkv, int(n), d, generator=g) for n in lens]  # "reconstructed" tokens per span
        tokens_v = [torch.randn(hkv, int(n), d, generator=g) for n in lens]
        full_k, full_v = torch.randn(hkv, F, d, generator=g), torch.randn(hkv, F, d, generator=g)
        co_k, co_v = torch.randn(hkv, S, d, generator=g), torch.randn(hkv, S, d, generator=g)
        tail_k, tail_v = torch.randn(hkv, A, d, generator=g), torch.randn(hkv, A, d, generator=g)
        query = torch.randn(1, H, q, d, generator=g)
        expanded = torch.rand(H, S, generator=g) < 0.5
        keep = expanded.view(hkv, H // hkv, S).any(1)
        gi, ii = torch.nonzero(keep, as_tuple=True)
        n = lens[ii]
        rows_k = torch.zeros(len(gi), int(lens.max()), d)
        rows_v = torch.zeros_like(rows_k)
        for e, (gg, sp) in enumerate(zip(gi.tolist(), ii.tolist())):
            rows_k[e, : lens[sp]] = tokens_k[sp][gg]
            rows_v[e, : lens[sp]] = tokens_v[sp][gg]
        rk, blk, _ = place(rows_k, gi, n, hkv)
        rv, _, _ = place(rows_v, gi, n, hkv)
        slot_span = torch.where(blk >= 0, ii[blk.clamp_min(0)], torch.full_like(blk, -1))
        keys = torch.cat([full_k, co_k, tail_k, rk], 1).unsqueeze(0)
        vals = torch.cat([full_v, co_v, tail_v, rv], 1).unsqueeze(0)
        log_n = lens.float().log()
        mask = build_mask(n_heads=H, n_q=q, n_full=F, log_n=log_n, expanded=expanded, n_tail=A, slot_span=slot_span, dtype=torch.float32)
        out = mixed_attention(query, keys, vals, mask, 0.3)
        for h in range(H):
            kv = h // (H // hkv)
            for t in range(q):
                ks, vs, bias = [full_k[kv]], [full_v[kv]], [torch.zeros(F)]
                for sp in range(S):
                    if expanded[h, sp]:
                        ks.append(tokens_k[sp][kv]), vs.append(tokens_v[sp][kv]), bias.append(torch.zeros(int(lens[sp])))
                    else:
                        ks.append(co_k[kv, sp : sp + 1]), vs.append(co_v[kv, sp : sp + 1]), bias.append(log_n[sp : sp + 1])
                vis = A - q + t + 1
                ks.append(tail_k[kv, :vis]), vs.append(tail_v[kv, :vis]), bias.append(torch.zeros(vis))
                kk, vv, bb = torch.cat(ks), torch.cat(vs), torch.cat(bias)
                p = torch.softmax(kk @ query[0, h, t] * 0.3 + bb, 0)
                assert torch.allclose(out[0, h, t], p @ vv, atol=1e-5), (trial, h, t)


def test_select_budget_property():
    for seed in range(300):
        rng = random.Random(seed)
        hkv, s = rng.randint(1, 4), rng.randint(0, 40)
        prio = torch.tensor([[rng.gauss(0, 3) if rng.random() < 0.7 else float("-inf") for _ in range(s)] for _ in range(hkv)]).view(hkv, s)
        cost = torch.tensor([rng.randint(1, 500) for _ in range(s)], dtype=torch.long)
        cap = rng.choice([0, rng.randint(0, 3000), 10**9])
        keep = select(prio, cost, cap)
        spent = int((keep.long() * cost.view(1, -1)).sum())
        assert spent <= cap
        assert not (keep & (prio == float("-inf"))).any()
        # a prefix in decreasing priority: every kept candidate outranks every dropped one
        cand = prio > float("-inf")
        if keep.any() and (cand & ~keep).any():
            assert prio[keep].min() >= prio[cand & ~keep].max()
        # maximal: the best dropped candidate would not have fit
        if (cand & ~keep).any():
            nxt = (cand & ~keep).nonzero()[torch.argmax(prio[cand & ~keep])]
            assert spent + int(cost[nxt[1]]) > cap
    assert torch.equal(select(torch.zeros(2, 3), torch.ones(3, dtype=torch.long), None), torch.ones(2, 3, dtype=torch.bool))


def test_route_max_over_tokens_and_group_priority():
    logits = torch.tensor([[[0.0, 5.0], [3.0, -1.0]], [[-4.0, -4.0], [-4.0, 1.0]]])  # [H=2, q=2, S=2]
    cand, prio = route(logits, torch.tensor([2.0, 0.5]), 1)
    assert cand.tolist() == [[True, True], [False, True]]
    assert prio.tolist() == [[3.0, 5.0]]


def test_memory_never_exceeds_budget():
    """Random documents, budgets, thresholds and query scales: each step's resident bytes stay within the budget."""
    for seed in range(12):
        rng = random.Random(seed)
        n = rng.randint(150, 700)
        pf = synthetic_prefill(n=n, seed=seed)
        budget = rng.choice([0.1, 0.2, 0.3, 0.5])
        tau = rng.choice([0.0, 1e-6, 0.3, 0.9])
        m, params, store, mem = open_memory(pf, budget=budget, tau=tau, min_span=rng.randint(4, 20), window=rng.randint(0, 30))
        g = torch.Generator().manual_seed(seed)
        for step in range(4):
            q_new = rng.choice([1, 1, 5])
            scale = rng.choice([0.1, 1.0, 10.0])
            for layer in range(pf.shape.n_layers):
                mem.attend(layer, scale * torch.randn(1, 4, q_new, 16, generator=g), torch.randn(1, 2, q_new, 16, generator=g), torch.randn(1, 2, q_new, 16, generator=g), 0.25)
            st = mem.step_stats()
            # the budget is b x the document's full KV; the appended tokens (question, answer) are resident on
            # top of it and reported apart: exactly their K/V bytes
            appended = st.extra["appended_bytes"]
            assert appended == (mem.n_tokens() - n) * pf.shape.kv_bytes_per_token()
            budget_bytes = st.extra["budget_bytes"]
            assert budget_bytes == int(budget * n * pf.shape.kv_bytes_per_token())
            persistent = mem.resident_bytes()
            if persistent - appended <= budget_bytes:
                assert st.resident_bytes - appended <= budget_bytes, (seed, step)
            else:  # nothing may be expanded once the document's persistent part alone is over budget
                assert st.resident_bytes == persistent
        mem.truncate(n)
        assert mem.n_tokens() == n
