"""sekv factors: exact at full rank, the energy rule, int8, subset gathers; RoPE undo/redo; summaries."""

from __future__ import annotations

import pytest
import torch
import transformers

from sekv_core.methods.base import ModelShape
from sekv_core.sekv import factorize as fz
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
    lam, v = fz.top_eigh(gram, 32, exact_orth=exact_orth)
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
        fz._decompose = lambda t, method, want=None, rows_at_least_want=False: (lambda ad: (lambda ev: ((ad @ ev[1]).float(), ev[0].sqrt().float(), ev[1].transpose(1, 2).float()))(fz.top_eigh(ad.transpose(1, 2) @ ad, want, exact_orth=exact_orth)))(t.double())
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
