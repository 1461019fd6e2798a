"""The at-rest factor codec (sekv/codec.py: 4- and 3-bit codes, log8 row scales) and `factor_bits=4` packs."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.errors import SekvError
from sekv_core.pack import read_pack, write_pack
from sekv_core.sekv import codec
from sekv_core.sekv import factorize as fz

from test_sekv_method import Store, _setup

LENS = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])


def _half_gap_bound(q: torch.Tensor, group: int, levels: str) -> torch.Tensor:
    """Per element: a * (gap between the levels around q / a) / 2 + 1/2, a = the group's max |q| (module docstring)."""
    lv = codec.LEVELS[levels]
    n = q.numel()
    a = torch.zeros(codec.n_groups(n, group) * group)
    a[:n] = q.float().abs()
    a = a.view(-1, group).amax(1).repeat_interleave(group)[:n]
    y = q.float() / torch.where(a > 0, a, torch.ones_like(a))
    hi = torch.bucketize(y, lv).clamp(1, lv.numel() - 1)  # levels lv[hi - 1] <= y <= lv[hi]
    gap = lv[hi] - lv[hi - 1]
    return a * gap / 2 + 0.5


def test_int4_hand_computed():
    # group 4, a = 127: q / a * 7 = 7, -3.53, 0, 0.55 -> levels 7/7, -4/7, 0, 1/7 -> 127, round(-72.57), 0, round(18.14)
    q = torch.tensor([127, -64, 0, 10], dtype=torch.int8)
    codes, m = codec.encode(q, 4, "int4")
    assert m.tolist() == [127] and m.dtype == torch.uint8
    # level index = k + 8: 15, 4, 8, 9; element 2k in the low nibble
    assert codes.tolist() == [15 | (4 << 4), 8 | (9 << 4)]
    assert codec.decode(codes, m, 4, 4, "int4").tolist() == [127, -73, 0, 18]
    # nf4, same group: q / a = 1, -0.504, 0, 0.0787 -> levels 1.0, -0.5251, 0, 0.0796
    c2, _ = codec.encode(q, 4, "nf4")
    assert codec.decode(c2, m, 4, 4, "nf4").tolist() == [127, round(-0.5250730514526367 * 127), 0, round(0.07958029955625534 * 127)]


def test_3bit_hand_computed():
    # group 4, a = 127: q / a = 1, -0.504, 0, 0.0787
    q = torch.tensor([127, -64, 0, 10], dtype=torch.int8)
    # int3, levels k / 3: x3 = 3, -1.51, 0, 0.236 -> k = 3, -2, 0, 0 -> indices k + 4 = 7, 2, 4, 4
    codes, m = codec.encode(q, 4, "int3")
    assert m.tolist() == [127] and codec.bits_of("int3") == 3
    # 12 bits, little-endian: 111 | 010 | 001 | 001 (each index's bits low first) -> bytes 0b00010111, 0b00001001
    assert codes.tolist() == [0b00010111, 0b00001001]
    assert codec.decode(codes, m, 4, 4, "int3").tolist() == [127, round(-2 / 3 * 127), 0, 0]
    # nf3: -0.504 -> -0.4786 (index 1); 0.0787 is below the midpoint 0.0805 of 0 and 0.1609 -> 0 (index 3)
    c2, _ = codec.encode(q, 4, "nf3")
    assert c2.tolist() == [7 | (1 << 3) | ((3 & 3) << 6), (3 >> 2) | (3 << 1)]
    assert codec.decode(c2, m, 4, 4, "nf3").tolist() == [127, round(-0.478629160115911 * 127), 0, 0]


def test_log8_scales_hand_computed_and_bound():
    # lo = log2 1 = 0, hi = log2 4 = 2, step = 2 / 254: 1 -> code 1, 2 -> 127 steps -> code 128, 4 -> code 255, 0 -> 0
    s = torch.tensor([0.0, 1.0, 2.0, 4.0], dtype=torch.float16)
    c, p = codec.encode_scales(s)
    assert c.dtype == torch.uint8 and c.tolist() == [0, 1, 128, 255]
    assert abs(float(p[0])) < 1e-7 and abs(float(p[1]) - 2 / 254) < 1e-7
    assert codec.decode_scales(c, p).tolist() == [0.0, 1.0, 2.0, 4.0]
    # random positive scales over 2^-14..2^-2 (normal float16): relative error <= 2^(step / 2) - 1 + the float16 half-ulp 2^-11
    g = torch.Generator().manual_seed(3)
    s = torch.exp2(torch.rand(5000, generator=g) * 12 - 14).to(torch.float16)
    c, p = codec.encode_scales(s)
    back = codec.decode_scales(c, p)
    assert back.dtype == torch.float16
    rel = ((back.float() - s.float()).abs() / s.float()).max()
    bound = 2 ** (float(p[1]) / 2) - 1 + 2**-11
    assert float(rel) <= bound + 1e-6 and bound < 0.025, (float(rel), bound)
    # no positive scale at all
    c0, p0 = codec.encode_scales(torch.zeros(3, dtype=torch.float16))
    assert c0.tolist() == [0, 0, 0] and codec.decode_scales(c0, p0).tolist() == [0.0, 0.0, 0.0]


@pytest.mark.parametrize("levels", ["int4", "nf4", "int3", "nf3"])
@pytest.mark.parametrize("group", [2, 16, 32, 64])
def test_round_trip_within_half_a_step(levels, group):
    g = torch.Generator().manual_seed(group)
    bits = codec.bits_of(levels)
    for n in (1, 7, 1000, 4097):
        q = (torch.randn(n, generator=g) * torch.rand(n, generator=g).pow(3) * 60).round().clamp(-127, 127).to(torch.int8)
        codes, m = codec.encode(q, group, levels)
        assert codes.numel() == (n * bits + 7) // 8 and m.numel() == -(-n // group)
        back = codec.decode(codes, m, n, group, levels)
        assert back.dtype == torch.int8 and back.shape == q.shape
        err = (back.float() - q.float()).abs()
        assert bool((err <= _half_gap_bound(q, group, levels) + 1e-4).all()), float((err - _half_gap_bound(q, group, levels)).max())
        if levels == "int4":  # the uniform bound: a / 14 + 1/2
            assert float(err.max()) <= float(m.float().max()) / 14 + 0.5
        if levels == "int3":  # a / 6 + 1/2
            assert float(err.max()) <= float(m.float().max()) / 6 + 0.5
        # the group maximum itself is exact (the level +-1 is in both tables)
        pos = q.float().abs().argmax()
        assert back[pos] == q[pos]


@pytest.mark.parametrize("levels", ["int4", "nf4", "int3", "nf3"])
def test_constant_and_zero_groups_are_exact(levels):
    q = torch.tensor([0] * 8 + [5] * 8 + [-7] * 8 + [127] * 8 + [-127] * 3, dtype=torch.int8)
    codes, m = codec.encode(q, 8, levels)
    assert m.tolist() == [0, 5, 7, 127, 127]
    assert torch.equal(codec.decode(codes, m, q.numel(), 8, levels), q)
    z = torch.zeros(33, dtype=torch.int8)
    cz, mz = codec.encode(z, 16, levels)
    assert int(mz.sum()) == 0 and torch.equal(codec.decode(cz, mz, 33, 16, levels), z)
    empty = torch.zeros(0, dtype=torch.int8)
    ce, me = codec.encode(empty, 16, levels)
    assert ce.numel() == me.numel() == 0 and codec.decode(ce, me, 0, 16, levels).numel() == 0


def test_bad_input_is_refused():
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(4), 4)  # float
    with pytest.raises(ValueError):
        codec.encode(torch.zeros(4, dtype=torch.int8), 3)  # odd group
    c, m = codec.encode(torch.ones(10, dtype=torch.int8), 4)
    with pytest.raises(ValueError):
        codec.decode(c, m, 20, 4)  # too few codes for 20 elements


def test_column_order_by_hand():
    # blocks 2 x 3 and 1 x 2: row-major 0..5 | 6 7 -> column-major positions
    p = codec.column_order(torch.tensor([2, 1]), torch.tensor([3, 2]))
    assert p.tolist() == [0, 2, 4, 1, 3, 5, 6, 7]
    x = torch.arange(8)
    col = torch.empty_like(x)
    col[p] = x
    assert col.tolist() == [0, 3, 1, 4, 2, 5, 6, 7]  # block 1 transposed
    assert torch.equal(col[p], x)


def test_factor_round_trip():
    x = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(4))
    f = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True)
    kw = codec.DEFAULT
    t = codec.encode_factors(f, LENS, 64, **kw)
    assert {"us", "vt"}.isdisjoint(t) and t["us.q4"].dtype == torch.uint8 and t["vt.lead"].dtype == torch.int8
    g = codec.decode_factors(t, LENS, 64, **kw)
    assert g.us.dtype == torch.int8 and g.us.shape == f.us.shape and g.vt.shape == f.vt.shape
    assert torch.equal(g.rank, f.rank) and torch.equal(g.us_scale, f.us_scale) and torch.equal(g.vt_scale, f.vt_scale)
    # the first vt row of every block is stored as it was
    lay = fz.Layout.of(f, LENS, 64)
    live = lay.rank > 0
    first = lay.vt_off[live].view(-1, 1) + torch.arange(64).view(1, -1)
    assert torch.equal(g.vt[first], f.vt[first])
    # us: column-major groups -> each element within its group's half step
    p = codec.column_order(LENS.view(1, -1).expand_as(f.rank), f.rank)
    col = torch.empty_like(f.us)
    col[p] = f.us
    bound = _half_gap_bound(col, kw["group"], kw["levels"])[p]
    assert bool(((g.us.float() - f.us.float()).abs() <= bound + 1e-4).all())
    # bytes: a little over half of int8 (4-bit codes + a byte per 32 + the int8 leading rows)
    nb = sum(v.numel() * v.element_size() for v in t.values())
    assert nb < 0.62 * f.nbytes()
    y8 = fz.reconstruct_all(f, LENS, 64)
    y4 = fz.reconstruct_all(g, LENS, 64)
    assert float((y4 - y8).norm() / y8.norm()) < 0.15


def test_factor_round_trip_3bit_log8():
    """Value-factor settings (nf3, log8 row scales): every element within its half step, scales within the log8 bound."""
    x = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(5))
    f = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True)
    kw = dict(codec.VALUES_3BIT, scales="log8")
    t = codec.encode_factors(f, LENS, 64, **kw)
    assert {"us.q3", "us.q3m", "vt.q3", "vt.q3m", "us_scale.l8", "vt_scale.l8"} <= set(t) and "us_scale" not in t
    g = codec.decode_factors(t, LENS, 64, **kw)
    assert g.us_scale.dtype == torch.float16 and g.us_scale.shape == f.us_scale.shape and torch.equal(g.rank, f.rank)
    for a, b, k in ((g.us_scale, f.us_scale, "us_scale"), (g.vt_scale, f.vt_scale, "vt_scale")):
        step = float(t[f"{k}.l8p"][1])
        rel = ((a.float() - b.float()).abs() / b.float()).max()
        assert float(rel) <= 2 ** (step / 2) - 1 + 2**-11 + 1e-6
    p = codec.column_order(LENS.view(1, -1).expand_as(f.rank), f.rank)
    col = torch.empty_like(f.us)
    col[p] = f.us
    assert bool(((g.us.float() - f.us.float()).abs() <= _half_gap_bound(col, kw["group"], "nf3")[p] + 1e-4).all())
    nb = sum(v.numel() * v.element_size() for v in t.values())
    t4 = codec.encode_factors(f, LENS, 64, **codec.DEFAULT)
    assert nb < 0.85 * sum(v.numel() * v.element_size() for v in t4.values())
    y8 = fz.reconstruct_all(f, LENS, 64)
    # random Gaussian blocks (no dominant components, the hard case): 3 bits err more than 4, still well below 1
    e3 = float((fz.reconstruct_all(g, LENS, 64) - y8).norm() / y8.norm())
    e4 = float((fz.reconstruct_all(codec.decode_factors(t4, LENS, 64, **codec.DEFAULT), LENS, 64) - y8).norm() / y8.norm())
    assert e4 < e3 < 0.3, (e4, e3)


def test_factor_bits_parameter():
    m = methods.get("sekv")
    d = m.resolve_params({})
    assert (d.factor_bits, d.value_bits, d.scale_bits) == (4, 3, 8)
    assert m.resolve_params({"factor_bits": "8"}).factor_bits == 8
    with pytest.raises(SekvError, match="factor_bits"):
        m.resolve_params({"factor_bits": 3})
    with pytest.raises(SekvError, match="value_bits"):
        m.resolve_params({"value_bits": 2})
    with pytest.raises(SekvError, match="scale_bits"):
        m.resolve_params({"scale_bits": 4})


# exact factors apart from the 8-bit quantisation: full rank, every span expanded
INT8_FULL = {"zoom": "all", "budget": 1.0, "energy_k": 1.0, "energy_v": 1.0, "rank_max": 64, "min_span": 8, "window": 16, "router": "untrained"}


def test_4bit_pack_round_trip_and_full_expansion(tmp_path):
    """A factor_bits=4 pack: only coded tensors, write / read / open, and logits at full expansion near full KV.

    Tolerance: the logits move (to first order) in proportion to the factors' element errors.  Per element,
    int8 rounding errs by at most B8 = 1/2 (of a row's scale unit) and the codec by at most
    B4 = 127 * max_gap / 2 + 1/2 (largest nf4 gap, at +1: 0.277 -> 18.1 units).  So the 4-bit memory's deviation
    from full KV is bounded by that of the int8 memory (same factors) times B4 / B8 (+ the float noise of the
    exact path, 2e-4).
    """
    model, _, ids, res, store8, p8, mem8, full = _setup("qwen2", n=500, **INT8_FULL, factor_bits=8)
    m = methods.get("sekv")
    p4 = m.resolve_params({**INT8_FULL, "factor_bits": 4, "value_bits": 4, "scale_bits": 16})  # the `4bit-factors` storage
    store4 = Store(m.compress(res, p4))
    assert codec.config_name("fv") not in store4
    assert not any(k.endswith((".us", ".vt")) for k in store4)
    assert codec.CONFIG in store4 and codec.parse_config(store4[codec.CONFIG]) == dict(codec.DEFAULT, scales="fp16")
    assert store4[codec.CONFIG].numel() == 4  # the same config tensor as packs made before value_bits / scale_bits
    path = tmp_path / "q4.sekv"
    write_pack(path, {"method": "sekv", "method_params": p4.to_dict()}, dict(store4))
    pack = read_pack(path)
    for k, v in store4.items():
        assert torch.equal(pack.get(k), v), k
    mem4 = m.open(pack, p4, res.shape, "cpu")
    # decoded factors are int8 like the 8-bit memory's, with identical ranks and scales
    for (f4, _), (f8, _) in zip(mem4.res.factors, mem8.res.factors):
        assert f4.us.dtype == f8.us.dtype == torch.int8 and f4.us.shape == f8.us.shape
        assert torch.equal(f4.rank, f8.rank) and torch.equal(f4.us_scale, f8.us_scale)
        assert not torch.equal(f4.us, f8.us)  # the code is lossy here: the test below is not vacuous
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    ref = runtime.forward_logits(model, q, full.n_tokens(), full, last_only=False)
    a8 = runtime.forward_logits(model, q, mem8.n_tokens(), mem8, last_only=False)
    a4 = runtime.forward_logits(model, q, mem4.n_tokens(), mem4, last_only=False)
    lv = codec.LEVELS[codec.DEFAULT["levels"]]
    b4 = 127 * float((lv[1:] - lv[:-1]).max()) / 2 + 0.5
    tol = float((a8 - ref).abs().max()) * b4 / 0.5 + 2e-4
    err4 = float((a4 - ref).abs().max())
    assert err4 <= tol, (err4, tol)
    assert err4 > 0
    # smaller pack, reported by describe
    d4, d8 = m.describe(pack, p4), m.describe(store8, p8)
    assert d4["factors"].startswith("4-bit") and d8["factors"] == "int8"
    assert d4["factor_bytes"] < 0.62 * d8["factor_bytes"] and d4["pack_tensor_bytes"] < d8["pack_tensor_bytes"]

    # the default storage (3-bit value codes, log8 row scales): first-order bound as above, with the largest element
    # bound of the two codes plus the row scales' relative error (us and vt rows, each up to 127 units)
    pd = m.resolve_params(dict(INT8_FULL))
    stored = Store(m.compress(res, pd))
    assert "sekv.fk.0.us.q4" in stored and "sekv.fv.0.us.q3" in stored and "sekv.fk.0.us_scale" not in stored
    assert codec.parse_config(stored[codec.config_name("fv")])["levels"] == "nf3"
    path = tmp_path / "q3.sekv"
    write_pack(path, {"method": "sekv", "method_params": pd.to_dict()}, dict(stored))
    memd = m.open(read_pack(path), pd, res.shape, "cpu")
    for (fd, _), (f8, _) in zip(memd.res.factors, mem8.res.factors):
        assert fd.us.dtype == torch.int8 and torch.equal(fd.rank, f8.rank) and fd.us_scale.dtype == torch.float16
    lv3 = codec.LEVELS["nf3"]
    b3 = 127 * float((lv3[1:] - lv3[:-1]).max()) / 2 + 0.5
    step = max(float(stored[k][1]) for k in stored if k.endswith("_scale.l8p"))
    rs = 2 ** (step / 2) - 1 + 2**-11
    tol_d = float((a8 - ref).abs().max()) * (max(b3, b4) + 2 * 127 * rs) / 0.5 + 2e-4
    ad = runtime.forward_logits(model, q, memd.n_tokens(), memd, last_only=False)
    errd = float((ad - ref).abs().max())
    assert 0 < errd <= tol_d, (errd, tol_d)
    dd = m.describe(read_pack(path), pd)
    assert "values 3-bit nf3" in dd["factors"] and "log8" in dd["factors"] and dd["pack_tensor_bytes"] < d4["pack_tensor_bytes"]


def test_float_factors_ignore_factor_bits():
    """factor_bits codes int8 factors only: float factors (the exactness tests' setting) stay float."""
    *_, store, p, mem, _ = _setup("qwen2", n=300, min_span=8, factors_8bit=False, factor_dtype="float32")
    assert p.factor_bits == 4 and codec.CONFIG not in store and store["sekv.fk.0.us"].dtype == torch.float32


def test_default_packs_are_coded_and_8bit_is_an_ablation():
    from sekv_core.bench import variants
    from sekv_core.sekv.params import ABLATIONS

    *_, store, p, mem, _ = _setup("qwen2", n=300, min_span=8)
    assert "sekv.fk.0.us.q4" in store and "sekv.fk.0.us" not in store
    assert "sekv.fv.0.us.q3" in store and "sekv.fv.0.vt_scale.l8" in store
    assert ABLATIONS["8bit-factors"].overrides == {"factor_bits": 8}
    v = variants.parse("sekv:8bit-factors")
    assert methods.get("sekv").resolve_params(v.params(0.1)).factor_bits == 8
    assert ABLATIONS["4bit-factors"].overrides == {"value_bits": 4, "scale_bits": 16}
    p4 = methods.get("sekv").resolve_params(variants.parse("sekv:4bit-factors").params(0.1))
    assert (p4.factor_bits, p4.value_bits, p4.scale_bits) == (4, 4, 16)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compress_4bit():
    """compress() on an accelerator encodes there (and through the host arena); the codes equal a CPU encode,
    and a CUDA memory opened from the pack gives the CPU memory's logits."""
    from test_sekv_method import tiny

    g = torch.Generator().manual_seed(5)
    q = torch.randint(-127, 128, (4099,), generator=g).to(torch.int8)
    for levels in codec.LEVELS:
        a, b = codec.encode(q, 32, levels), codec.encode(q.cuda(), 32, levels)
        assert all(torch.equal(x, y.cpu()) for x, y in zip(a, b))
    # the merge codes a layer's factors on the GPU (scales on the host): the tensors a CPU merge writes
    from sekv_core.sekv.merge import encode_factors

    f = fz.factorize(torch.randn(2, int(LENS.sum()), 64, generator=g), LENS, energy=0.99, rank_max=32, int8=True)
    for cfg in (dict(codec.DEFAULT, scales="log8"), dict(codec.VALUES_3BIT, scales="log8"), dict(codec.DEFAULT, scales="fp16")):
        a, b = codec.encode_factors(f, LENS, 64, **cfg), encode_factors(f, LENS, 64, cfg, "cuda")
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k].cpu()) for k in a)
    model = tiny("qwen2").cuda()
    runtime.install(model)
    ids = torch.randint(0, 300, (700,), generator=torch.Generator().manual_seed(1))
    from sekv_core.prefill import prefill

    res = prefill(model, ids, with_surprisal=True, chunk=256)
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.2, "min_span": 10, "factor_bits": 4})
    m.reserve_host(res.n_tokens, res.shape, p)
    store = Store(m.compress(res, p))
    assert "sekv.fk.0.us.q4" in store and all(t.device.type == "cpu" for t in store.values())
    cpu_model = tiny("qwen2")
    cpu_model.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    runtime.install(cpu_model)
    mem = m.open(store, p, res.shape, "cpu")
    gmem = m.open(store, p, res.shape, "cuda")
    for (fa, _), (fg, _) in zip(mem.res.factors, gmem.res.factors):  # decoded on the GPU at open: the CPU's int8 factors
        assert fg.us.device.type == "cpu" and torch.equal(fa.us, fg.us) and torch.equal(fa.vt, fg.vt)
    gmem.batched = False  # the reference step (the batched step reads the same int8 factors: tests/test_sekv_decode.py)
    x = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    a = runtime.forward_logits(cpu_model, x, mem.n_tokens(), mem, last_only=False)
    b = runtime.forward_logits(model, x.cuda(), gmem.n_tokens(), gmem, last_only=False).cpu()
    assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()


def test_lazy_factors_give_the_eager_open_s_attention(monkeypatch):
    """A pack opened the CUDA way (layout.PackFactors: no factor read at open, each layer decoded when the batched
    step first builds its blocks) answers with the eagerly opened memory's logits, bit for bit, and reads no
    factor tensor before the first forward."""
    from sekv_core.sekv import residents

    model, _, ids, res, _, _, _, full = _setup("qwen2", n=600, budget=0.3, min_span=10, factor_bits=4)
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.3, "min_span": 10, "factor_bits": 4})
    store = Store(m.compress(res, p))
    assert "sekv.fk.0.us.q4" in store

    class Counting(dict):
        reads: set = set()

        def get(self, k, *a):
            self.reads.add(k)
            return super().get(k, *a)

    eager = m.open(store, p, res.shape, "cpu")
    eager.batched = True
    monkeypatch.setattr(residents, "LAZY_FACTORS", "always")
    counted = Counting(store)
    lazy = m.open(counted, p, res.shape, "cpu")
    lazy.batched = True
    assert not any(k.startswith(("sekv.fk.", "sekv.fv.")) and not k.endswith(".rank") for k in counted.reads)
    q = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(4))
    for mem in (eager, lazy):
        mem.prepare_question(lambda mem=mem: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    a = runtime.forward_logits(model, q, eager.n_tokens(), eager, last_only=False)
    b = runtime.forward_logits(model, q, lazy.n_tokens(), lazy, last_only=False)
    assert torch.equal(a, b)
    assert any(k.endswith(".us.q4") for k in counted.reads)  # read when the step needed them
    for (fe, _), (fl, _) in zip(eager.res.factors, lazy.res.factors):  # and the reference step's host factors
        assert torch.equal(fe.us, fl.us) and torch.equal(fe.vt, fl.vt) and torch.equal(fe.rank, fl.rank)


def _reference_vt(t: dict, rank: torch.Tensor, d: int, cfg: dict) -> torch.Tensor:
    """The packed vt from its coded tensors by boolean masks, the leading rows of every block found block by block."""
    lead_rows = []
    for r in rank.flatten().tolist():
        lead_rows += [j < cfg["lead"] for j in range(r)]
    lm = torch.tensor(lead_rows, dtype=torch.bool).repeat_interleave(d)
    vt = torch.zeros(lm.numel(), dtype=torch.int8)
    vt[lm] = t["vt.lead"]
    _, _, cvt, mvt = codec.code_names(cfg["levels"])
    vt[~lm] = codec.decode(t[cvt], t[mvt], int((~lm).sum()), cfg["group"], cfg["levels"])
    return vt


@pytest.mark.parametrize("kw", [codec.DEFAULT, dict(codec.VALUES_3BIT, scales="log8"), dict(codec.DEFAULT, lead=0), dict(codec.DEFAULT, lead=40)])
def test_decode_places_vt_rows_as_boolean_masks_do(kw):
    """decode_factors places the leading and the coded vt rows by their running counts (no host sync on CUDA): the
    same int8 factors as placing them by boolean masks; with the host's sizes handed in or read off the ranks."""
    x = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(6))
    f = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True)
    t = codec.encode_factors(f, LENS, 64, **kw)
    want = _reference_vt(t, f.rank, 64, kw)
    sizes = codec.factor_sizes(f.rank, LENS, kw["lead"])
    assert sizes == (int((f.rank * LENS.view(1, -1)).sum()), int(f.rank.sum()), int(f.rank.clamp_max(kw["lead"]).sum()))
    for s in (None, sizes):
        g = codec.decode_factors(t, LENS, 64, **kw, sizes=s)
        assert torch.equal(g.vt, want)
        assert g.us.shape == f.us.shape and torch.equal(g.rank, f.rank)
    if kw["lead"]:  # a damaged pack's leading rows: an error, not factors shifted by one
        with pytest.raises(ValueError):
            codec.decode_factors(dict(t, **{"vt.lead": t["vt.lead"][:-1]}), LENS, 64, **kw)


@pytest.mark.parametrize("kw", [codec.DEFAULT, dict(codec.VALUES_3BIT, scales="log8"), dict(codec.DEFAULT, lead=0), dict(codec.DEFAULT, lead=40)])
def test_decode_in_chunks_and_runs_gives_the_whole_decode(kw, monkeypatch):
    """decode_factors a chunk of codes at a time, its us columns re-ordered a run of blocks at a time and its vt rows
    placed by row indices (the host's ranks): the int8 factors of decoding every element at once, re-ordering them
    by one column_order and placing the vt rows by boolean masks."""
    x = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(11))
    f = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True)
    t = codec.encode_factors(f, LENS, 64, **kw)
    cus, mus, _, _ = codec.code_names(kw["levels"])
    n_us = int((f.rank * LENS.view(1, -1)).sum())
    whole = codec.decode(t[cus], t[mus], n_us, kw["group"], kw["levels"])
    assert n_us > 4 * 8 * kw["group"]  # several chunks below
    want_us = whole[codec.column_order(LENS.view(1, -1).expand_as(f.rank), f.rank)] if kw["order"] == "col" else whole
    want_vt = _reference_vt(t, f.rank, 64, kw)
    monkeypatch.setattr(codec, "_ENCODE_CHUNK", 256)  # decode chunks of 8 groups, runs of few blocks
    g = codec.decode_factors(t, LENS, 64, **kw)
    assert torch.equal(g.us, want_us) and torch.equal(g.vt, want_vt)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_decode_reads_nothing_back():
    """A pack's factors decoded on CUDA with the host's sizes: no host sync (torch's sync debug mode raises on one),
    and the CPU's int8 factors."""
    x = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(7))
    f = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True)
    kw = dict(codec.VALUES_3BIT, scales="log8")
    t = codec.encode_factors(f, LENS, 64, **kw)
    cpu = codec.decode_factors(t, LENS, 64, **kw)
    sizes = codec.factor_sizes(f.rank, LENS, kw["lead"])
    on = {k: v.cuda() for k, v in t.items()}
    lens = LENS.cuda()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        g = codec.decode_factors(on, lens, 64, **kw, sizes=sizes)
        h = codec.decode_factors(on, lens, 64, **kw, sizes=sizes, rank_host=f.rank, span_host=LENS)  # in runs, rows by index
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for x in (g, h):
        assert torch.equal(x.us.cpu(), cpu.us) and torch.equal(x.vt.cpu(), cpu.vt) and torch.equal(x.us_scale.cpu(), cpu.us_scale)


@pytest.mark.parametrize("kw", [codec.DEFAULT, dict(codec.VALUES_3BIT, scales="log8"), dict(codec.DEFAULT, lead=0), dict(codec.DEFAULT, lead=40)])
def test_encode_selects_vt_rows_and_us_columns_as_masks_do(kw, monkeypatch):
    """encode_factors indexes the factors from the host's ranks (no host sync when they are on CUDA): the codes of
    selecting the leading vt rows by boolean masks and reordering us by column_order, here, also when us is cut
    into several runs."""
    monkeypatch.setattr(codec, "_ENCODE_CHUNK", 256)  # several runs of whole blocks in _to_columns
    x = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(9))
    f = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True)
    got = codec.encode_factors(f, LENS, 64, **kw)
    lead_rows = []
    for r in f.rank.flatten().tolist():
        lead_rows += [j < kw["lead"] for j in range(r)]
    lm = torch.tensor(lead_rows, dtype=torch.bool).repeat_interleave(64)
    p = codec.column_order(LENS.view(1, -1).expand_as(f.rank), f.rank)
    col = torch.empty_like(f.us)
    col[p] = f.us
    cu, mu = codec.encode(col, kw["group"], kw["levels"])
    cv, mv = codec.encode(f.vt[~lm], kw["group"], kw["levels"])
    want = dict(zip(codec.code_names(kw["levels"]), (cu, mu, cv, mv)))
    want["vt.lead"] = f.vt[lm]
    for k, v in want.items():
        assert torch.equal(got[k], v), k


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_encode_reads_nothing_back():
    """The merge's coding on CUDA (factors there, ranks and row scales on the host): no host sync until its results
    are copied back, and the CPU's codes."""
    x = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(10))
    f = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True)
    kw = dict(codec.VALUES_3BIT, scales="log8")
    cpu = codec.encode_factors(f, LENS, 64, **kw)
    on = fz.Factors(f.us.cuda(), f.vt.cuda(), f.rank, f.us_scale, f.vt_scale)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        got = codec.encode_factors(on, LENS, 64, **kw)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    for k, v in cpu.items():
        assert torch.equal(got[k].cpu(), v), k
