"""The zoom tier (sekv/zoom_tier.py): the span tokens' own K / V stored in the pack and read for zoomed blocks.

References are independent of the tier's code: the prefill's K / V, full-KV attention and plain transformers SDPA,
the int8 rounding bound computed by hand; and the same pack read without its tier must NOT match (the lossy
factors), so a tier that is stored but not read fails."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods
from sekv_core.ingest import ingest
from sekv_core.errors import PackError
from sekv_core.pack import read_pack
from sekv_core.sekv import layout, rope
from sekv_core.sekv.segment import span_token_index

from test_sekv_method import Store, _logits, _setup, assert_full_kv

# the default (lossy: rank <= 32, 4-bit) factors; only the tier is exact
SEKV = methods.get("sekv")
TIER = {"zoom": "all", "budget": 1.0, "store_dtype": "model", "min_span": 8, "window": 16, "router": "untrained", "zoom_tier": "exact"}


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("batched", [False, True])
def test_every_block_zoomed_from_the_exact_tier_equals_full_kv(kind, batched):
    model, ref, ids, res, store, p, mem, full = _setup(kind, **TIER)
    assert mem.res.zoom_tier is not None and mem.res.n_spans > 5
    mem.batched = batched
    q = assert_full_kv(model, ref, ids, mem, full)
    # the same pack read from its factors (rank <= 32, 4-bit) is not full KV: the tier is what made it exact
    lossy = SEKV.open(store, p.replace(read_zoom_tier=False), res.shape, "cpu")
    lossy.batched = batched
    assert lossy.res.zoom_tier is None
    d = (_logits(model, lossy, q) - _logits(model, full, q)).abs().max()
    assert d > 1e-2, d


def test_every_block_zoomed_from_the_exact_tier_re_positioned_equals_full_kv():
    """Past the window the tier's pre-RoPE keys are rotated to their slots like the factors' rows."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", **TIER)
    n, s = mem.res.n_doc, mem.res.n_spans
    mem.question_at(n + s + 7)  # every key keeps its distance to every query (tests/test_reposition.py)
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    a, b = _logits(model, mem, q), _logits(model, full, q)
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_the_exact_tier_holds_the_prefills_k_and_v_of_every_span_token(kind):
    model, ref, ids, res, store, p, mem, full = _setup(kind, **TIER)
    pos = store["sekv.zoom.idx"]
    assert torch.equal(pos, span_token_index(store["sekv.span_start"], store["sekv.span_end"])[0])
    assert pos.numel() + store["sekv.full_idx"].numel() == ids.numel()
    inv, sc = store["sekv.rope_inv_freq"], float(store["sekv.rope_scaling"][0])
    for li in range(res.shape.n_layers):
        assert torch.equal(store[f"sekv.zoom.v.{li}"], res.values[li][:, pos])  # values: bit for bit
        cos, sin = rope.cos_sin(pos, inv, sc)  # keys: pre-RoPE, rotated back by RoPE computed here
        back = rope.apply(store[f"sekv.zoom.k.{li}"].float(), cos, sin)
        assert torch.allclose(back, res.keys[li][:, pos].float(), atol=1e-5, rtol=1e-5), (back - res.keys[li][:, pos]).abs().max()


def test_the_int8_tier_is_within_half_a_step_of_every_row():
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", **(TIER | {"zoom_tier": "int8"}))
    pos = store["sekv.zoom.idx"]
    for li in range(res.shape.n_layers):
        v = res.values[li][:, pos].float()
        q, s = store[f"sekv.zoom.v.{li}"], store[f"sekv.zoom.vs.{li}"].float()
        assert q.dtype == torch.int8 and s.dtype == torch.float32
        step = v.abs().amax(-1) / 127  # the row's step, by hand; its float16 rounding moves it by <= 2^-11
        assert torch.allclose(s, step, rtol=2**-10, atol=1e-12)
        err = (q.float() * s.unsqueeze(-1) - v).abs()
        assert bool((err <= 0.5 * step.unsqueeze(-1) * (1 + 2**-9) + 127 * step.unsqueeze(-1) * 2**-10).all())
    # read through the memory: the rows it rebuilds for zoomed blocks are those values (every block zoomed)
    tier = mem.res.zoom_tier
    g = torch.zeros(pos.numel(), dtype=torch.long)
    hit, k, v = tier.lookup(0, g, pos, torch.ones_like(pos, dtype=torch.bool))
    assert bool(hit.all())
    assert torch.allclose(v.float(), res.values[0][0, pos].float(), atol=float(res.values[0].abs().max()) / 127)
    miss, _, _ = tier.lookup(0, g[:3], store["sekv.full_idx"][:3], torch.ones(3, dtype=torch.bool))
    assert not bool(miss.any())  # full-resolution tokens are not in the tier


@pytest.mark.parametrize("kind", ["int8", "exact"])
def test_pack_round_trip_and_damaged_tier(lm, tmp_path, kind):
    from conftest import SAMPLE_MD

    doc = tmp_path / "a.txt"
    doc.write_text(SAMPLE_MD.read_text()[:3000])
    pack = tmp_path / "a.sekv"
    ingest(doc, pack, lm=lm, method="sekv", params={"zoom_tier": kind})
    rp = read_pack(pack)
    t = {k: rp.get(k) for k in rp.keys()}
    assert rp.manifest["method_params"]["zoom_tier"] == kind
    rp.close()
    shape = methods.base.ModelShape.of(lm.config, torch.float32)
    layout.validate(Store(t), shape, int(t["sekv.config"][0]))
    assert ("sekv.zoom.ks.0" in t) == (kind == "int8")
    # a tier whose index is not the spans' tokens, or whose rows are missing, is refused
    bad = dict(t)
    bad["sekv.zoom.idx"] = t["sekv.zoom.idx"].flip(0)
    with pytest.raises(PackError, match="zoom"):
        layout.validate(Store(bad), shape, int(t["sekv.config"][0]))
    bad = {k: v for k, v in t.items() if k != "sekv.zoom.idx"}
    with pytest.raises(PackError, match="zoom"):
        layout.validate(Store(bad), shape, int(t["sekv.config"][0]))
    bad = {k: v for k, v in t.items() if k != "sekv.zoom.v.1"}
    with pytest.raises(PackError, match="zoom.v.1"):
        layout.validate(Store(bad), shape, int(t["sekv.config"][0]))
    # a pack without a tier (made before it existed, or with zoom_tier factors) opens and reads its factors
    old = {k: v for k, v in t.items() if not k.startswith("sekv.zoom.")}
    layout.validate(Store(old), shape, int(t["sekv.config"][0]))
    mem = SEKV.open(Store(old), SEKV.resolve_params({}), shape, "cpu")
    assert mem.res.zoom_tier is None
    assert SEKV.resolve_params({}).zoom_tier in ("factors", "int8", "exact")


def test_windowed_ingest_and_add_keep_the_tier_whole(lm, tmp_path, monkeypatch):
    """A pack read in windows and extended by `sekv add` (in windows too): its tier covers exactly the span tokens of
    the merged pack (validate), the added ones after the pack's, whose rows are kept bit for bit."""
    from conftest import SAMPLE_MD
    from sekv_core.add import add
    from sekv_core.documents import load_corpus
    from sekv_core.ingest import WINDOW_ENV

    (tmp_path / "a.txt").write_text(SAMPLE_MD.read_text()[:5000])
    (tmp_path / "b.txt").write_text(" ".join(f"Line {i}: the harbour master logged ship {i * 7} at dawn." for i in range(40)))
    pack = tmp_path / "p.sekv"
    monkeypatch.setenv(WINDOW_ENV, "512")
    ingest(tmp_path / "a.txt", pack, lm=lm, method="sekv", params={"zoom_tier": "int8"})
    shape = methods.base.ModelShape.of(lm.config, torch.float32)

    def tensors():
        rp = read_pack(pack)
        try:
            return {k: rp.get(k) for k in rp.keys()}, rp.manifest
        finally:
            rp.close()

    t0, m0 = tensors()
    assert len(m0["windows"]) > 2
    layout.validate(Store(t0), shape, m0["n_tokens"])
    r = add(pack, load_corpus([tmp_path / "b.txt"], headings=True), lm=lm)
    assert r.windows > 1
    t1, m1 = tensors()
    layout.validate(Store(t1), shape, m1["n_tokens"])
    P0 = t0["sekv.zoom.idx"].numel()
    assert t1["sekv.zoom.idx"].numel() > P0 and torch.equal(t1["sekv.zoom.idx"][:P0], t0["sekv.zoom.idx"])
    assert int(t1["sekv.zoom.idx"][-1]) >= m0["n_tokens"]
    for li in range(shape.n_layers):
        for part in ("k", "ks", "v", "vs"):
            assert torch.equal(t1[f"sekv.zoom.{part}.{li}"][:, :P0], t0[f"sekv.zoom.{part}.{li}"])


def test_a_pack_made_before_the_zoom_tier_reads_as_factors(tmp_path):
    from sekv_core.pack import write_pack
    from sekv_core.sekv.params import SekvParams
    from sekv_core.session import pack_params, stored_params

    assert SekvParams.absent_in_pack["zoom_tier"] == "factors"
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", **(TIER | {"zoom_tier": "factors"}))
    assert not any(k.startswith("sekv.zoom.") for k in store)
    before = {k: v for k, v in p.to_dict().items() if k not in ("zoom_tier", "read_zoom_tier")}
    write_pack(tmp_path / "old.sekv", {"method": "sekv", "method_params": before}, dict(store))
    old = read_pack(tmp_path / "old.sekv")
    assert "zoom_tier" not in old.params and pack_params(old)["zoom_tier"] == "factors"
    assert stored_params(old).zoom_tier == "factors"
