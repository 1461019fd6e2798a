"""How an ask reads the zoom tier (sekv/zoom_tier.py): only the rows a plan zooms, gathered on the host from the pack's
memory map, staged through a small ring to the device (StagedRows), never page-locked whole.

References: the previous read path's tensors (every layer's parts laid side by side as int64 words and gathered row
by row, :func:`old_rows`, as the code before this read did), full-KV attention, the same pack read without its tier,
and the pack's own sha256s."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.errors import PackError
from sekv_core.ingest import ingest
from sekv_core.pack import read_pack
from sekv_core.sekv import zoom_tier
from sekv_core.sekv.zoom_tier import ZoomTier

from test_sekv_method import Store, _setup, assert_full_kv
from test_zoom_tier import TIER

SEKV = methods.get("sekv")


def old_rows(store, shape, layer: int, row: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The read before this one: a layer's k, v (and scales) side by side as one [Hkv * P, W] int64 table, a row's W
    words gathered, the codes times their scale (int8) -> K, V [M, d] in the model dtype."""
    hkv, d, P = shape.n_kv_heads, shape.head_dim, int(store.get("sekv.zoom.idx").numel())
    int8 = "sekv.zoom.ks.0" in store
    g = lambda p: store.get(f"sekv.zoom.{p}.{layer}").reshape(hkv * P, -1).view(torch.uint8)  # noqa: E731
    raw = torch.cat([g("k"), g("v")] + ([g("ks"), g("vs")] if int8 else []), 1)
    raw = torch.cat([raw, torch.zeros(raw.shape[0], (-raw.shape[1]) % 8, dtype=torch.uint8)], 1)
    words = raw.contiguous().view(torch.int64)
    W = words.shape[1]
    got = words.flatten().index_select(0, (row.view(-1, 1) * W + torch.arange(W).view(1, -1)).flatten()).view(-1, W).view(torch.uint8)
    if int8:
        sc = got[:, 2 * d : 2 * d + 4].contiguous().view(torch.float16).float()
        k, v = got[:, :d].view(torch.int8).float() * sc[:, :1], got[:, d : 2 * d].view(torch.int8).float() * sc[:, 1:2]
        return k.to(shape.dtype), v.to(shape.dtype)
    dt = store.get("sekv.zoom.k.0").dtype
    isz = torch.empty(0, dtype=dt).element_size()
    return got[:, : d * isz].contiguous().view(dt).to(shape.dtype), got[:, d * isz : 2 * d * isz].contiguous().view(dt).to(shape.dtype)


def _plan_rows(tier: ZoomTier, m: int, seed: int = 0, device="cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """(hit, row) of m random (group, token) pairs, some tokens not covered, some pairs not valid (on ``device``)."""
    g = torch.Generator().manual_seed(seed)
    n = int(tier.pos.max()) + 5
    token = torch.randint(0, n, (m,), generator=g)
    group = torch.randint(0, tier.shape.n_kv_heads, (m,), generator=g)
    return tier.locate(group.to(device), token.to(device), (torch.rand(m, generator=g) > 0.2).to(device))


def _staged_here(monkeypatch, slots: int = 1) -> None:
    monkeypatch.setattr(zoom_tier, "STAGED_ON", {"cpu", "cuda"})
    monkeypatch.setattr(zoom_tier, "SLOTS", slots)


@pytest.fixture(params=["int8", "exact"])
def tiered(request):
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", **(TIER | {"zoom_tier": request.param}))
    return res.shape, store, mem.res.zoom_tier


def test_rows_are_the_previous_reads_rows_bit_for_bit(tiered, monkeypatch):
    """rows() (one layer now) and fetch() (every layer, staged through a one-slot ring so that each layer waits for
    the one before it) give the previous read's K / V bit for bit, and the same hits."""
    shape, store, tier = tiered
    hit, row = _plan_rows(tier, 700)
    assert bool(hit.any()) and not bool(hit.all())
    want = [old_rows(store, shape, li, row) for li in range(shape.n_layers)]
    for li in range(shape.n_layers):
        h, k, v = tier.rows(li, hit, row)
        assert torch.equal(h, hit) and torch.equal(k, want[li][0]) and torch.equal(v, want[li][1])
    _staged_here(monkeypatch)
    for rnd in range(2):  # a second plan reuses the ring
        staged = tier.fetch(hit, row, shape.n_layers)
        assert isinstance(staged, zoom_tier.StagedRows)
        for li in range(shape.n_layers):
            h, k, v = staged.layer(li)
            assert torch.equal(h, hit) and torch.equal(k, want[li][0]) and torch.equal(v, want[li][1]), (rnd, li)
        assert tier.last["tier_bytes"] > 0 and tier.last is staged.stats


def test_staged_rows_skip_repeat_cancel_and_empty_plans(tiered, monkeypatch):
    shape, store, tier = tiered
    _staged_here(monkeypatch)
    hit, row = _plan_rows(tier, 300, seed=4)
    want = [old_rows(store, shape, li, row) for li in range(shape.n_layers)]
    staged = tier.fetch(hit, row, shape.n_layers)
    _, k, v = staged.layer(shape.n_layers - 1)  # the layers before it skipped (filled for this plan already)
    assert torch.equal(k, want[-1][0]) and torch.equal(v, want[-1][1])
    _, k, v = staged.layer(0)  # asked again after its slot went on: read directly, the same rows
    assert torch.equal(k, want[0][0]) and torch.equal(v, want[0][1])
    # the staging ended (settle: a step about to be captured) before the fill took every layer: the rest read directly
    staged = tier.fetch(hit, row, shape.n_layers)
    staged.layer(0)
    tier.settle()
    _, k, v = staged.layer(1)
    assert torch.equal(k, want[1][0]) and torch.equal(v, want[1][1])
    # a plan replaced before its fill took every layer: its thread ends (no deadlock), the next plan reads right
    tier.fetch(hit, row, shape.n_layers)
    hit2, row2 = _plan_rows(tier, 50, seed=5)
    staged = tier.fetch(hit2, row2, shape.n_layers)
    assert torch.equal(staged.layer(1)[1], old_rows(store, shape, 1, row2)[0])
    # no zoomed rows: an empty plan, and a plan where nothing is valid (every row comes from the factors)
    empty = tier.fetch(torch.zeros(0, dtype=torch.bool), torch.zeros(0, dtype=torch.long), shape.n_layers)
    h, k, v = empty.layer(0)
    assert h.numel() == 0 and k.shape == (0, shape.head_dim) and v.shape == (0, shape.head_dim)
    none, row3 = tier.locate(torch.zeros(20, dtype=torch.long), tier.pos[:20], torch.zeros(20, dtype=torch.bool))
    h, k, _ = tier.fetch(none, row3, shape.n_layers).layer(0)
    assert not bool(h.any()) and torch.equal(k, old_rows(store, shape, 0, row3)[0])
    staged.cancel()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_staged_fill_of_every_block_from_the_exact_tier_equals_full_kv(kind, monkeypatch):
    """The batched step's fixed sets with their tier rows staged (on the CPU here, a one-slot ring): full KV, as the
    direct read gives (tests/test_zoom_tier.py)."""
    _staged_here(monkeypatch)
    model, ref, ids, res, store, p, mem, full = _setup(kind, **TIER)
    mem.batched = True
    assert_full_kv(model, ref, ids, mem, full)
    assert mem.res.zoom_tier.last["tier_bytes"] > 0  # the fill read its rows through the ring


def _scout(model, mem, q):
    mem.truncate(mem.res.n_doc)
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    return mem.ranking.prio.clone()


@pytest.mark.parametrize("batched", [False, True])
def test_the_scout_ranks_from_the_factors_and_the_answer_reads_the_tier(batched, monkeypatch):
    """The scout pass reads no tier row (its per-layer rows would each wait for the device): its ranking is the one
    of the same pack read without its tier.  The answer's forward reads the tier (staged where batched), and its
    logits differ from the tier-less pack's."""
    if batched:
        _staged_here(monkeypatch, slots=4)
    params = {"budget": 0.3, "min_span": 10, "window": 16, "zoom_tier": "int8", "router": "untrained"}
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, **params)
    plain = SEKV.open(store, p.replace(read_zoom_tier=False), res.shape, "cpu")
    calls = []
    for name in ("rows", "fetch"):
        orig = getattr(ZoomTier, name)
        monkeypatch.setattr(ZoomTier, name, lambda self, *a, _o=orig, _n=name: calls.append(_n) or _o(self, *a))
    q = torch.tensor([[5, 17, 42, 99, 7, 250, 31, 8]])
    for m in (mem, plain):
        m.batched = batched
    a = _scout(model, mem, q)
    assert calls == []
    assert torch.equal(a, _scout(model, plain, q))
    with_tier = runtime.forward_logits(model, q, mem.n_tokens(), mem)
    assert calls
    without = runtime.forward_logits(model, q, plain.n_tokens(), plain)
    assert (with_tier - without).abs().max() > 1e-4
    parts = mem.step_stats().extra["first_token_parts"]
    assert parts["scout_forward_s"] > 0 and (not batched or parts["fill_s"] > 0)


def test_a_pack_file_is_read_through_its_map_and_checked_on_the_side(lm, tmp_path):
    """A pack on disk: the tier's rows come from the file's map (nothing read whole), equal to the checked reads'; the
    sha256 check on its thread passes; a damaged tier row is found by it and the next read raises."""
    from conftest import SAMPLE_MD

    doc = tmp_path / "a.txt"
    doc.write_text(SAMPLE_MD.read_text()[:3000])
    pack = tmp_path / "a.sekv"
    ingest(doc, pack, lm=lm, method="sekv", params={"zoom_tier": "int8"})
    shape = methods.base.ModelShape.of(lm.config, torch.float32)
    rp = read_pack(pack)
    names = set(rp.keys())
    tier = ZoomTier(rp, names, shape, "cpu")
    assert tier.check.done.wait(30) and tier.damaged is None
    assert not any(n.startswith("sekv.zoom.") and n != "sekv.zoom.idx" for n in rp._cache)  # the rows came from the map
    ref = Store({n: rp.get(n) for n in names})  # read whole and checked
    hit, row = _plan_rows(tier, 400, seed=2)
    for li in range(shape.n_layers):
        _, k, v = tier.rows(li, hit, row)
        wk, wv = old_rows(ref, shape, li, row)
        assert torch.equal(k, wk) and torch.equal(v, wv)
    e = rp.info("sekv.zoom.v.1")
    rp.close()
    raw = bytearray(pack.read_bytes())
    raw[e.start + 3] ^= 0x41
    pack.write_bytes(bytes(raw))
    rp = read_pack(pack)
    SEKV.start_open(rp, shape, rp.n_tokens(), "cpu")  # a session starts the check before the model loads
    early = zoom_tier._EARLY[id(rp)][1]
    tier = ZoomTier(rp, names, shape, "cpu")
    assert tier.check is early and id(rp) not in zoom_tier._EARLY  # taken up by the open
    assert tier.check.done.wait(30)
    with pytest.raises(PackError, match="checksum mismatch in tensor 'sekv.zoom.v.1'"):
        tier.rows(0, hit, row)
    rp.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["int8", "exact"])
def test_cuda_staged_rows_equal_the_host_rows(kind, monkeypatch):
    """On CUDA the staged rows (page-locked ring, side stream, a two-slot ring so that slots are reused) are the
    previous read's, bit for bit, for two plans in a row, and the row ids' copy is no sync."""
    monkeypatch.setattr(zoom_tier, "SLOTS", 2)
    model, ref, ids, res, store, p, mem, full = _setup("llama", **(TIER | {"zoom_tier": kind}))
    shape = res.shape
    tier = ZoomTier(store, set(store), shape, "cuda")
    for seed in (0, 1):
        hit, row = _plan_rows(tier, 900, seed=seed, device="cuda")
        assert row.is_cuda
        want = [old_rows(store, shape, li, row.cpu()) for li in range(shape.n_layers)]
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode("error")
        try:
            staged = tier.fetch(hit, row, shape.n_layers)
            got = [staged.layer(li) for li in range(shape.n_layers)]
        finally:
            torch.cuda.set_sync_debug_mode("default")
        assert isinstance(staged, zoom_tier.StagedRows) and staged.stats["tier_bytes"] > 0
        for li, (h, k, v) in enumerate(got):
            assert k.is_cuda and torch.equal(k.cpu(), want[li][0]) and torch.equal(v.cpu(), want[li][1]), (seed, li)


@pytest.mark.parametrize("routing", ["scout", "per_layer"])
def test_steps_that_read_the_tier_through_the_host_are_not_captured(routing):
    """Per-layer routing reads a step's tier rows through the host (ZoomTier.rows), which a CUDA graph cannot hold:
    such a memory offers no static steps; under scout routing the fixed set's rows are read once, before the steps."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", **(TIER | {"zoom": "router", "budget": 0.5, "routing": routing}))
    assert mem.res.zoom_tier is not None
    mem.batched = True
    assert mem.static_supported() is (routing == "scout")
