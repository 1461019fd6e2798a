"""sekv factors: exact at full rank, the energy rule, int8, subset gathers; RoPE undo/redo; summaries."""

from __future__ import annotations

import pytest
import torch
import transformers

from sekv_core.methods.base import ModelShape
from sekv_core.sekv import factorize as fz
from sekv_core.sekv import linalg as la
from sekv_core.sekv import rope
from sekv_core.sekv.summarize import span_weights, weighted_means

LENS = torch.tensor([3, 17, 33, 40, 64, 70, 100, 5])


def _low_rank(hkv: int, lens: torch.Tensor, d: int, rank: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    blocks = [torch.randn(hkv, int(n), rank, generator=g) @ torch.randn(hkv, rank, d, generator=g) for n in lens]
    return torch.cat(blocks, 1)


@pytest.mark.parametrize("method", ["gram", "svd"])
def test_full_rank_is_exact(method):
    x = torch.randn(2, int(LENS.sum()), 64)
    f = fz.factorize(x, LENS, energy=1.0, rank_max=64, dtype=torch.float32, method=method)
    assert torch.equal(f.rank.long(), torch.minimum(LENS, torch.tensor(64)).view(1, -1).expand(2, -1))
    y = fz.reconstruct_all(f, LENS, 64)
    assert torch.allclose(y, x, atol=1e-4, rtol=1e-4)
    # float16 storage: ~1e-3 relative
    y16 = fz.reconstruct_all(fz.factorize(x, LENS, energy=1.0, rank_max=64, method=method), LENS, 64)
    assert ((y16 - x).norm() / x.norm()) < 2e-3


def test_energy_rule_picks_smallest_rank():
    sigma = torch.tensor([[4.0, 2.0, 1.0, 0.5, 0.0], [1.0, 1.0, 1.0, 1.0, 0.0], [0.0, 0.0, 0.0, 0.0, 0.0]])
    # energies: 16, 4, 1, .25 -> cumulative share .753, .941, .988, 1
    assert fz.choose_rank(sigma, 0.9, 32).tolist() == [2, 4, 0]
    assert fz.choose_rank(sigma, 0.95, 32).tolist() == [3, 4, 0]
    assert fz.choose_rank(sigma, 0.95, 2).tolist() == [2, 2, 0]
    assert fz.choose_rank(sigma, 1.0, 32).tolist() == [4, 4, 0]


def test_low_rank_spans_get_their_rank_and_error_follows_energy():
    x = _low_rank(2, LENS, 64, rank=6)
    f = fz.factorize(x, LENS, energy=0.999999, rank_max=32)
    assert int(f.rank.max()) <= 6
    y = fz.reconstruct_all(f, LENS, 64)
    assert ((y - x).norm() / x.norm()) < 2e-3  # float16 storage only
    x = torch.randn(2, int(LENS.sum()), 64)
    for energy in (0.8, 0.9, 0.95):
        f = fz.factorize(x, LENS, energy=energy, rank_max=64)
        y = fz.reconstruct_all(f, LENS, 64)
        # per span, the relative error of a rank reaching `energy` is at most sqrt(1 - energy) (+ fp16 noise)
        assert ((y - x).norm() / x.norm()) <= (1 - energy) ** 0.5 + 5e-3


@pytest.mark.parametrize("method", ["gram", "svd"])
def test_int8_factors_small_error(method):
    x = _low_rank(2, LENS, 64, rank=12, seed=3) + 0.05 * torch.randn(2, int(LENS.sum()), 64)
    f16 = fz.factorize(x, LENS, energy=0.99, rank_max=32, method=method)
    f8 = fz.factorize(x, LENS, energy=0.99, rank_max=32, int8=True, method=method)
    assert torch.equal(f16.rank, f8.rank)
    y16 = fz.reconstruct_all(f16, LENS, 64)
    y8 = fz.reconstruct_all(f8, LENS, 64)
    assert ((y8 - y16).norm() / y16.norm()) < 0.01
    assert f8.nbytes() < 0.6 * f16.nbytes()


def test_gather_subset_matches_full_reconstruction():
    x = torch.randn(3, int(LENS.sum()), 32)
    for int8 in (False, True):
        f = fz.factorize(x, LENS, energy=0.9, rank_max=16, int8=int8)
        allrows = fz.reconstruct_all(f, LENS, 32)
        lay = fz.Layout.of(f, LENS, 32)
        g = torch.tensor([0, 2, 2, 1])
        i = torch.tensor([5, 0, 6, 1])
        fe = fz.gather(f, lay, LENS, g, i, 32)
        rows = fz.expand(fe, 32)
        first = torch.cumsum(LENS, 0) - LENS
        for e in range(4):
            n = int(LENS[i[e]])
            want = allrows[g[e], first[i[e]] : first[i[e]] + n]
            assert torch.allclose(rows[e, :n], want, atol=1e-5)
            assert torch.all(rows[e, n:] == 0)
        # gathering into (reused, growing) staging buffers gives the same
        stage: dict = {}
        fe2 = fz.gather(f, lay, LENS, g, i, 32, out=stage)
        fe3 = fz.gather(f, lay, LENS, g[:1], i[:1], 32, out=stage)
        assert torch.equal(fz.expand(fe2, 32), rows)
        assert torch.equal(fz.expand(fe3, 32)[0], rows[0, : fe3.n_max])


def test_empty_gather():
    x = torch.randn(1, int(LENS.sum()), 16)
    f = fz.factorize(x, LENS, energy=0.9, rank_max=8)
    fe = fz.gather(f, fz.Layout.of(f, LENS, 16), LENS, torch.empty(0, dtype=torch.long), torch.empty(0, dtype=torch.long), 16)
    assert fz.expand(fe, 16).shape == (0, 0, 16)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_matches_transformers_and_inverts(dtype):
    cfg = transformers.LlamaConfig(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, rope_theta=5000.0)
    shape = ModelShape.of(cfg, dtype)
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    pos = torch.arange(0, 3000, 7)
    k = torch.randn(1, 2, pos.numel(), 16).to(dtype)
    cos_t, sin_t = rot(k, pos.view(1, -1))
    _, k_post = transformers.models.llama.modeling_llama.apply_rotary_pos_emb(k, k, cos_t, sin_t)
    cos, sin = rope.cos_sin(pos, rope.inv_freq_of(shape), shape.rope_attention_scaling, dtype=dtype)
    assert torch.allclose(cos, cos_t[0].float()) and torch.allclose(sin, sin_t[0].float())
    mine = rope.apply(k.float(), cos, sin)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert torch.allclose(mine, k_post.float(), atol=tol, rtol=tol)
    back = rope.undo(k_post.float(), cos, sin)
    assert torch.allclose(back, k.float(), atol=tol, rtol=tol)


def test_rope_scaling_is_read_from_the_config():
    cfg = transformers.LlamaConfig(
        hidden_size=64,
        num_attention_heads=4,
        num_key_value_heads=2,
        rope_parameters={"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    )
    shape = ModelShape.of(cfg, torch.float32)
    rot = transformers.models.llama.modeling_llama.LlamaRotaryEmbedding(cfg)
    assert torch.allclose(rope.inv_freq_of(shape), rot.inv_freq.float())


def test_weighted_means():
    pos = torch.tensor([1, 2, 3, 5, 6])
    sid = torch.tensor([0, 0, 0, 1, 1])
    s = torch.tensor([0.0, 1.0, 2.0, 1.0, 9.0, 3.0, 1.0])
    w = span_weights(s, pos, sid, 2)
    assert torch.allclose(w, torch.tensor([0.25, 0.5, 0.25, 0.75, 0.25]))
    wm = span_weights(s, pos, sid, 2, "mean")
    assert torch.allclose(wm, torch.tensor([1 / 3, 1 / 3, 1 / 3, 0.5, 0.5]))
    x = torch.randn(2, 7, 4)
    m = weighted_means(x, pos, sid, w, 2)
    assert torch.allclose(m[:, 0], 0.25 * x[:, 1] + 0.5 * x[:, 2] + 0.25 * x[:, 3], atol=1e-6)
    assert torch.allclose(m[:, 1], 0.75 * x[:, 5] + 0.25 * x[:, 6], atol=1e-6)
    # zero surprisal is clamped, not divided by
    w0 = span_weights(torch.zeros(7), pos, sid, 2)
    assert torch.allclose(w0, wm)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_weighted_means_sparse_path_equals_index_add(device):
    """The CSR segment sum (CUDA's path) gives index_add_'s span means, for ragged spans with empty-free gaps."""
    from sekv_core.sekv.segment import span_token_index

    g = torch.Generator().manual_seed(3)
    start = torch.tensor([4, 9, 40, 41, 100])
    end = torch.tensor([9, 40, 41, 97, 180])
    pos, sid = span_token_index(start, end)
    x = torch.randn(3, 200, 8, generator=g).to(torch.bfloat16)
    w = span_weights(torch.rand(200, generator=g) * 5, pos, sid, 5)
    ref = torch.stack([torch.stack([(x[h, pos[sid == i]].float() * w[sid == i].view(-1, 1)).sum(0) for i in range(5)]) for h in range(3)])
    a = weighted_means(x.to(device), pos, sid, w, 5, sparse=False).cpu()
    b = weighted_means(x.to(device), pos, sid, w, 5, sparse=True).cpu()
    assert torch.allclose(a, ref, atol=1e-5) and torch.allclose(b, ref, atol=1e-5)


@pytest.mark.parametrize("exact_orth", [True, False])
def test_top_eigh_matches_eigh_on_span_grams(exact_orth):
    """The CUDA path's subspace iteration (run here on the CPU) finds the leading eigenpairs of span Gram matrices,
    orthonormalising by eigen-decompositions or by Cholesky QR (spans of at least 32 rows)."""
    g = torch.Generator().manual_seed(5)
    # 40 spans of 90 rows, d 128: a decaying spectrum like keys' (plus noise), and pure noise (the hard case)
    a = torch.randn(40, 90, 16, generator=g, dtype=torch.float64) @ torch.randn(40, 16, 128, generator=g, dtype=torch.float64)
    a = torch.cat([a + 0.1 * torch.randn(40, 90, 128, generator=g, dtype=torch.float64), torch.randn(8, 90, 128, generator=g, dtype=torch.float64)])
    gram = a.transpose(1, 2) @ a
    lam, v = la.top_eigh(gram, 32, exact_orth=exact_orth)
    ref = torch.linalg.eigh(gram).eigenvalues.flip(-1)[:, :32]
    assert torch.allclose(v.transpose(1, 2) @ v, torch.eye(32, dtype=torch.float64).expand(48, -1, -1), atol=1e-10)
    assert torch.allclose(lam[:40, :16], ref[:40, :16], rtol=1e-6)  # the signal components: exact
    # captured energy of the rank-32 projection: the optimum for the low-rank spans, within 2% of it for pure noise
    got = ((a @ v).norm(dim=(1, 2)) ** 2) / ref.sum(-1)
    assert got[:40].min() > 1 - 1e-4 and got.min() > 0.98 and got.max() < 1 + 1e-9


@pytest.mark.parametrize("exact_orth", [True, False])
def test_decompose_subspace_path_equals_eigh_path_on_low_rank(exact_orth):
    """The subspace path (forced here on the CPU) reconstructs a rank-<=32 span as well as the exact one, also when
    Cholesky QR orthonormalises a block with fewer independent directions (12) than components (32)."""
    x = _low_rank(2, LENS[LENS > 32], 128, rank=12, seed=7)
    lens = LENS[LENS > 32]
    a = fz.decompose_spans(x, lens, 32)
    orig = fz._decompose
    try:
        fz._decompose = lambda t, method, want=None, rows_at_least_want=False, own=False: (lambda ad: (lambda ev: ((ad @ ev[1]).float(), ev[0].sqrt().float(), ev[1].transpose(1, 2).float()))(la.top_eigh(ad.transpose(1, 2) @ ad, want, exact_orth=exact_orth)))(t.double())
        b = fz.decompose_spans(x, lens, 32)
    finally:
        fz._decompose = orig
    ra = a[0][..., :12] @ a[2][..., :12, :]
    rb = b[0][..., :12] @ b[2][..., :12, :]
    assert torch.allclose(ra, rb, atol=1e-4)
    assert torch.allclose(a[1][..., :12], b[1][..., :12], rtol=1e-5)


def test_no_spans_packs_empty_factors():
    """A document too short to have spans: int8 and float packing both give empty factors, not a crash."""
    from sekv_core.sekv import factorize as fzm

    x = torch.zeros(2, 0, 16)
    for int8 in (True, False):
        f = fzm.factorize(x, torch.zeros(0, dtype=torch.long), energy=0.99, int8=int8)
        assert f.rank.shape == (2, 0) and f.us.numel() == 0 and f.vt.numel() == 0


# ---------------------------------------------------------------------------------------------
# factorisation that cannot fail: blocks real keys and values produce (all zero, rank-deficient, repeated singular
# values, norms far from 1, huge and tiny entries mixed) against a float64 SVD of the same block


#: singular values from the eigenvalues of a float32 Gram (the CUDA path) are accurate to about sqrt(eps) * |x|: a
#: rank-deficient block shows spurious components of that size (their reconstructions stay at eps * |x|)
SIGMA_F32_GRAM = 1e-3

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))]


def _hard_blocks(n: int, d: int, seed: int = 0) -> dict[str, torch.Tensor]:
    """Named [n, d] float32 blocks, each of rank <= 16 unless its name says otherwise."""
    g = torch.Generator().manual_seed(seed)
    rnd = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    low = rnd(n, 6) @ rnd(6, d)
    q1, _ = torch.linalg.qr(rnd(n, n))
    q2, _ = torch.linalg.qr(rnd(d, d))
    r8, r12 = min(8, n), min(12, n)
    rep = q1[:, :r8] @ q2[:, :r8].T * 3.0  # eight equal singular values
    steps = q1[:, :r12] @ torch.diag(torch.tensor(([5.0] * 4 + [2.0] * 4 + [1.0] * 4)[:r12], dtype=torch.float64)) @ q2[:, :r12].T
    outlier = low * 1e-3
    outlier[:, 3] = 1e6 * rnd(n)  # one outlier dimension, as pre-RoPE keys have
    rowmix = low.clone()
    rowmix[: n // 2] *= 1e18
    rowmix[n // 2 :] *= 1e-18
    blocks = {
        "zero": torch.zeros(n, d, dtype=torch.float64),
        "rank1": rnd(n, 1) @ rnd(1, d),
        "same_rows": rnd(1, d).expand(n, d).clone(),
        "repeated_sigma": rep,
        "repeated_steps": steps,
        "huge": low * 1e30,
        "tiny": low * 1e-30,
        "subnormal": low * 1e-40,  # float32 subnormals
        "outlier_dim": outlier,
        "huge_tiny_rows": rowmix,
        "full_rank_equal_sigma": q1[:, :d] @ q2.T if n >= d else q1 @ q2[:, :n].T,  # rank min(n, d), every sigma 1
    }
    return {k: v.float() for k, v in blocks.items()}


def _assert_near_optimal(name, x, us, sigma, vt, ranks, rel: float = 1e-5, sigma_rel: float = 1e-5):
    """For each r in ranks, the rank-r reconstruction from the factors is within the optimal rank-r error (float64
    SVD of x on the host) plus rel * ||x||; the singular values agree to sigma_rel * ||x||."""
    xd = x.double().cpu()
    us, sigma, vt = us.double().cpu(), sigma.double().cpu(), vt.double().cpu()
    assert torch.isfinite(us).all() and torch.isfinite(sigma).all() and torch.isfinite(vt).all(), name
    ref = torch.linalg.svd(xd).S
    norm = float(xd.norm())
    k = sigma.numel()
    assert torch.all(sigma[:-1] >= sigma[1:] - sigma_rel * norm), f"{name}: sigma not descending"
    assert float((sigma - ref[:k]).abs().max()) <= sigma_rel * norm + 1e-300, f"{name}: sigma {sigma[:4]} vs {ref[:4]}"
    for r in ranks:
        r = min(r, k)
        err = float((xd - us[:, :r] @ vt[:r]).norm())
        opt = float(ref[r:].pow(2).sum().sqrt())
        assert err <= opt * (1 + 1e-3) + rel * norm + 1e-300, f"{name}: rank {r} error {err:.3e}, optimum {opt:.3e}, |x| {norm:.3e}"


@pytest.mark.parametrize("method", ["gram", "svd"])
def test_hard_blocks_factorise_near_optimally(method):
    """The exact paths (CPU): every hard block in one batch, each at its own scale."""
    blocks = _hard_blocks(48, 64)
    a = torch.stack(list(blocks.values()))
    us, sigma, vt = la._decompose(a, method)
    for j, (name, x) in enumerate(blocks.items()):
        _assert_near_optimal(f"{method}/{name}", x, us[j], sigma[j], vt[j], ranks=(1, 4, 8, 16, 48))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("exact_orth", [True, False])
def test_hard_blocks_subspace_path(monkeypatch, device, exact_orth):
    """The CUDA path (subspace iteration of float32 Grams in float64, forced here on the CPU too) on the same hard blocks: the leading 32
    components as good as the SVD's, with both orthonormalisations (Cholesky QR also on rank-deficient blocks,
    which real spans of >= 32 rows can be)."""
    monkeypatch.setattr(la, "_subspace_path", lambda a, method, want: True)
    for n in (48, 128):
        blocks = _hard_blocks(n, 64, seed=n)
        a = torch.stack(list(blocks.values())).to(device)
        us, sigma, vt = la._decompose(a, "gram", want=32, rows_at_least_want=not exact_orth)
        assert us.shape == (len(blocks), n, 32) and vt.shape == (len(blocks), 32, 64)
        for j, (name, x) in enumerate(blocks.items()):
            _assert_near_optimal(f"{n}/{name}", x, us[j], sigma[j], vt[j], ranks=(1, 4, 8, 16, 32), sigma_rel=SIGMA_F32_GRAM)


def _fail_eigh_but_on_the_host(monkeypatch) -> list[int]:
    """torch.linalg.eigh raises except inside linalg's host fallback (_host_eigh); returns the failure count."""
    real_eigh, real_host = torch.linalg.eigh, la._host_eigh
    inside, failed = [False], [0]

    def eigh(c, *args, **kwargs):
        if not inside[0]:
            failed[0] += 1
            raise torch.linalg.LinAlgError("linalg.eigh: (Batch element 0): The algorithm failed to converge (injected)")
        return real_eigh(c, *args, **kwargs)

    def host(c):
        inside[0] = True
        try:
            return real_host(c)
        finally:
            inside[0] = False

    monkeypatch.setattr(torch.linalg, "eigh", eigh)
    monkeypatch.setattr(la, "_host_eigh", host)
    return failed


def _fail_cholesky(real):
    def cholesky_ex(c, *args, **kwargs):
        ch, info = real(c, *args, **kwargs)
        bad = torch.arange(c.shape[0], device=c.device) % 2 == 0  # every other matrix "fails", its factor is garbage
        return torch.where(bad.view(-1, 1, 1), torch.full_like(ch, float("nan")), ch), torch.where(bad, torch.ones_like(info), info)

    return cholesky_ex


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("fault", ["eigh", "cholesky"])
def test_solver_failures_fall_back(monkeypatch, device, fault):
    """An eigensolver that raises (cuSOLVER's Jacobi on a hard batch) or a Cholesky that reports failure for some
    matrices: the factors are still right (host LAPACK / Householder QR take over), no exception."""
    failed = [1]
    if fault == "eigh":
        failed = _fail_eigh_but_on_the_host(monkeypatch)
    else:
        monkeypatch.setattr(torch.linalg, "cholesky_ex", _fail_cholesky(torch.linalg.cholesky_ex))
    monkeypatch.setattr(la, "_subspace_path", lambda a, method, want: True)
    blocks = _hard_blocks(64, 128, seed=11)
    a = torch.stack(list(blocks.values())).to(device)
    for exact_orth in (True, False):
        us, sigma, vt = la._decompose(a, "gram", want=32, rows_at_least_want=not exact_orth)
        for j, (name, x) in enumerate(blocks.items()):
            _assert_near_optimal(f"{fault}/{name}", x, us[j], sigma[j], vt[j], ranks=(1, 8, 32), sigma_rel=SIGMA_F32_GRAM)
    assert failed[0] > 0  # the fault was met


def test_host_eigh_last_resort_is_an_orthonormal_basis(monkeypatch):
    """Even if LAPACK raised too, the answer is an orthonormal basis (the matrix's own axes), not an exception."""
    real = torch.linalg.eigh

    def never(c, *args, **kwargs):
        raise torch.linalg.LinAlgError("injected")

    monkeypatch.setattr(torch.linalg, "eigh", never)
    c = torch.diag(torch.tensor([3.0, 1.0, 2.0])).expand(2, 3, 3)
    w, v = la._eigh(c)
    assert torch.equal(w, torch.tensor([[1.0, 2.0, 3.0]] * 2))
    assert torch.allclose(v @ torch.diag_embed(w) @ v.transpose(1, 2), c)
    monkeypatch.setattr(torch.linalg, "eigh", real)


@pytest.mark.parametrize("device", DEVICES)
def test_non_finite_blocks_give_finite_factors(device, monkeypatch):
    """NaN / inf entries (a broken activation) never raise: the factors are finite, the finite blocks beside them exact."""
    g = torch.Generator().manual_seed(2)
    good = (torch.randn(48, 4, generator=g) @ torch.randn(4, 64, generator=g))
    bad = good.clone()
    bad[3, 5], bad[7, 1], bad[9, 9] = float("nan"), float("inf"), float("-inf")
    a = torch.stack([good, bad]).to(device)
    for forced in (False, True):
        if forced:
            monkeypatch.setattr(la, "_subspace_path", lambda a, method, want: True)
        for method in ("gram", "svd"):
            us, sigma, vt = la._decompose(a, method, want=32)
            assert all(bool(torch.isfinite(t).all()) for t in (us, sigma, vt))
            _assert_near_optimal("good", good, us[0], sigma[0], vt[0], ranks=(4, 32), sigma_rel=SIGMA_F32_GRAM)


@pytest.mark.parametrize("device", DEVICES)
def test_factorize_layer_of_hard_spans(device):
    """A whole layer through factorize() (on CUDA: the subspace path) whose spans are the hard blocks, short spans
    among them: every span reconstructs to float32 accuracy relative to its own norm."""
    hkv, d = 2, 64
    spans = []
    for seed, n in enumerate((40, 5, 64, 17, 33)):
        for name, x in _hard_blocks(n, d, seed=seed).items():
            if name != "full_rank_equal_sigma":  # rank <= 16: rank_max 32 keeps all of it
                spans.append(x)
    lens = torch.tensor([s.shape[0] for s in spans])
    x = torch.stack([torch.cat(spans), torch.cat(spans) * -1.0])
    f = fz.factorize(x.to(device), lens, energy=1.0 - 1e-12, rank_max=32, dtype=torch.float32)
    f = fz.Factors(f.us.cpu(), f.vt.cpu(), f.rank.cpu())
    y = fz.reconstruct_all(f, lens, d)
    first = torch.cumsum(lens, 0) - lens
    for h in range(hkv):
        for i, n in enumerate(lens.tolist()):
            xs, ys = x[h, first[i] : first[i] + n].double(), y[h, first[i] : first[i] + n].double()
            assert torch.isfinite(ys).all()
            assert float((xs - ys).norm()) <= 1e-5 * float(xs.norm()) + 1e-300, (h, i, n)


def test_factorize_many_is_each_matrix_near_optimal_at_its_own_energy():
    """Keys and values of a layer in one batched decomposition (compress does this): each matrix keeps its own
    energy rule, and every span's rank-r reconstruction is within the optimal rank-r error of a float64 SVD of
    that span alone (computed here, span by span) plus float16 storage noise."""
    k = _low_rank(2, LENS, 64, rank=6, seed=1)
    v = torch.randn(2, int(LENS.sum()), 64, generator=torch.Generator().manual_seed(2))
    fk, fv = fz.factorize_many([k, v], LENS, energies=[0.999999, 0.9], keeps=[None, None], rank_max=32)
    first = torch.cumsum(LENS, 0) - LENS
    for x, f, energy in ((k, fk, 0.999999), (v, fv, 0.9)):
        y = fz.reconstruct_all(f, LENS, 64)
        for h in range(2):
            for i, n in enumerate(LENS.tolist()):
                xs = x[h, first[i] : first[i] + n].double()
                sig = torch.linalg.svd(xs).S
                top = sig[:32] ** 2  # the rule's share is of the rank_max leading components' energy
                want = min(int((torch.cumsum(top, 0) / top.sum() < energy).sum()) + 1, 32, n)  # on the reference's spectrum
                r = int(f.rank[h, i])
                assert abs(r - want) <= 1 if energy < 0.99 else r == min(want, 6), (h, i, r, want)
                err = float((xs - y[h, first[i] : first[i] + n].double()).norm())
                opt = float(sig[r:].pow(2).sum().sqrt())
                assert err <= opt * 1.01 + 2e-3 * float(xs.norm()), (h, i, err, opt)


def test_compress_decomposes_layers_in_groups_with_the_same_factors(monkeypatch):
    """compress decomposes several layers' keys and values in one batch; every block is decomposed on its own, so
    the pack is bit for bit the one of one layer at a time."""
    from test_sekv_method import tiny

    from sekv_core import methods, runtime
    from sekv_core.prefill import prefill
    from sekv_core.sekv import compress

    model = tiny("qwen2")
    runtime.install(model)
    res = prefill(model, torch.randint(0, 300, (400,), generator=torch.Generator().manual_seed(3)), with_surprisal=True, chunk=128)
    m = methods.get("sekv")
    p = m.resolve_params({})
    monkeypatch.setattr(compress, "GROUP_ON_CPU", True)  # as on a GPU: the layers together
    together = m.compress(res, p)
    monkeypatch.setattr(compress, "GROUP_ON_CPU", False)  # the CPU's own way: one layer at a time
    alone = m.compress(res, p)
    assert together.keys() == alone.keys() and len(together) > 8
    for k in together:
        assert torch.equal(together[k], alone[k]), k
