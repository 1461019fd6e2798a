"""The untrained router's PCA, every layer's eigenproblems in one batch (router.pca_directions, merge), against
hand-made moments with known eigenvectors and against a per-layer float64 eigh of a real prefill's keys."""

from __future__ import annotations

import math

import pytest
import torch

from sekv_core.sekv import router

from test_sekv_method import _setup


def _known(lead: tuple[int, ...], d: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Second moments [*lead, d, d] with eigenvalues 2^-i (distinct gaps) and random eigenvectors [*lead, d, d]
    (columns, descending)."""
    g = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(*lead, d, d, generator=g, dtype=torch.float64))
    lam = 2.0 ** -torch.arange(d, dtype=torch.float64)
    return q @ torch.diag_embed(lam.expand(*lead, d)) @ q.transpose(-1, -2), q


@pytest.mark.parametrize("d_r,d", [(4, 16), (32, 16)])
def test_directions_span_the_leading_eigenvectors_of_every_layer(d_r, d):
    n = 1000
    moments, q = _known((3, 2), d)
    w = router.pca_directions(moments * n, n, d_r)  # summed over n keys
    assert w.shape == (3, 2, d_r, d) and w.dtype == torch.float32
    r = min(d_r, d)
    assert torch.equal(w[..., r:, :], torch.zeros_like(w[..., r:, :]))  # zero rows past d
    wr = w[..., :r, :].double()
    assert torch.allclose(wr @ wr.transpose(-1, -2), torch.eye(r, dtype=torch.float64).expand(3, 2, r, r), atol=1e-5)
    want = q[..., :, :r] @ q[..., :, :r].transpose(-1, -2)  # the projector on the top-r eigenvectors
    assert torch.allclose(wr.transpose(-1, -2) @ wr, want, atol=1e-5)


def test_scale_is_the_median_projection_norm():
    g = torch.Generator().manual_seed(3)
    d_r, d, s = 4, 16, 7
    w = torch.linalg.qr(torch.randn(2, d, d_r, generator=g))[0].transpose(-1, -2).contiguous()  # [2, d_r, d] orthonormal rows
    ref = torch.randn(2, s, d, generator=g) * 3
    got = router.pca_scaled(w, ref)
    for h in range(2):
        norms = sorted(math.sqrt(sum(float(w[h, i] @ ref[h, j]) ** 2 for i in range(d_r))) for j in range(s))
        c = math.sqrt(d_r / d) * norms[(s - 1) // 2]
        assert torch.allclose(got[h], w[h] * c, rtol=1e-5)


def test_pack_router_w_per_layer_reference():
    """Each layer's W in a pack (merge: all layers' directions in one batch) spans the top-d_r eigenvectors of that
    layer's own keys' second moment (float64 eigh, one layer at a time, here) and has the median scale of its span
    means."""
    *_, res, store, p, _mem, _ = _setup("qwen2", n=300, min_span=8, router="untrained", d_r=4)  # d_r < head_dim 16
    d_r = p.d_r
    for li, k in enumerate(res.keys):
        kd = k.double()
        m = kd.transpose(1, 2) @ kd  # [Hkv, d, d]
        d = m.shape[-1]
        r = min(d_r, d)
        _, vec = torch.linalg.eigh(m)
        top = vec.flip(-1)[..., :r]  # [Hkv, d, r]
        w = store[f"sekv.router.w.{li}"].double()
        dirs = w[:, :r] / w[:, :r].norm(dim=-1, keepdim=True)
        assert torch.allclose(dirs.transpose(-1, -2) @ dirs, top @ top.transpose(-1, -2), atol=2e-3), li
        kbar = store[f"sekv.coarse.k.{li}"].double()
        proj = (kbar @ dirs.transpose(-1, -2)).norm(dim=-1)
        c = math.sqrt(d_r / d) * proj.median(dim=1).values
        assert torch.allclose(w[:, :r].norm(dim=-1), c.view(-1, 1).expand(-1, r), rtol=5e-3), li


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (top_eigh's batched subspace iteration)")
def test_batched_directions_on_cuda_match_one_layer_at_a_time():
    d_r, d, n = 32, 64, 4096
    moments, q = _known((24, 2), d, seed=5)
    m = (moments * n).float().cuda().double()
    batched = router.pca_directions(m, n, d_r).cpu().double()
    for li in range(24):
        one = router.pca_directions(m[li], n, d_r).cpu().double()
        assert torch.allclose(batched[li].transpose(-1, -2) @ batched[li], one.transpose(-1, -2) @ one, atol=1e-4)
