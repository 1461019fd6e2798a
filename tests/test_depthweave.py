"""DepthWeave-KV (`--method depthweave`): quantiser bounds, exact reconstruction, routing, probes, end to end.

References are independent of the code under test: plain float64 algebra, SDPA over
explicitly reconstructed K/V, and the `full` method's answers.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from sekv_core import models
from sekv_core.depthweave import attention as at
from sekv_core.depthweave import codec, router
from sekv_core.depthweave import quantize as qz
from sekv_core.depthweave.probe import ProbeController
from sekv_core.errors import SekvError
from sekv_core.ingest import ingest
from sekv_core.methods import get
from sekv_core.methods.base import ModelShape, PrefillResult
from sekv_core.pack import read_pack
from sekv_core.sekv import rope
from sekv_core.session import Session

from conftest import SAMPLE_MD

METHOD = get("depthweave")
QUESTION = "How many steps does the tower have?"
#: lossless settings: no quantisation, every token at the top residual level
LOSSLESS = {"coef_bits": 0, "res_bits": 0, "budget": 1.0}


class DictStore(dict):
    def get(self, name):  # noqa: D102 - the TensorStore protocol
        return self[name]


def synthetic_prefill(n=300, layers=4, hkv=2, heads=4, d=16, seed=0, dtype=torch.float32) -> PrefillResult:
    """Random low-rank-ish pre-RoPE keys (rotated like a model would) and values, with prefill statistics."""
    g = torch.Generator().manual_seed(seed)
    inv = 1.0 / (10000.0 ** (torch.arange(0, d, 2).float() / d))
    shape = ModelShape(layers, heads, hkv, d, dtype, 10000.0, tuple(inv.tolist()), 1.0)
    cos, sin = rope.cos_sin(torch.arange(n), inv, 1.0, dtype)
    mix = torch.randn(hkv, d, d, generator=g) * torch.logspace(0, -2, d).view(1, d, 1)  # decaying spectrum
    keys, values = [], []
    for _ in range(layers):
        pre = torch.randn(hkv, n, d, generator=g) @ mix + 0.05 * torch.randn(hkv, n, d, generator=g)
        keys.append(rope.apply(pre, cos, sin).to(dtype))
        values.append((torch.randn(hkv, n, d, generator=g) @ mix).to(dtype))
    mass = [torch.rand(heads, n, generator=g) * 3 for _ in range(layers)]
    obs = [torch.randn(heads, 8, d, generator=g) for _ in range(layers)]
    text = [("\n" if i % 17 == 0 else "tok") for i in range(n)]
    scores = {"attn_mass": mass, "obs_queries": obs, "obs_window": 8, "scaling": d**-0.5, "token_text": text}
    return PrefillResult(torch.arange(n), keys, values, None, shape, scores=scores)


def open_memory(pre: PrefillResult, **params):
    p = METHOD.resolve_params(params)
    store = DictStore(METHOD.compress(pre, p))
    return METHOD.open(store, p, pre.shape, "cpu"), store, p


def budget_range(mem) -> tuple[float, float]:
    """(floor, top): resident fractions of a memory's routing-independent part and of every token at the top level."""
    full = mem.spec.n_tokens * mem.shape.kv_bytes_per_token()
    fixed = sum(mem.fixed.values()) + mem.transient_reserve
    top = fixed + float(mem.cost[:, -1].sum()) * mem.spec.n_kv_heads * mem.spec.n_compressed
    return fixed / full, top / full


def mid_budget(pre: PrefillResult, share: float, **params) -> float:
    """A budget that leaves room for ``share`` of the top-level residual bytes."""
    mem, _, _ = open_memory(pre, **{**params, "budget": 1.0})
    lo, hi = budget_range(mem)
    return lo + share * (hi - lo)


def reconstructed_layer(mem, layer: int, dense: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """The memory's current reconstruction of one layer's document K (post-RoPE) and V, exact tokens included."""
    m, nc = mem.spec.window_of(layer), mem.spec.n_compressed
    zk, zv = mem.codes[layer]["k"], mem.codes[layer]["v"]
    dk = mem.tier[layer]["k"] if dense else None
    dv = mem.tier[layer]["v"] if dense else None
    goff = codec.token_offsets(mem.ng[m])
    k = at.reconstruct(zk, 0, nc, mem.ng[m], goff, mem.spec.max_groups, mem.rot, dk)
    v = at.reconstruct(zv, 0, nc, mem.ng[m], goff, mem.spec.max_groups, None, dv)
    ne = mem.spec.n_exact
    return torch.cat([mem.kv.k[layer][0, :, :ne].float(), k], 1), torch.cat([mem.kv.v[layer][0, :, :ne].float(), v], 1)


# ------------------------------------------------------------------------------------------------ quantisers


def test_int8_block_error_within_half_a_step():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(7, 50, 37, generator=g) * torch.logspace(-6, 3, 50).view(1, 50, 1)  # width not a multiple of the block
    x[0, 0] = 0.0  # an all-zero row
    q, scale = qz.quantize_blocks(x, 16)
    assert q.dtype == torch.int8 and scale.dtype == torch.float16 and q.shape[-1] == 48 and scale.shape[-1] == 3
    deq = qz.dequantize_blocks(q, scale, 37)
    s = scale.float().repeat_interleave(16, -1)[..., :37]
    err = (x - deq).abs()
    # |x - s q| <= s/2 per element (+ float32 rounding of x/s and s*q)
    assert bool((err <= s / 2 + x.abs() * 2**-22 + 1e-30).all())
    # the stored scale is never below absmax/127 (no clipping) and at most (1+2^-9) above it (or the float16 floor)
    absmax = F.pad(x, (0, 11)).view(7, 50, 3, 16).abs().amax(-1)
    assert bool((scale.float() >= absmax / 127).all())
    assert bool((scale.float() <= torch.maximum(absmax / 127 * (1 + 2**-9), torch.tensor(qz.MIN_SCALE) * (1 + 2**-9))).all())
    assert bool((q.abs() <= 127).all())
    assert torch.equal(deq[0, 0], torch.zeros(37))


def test_int4_group_error_bound_packing_and_prefixes():
    g = torch.Generator().manual_seed(2)
    x = torch.randn(5, 40, 24, generator=g) * torch.logspace(-4, 2, 40).view(1, 40, 1)
    packed, scale = qz.quantize_groups4(x, 6)
    assert packed.shape == (5, 40, 12) and scale.shape == (5, 40, 4) and packed.dtype == torch.uint8
    deq = qz.dequantize_groups4(packed, scale, 6)
    s = scale.float().repeat_interleave(6, -1)
    assert bool(((x - deq).abs() <= s / 2 + x.abs() * 2**-22 + 1e-30).all())
    codes = qz.unpack_groups4(packed, 6)
    assert bool((codes.abs() <= 7).all())
    assert torch.equal(codes.float() * s, deq)
    # a prefix of whole groups is a prefix of the bytes: keeping 2 of 4 groups decodes the first 12 channels
    assert torch.equal(qz.dequantize_groups4(packed[..., :6], scale[..., :2], 6), deq[..., :12])
    with pytest.raises(ValueError):
        qz.quantize_groups4(x, 5)


def test_quantised_reconstruction_error_within_the_analytic_bound():
    """Per element |a - a^| <= s/2 and |c - c^| <= s/2, hence ||x~ - x^|| <= ||B|| sqrt(sum (s/2)^2) + ||C|| sqrt(sum (s/2)^2),
    where x~ = a B + c C is the unquantised reconstruction on the stored bases."""
    pre = synthetic_prefill(n=200, d=16)
    mem, store, _ = open_memory(pre, rank_k=4, rank_v=8, budget=1.0, exact_tokens=1, gate=0)
    spec, ne = mem.spec, mem.spec.n_exact
    assert spec.coef_bits == 8 and spec.res_bits == 4 and mem.level_shares()[-1] == 1.0
    cos, sin = codec.key_rotation(pre.shape, pre.n_tokens)
    for layer in range(spec.n_layers):
        m = spec.window_of(layer)
        for z in "kv":
            x = (pre.keys if z == "k" else pre.values)[layer][:, ne:].float()
            if z == "k":
                x = rope.undo(x, cos[ne:], sin[ne:])
            zc = mem.codes[layer][z]
            a, c = x @ zc.basis.transpose(1, 2), x @ zc.resbasis.transpose(1, 2)
            a_hat = at.dequant_coef(zc, 0, spec.n_compressed)
            s_a = zc.coef_scale.float().repeat_interleave(spec.block(z), -1)
            assert bool(((a - a_hat).abs() <= s_a / 2 + a.abs() * 2**-20 + 1e-7).all())
            c_hat = qz.dequantize_groups4(store[f"depthweave.res.{z}.{layer}"], store[f"depthweave.res_scale.{z}.{layer}"], zc.group)
            s_c = store[f"depthweave.res_scale.{z}.{layer}"].float().repeat_interleave(zc.group, -1)
            assert bool(((c - c_hat).abs() <= s_c / 2 + c.abs() * 2**-20 + 1e-7).all())
            x_hat = at.reconstruct(zc, 0, spec.n_compressed, mem.ng[m], codec.token_offsets(mem.ng[m]), spec.max_groups, None)
            bound = (torch.linalg.matrix_norm(zc.basis, ord=2).view(-1, 1) * (s_a / 2).pow(2).sum(-1).sqrt()
                     + torch.linalg.matrix_norm(zc.resbasis, ord=2).view(-1, 1) * (s_c / 2).pow(2).sum(-1).sqrt())
            err = (a @ zc.basis + c @ zc.resbasis - x_hat).norm(dim=-1)
            assert bool((err <= bound * 1.001 + 1e-6).all()), (layer, z)


def test_residual_gate_never_increases_the_error():
    pre = synthetic_prefill(n=200, d=16, seed=3)
    gated, _, _ = open_memory(pre, rank_k=4, rank_v=4, budget=1.0, gate=1)
    plain, _, _ = open_memory(pre, rank_k=4, rank_v=4, budget=1.0, gate=0)
    for layer in range(4):
        for i, src in enumerate((pre.keys, pre.values)):
            eg = (reconstructed_layer(gated, layer)[i] - src[layer]).norm(dim=-1)
            ep = (reconstructed_layer(plain, layer)[i] - src[layer]).norm(dim=-1)
            # least squares in coefficient space; the gated scale is rounded to float16 again (relative 2^-11)
            assert bool((eg <= ep * (1 + 2e-3) + 1e-5).all())
            assert float(eg.mean()) <= float(ep.mean())


# ------------------------------------------------------------------------------------------------ factorisation


@pytest.mark.parametrize("window,overlap", [(1, 0), (2, 0), (2, 1), (4, 0)])
def test_maximal_rank_without_quantisation_reproduces_the_cache(window, overlap):
    """rank_b = 8 shared channels + the top residual level (the 8 complement channels) = the whole head dim."""
    pre = synthetic_prefill(n=257, d=16, layers=4)
    mem, _, _ = open_memory(pre, rank_k=8, rank_v=8, level_unit=1, depth_window=window, depth_overlap=overlap, exact_tokens=2, **LOSSLESS)
    assert mem.spec.channels("k") == 8 and mem.level_shares()[-1] == 1.0
    for layer in range(4):
        k, v = reconstructed_layer(mem, layer)
        torch.testing.assert_close(k, pre.keys[layer].float(), atol=2e-5, rtol=1e-5)
        torch.testing.assert_close(v, pre.values[layer].float(), atol=2e-5, rtol=1e-5)


def test_bases_are_orthonormal_and_complementary():
    pre = synthetic_prefill(n=200, d=16)
    mem, _, _ = open_memory(pre, rank_k=6, rank_v=4, level_unit=1, levels="0,2,4,10", **LOSSLESS)
    for layer in range(mem.spec.n_layers):
        for z in "kv":
            zc = mem.codes[layer][z]
            full = torch.cat([zc.basis, zc.resbasis], 1).double()  # [Hkv, r + R, d]: orthonormal rows
            r = full.shape[1]
            assert r == (16 if z == "k" else 14)  # 6 + 10 complete; 4 + 10 leaves 2 channels out
            torch.testing.assert_close(full @ full.transpose(1, 2), torch.eye(r, dtype=torch.float64).expand(2, r, r), atol=1e-5, rtol=0)


def test_lower_levels_keep_the_residual_prefix_and_cost_less():
    pre = synthetic_prefill(n=300, d=16)
    hi, _, _ = open_memory(pre, rank_k=4, rank_v=4, budget=1.0)
    b = mid_budget(pre, 0.4, rank_k=4, rank_v=4)
    lo, _, _ = open_memory(pre, rank_k=4, rank_v=4, budget=b)
    assert lo.pool_bytes() < hi.pool_bytes() and lo.resident_bytes() <= b * pre.n_tokens * pre.shape.kv_bytes_per_token()
    err_hi = err_lo = 0.0
    for layer in range(4):
        k_hi, v_hi = reconstructed_layer(hi, layer)
        k_lo, v_lo = reconstructed_layer(lo, layer)
        err_hi += float((k_hi - pre.keys[layer]).norm() + (v_hi - pre.values[layer]).norm())
        err_lo += float((k_lo - pre.keys[layer]).norm() + (v_lo - pre.values[layer]).norm())
    assert err_hi < err_lo


# ------------------------------------------------------------------------------------------------ attention paths


@pytest.mark.parametrize("chunk", [16, 0])
def test_chunked_attention_equals_sdpa_over_the_reconstruction(chunk):
    """The partial-softmax path (chunks, GQA groups, causal new block) against SDPA over materialised K/V."""
    pre = synthetic_prefill(n=150, d=16, layers=2)
    params = dict(rank_k=4, rank_v=6, chunk=chunk, question_routing=0)
    mem, _, _ = open_memory(pre, budget=mid_budget(pre, 0.5, **params), **params)
    assert max(mem.level_shares()) < 1  # a mix of levels
    g = torch.Generator().manual_seed(5)
    q_new = 3
    mem.truncate(pre.n_tokens)
    mem.begin_step(q_new)
    for layer in range(2):
        k_doc, v_doc = reconstructed_layer(mem, layer)
        q = torch.randn(1, 4, q_new, 16, generator=g)
        k = torch.randn(1, 2, q_new, 16, generator=g)
        v = torch.randn(1, 2, q_new, 16, generator=g)
        out = mem.attend(layer, q, k, v, 0.25)
        keys = torch.cat([k_doc[None], k], 2)
        vals = torch.cat([v_doc[None], v], 2)
        mask = torch.ones(q_new, keys.shape[2], dtype=torch.bool).tril(diagonal=keys.shape[2] - q_new)
        ref = F.scaled_dot_product_attention(q, keys, vals, attn_mask=mask, scale=0.25, enable_gqa=True)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=2e-5)
    mem.end_step()
    assert mem.n_tokens() == pre.n_tokens + q_new


# ------------------------------------------------------------------------------------------------ routing, budget


def test_router_levels_and_budget_solve():
    s = torch.tensor([[[-1.0, 0.5, 1.5, 2.5, 10.0]]])
    lv = router.levels(s, torch.tensor([0.0]), 1.0, 4)
    assert lv.flatten().tolist() == [0, 1, 2, 3, 3]
    cost = torch.tensor([[0.0, 1.0, 2.0, 4.0]], dtype=torch.float64)
    for allowance in (0, 1, 3, 6, 9, 14, 100):
        tau = router.solve_offset(s, torch.zeros(1), 1.0, cost, allowance)
        used = router.usage(s, torch.tensor([tau]), 1.0, cost)
        assert used <= allowance
        # minimal: lowering the threshold a little would exceed the allowance (unless everything is at the top)
        if used < 14:
            assert router.usage(s, torch.tensor([tau - 1e-3]), 1.0, cost) > allowance or used == allowance


def test_budget_is_the_resident_fraction_and_a_too_small_budget_is_an_error():
    pre = synthetic_prefill(n=400, d=16)
    full = pre.n_tokens * pre.shape.kv_bytes_per_token()
    for share in (0.2, 0.5, 0.8):
        budget = mid_budget(pre, share, rank_k=4, rank_v=4)
        mem, _, _ = open_memory(pre, rank_k=4, rank_v=4, budget=budget)
        assert mem.resident_bytes() + mem.transient_reserve <= budget * full
        assert mem.resident_bytes() + mem.transient_reserve > (budget - 0.03) * full  # the residual pools use the room
        mem.truncate(pre.n_tokens)
        mem.begin_step(1)
        for layer in range(4):
            mem.attend(layer, torch.randn(1, 4, 1, 16), torch.randn(1, 2, 1, 16), torch.randn(1, 2, 1, 16), 0.25)
        mem.end_step()
        peak = mem.step_stats().resident_bytes
        assert peak <= budget * full + mem.kv.nbytes()  # + the appended token (and the exact ones), full precision
    with pytest.raises(SekvError, match="below depthweave's floor"):
        open_memory(pre, rank_k=8, rank_v=8, budget=0.9 * budget_range(open_memory(pre, rank_k=8, rank_v=8, budget=1.0)[0])[0])


def test_question_routing_moves_residuals_to_attended_tokens_within_the_window_bytes():
    pre = synthetic_prefill(n=300, d=16, layers=2)
    params = dict(rank_k=4, rank_v=4, depth_window=2, online_weight=1.0)
    mem, _, _ = open_memory(pre, budget=mid_budget(pre, 0.3, **params), **params)
    before = mem.level[0].clone()
    cost = mem.cost[0]
    used_before = float(cost[before.long()].sum())
    # a question whose queries point at the keys of tokens 100..109 (head 0): they must be promoted
    k0 = pre.keys[0][0, 100:110].float()
    q = torch.zeros(1, 4, 5, 16)
    q[0, :2] = 4.0 * k0.mean(0)
    mem.truncate(pre.n_tokens)
    mem.begin_step(5)
    mem.attend(0, q, torch.zeros(1, 2, 5, 16), torch.zeros(1, 2, 5, 16), 0.25)
    after = mem.level[0]
    assert float(cost[after.long()].sum()) <= used_before + 1e-6
    attended = pre.keys[0][0, 4:].float() @ (4.0 * k0.mean(0))
    top = attended.topk(10).indices
    assert after[0, top].float().mean() > before[0, top].float().mean()
    assert after[0, top].float().mean() >= 2.5


def test_probe_controller_moves_thresholds_in_the_right_direction():
    c = ProbeController(n_windows=3, tolerance=0.05, step=0.5, quiet=2)
    c.reset(2)
    assert c.record(0, 1, 0.3)  # loud: threshold down
    assert c.delta[0] == -0.5
    assert not c.record(1, 0, 0.01)  # one quiet interval: no change yet
    assert c.record(1, 0, 0.02)  # second quiet interval: threshold up
    assert c.delta[1] == 0.5 and c.quiet_count[1] == 0
    assert c.record(0, 0, 0.01) is False and c.quiet_count[0] == 1
    assert c.record(0, 0, 0.2) and c.delta[0] == -1.0 and c.quiet_count[0] == 0  # a loud probe resets the quiet count
    assert c.last_error[0, 0] == pytest.approx(0.2)


def test_probe_feedback_on_a_memory_shifts_residual_bytes_to_the_noisy_window():
    """Synthetic: window 0 reports errors above tolerance, window 1 stays quiet; re-solved against the budget."""
    pre = synthetic_prefill(n=400, d=16, layers=2)
    params = dict(rank_k=4, rank_v=4, depth_window=1, probe_quiet=1, probe_tolerance=0.1)
    mem, _, _ = open_memory(pre, budget=mid_budget(pre, 0.5, **params), **params)
    used = [float(mem.cost[m][mem.level[m].long()].sum()) for m in range(2)]
    tau0 = [mem.tau + float(mem.controller.delta[m]) for m in range(2)]
    for _ in range(3):
        mem.controller.record(0, 0, 0.5)
        mem.controller.record(1, 0, 0.0)
    mem.controller.last_error.zero_()  # isolate the threshold feedback from the probe-error feature
    mem._route_all()
    tau1 = [mem.tau + float(mem.controller.delta[m]) for m in range(2)]
    used1 = [float(mem.cost[m][mem.level[m].long()].sum()) for m in range(2)]
    assert tau1[0] < tau0[0] and tau1[1] > tau0[1]
    assert used1[0] > used[0] and used1[1] < used[1]
    assert sum(used1) <= mem.allowance


def test_online_probes_run_during_decoding(tiny_qwen, tmp_path):
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    pack = tmp_path / "p.sekv"
    ingest(SAMPLE_MD, pack, lm=lm, method="depthweave", params={"rank_k": 8, "rank_v": 8, "budget": 1.0, "probe_every": 2,
                                                                  "probe_tolerance": 0.0})
    lo, hi = budget_range(Session.open(pack, lm=lm).memory)  # at budget 1 every token is at the top level: zero probe error
    s = Session.open(pack, lm=lm, params={"budget": lo + 0.3 * (hi - lo)})
    a = s.ask(QUESTION, max_new_tokens=8)
    extra = a.stats.extra
    assert extra["probes"] >= 3  # one per window and probe step
    assert all(d < 0 for d in extra["probe_moves"])  # tolerance 0: every probe is loud, thresholds only go down
    assert extra["probe_error_mean"] > 0


# ------------------------------------------------------------------------------------------------ end to end


_FULL: dict[str, tuple] = {}


def full_answer(arch: str, request, tmp_path_factory):
    """(model, `full` answer token ids), once per architecture."""
    if arch not in _FULL:
        lm = models.load(str(request.getfixturevalue(arch)), device="cpu", dtype=torch.float32)
        pack = tmp_path_factory.mktemp("full") / "full.sekv"
        ingest(SAMPLE_MD, pack, lm=lm, method="full")
        _FULL[arch] = (lm, Session.open(pack, lm=lm).ask(QUESTION, max_new_tokens=24).token_ids)
    return _FULL[arch]


@pytest.mark.parametrize("arch", ["tiny_qwen", "tiny_llama"])
@pytest.mark.parametrize("setting", [{"rank_k": 16, "rank_v": 16}, {"rank_k": 8, "rank_v": 8, "level_unit": 1, "depth_window": 2}])
def test_lossless_setting_answers_like_full(arch, setting, request, tmp_path, tmp_path_factory):
    """Without quantisation, at full basis rank or at basis + top residual level = head dim: token-for-token `full`."""
    lm, expected = full_answer(arch, request, tmp_path_factory)
    ingest(SAMPLE_MD, tmp_path / "dw.sekv", lm=lm, method="depthweave", params={**setting, **LOSSLESS, "chunk": 300})
    session = Session.open(tmp_path / "dw.sekv", lm=lm)
    assert len(expected) > 3
    assert session.ask(QUESTION, max_new_tokens=24).token_ids == expected
    assert session.ask(QUESTION, max_new_tokens=24).token_ids == expected  # and again from the pack state


def test_ingest_ask_inspect_end_to_end(tiny_qwen, tmp_path):
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    pack = tmp_path / "doc.sekv"
    params = {"rank_k": 4, "rank_v": 8}
    ingest(SAMPLE_MD, pack, lm=lm, method="depthweave", params={**params, "budget": 1.0}, chunk=128)
    lo, hi = budget_range(Session.open(pack, lm=lm).memory)
    budget = round(lo + 0.4 * (hi - lo), 4)
    r = ingest(SAMPLE_MD, pack, lm=lm, method="depthweave", params={**params, "budget": budget}, chunk=128)
    p = read_pack(pack)
    assert p.manifest["format_version"] == 4 and p.manifest["method"] == "depthweave"
    names = p.keys()
    assert names and all(n.startswith("depthweave.") for n in names)
    assert {"depthweave.basis.k.0", "depthweave.coef.v.1", "depthweave.res.k.0", "depthweave.res_scale.v.1"} <= set(names)
    assert p.get("depthweave.coef.k.0").dtype == torch.int8 and p.get("depthweave.res.k.0").dtype == torch.uint8
    stats = METHOD.describe(p, METHOD.resolve_params(p.params))
    assert stats["resident_reduction_vs_raw_fp16"] > 1 and stats["pack_reduction_vs_raw_fp16"] > 1
    assert math.isclose(sum(stats["level_shares"].values()), 1.0, abs_tol=1e-3) and stats["level_shares"]["0"] > 0
    session = Session.open(pack, lm=lm)
    a1 = session.ask(QUESTION, max_new_tokens=16)
    assert a1.stats.generated_tokens > 0 and a1.token_ids
    assert session.ask(QUESTION, max_new_tokens=16).token_ids == a1.token_ids  # each ask starts from the pack state
    per_token = session.memory.shape.kv_bytes_per_token()
    tail = (a1.stats.question_tokens + a1.stats.generated_tokens) * per_token  # appended at full precision
    assert a1.stats.resident_kv_bytes_peak <= budget * r.n_tokens * per_token + tail
    # an ask-time budget re-routes without re-ingesting
    s2 = Session.open(pack, lm=lm, params={"budget": hi})
    assert s2.memory.pool_bytes() > session.memory.pool_bytes()
    assert s2.memory.level_shares()[-1] == 1.0
