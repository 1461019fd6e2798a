"""linalg's unit scaling with fewer passes (one max-abs reduction, the caller's temporary scaled in place, a finite
Gram not searched for non-finite entries, the symmetrisation's halving folded into the scale) gives the previous
expressions' values, bit for bit, and so the same factors."""

from __future__ import annotations

import pytest
import torch

from sekv_core.sekv import factorize as fz
from sekv_core.sekv import linalg as la


def _old_unit_scale(a):
    a = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    s = a.abs().amax(dim=(-2, -1), keepdim=True) if a.numel() else a.new_ones(a.shape[0], 1, 1)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return a.div_(s), s


def _blocks(dtype, bad=True):
    g = torch.Generator().manual_seed(0)
    a = torch.randn(12, 40, 24, generator=g, dtype=dtype) * torch.logspace(-20, 20, 12, dtype=dtype).view(-1, 1, 1)
    a[3] = 0.0  # an all-zero block
    if bad:
        a[5, 1, 2], a[6, 0, 0], a[7, 3, 3] = float("nan"), float("inf"), -float("inf")
    return a


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("own", [False, True])
def test_unit_scale_is_the_previous_values(dtype, own):
    a = _blocks(dtype)
    ref, rs = _old_unit_scale(a.clone())
    keep = a.clone()
    got, gs = la._unit_scale(a, own=own)
    assert torch.equal(got, ref) and torch.equal(gs, rs)
    assert own or torch.equal(a.nan_to_num(), keep.nan_to_num())  # not the caller's tensor unless it says so
    fin = _blocks(dtype, bad=False)
    got, gs = la._unit_scale(fin.clone(), own=own, finite=True)
    ref, rs = _old_unit_scale(fin.clone())
    assert torch.equal(got, ref) and torch.equal(gs, rs)


def test_symmetrised_gram_scaled_as_before():
    """0.5 (g + g^T) scaled to max-abs 1 (the previous top_eigh's first step) equals g + g^T scaled by its own
    max-abs, with half that scale: the values top_eigh iterates on and the scale its eigenvalues are multiplied by."""
    x = _blocks(torch.float32, bad=False).double()
    g = x.transpose(1, 2) @ x
    g = g + 1e-3 * torch.randn(g.shape, dtype=g.dtype, generator=torch.Generator().manual_seed(1))  # not exactly symmetric
    ref, rs = _old_unit_scale(0.5 * (g + g.transpose(1, 2)))
    got, gs = la._unit_scale(g + g.transpose(1, 2), own=True, finite=True)
    assert torch.equal(got, ref) and torch.equal(gs * 0.5, rs)


def _old_top_eigh(g, k, iters=4, exact_orth=True, finite=False):
    """linalg.top_eigh as it was before the scaling's passes were cut (verbatim but for the names)."""
    b, d, _ = g.shape
    g, s = _old_unit_scale(0.5 * (g + g.transpose(1, 2)))
    gen = torch.Generator(device=g.device).manual_seed(0)
    x = g @ torch.randn(d, k, generator=gen, device=g.device, dtype=torch.float64).to(g.dtype)
    for _ in range(iters):
        x = g @ la._cholqr(x)
    if exact_orth:
        x = la._orthonormalize(la._orthonormalize(x))
    else:
        y = la._cholqr(la._cholqr(x))
        eye = torch.eye(k, dtype=y.dtype, device=y.device)
        off = (y.transpose(1, 2) @ y - eye).abs().amax(dim=(1, 2))
        bad = ~(off <= (1e-10 if y.dtype == torch.float64 else 1e-4))
        if bool(bad.any()):
            idx = torch.nonzero(bad).flatten()
            y[idx] = la._orthonormalize(la._orthonormalize(x[idx]))
        x = y
    lam, z = la._eigh(x.transpose(1, 2) @ g @ x)
    return (lam.flip(-1).clamp_min(0) * s.view(-1, 1)), (x @ z).flip(-1)


@pytest.mark.parametrize("rows", [60, 20])  # spans of at least the rank (Cholesky QR), and shorter (exact orthonormalisation)
def test_subspace_factors_are_the_previous_ones(monkeypatch, rows):
    """The CUDA path's factorisation (subspace iteration, taken on the CPU here) and the previous code's: the same
    factors, bit for bit."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, rows * 7, 64, generator=g) * torch.linspace(0.1, 5, 64)
    x[1, :rows] = 0.0  # an all-zero block
    x[2, 3, 5] = float("nan")  # a broken activation
    n = torch.full((7,), rows)
    monkeypatch.setattr(la, "SUBSPACE_ON_CPU", True)
    lam_new = la.top_eigh(x[:, :64].transpose(1, 2) @ x[:, :64].nan_to_num(), 8)
    new = fz.factorize_many([x, 2 * x], n, energies=[0.99, 0.9], keeps=[None, None], rank_max=32, int8=True)
    monkeypatch.setattr(la, "_unit_scale", lambda a, own=False, finite=False: _old_unit_scale(a))
    monkeypatch.setattr(la, "top_eigh", _old_top_eigh)
    old = fz.factorize_many([x, 2 * x], n, energies=[0.99, 0.9], keeps=[None, None], rank_max=32, int8=True)
    lam_old = la.top_eigh(x[:, :64].transpose(1, 2) @ x[:, :64].nan_to_num(), 8)
    assert all(torch.equal(a, b) for a, b in zip(lam_new, lam_old))
    for f_new, f_old in zip(new, old):
        for k in ("us", "vt", "rank", "us_scale", "vt_scale"):
            assert torch.equal(getattr(f_new, k), getattr(f_old, k)), k
