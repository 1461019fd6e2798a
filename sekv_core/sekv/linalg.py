"""Batched decompositions of many small matrices that cannot fail (the numerics under :mod:`factorize`).

Real keys and values give blocks that are all zero (padding), rank-deficient (a span shorter than the rank),
have repeated singular values, or norms far from 1 (outlier dimensions); float32 Grams of such blocks
overflow, underflow or are too ill-conditioned for Cholesky, and cuSOLVER's batched Jacobi eigensolver then
raises for the whole batch ("failed to converge ... ill-conditioned or has too many repeated eigenvalues").
So every block is first scaled to unit max-abs (its own scale, restored at the end), every Cholesky reports
failure per matrix (cholesky_ex) and the failing matrices take Householder QR, every eigensolver call that
raises is answered by LAPACK's float64 solver on the host, and any block whose factors still come out
non-finite is redone by a float64 SVD on the host.  Each is one fallback, taken only where needed.
"""

from __future__ import annotations

import torch

#: largest eigenproblem cuSOLVER solves as one batched call (Jacobi); larger ones loop over the batch
BATCHED_EIG_MAX = 32

#: take CUDA's subspace path on the CPU too (studies and tests of what CUDA computes: benchmarks/studies/subspace_keys.py)
SUBSPACE_ON_CPU = False
#: subspace iterations of that path: real span keys and values of qwen2.5-0.5b get the exact path's energy-rule ranks
#: and errors within 0.2 % (keys) and 0.5 % (values) at 6, 1.5 % (values) at 3 (benchmarks/studies/subspace_keys.py)
SUBSPACE_ITERS = 6
#: Cholesky QR's diagonal shift in float32, relative to the block Gram's trace (float64: 1e-12).  It outweighs
#: directions below ~1e-3 of the largest (their Gram entries are squares): a float32 subspace iteration loses them
CHOLQR_SHIFT_F32 = 1e-6


def _unit_scale(a: torch.Tensor, own: bool = False, finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """a [B, m, n] -> (a / s, s [B, 1, 1]): every matrix scaled to max-abs 1 (all-zero ones by 1).

    Non-finite entries (a broken activation) count as 0, so every later step sees finite numbers.  ``own``: a is
    the caller's temporary, scaled in place (no copy of it); ``finite``: a is known finite (a Gram of unit-scaled
    blocks), nothing to clear.  The max-abs is one reduction (no |a| made): the same values."""
    if not finite:
        a = a.nan_to_num_(nan=0.0, posinf=0.0, neginf=0.0) if own else torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)
    elif not own:
        a = a.clone()
    s = _max_abs(a) if a.numel() else a.new_ones(a.shape[0], 1, 1)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return a.div_(s), s


def _max_abs(a: torch.Tensor) -> torch.Tensor:
    """max |a| of every matrix of a [B, m, n]: [B, 1, 1] (a.abs().amax(...) without the |a| tensor: the same values)."""
    return torch.linalg.vector_norm(a, float("inf"), dim=(-2, -1), keepdim=True)


def _host_eigh(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """LAPACK float64 eigendecomposition of c [B, m, m] (symmetric, finite) on the host, each matrix scaled to
    unit max-abs; if even that raises, each matrix's own axes (its diagonal as eigenvalues, ascending): an
    orthonormal basis that spans everything, only not ordered by energy."""
    cd = c.detach().to("cpu", torch.float64)
    s = cd.abs().amax(dim=(-2, -1), keepdim=True).clamp_min(torch.finfo(torch.float64).tiny)
    try:
        w, v = torch.linalg.eigh(cd / s)
        w = w * s.squeeze(-1)
    except torch.linalg.LinAlgError:
        w, order = torch.sort(cd.diagonal(dim1=-2, dim2=-1), dim=-1)
        v = torch.eye(cd.shape[-1], dtype=torch.float64).expand_as(cd).gather(-1, order.unsqueeze(-2).expand_as(cd)).contiguous()
    return w.to(c.device, c.dtype), v.to(c.device, c.dtype)


def _eigh(c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """torch.linalg.eigh (ascending) of symmetric c [B, m, m] that does not raise: symmetrised and made finite
    first; where the solver still reports a failure (cuSOLVER's batched Jacobi on a hard matrix), the whole
    batch is solved again by :func:`_host_eigh`."""
    c = torch.nan_to_num(0.5 * (c + c.transpose(-2, -1)))
    try:
        return torch.linalg.eigh(c)
    except torch.linalg.LinAlgError:
        return _host_eigh(c)


def _householder_q(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal Q [B, d, k] of x [B, d, k] by Householder QR (any x, rank-deficient too: never fails)."""
    return torch.linalg.qr(x, mode="reduced").Q


def _host_svd(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [B, n, d] -> (U*sigma, sigma, Vt) with k = min(n, d) components, float64 on the host (the reference
    path for blocks whose fast factors failed); LAPACK's SVD, else the eigendecomposition of the Gram."""
    ad, s = _unit_scale(a.detach().to("cpu", torch.float64))
    try:
        u, sig, vt = torch.linalg.svd(ad, full_matrices=False)
        us = u * sig.unsqueeze(-2)
    except torch.linalg.LinAlgError:
        k = min(ad.shape[-2], ad.shape[-1])
        w, v = _host_eigh(ad.transpose(-2, -1) @ ad)
        v = v.flip(-1)[..., :k]
        sig, us, vt = w.flip(-1)[..., :k].clamp_min(0).sqrt(), ad @ v, v.transpose(-2, -1)
    dev, dt = a.device, a.dtype
    return (us * s).to(dev, dt), (sig * s.view(-1, 1)).to(dev, dt), vt.to(dev, dt)


def _finite_rows(*ts: torch.Tensor) -> torch.Tensor:
    """[B] bool: every tensor's batch element b is finite."""
    ok = torch.ones(ts[0].shape[0], dtype=torch.bool, device=ts[0].device)
    for t in ts:
        ok &= torch.isfinite(t.reshape(t.shape[0], -1)).all(-1)
    return ok


def _orthonormalize(x: torch.Tensor) -> torch.Tensor:
    """Orthonormal basis of the columns of x [B, d, k] (k <= 32): eigen-decomposition of the k x k Gram.

    Directions with a negligible Gram eigenvalue (x rank-deficient: a span shorter than k rows) become zero
    columns instead of noise.
    """
    c = x.transpose(1, 2) @ x
    lam, w = _eigh(c)
    tiny = torch.finfo(x.dtype).tiny
    tol = lam[..., -1:].clamp_min(tiny) * (1e-12 if x.dtype == torch.float64 else 1e-6)
    inv = torch.where(lam > tol, lam.clamp_min(tiny).rsqrt(), torch.zeros_like(lam))
    return x @ (w * inv.unsqueeze(-2))


def _cholqr(x: torch.Tensor) -> torch.Tensor:
    """x [B, d, k] times the inverse Cholesky factor of its (slightly shifted) k x k Gram: one Cholesky QR step.

    Orthonormal up to cond(x)^2 * eps; a batched k x k Cholesky and triangular solve, far cheaper than the k x k
    eigensolver of :func:`_orthonormalize`.  The shift keeps a rank-deficient x finite (its extra columns stay small).
    Matrices whose Cholesky fails (info > 0: too ill-conditioned for the dtype) or whose result is not finite take
    Householder QR instead.
    """
    k = x.shape[-1]
    c = x.transpose(1, 2) @ x
    shift = 1e-12 if x.dtype == torch.float64 else CHOLQR_SHIFT_F32
    eye = torch.eye(k, dtype=x.dtype, device=x.device)
    c = c + eye * (c.diagonal(dim1=1, dim2=2).sum(-1, keepdim=True).unsqueeze(-1) * shift + torch.finfo(x.dtype).tiny)
    ch, info = torch.linalg.cholesky_ex(c)
    # x L^-T through the k x k inverse: a batched triangular solve with k right-hand sides, then one bmm, is cheaper
    # on a GPU than the solve with d right-hand sides
    inv = torch.linalg.solve_triangular(ch, eye.expand_as(ch), upper=False)
    q = x @ inv.transpose(1, 2)
    bad = (info != 0) | ~_finite_rows(q)
    if bool(bad.any()):  # one host sync per step: a fallback, not a retry
        idx = torch.nonzero(bad).flatten()
        q[idx] = _householder_q(torch.nan_to_num(x[idx]))
    return q


def top_eigh(g: torch.Tensor, k: int, iters: int = 4, exact_orth: bool = True, finite: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Leading k eigenpairs of batched symmetric PSD matrices g [B, d, d]: (values [B, k] descending,
    vectors [B, d, k]).  Subspace iteration from a fixed random start, then Rayleigh-Ritz: only k x k
    eigenproblems (k <= 32), which cuSOLVER batches, where a d x d eigh (d = 128) would loop over the batch.
    Converges to the exact leading subspace at the rate (lambda_{k+1} / lambda_j)^iters per component.

    exact_orth: the block is orthonormalised before Rayleigh-Ritz by two eigen-decompositions of its Gram, which
    turn the directions of a rank-deficient block (fewer than k independent rows) into zero columns.  False:
    by two Cholesky QR steps instead (CholQR2; one k x k eigensolver per call instead of three), for blocks
    known to have k independent directions (spans of at least k rows).

    Each matrix is scaled to unit max-abs first (its eigenvalues are scaled back), and every step falls back
    per matrix where it fails (module comment above): any finite or non-finite input gives finite output.
    ``finite``: g is known finite (a Gram of finite blocks), its non-finite entries are not looked for.
    """
    b, d, _ = g.shape
    # 0.5 (g + g^T) scaled to max-abs 1: the halving folded into the scale (a power of two: the same quotients), the
    # sum scaled in place; a Gram of finite blocks (``finite``) has nothing to clear
    g2, s = _unit_scale(g + g.transpose(1, 2), own=True, finite=finite)
    g, s = g2, s * 0.5
    gen = torch.Generator(device=g.device).manual_seed(0)
    x = g @ torch.randn(d, k, generator=gen, device=g.device, dtype=torch.float64).to(g.dtype)
    for _ in range(iters):
        # Cholesky QR keeps the block well conditioned between products; the exact orthonormalisation is below
        x = g @ _cholqr(x)
    if exact_orth:
        x = _orthonormalize(_orthonormalize(x))  # twice: orthonormal to ~1e-15, not ~cond * 1e-16
    else:
        y = _cholqr(_cholqr(x))
        # a block with fewer than k directions after all (rows are not rank): CholQR2 leaves its extra columns
        # small instead of orthonormal, so those matrices take the exact orthonormalisation
        eye = torch.eye(k, dtype=y.dtype, device=y.device)
        off = (y.transpose(1, 2) @ y - eye).abs().amax(dim=(1, 2))
        bad = ~(off <= (1e-10 if y.dtype == torch.float64 else 1e-4))
        if bool(bad.any()):
            idx = torch.nonzero(bad).flatten()
            y[idx] = _orthonormalize(_orthonormalize(x[idx]))
        x = y
    lam, z = _eigh(x.transpose(1, 2) @ g @ x)  # ascending
    return (lam.flip(-1).clamp_min(0) * s.view(-1, 1)), (x @ z).flip(-1)


def _subspace_path(a: torch.Tensor, method: str, want: int | None) -> bool:
    """Whether :func:`_decompose` takes the leading components by subspace iteration (:func:`top_eigh`): on CUDA,
    when fewer than min(n, d) are wanted and d exceeds what cuSOLVER's batched eigensolver takes."""
    n, d = a.shape[1], a.shape[2]
    return method == "gram" and (a.is_cuda or SUBSPACE_ON_CPU) and want is not None and want < min(n, d) and d > BATCHED_EIG_MAX and want <= BATCHED_EIG_MAX


def _decompose(a: torch.Tensor, method: str, want: int | None = None, rows_at_least_want: bool = False, own: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [B, n, d] -> (U*sigma [B, n, k], sigma [B, k], Vt [B, k, d]), sigma descending, k = min(n, d).

    On CUDA, when only ``want`` < min(n, d) components are needed and d exceeds what cuSOLVER's batched
    eigensolver takes, the leading ones come from :func:`top_eigh` (k = want); ``rows_at_least_want`` (every
    matrix of the batch has at least ``want`` real, unpadded rows) lets it orthonormalise by Cholesky QR.
    Every block is factorised at unit scale (max-abs 1) and scaled back; blocks whose factors come out non-finite
    are redone by the float64 SVD on the host (:func:`_host_svd`).  ``own``: a is the caller's temporary, scaled in
    place (it is the unit-scaled blocks afterwards).
    """
    if method not in ("gram", "svd"):
        raise ValueError(f"unknown factorisation method {method!r}")
    an, s = _unit_scale(a, own=own)
    if _subspace_path(a, method, want):
        # the Gram's product in float32, the iteration in float64: real pre-RoPE keys have lambda_1 / lambda_32 ~ 3,400,
        # so the iterated block's Gram spans ~1e7, and float32's Cholesky QR shift (CHOLQR_SHIFT_F32) damped the
        # trailing components: the energy rule stopped at rank 13.7 for 16.9 (docs/long-documents.md)
        af = an.float()
        evals, v = top_eigh((af.transpose(1, 2) @ af).double(), want, iters=SUBSPACE_ITERS, exact_orth=not rows_at_least_want, finite=True)
        v = v.float()
        us, sigma, vt = (af @ v).to(a.dtype), evals.sqrt().to(a.dtype), v.transpose(1, 2).to(a.dtype)
    elif method == "svd":
        try:
            u, sigma, vt = torch.linalg.svd(an, full_matrices=False)
            us = u * sigma.unsqueeze(-2)
        except torch.linalg.LinAlgError:
            us, sigma, vt = _host_svd(an)
    else:
        # float64 Gram + eigh: squaring the condition number in float32 cost 1e-4 relative logit error at full rank
        # on pre-RoPE keys (outlier dimensions); float64 is back at float32 SVD accuracy and still 1.5x faster
        ad = an.double()
        evals, evecs = _eigh(ad.transpose(1, 2) @ ad)  # ascending
        evals, evecs = evals.flip(-1), evecs.flip(-1)
        k = min(a.shape[1], a.shape[2])
        v = evecs[..., :k]  # [B, d, k]
        us, sigma, vt = (ad @ v).to(a.dtype), evals[..., :k].clamp_min(0).sqrt().to(a.dtype), v.transpose(1, 2).to(a.dtype)
    bad = ~_finite_rows(us, sigma, vt)
    if bool(bad.any()):
        idx = torch.nonzero(bad).flatten()
        k = us.shape[-1]
        rus, rsig, rvt = _host_svd(an[idx])
        us[idx], sigma[idx], vt[idx] = rus[..., :k], rsig[..., :k], rvt[..., :k, :]
    return us * s, sigma * s.view(-1, 1), vt
