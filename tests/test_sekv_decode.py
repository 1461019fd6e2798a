"""The batched, sync-free decode step (sekv/gpu_step.py, sekv/fixed_set.py, sekv/blocks.py) against the reference step and full KV."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.sekv import attention, blocks, gpu_step
from sekv_core.sekv import factorize as fz

from test_sekv_method import EXACT, _setup


def _batched(store, p, res):
    mem = methods.get("sekv").open(store, p, res.shape, "cpu")
    mem.batched = True
    return mem


def _agree(model, q, m1, m2, tol, rtol):
    """Same logits from two memories on the prompt q and then three greedy steps."""
    a = runtime.forward_logits(model, q, m1.n_tokens(), m1, last_only=False)
    b = runtime.forward_logits(model, q, m2.n_tokens(), m2, last_only=False)
    assert torch.allclose(a, b, atol=tol, rtol=rtol), (a - b).abs().max()
    for _ in range(3):
        nxt = b[:, -1:].argmax(-1)
        a = runtime.forward_logits(model, nxt, m1.n_tokens(), m1)
        b = runtime.forward_logits(model, nxt, m2.n_tokens(), m2)
        assert torch.allclose(a, b, atol=tol, rtol=rtol), (a - b).abs().max()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_batched_full_expansion_equals_full_kv(kind, key_space):
    model, ref, ids, res, store, p, mem, full = _setup(kind, key_space=key_space, **EXACT)
    mem = _batched(store, p, res)
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    _agree(model, q, mem, full, tol=2e-4, rtol=1e-4)
    st = mem.step_stats().extra
    assert st["zoom_spans_step"] == mem.res.n_spans and st["zoom_rate_per_layer"] == [1.0, 1.0]


def _same_cap(monkeypatch):
    """Give the batched step exactly the reference step's cap (nothing counted beyond the reference's persistent
    part, no reserve for later tokens), so that both keep the same spans."""

    def reference_cap(self):
        cap = self.ledger.layer_cap()  # the one rule both steps share, without the batched step's own tables
        return None if cap is None else cap // self.res.entry_bytes

    monkeypatch.setattr(gpu_step.BatchedStep, "_slots", reference_cap)


@pytest.mark.parametrize("extra", [{}, {"factors_8bit": False}, {"key_space": "post_rope"}, {"head_masks": False}, {"zoom_tier": "int8"}, {"zoom_tier": "exact"}])
def test_batched_step_equals_reference_step_under_the_cap(monkeypatch, extra):
    """Router path, cap binding: same kept spans, same stats, same logits as the reference (CPU) step."""
    _same_cap(monkeypatch)
    model, ref, ids, res, store, p, mem, full = _setup("llama", n=600, budget=0.5, min_span=10, **extra)
    mem2 = _batched(store, p, res)
    q = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    _agree(model, q, mem, mem2, tol=1e-5, rtol=1e-5)
    x, y = mem.step_stats().extra, mem2.step_stats().extra
    assert 0 < x["zoom_spans_total"] < mem.res.n_spans  # the cap binds
    for k in ("zoom_spans_step", "zoom_spans_total", "span_zoom_counts", "budget_bytes"):
        assert x[k] == y[k], k
    assert x["zoom_rate_per_layer"] == pytest.approx(y["zoom_rate_per_layer"])
    assert y["h2d_bytes_total"] > 0


@pytest.mark.parametrize("routing", ["per_layer", "scout"])
def test_batched_never_exceeds_budget_and_counts_its_buffers(routing):
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=2000, budget=0.5, min_span=12, routing=routing)
    mem = _batched(store, p, res)
    q = torch.randint(0, 300, (1, 5))
    if routing == "scout":  # a fixed set in the annex, refilled when the cap shrinks
        mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    runtime.forward_logits(model, q, mem.n_tokens(), mem)
    sizes, zoomed = set(), 0
    for _ in range(300):  # past the tail's reserved capacity (256)
        runtime.forward_logits(model, q[:, :1], mem.n_tokens(), mem)
        sizes.add(mem.step.U)
        st = mem.step_stats()
        zoomed = max(zoomed, st.extra["zoom_spans_step"])
        assert st.resident_bytes - st.extra["appended_bytes"] <= st.extra["budget_bytes"]
        assert st.extra["appended_bytes"] == (mem.n_tokens() - 2000) * mem.shape.kv_bytes_per_token()
        # resident = the whole memory on the device: tokens, router, block tables, slot buffers at capacity
        assert st.resident_bytes == mem.resident_bytes()
        assert mem.resident_now() == st.resident_bytes  # what generate() reads each step, without the stats
    dec = mem.step
    assert max(sizes) > 0 and dec.resident_bytes() > dec.table_bytes
    if routing == "per_layer":  # the appended tail is outside the document's budget: the slot buffers keep their size
        assert len(sizes) == 1
    else:  # the fixed set's masks have a column per resident token, tail included: the slots shrink as it grows
        assert len(sizes) >= 2 and min(sizes) < max(sizes)
    assert zoomed > 0


def test_select_topk_equals_select():
    g = torch.Generator().manual_seed(0)
    for trial in range(30):
        hkv, s = 1 + trial % 4, 5 + 7 * trial
        prio = torch.randn(hkv, s, generator=g)
        prio[torch.rand(hkv, s, generator=g) < 0.4] = float("-inf")
        cost = torch.randint(3, 20, (s,), generator=g)
        cap = float(torch.randint(0, 200, (1,), generator=g))
        ref = attention.select(prio, cost, cap)
        pair, ok = attention.select_topk(prio, cost, cap, int(cap // 3) + 1)
        keep = torch.zeros(hkv * s, dtype=torch.bool).index_put_((pair,), ok).view(hkv, s)
        assert torch.equal(keep, ref)


@pytest.mark.parametrize("int8", [True, False])
def test_blocks_fetch_unpack_reconstruct_like_the_packed_gather(int8):
    lens = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])
    g = torch.Generator().manual_seed(4)
    x = torch.randn(2, int(lens.sum()), 32, generator=g)
    fk = fz.factorize(x, lens, energy=0.9, rank_max=16, int8=int8)
    fv = fz.factorize(x.flip(-1), lens, energy=0.95, rank_max=16, int8=int8)
    f = fz.stack_kv(fk, fv)
    b = blocks.build(f, lens, 32, "cpu", pin=False)
    ref_k = fz.reconstruct_all(fk, lens, 32)
    ref_v = fz.reconstruct_all(fv, lens, 32)
    pair = torch.tensor([9, 0, 15, 4, 7, 3])  # flat g * S + i
    ok = torch.tensor([True, True, True, True, True, False])
    rows, words = blocks.fetch(b, pair, ok)
    us, vt = blocks.unpack(b, rows)
    rec = us @ vt
    first = torch.cumsum(lens, 0) - lens
    for p_, (pp, k) in enumerate(zip(pair.tolist(), ok.tolist())):
        if not k:
            continue
        gg, i = divmod(pp, 8)
        n = int(lens[i])
        assert torch.allclose(rec[p_, 0, :n], ref_k[gg, first[i] : first[i] + n], atol=1e-5)
        assert torch.allclose(rec[p_, 1, :n], ref_v[gg, first[i] : first[i] + n], atol=1e-5)
    # what moved: each kept block up to the end of its own rows (no padding past them), one word per skipped pair
    assert int(words) == int(b.used[pair[ok]].sum()) + 1
    assert int(b.used.max()) <= b.stride and int(b.used.min()) < b.stride


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_batched_and_graphed_steps_match_cpu_reference(monkeypatch):
    """On CUDA: the batched step (UVA fetch: blocks pinned from the start, none kept on the device) against the CPU
    reference."""
    _same_cap(monkeypatch)
    monkeypatch.setattr(gpu_step, "KEEP_SHARE", 0.0)
    from test_sekv_method import tiny

    for params in (EXACT, {"budget": 0.5, "min_span": 10}):
        model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, **params)
        gpu_model = tiny("qwen2").cuda()
        gpu_model.load_state_dict(model.state_dict())
        runtime.install(gpu_model)
        gm = methods.get("sekv").open(store, p, res.shape, "cuda")
        assert gm.batched
        mems = [gm]
        q = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
        a = runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)
        for k, gm in enumerate(mems):
            b = runtime.forward_logits(gpu_model, q.cuda(), gm.n_tokens(), gm, last_only=False).cpu()
            assert torch.allclose(a, b, atol=2e-3, rtol=1e-3), (params, k, (a - b).abs().max())
        for step in range(5):
            nxt = a[:, -1:].argmax(-1)
            a = runtime.forward_logits(model, nxt, mem.n_tokens(), mem)
            for k, gm in enumerate(mems):
                b = runtime.forward_logits(gpu_model, nxt.cuda(), gm.n_tokens(), gm).cpu()
                assert torch.allclose(a, b, atol=2e-3, rtol=1e-3), (params, step, (a - b).abs().max())
        assert gm.step.uva
        x = mem.step_stats().extra
        for gm in mems:
            y = gm.step_stats().extra
            assert x["zoom_spans_total"] == y["zoom_spans_total"] and x["span_zoom_counts"] == y["span_zoom_counts"]


@pytest.mark.parametrize("kw", [{"n": 12, "factors_8bit": False}, {"n": 300, "zoom": "none"}])
def test_batched_without_spans_or_zoom_equals_reference(kw):
    kw = dict(kw)
    n = kw.pop("n")
    model, ref, ids, res, store, p, mem, full = _setup("llama", n=n, min_span=8, window=16, **kw)
    mem2 = _batched(store, p, res)
    q = torch.randint(0, 300, (1, 3), generator=torch.Generator().manual_seed(5))
    for step in range(3):
        x = q if step == 0 else q[:, :1]
        a = runtime.forward_logits(model, x, mem.n_tokens(), mem)
        b = runtime.forward_logits(model, x, mem2.n_tokens(), mem2)
        assert torch.allclose(a, b, atol=1e-5, rtol=1e-5)
    assert mem2.step_stats().extra["zoom_spans_total"] == 0


@pytest.mark.parametrize("q", [1, 5])
def test_grouped_attention_is_masked_gqa(q):
    """fixed_set.grouped_attention (a group's heads stacked on the query axis, no GQA flag) against a hand-written
    softmax with each head on its group's K/V, under an additive mask with hidden entries, on an aligned sliced
    mask as the fixed sets keep it."""
    from sekv_core.sekv.fixed_set import grouped_attention

    g = torch.Generator().manual_seed(7)
    h, hkv, t, d = 6, 2, 37, 16
    query, keys, values = torch.randn(1, h, q, d, generator=g), torch.randn(1, hkv, t, d, generator=g), torch.randn(1, hkv, t, d, generator=g)
    hide = torch.rand(1, h, q, t, generator=g) < 0.3
    hide[..., 0] = False
    mask = torch.empty(1, h, q, 48)[..., :t]
    mask.copy_(torch.where(hide, float("-inf"), torch.randn(1, h, q, t, generator=g)))
    out = grouped_attention(query, keys, values, mask, 0.3)
    kk, vv = keys[0].repeat_interleave(h // hkv, 0), values[0].repeat_interleave(h // hkv, 0)
    ref = torch.softmax(query[0] @ kk.transpose(1, 2) * 0.3 + mask[0], -1) @ vv
    assert out.shape == (1, h, q, d) and torch.allclose(out[0], ref, atol=1e-5)
    if q == 1:  # one token: a mask shared by the query positions broadcasts
        assert torch.allclose(grouped_attention(query, keys, values, mask[:, :, :1], 0.3), out, atol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA's memory-efficient kernel")
@pytest.mark.parametrize("t", [37, 48])
def test_cuda_efficient_attention_is_masked_attention(t):
    """fixed_set.efficient_attention (the memory-efficient kernel's own operator: what grouped_attention calls on CUDA)
    against a float32 softmax, bf16 inputs, a mask with hidden entries whose rows are not 16-aligned (t = 37, and a
    slice of a wider buffer) or are (t = 48, contiguous), and through grouped_attention with 4 heads a group."""
    from sekv_core.sekv.fixed_set import efficient_attention, grouped_attention

    g = torch.Generator().manual_seed(3)
    h, hkv, q, d = 8, 2, 5, 64
    query, keys, values = (torch.randn(1, n, m, d, generator=g) for n, m in ((h, q), (hkv, t), (hkv, t)))
    hide = torch.rand(1, h, q, t, generator=g) < 0.3
    hide[..., 0] = False
    bias = torch.where(hide, float("-inf"), torch.randn(1, h, q, t, generator=g))
    kk, vv = keys[0].repeat_interleave(h // hkv, 0), values[0].repeat_interleave(h // hkv, 0)
    ref = torch.softmax(query[0] @ kk.transpose(1, 2) * 0.125 + bias[0], -1) @ vv
    c = lambda x: x.to("cuda", torch.bfloat16)  # noqa: E731
    wide = torch.empty(1, h, q, t + 11, dtype=torch.bfloat16, device="cuda")[..., :t]
    wide.copy_(bias)
    out = grouped_attention(c(query), c(keys), c(values), wide, 0.125)
    assert out.shape == (1, h, q, d) and torch.allclose(out[0].float().cpu(), ref, atol=3e-2)
    same = efficient_attention(c(query), c(kk[None]), c(vv[None]), c(bias), 0.125)
    assert torch.allclose(same[0].float().cpu(), ref, atol=3e-2)


@pytest.mark.parametrize("layout", ["packed", "math"])
def test_fixed_set_sdpa_layouts_equal_full_kv(monkeypatch, layout):
    """The fixed sets' other ways of making their SDPA call (fixed_set.SDPA_LAYOUT, for comparing kernels on a
    device) give full KV's logits under full expansion, as the default does (test above)."""
    from sekv_core.sekv import fixed_set

    monkeypatch.setattr(fixed_set, "SDPA_LAYOUT", layout)
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", **EXACT)
    mem = _batched(store, p, res)
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    _agree(model, q, mem, full, tol=2e-4, rtol=1e-4)


def test_blocks_built_on_a_second_thread_give_the_same_step():
    """The batched step's blocks built by BlockBuild (on CUDA from the pack's open, on a second thread) give the
    logits of blocks built in the first forward; an error of the build is raised where the blocks are first used."""
    from sekv_core.errors import PackError

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    plain, threaded = _batched(store, p, res), _batched(store, p, res)
    threaded._blocks = gpu_step.BlockBuild(threaded.res)
    q = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    _agree(model, q, plain, threaded, tol=0, rtol=0)
    assert threaded._blocks is None and len(threaded.step.blocks) == res.shape.n_layers

    broken = _batched(store, p, res)

    def damaged(i):
        raise PackError("checksum mismatch")

    broken.res.factors.on_device = damaged
    broken._blocks = gpu_step.BlockBuild(broken.res)
    with pytest.raises(PackError, match="checksum"):
        runtime.forward_logits(model, q, broken.n_tokens(), broken)


def test_blocks_with_the_hosts_largest_rank_are_the_same_words():
    """build() given the largest rank by its caller (the pack's host ranks, PackFactors.rank_max) lays the same blocks."""
    lens = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])
    x = torch.randn(2, int(lens.sum()), 32, generator=torch.Generator().manual_seed(8))
    f = fz.stack_kv(fz.factorize(x, lens, energy=0.9, rank_max=16, int8=True), fz.factorize(x.flip(-1), lens, energy=0.95, rank_max=16, int8=True))
    a = blocks.build(f, lens, 32, "cpu", pin=False)
    b = blocks.build(f, lens, 32, "cpu", pin=False, r_max=int(f.rank.max()))
    assert torch.equal(a.words, b.words) and torch.equal(a.used, b.used) and (a.stride, a.r_max, a.n_max) == (b.stride, b.r_max, b.n_max)


@pytest.mark.parametrize("int8", [True, False])
def test_blocks_built_a_run_at_a_time_are_the_same_words(int8, monkeypatch):
    """The re-layout's padded factors filled a run of (kind, group, span) blocks at a time (blocks.SCATTER_ELEMS: on
    CUDA each masked_scatter_ makes an int64 count of its whole destination) lay the words of one fill of each, and
    the blocks still rebuild every span's factors (each block's rows against its packed factors' product)."""
    lens = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])
    x = torch.randn(2, int(lens.sum()), 32, generator=torch.Generator().manual_seed(12))
    fk, fv = fz.factorize(x, lens, energy=0.9, rank_max=16, int8=int8), fz.factorize(x.flip(-1), lens, energy=0.95, rank_max=16, int8=int8)
    f = fz.stack_kv(fk, fv)
    whole = blocks.build(f, lens, 32, "cpu", pin=False)
    monkeypatch.setattr(blocks, "SCATTER_ELEMS", 100)  # a block or two a run
    runs = blocks.build(f, lens, 32, "cpu", pin=False)
    assert torch.equal(whole.words, runs.words) and torch.equal(whole.used, runs.used)
    pair = torch.arange(2 * lens.numel())
    rows, _ = blocks.fetch(runs, pair, torch.ones_like(pair, dtype=torch.bool))
    us, vt = blocks.unpack(runs, rows)
    rec = us @ vt
    first = torch.cumsum(lens, 0) - lens
    for k, ref in enumerate((fz.reconstruct_all(fk, lens, 32), fz.reconstruct_all(fv, lens, 32))):
        for p_ in pair.tolist():
            gg, i = divmod(p_, lens.numel())
            n = int(lens[i])
            assert torch.allclose(rec[p_, k, :n], ref[gg, first[i] : first[i] + n], atol=1e-5)


def test_unpack_scales_in_place_as_a_product_does():
    """blocks.unpack scales its dequantised copies in place: the values of the codes times their scales (the previous
    code's products), bit for bit, in the model dtype and float32, and the blocks' words untouched; one side alone
    (and its Vt in RoPE's pairs order) the same values."""
    from sekv_core.sekv import rope

    lens = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])
    x = torch.randn(2, int(lens.sum()), 32, generator=torch.Generator().manual_seed(13))
    f = fz.stack_kv(fz.factorize(x, lens, energy=0.9, rank_max=16, int8=True), fz.factorize(x.flip(-1), lens, energy=0.95, rank_max=16, int8=True))
    b = blocks.build(f, lens, 32, "cpu", pin=False)
    words = b.words.clone()
    pair = torch.arange(2 * lens.numel())
    rows, _ = blocks.fetch(b, pair, torch.ones_like(pair, dtype=torch.bool))
    p, (oa, ob, oc, od), nm, rm = rows.shape[0], b.sections, b.n_max, b.r_max
    by = rows.view(torch.uint8)
    for dtype in (torch.bfloat16, torch.float32):
        us, vt = blocks.unpack(b, rows, dtype)
        want_vt = by[:, oa : oa + 2 * rm * 32].view(torch.int8).reshape(p, 2, rm, 32).to(dtype) * by[:, ob : ob + 4 * rm].view(torch.float16).reshape(p, 2, rm, 1).to(dtype)
        want_us = by[:, od : od + nm * 2 * rm].view(torch.int8).reshape(p, nm, 2, rm).to(dtype) * by[:, oc : oc + 4 * nm].view(torch.float16).reshape(p, nm, 2, 1).to(dtype)
        assert torch.equal(vt, want_vt) and torch.equal(us, want_us.transpose(1, 2))
        for side in (0, 1) if dtype == torch.float32 else ():  # one side alone (float32, as the scout reads it), and
            # in RoPE's pairs order (the scout's keys): the same values, columns permuted
            us1, vt1 = blocks.unpack(b, rows, dtype, side=side)
            _, vtp = blocks.unpack(b, rows, dtype, side=side, pairs=True)
            assert torch.equal(us1, want_us[:, :, side]) and torch.equal(vt1, want_vt[:, side])
            assert torch.equal(vtp, want_vt[:, side][..., rope.pairs_order(32)])
    assert torch.equal(b.words, words)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_blocks_build_reads_nothing_back_before_its_copy():
    """On CUDA, given the host's span lengths and largest rank, the re-layout makes no host sync before the blocks'
    copy to the host (torch's sync debug mode, "warn" so the copy itself passes; counted here)."""
    import warnings

    lens = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])
    x = torch.randn(2, int(lens.sum()), 32, generator=torch.Generator().manual_seed(9))
    f = fz.stack_kv(fz.factorize(x, lens, energy=0.9, rank_max=16, int8=True), fz.factorize(x.flip(-1), lens, energy=0.95, rank_max=16, int8=True))
    ref = blocks.build(f, lens, 32, "cpu", pin=False)
    on = fz.Factors(*(t.cuda() for t in (f.us, f.vt, f.rank, f.us_scale, f.vt_scale)))
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as w:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            b = blocks.build(on, lens, 32, "cuda", pin=True, work_device="cuda", r_max=int(f.rank.max()))
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [x for x in w if "synchroniz" in str(x.message).lower()]
    assert len(syncs) <= 1, [str(x.message) for x in syncs]  # the copy of the blocks to pinned host memory
    assert torch.equal(b.words, ref.words)
    # wait=False (gpu_step.build_blocks: one wait for every layer): not even that copy waits; nor with the host's
    # ranks, a run of blocks at a time (bounded temporaries)
    torch.cuda.set_sync_debug_mode("error")
    try:
        c = blocks.build(on, lens, 32, "cuda", pin=True, work_device="cuda", r_max=int(f.rank.max()), wait=False)
        old, blocks.SCATTER_ELEMS = blocks.SCATTER_ELEMS, 100
        try:
            e = blocks.build(on, lens, 32, "cuda", pin=True, work_device="cuda", r_max=int(f.rank.max()), wait=False, rank_host=f.rank)
        finally:
            blocks.SCATTER_ELEMS = old
    finally:
        torch.cuda.set_sync_debug_mode("default")
    torch.cuda.synchronize()
    assert torch.equal(c.words, ref.words) and torch.equal(e.words, ref.words)
