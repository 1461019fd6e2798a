"""Device memory of a sekv ask (docs/gpu.md, "Device memory during an ask"): the scout pass streams factor blocks
from host memory chunk by chunk (gpu_step.ScoutRows) with the same result as reading them in place, the pieces that
page-locking registers cover their memory exactly, and what a question makes stays under the formula's bound
(benchmarks/ask_memory.py, counted with a TorchDispatchMode on the CPU running the batched step)."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.sekv import blocks as fb
from sekv_core.sekv import gpu_step

from benchmarks import ask_memory as am
from test_sekv_method import _setup, tiny

QUESTIONS = [[5, 17, 42, 99, 7, 250, 31, 8], [3, 14, 15, 92, 65, 35]]


def _batched(store, p, res, device="cpu"):
    m = methods.get("sekv").open(store, p, res.shape, device)
    m.batched = True
    return m


def _ask(model, mem, q) -> tuple[torch.Tensor, torch.Tensor]:
    """A question's scout pass and its answer's first forward: (the ranking's priorities, the first forward's logits)."""
    mem.truncate(mem.res.n_doc)
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    prio = mem.ranking.prio.clone()
    return prio, runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)


@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_streamed_scout_equals_reading_blocks_in_place(monkeypatch, key_space):
    """The scout's blocks copied chunk by chunk into two alternating buffers (small chunks: many of them, each copy
    cut into pieces) give the same block masses, ranking and first-forward logits, bit for bit, as reading the blocks
    where they are; and with another chunk size too."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=700, budget=0.3, min_span=10, key_space=key_space)
    monkeypatch.setattr(fb, "PIN_PIECE", 4096)
    for chunk in (1 << 14, 1 << 16):
        monkeypatch.setattr(gpu_step, "SCOUT_CHUNK_BYTES", chunk)
        got = {}
        for staging in (False, True):
            monkeypatch.setattr(gpu_step, "SCOUT_STAGING", staging)
            m = _batched(store, p, res)
            calls = []
            real = gpu_step.ScoutRows.rows

            def spy(self, k, _real=real):
                out = _real(self, k)
                calls.append((k, {i: t.data_ptr() for i, t in out.items()}))
                return out

            monkeypatch.setattr(gpu_step.ScoutRows, "rows", spy)
            got[staging] = [_ask(model, m, torch.tensor([q])) for q in QUESTIONS]
            monkeypatch.setattr(gpu_step.ScoutRows, "rows", real)
            if staging:  # many chunks, every one read from staged rows, the two buffers in turn
                starts = [min(c.values()) for _, c in calls if c]
                assert len(calls) > 2 * len(QUESTIONS) and len(starts) == len(calls)
                assert all(a != b for a, b in zip(starts, starts[1:]) if True) or len(set(starts)) >= 2
            else:
                assert all(c == {} for _, c in calls)
        for (pa, la), (pb, lb) in zip(got[False], got[True]):
            assert torch.equal(pa, pb) and torch.equal(la, lb)


def test_rotation_in_place_equals_rope_apply():
    """rope.apply_pairs_ (the scout's rotation: in place, on keys in RoPE's pairs order, half-size tables) gives
    rope.apply's values, permuted the same way (float32 rounding: a complex product may fuse its multiply-adds)."""
    from sekv_core.sekv import rope

    g = torch.Generator().manual_seed(0)
    x = torch.randn(3, 5, 7, 64, generator=g)
    pos = torch.randint(0, 50000, (5, 7), generator=g)
    inv = 1.0 / (10000 ** (torch.arange(0, 64, 2).float() / 64))
    for scaling, dtype in ((1.0, None), (0.7, torch.bfloat16)):
        cos, sin = (t.view(5, 7, 64) for t in rope.cos_sin(pos.flatten(), inv, scaling, dtype=dtype))
        c, s = (t.view(5, 7, 32) for t in rope.cos_sin_half(pos.flatten(), inv, scaling, dtype=dtype))
        assert torch.equal(c, cos[..., :32]) and torch.equal(s, sin[..., :32])  # the tables' halves (made in place)
        order = rope.pairs_order(64)
        got = rope.apply_pairs_(x[..., order].clone(), rope.pairs_phase(c, s))
        assert torch.allclose(got, rope.apply(x, cos, sin)[..., order], atol=1e-5, rtol=1e-5)


def _flat_attention_out_of_place(query, keys, values, resident_mask, rk, rv, visible, scaling, q_chunk=16, coarse_hidden=None):
    """flat_attention as it was written before its scores were worked in place (each step a new tensor)."""
    from sekv_core.sekv.attention import NEG_INF

    _, h, q, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    g = h // hkv
    kf, vf, rkf, rvf = keys[0].float(), values[0].float(), rk.float(), rv.float()
    hide = (~visible).unsqueeze(1)
    outs = []
    for a in range(0, q, q_chunk):
        qf = query[0, :, a : a + q_chunk].float()
        qc = qf.shape[1]
        sa = torch.matmul(qf.reshape(hkv, g * qc, d), kf.transpose(1, 2)).view(h, qc, t) * scaling + resident_mask[0, :, a : a + qc].float()
        if coarse_hidden is not None:
            c0, c1, hidden = coarse_hidden
            sa[:, :, c0:c1].masked_fill_(hidden.unsqueeze(1), NEG_INF)
        sb = (torch.matmul(rkf, qf.reshape(h * qc, d).t()).t().view(h, qc, -1) * scaling).masked_fill(hide, NEG_INF)
        m = sa.amax(-1, keepdim=True)
        if sb.shape[-1]:
            m = torch.maximum(m, sb.amax(-1, keepdim=True))
        pa, pb = torch.exp(sa - m), torch.exp(sb - m)
        z = pa.sum(-1, keepdim=True) + pb.sum(-1, keepdim=True)
        o = torch.matmul(pa.view(hkv, g * qc, t), vf).view(h, qc, d) + torch.matmul(pb.view(h * qc, -1), rvf).view(h, qc, d)
        outs.append(o / z)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).to(query.dtype).unsqueeze(0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_flat_attention_in_place_equals_its_out_of_place_form(dtype):
    """flat_attention's scores worked in place (the routed forward's transient: one score tensor of each kind alive)
    give its out-of-place form's output bit for bit: several query chunks, hidden coarse columns, no annex rows."""
    from sekv_core.sekv.attention import flat_attention

    g = torch.Generator().manual_seed(3)
    for h, hkv, q, t, u, qc in [(8, 2, 5, 40, 30, 16), (32, 8, 24, 300, 700, 16), (32, 8, 24, 300, 700, 7), (4, 4, 3, 10, 0, 16)]:
        d = 16
        query = torch.randn(1, h, q, d, generator=g).to(dtype)
        keys, values = (torch.randn(1, hkv, t, d, generator=g).to(dtype) for _ in range(2))
        mask = torch.where(torch.rand(1, h, q, t, generator=g) < 0.2, float("-inf"), 0.0)
        rk, rv = (torch.randn(u, d, generator=g).to(dtype) for _ in range(2))
        vis = torch.rand(h, u, generator=g) < 0.5
        for hidden in (None, (2, 7, torch.rand(h, 5, generator=g) < 0.5)):
            got = flat_attention(query, keys, values, mask, rk, rv, vis, 0.3, q_chunk=qc, coarse_hidden=hidden)
            want = _flat_attention_out_of_place(query, keys, values, mask, rk, rv, vis, 0.3, q_chunk=qc, coarse_hidden=hidden)
            assert torch.equal(got, want)


def test_live_bytes_lists_large_allocations_and_counts_what_masked_scatter_makes_on_cuda():
    """ask_memory.LiveBytes: every allocation of at least big_bytes listed with its phase; a masked_scatter_ counted at
    its destination's int64 running count (8 bytes an element: what CUDA's kernel allocates) beside what is alive."""
    with am.LiveBytes() as lb:
        lb.big_bytes, lb.phase = 4000, "a"
        x = torch.zeros(1000)  # 4000 bytes: listed
        torch.zeros(10)  # not listed, gone at once
        lb.phase = "b"
        y = torch.zeros(500, dtype=torch.int8)
        y.masked_scatter_(torch.ones(500, dtype=torch.bool), torch.ones(500, dtype=torch.int8))
    assert [(p, n) for p, _, n in lb.big] == [("a", 4000), ("b", 4000)]  # the scatter's 500 x 8 bytes
    assert lb.peak == 4000 + 3 * 500 + 4000  # x, y, the mask, the source and the running count
    del x, y


def test_tiled_prefill_repeats_the_kv_at_new_positions():
    """ask_memory.tiled: a prefill's tokens, values and surprisal repeated, its keys de-rotated, repeated and rotated
    at their new positions (each tile's keys, rotated back, are the first tile's pre-RoPE keys)."""
    from sekv_core.prefill import prefill
    from sekv_core.sekv import rope

    model = am.geometry_model(1, 4, 2, 16, 32, 64)
    with torch.inference_mode():
        res = prefill(model, torch.arange(40) % 1000, with_surprisal=True)
    t = am.tiled(res, 100)
    assert t.n_tokens == 100 and torch.equal(t.token_ids[40:80], res.token_ids) and torch.equal(t.values[0][:, 80:], res.values[0][:, :20])
    assert torch.equal(t.surprisal[40:80], res.surprisal)
    inv, sc = rope.inv_freq_of(res.shape), res.shape.rope_attention_scaling
    pre = rope.undo(res.keys[0].float(), *rope.cos_sin(torch.arange(40), inv, sc))
    back = rope.undo(t.keys[0].float(), *rope.cos_sin(torch.arange(100), inv, sc))
    for a in (0, 40, 80):
        assert torch.allclose(back[:, a : a + 20], pre[:, :20], atol=2e-2)


def test_a_fetch_index_is_half_the_words_it_gathers():
    """blocks.gather's word index is int32 where every word's index fits: a fetch makes its words and at most half as
    many bytes of index (an int64 index was as large as the words: a fill's first-forward peak at 128K)."""
    from sekv_core.sekv import factorize as fz

    lens = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])
    x = torch.randn(2, int(lens.sum()), 32, generator=torch.Generator().manual_seed(14))
    f = fz.stack_kv(fz.factorize(x, lens, energy=0.9, rank_max=16, int8=True), fz.factorize(x.flip(-1), lens, energy=0.95, rank_max=16, int8=True))
    b = fb.build(f, lens, 32, "cpu", pin=False)
    pair = torch.arange(2 * lens.numel())
    with am.LiveBytes() as lb:
        rows = fb.gather(b, pair, b.last[pair])
    idx = torch.minimum(torch.arange(b.stride).view(1, -1), b.last[pair].long().view(-1, 1)) + pair.view(-1, 1) * b.stride
    assert b.cols.dtype == torch.int32 and torch.equal(rows, b.words[idx])  # each block's words, its last one repeated
    words = rows.numel() * 8
    assert lb.peak <= words + words // 2 + 4096, (lb.peak, words)


def test_pieces_cover_a_range_and_cut_only_at_multiples_of_the_piece(monkeypatch):
    """blocks.pieces: consecutive ranges that cover [a, b) exactly, each inside one PIN_PIECE-aligned stretch of
    addresses (so each lies in one page-locking registration), every cut at such a boundary."""
    t = torch.zeros(100_000, dtype=torch.int64)
    base = t.data_ptr()
    for piece in (4096, 8192, 65536):
        monkeypatch.setattr(fb, "PIN_PIECE", piece)
        for a, b in ((0, t.numel()), (3, 4), (17, 60_001), (5000, 5000)):
            got = fb.pieces(t, a, b)
            assert [x for x, _ in got[1:]] == [y for _, y in got[:-1]]
            assert (got[0][0], got[-1][1]) == (a, b) if b > a else got == []
            for x, y in got:
                assert (base + 8 * x) // piece == (base + 8 * y - 1) // piece
            for x, _ in got[1:]:
                assert (base + 8 * x) % piece == 0


@pytest.mark.parametrize("chunk", [1 << 15, 1 << 17])
def test_scout_scoring_stays_under_the_formula(monkeypatch, chunk):
    """What the scout's scoring makes (blocks streamed; 8 KV heads of 32, 16 query heads: a scaled 8B) stays under
    benchmarks/ask_memory.scout_bound of its chunk plan, first and second question, and the plan's chunk is the
    SCOUT_CHUNK_BYTES asked for (or the pairs one step may fetch)."""
    monkeypatch.setattr(gpu_step, "SCOUT_CHUNK_BYTES", chunk)
    monkeypatch.setattr(gpu_step, "SCOUT_STAGING", True)
    model = am.geometry_model(3, 16, 8, 32, 64, 1500)
    mem, shape = am.open_pack(model, 1500, {"budget": 0.1})
    q = list(range(7, 19))
    runs = [am.ask(model, mem, q) for _ in range(2)]
    plan = am.scout_plan(mem.step, len(q))
    bound = am.scout_bound(shape, plan)
    for r in runs:
        assert 0 < r["scoring"] <= bound, (r["scoring"], bound, plan)
    n, r_, m, d = plan["n_max"], plan["r_max"], plan["m"], shape.head_dim
    assert plan["pairs"] * 4 * n * max(d, m, 2 * r_) <= max(chunk, 4 * n * max(d, m, 2 * r_) * max(64, mem.step.P)) or plan["pairs"] == mem.step.hkv * plan["n_spans"]


def test_smaller_chunks_make_a_smaller_scout_peak(monkeypatch):
    """The scout's transient follows SCOUT_CHUNK_BYTES (it is the chunks', not the document's): both layers' 136
    (group, span) pairs in one chunk against 64 pairs a chunk (the floor)."""
    monkeypatch.setattr(gpu_step, "SCOUT_STAGING", True)
    model = am.geometry_model(2, 16, 8, 32, 64, 1500)
    mem, shape = am.open_pack(model, 1500, {"budget": 0.1})
    q = list(range(7, 19))
    peaks = []
    for chunk in (1 << 23, 1 << 15):
        monkeypatch.setattr(gpu_step, "SCOUT_CHUNK_BYTES", chunk)
        peaks.append(am.ask(model, mem, q)["scoring"])
    assert peaks[1] < peaks[0] / 2, peaks
    assert am.scout_plan(mem.step, len(q))["pairs"] == 64


# -- CUDA: blocks page-locked by the build (in pieces) or kept on the device answer the same ------------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_streamed_blocks_equal_kept_blocks(monkeypatch):
    """On CUDA: the build page-locks every layer (KEEP_SHARE 0, in small pieces) and the scout streams them; a memory
    whose build kept every layer on the device (KEEP_SHARE large) reads them in place; a third reads the page-locked
    blocks in place through their mapped view (SCOUT_STAGING False).  Same priorities and logits (to float32
    rounding: CUDA's atomics are not bit-reproducible), and graphed decoding gives the same tokens."""
    from sekv_core.generate import generate

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=700, budget=0.3, min_span=10)
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)
    monkeypatch.setattr(fb, "PIN_PIECE", 1 << 16)
    monkeypatch.setattr(gpu_step, "SCOUT_CHUNK_BYTES", 1 << 15)
    mems = {}
    for name, share, staging in (("streamed", 0.0, None), ("kept", 100.0, None), ("mapped", 0.0, False)):
        monkeypatch.setattr(gpu_step, "KEEP_SHARE", share)
        monkeypatch.setattr(gpu_step, "SCOUT_STAGING", staging)
        gpu_step.start_blocks(store, res.shape, len(ids), "cuda")
        m = _batched(store, p, res, "cuda")
        m._step()
        mems[name] = (m, staging)
    s, k, mp = mems["streamed"][0], mems["kept"][0], mems["mapped"][0]
    assert s.pinning is None and all(b.uva and b.words.is_pinned() for b in s.step.blocks)
    assert k.pinning is not None and all(b.words.is_cuda for b in k.step.blocks)
    for q in QUESTIONS:
        outs = []
        for name, (m, staging) in mems.items():
            monkeypatch.setattr(gpu_step, "SCOUT_STAGING", staging)
            outs.append(_ask(gmodel, m, torch.tensor([q], device="cuda")))
        for pa, la in outs[1:]:  # CUDA's reductions (atomics) are not bit-reproducible run to run: equal to rounding
            assert torch.allclose(outs[0][0], pa, rtol=1e-5, atol=1e-5), (outs[0][0] - pa).abs().max()
            assert torch.allclose(outs[0][1], la, rtol=1e-4, atol=1e-4), (outs[0][1] - la).abs().max()
    toks = []
    for m in (s, k):
        m.truncate(m.res.n_doc)
        toks.append(generate(gmodel, m, QUESTIONS[1], max_new_tokens=6, stop_ids=set(), graphs=True)[0])
    assert toks[0] == toks[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_page_locked_in_pieces_reads_as_one_range(monkeypatch):
    """page_locked in pieces (PIN_PIECE small): the tensor is pinned, its mapped view reads every word, across the
    pieces' boundaries, and a device copy goes in and out piece by piece."""
    monkeypatch.setattr(fb, "PIN_PIECE", 1 << 16)
    n = 300_001
    t = fb.page_locked(n)
    assert t.is_pinned() and t.numel() == n
    t.copy_(torch.arange(n))
    v = fb.device_view(t, torch.device("cuda"))
    assert v is not None  # a kernel reads every word through the view, across the pieces' boundaries
    assert torch.equal(v.index_select(0, torch.arange(n, device="cuda")).cpu(), torch.arange(n))
    d = torch.empty(n, dtype=torch.int64, device="cuda")
    fb.copy_pieces(d, t, non_blocking=True)
    back = fb.page_locked(n)
    fb.copy_pieces(back, d * 2, non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, torch.arange(n) * 2)
