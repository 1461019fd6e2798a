"""Per-span truncated SVD of keys and values (SPEC §1.5), batched, in a ragged packed layout.

For every (KV head g, span i) the span's matrix X (n_i x d) is factorised as
X ~= (U * sigma)[:, :r] @ Vt[:r], keeping the smallest rank r whose retained
energy sum_{j<r} sigma_j^2 / sum sigma^2 reaches ``energy`` (the untrained rank
rule; r <= rank_max).  Spans are bucketed by length and zero-padded to the
bucket length (zero rows change neither sigma nor Vt), so one batched
decomposition runs per bucket: no Python loop per span or head.

Packed layout (one per layer and K/V), all 1-D so that any set of spans can be
gathered with one index_select:

* ``us``  -- the n_i x r_gi blocks of U*sigma, row-major, concatenated in
  (g, i) order; int8 (per-row absmax, ``us_scale`` one scale per token row:
  [Hkv * T]) or ``dtype`` (float16 by default);
* ``vt``  -- the r_gi x d blocks of Vt, concatenated likewise; int8 with one
  scale per row (``vt_scale`` [sum r]) or ``dtype``;
* ``rank`` -- [Hkv, S] int16.  Offsets are cumulative sums of n_i * r_gi and
  r_gi * d, recomputed at load time (:func:`offsets`).

``method="gram"`` (default) takes the eigendecomposition of X^T X (d x d) and
U*sigma = X @ V (float64): it is 1.5x faster than ``torch.linalg.svd`` on CPU and,
since the reconstruction is the projection X V_r V_r^T, exact at full rank up
to the orthogonality of V.  ``method="svd"`` is kept for comparison
(benchmarks/rope_factors.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

INT8_MAX = 127.0


@dataclass
class Factors:
    """One layer's factors of one matrix kind (K or V), packed."""

    us: torch.Tensor  # [sum_gi n_i * r_gi] int8 | float16
    vt: torch.Tensor  # [sum_gi r_gi * d] int8 | float16
    rank: torch.Tensor  # [Hkv, S] int16
    us_scale: torch.Tensor | None = None  # [Hkv * T] float16 (per token row)
    vt_scale: torch.Tensor | None = None  # [sum_gi r_gi] float16 (per component row)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.us": self.us, f"{prefix}.vt": self.vt, f"{prefix}.rank": self.rank}
        if self.us_scale is not None:
            out[f"{prefix}.us_scale"] = self.us_scale
            out[f"{prefix}.vt_scale"] = self.vt_scale
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors("").values())


def _bucket_len(n: torch.Tensor) -> torch.Tensor:
    """Bucket length of each span: n rounded up to a multiple of 16 (few buckets, little padding)."""
    return (n + 15) // 16 * 16


def choose_rank(sigma: torch.Tensor, energy: float, rank_max: int) -> torch.Tensor:
    """Smallest r with sum_{j<r} sigma_j^2 >= energy * sum sigma^2, capped at rank_max ([B] int64)."""
    e = sigma.double() ** 2
    total = e.sum(-1, keepdim=True)
    k = sigma.shape[-1]
    if energy >= 1.0:
        r = (e > 0).sum(-1) if k else torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
    else:
        frac = torch.cumsum(e, -1) / total.clamp_min(1e-300)
        r = (frac < energy).sum(-1) + 1
        r = torch.where(total.squeeze(-1) > 0, r, torch.zeros_like(r))
    return r.clamp(max=min(rank_max, k)).long()


@contextlib.contextmanager
def single_thread():
    """Batched LAPACK on many small matrices: one thread is several times faster than two on our CPU
    (and ~10x faster when the cores are shared); the thread count is restored afterwards."""
    old = torch.get_num_threads()
    if old != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if old != 1:
            torch.set_num_threads(old)


#: largest eigenproblem cuSOLVER solves as one batched call (Jacobi); larger ones loop over the batch
BATCHED_EIG_MAX = 32


# ---------------------------------------------------------------------------------------------
# decompositions that cannot fail
#
# Real keys and values give blocks that are all zero (padding), rank-deficient (a span shorter than the rank),
# have repeated singular values, or norms far from 1 (outlier dimensions); float32 Grams of such blocks
# overflow, underflow or are too ill-conditioned for Cholesky, and cuSOLVER's batched Jacobi eigensolver then
# raises for the whole batch ("failed to converge ... ill-conditioned or has too many repeated eigenvalues").
# So every block is first scaled to unit max-abs (its own scale, restored at the end), every Cholesky reports
# failure per matrix (cholesky_ex) and the failing matrices take Householder QR, every eigensolver call that
# raises is answered by LAPACK's float64 solver on the host, and any block whose factors still come out
# non-finite is redone by a float64 SVD on the host.  Each is one fallback, taken only where needed.


def _unit_scale(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """a [B, m, n] -> (a / s, s [B, 1, 1]): every matrix scaled to max-abs 1 (all-zero ones by 1).

    Non-finite entries (a broken activation) count as 0, so every later step sees finite numbers."""
    a = torch.nan_to_num(a, nan=0.0, posinf=0.0, neginf=0.0)  # a new tensor: scaled in place below (one copy of a)
    s = a.abs().amax(dim=(-2, -1), keepdim=True) if a.numel() else a.new_ones(a.shape[0], 1, 1)
    s = torch.where(s > 0, s, torch.ones_like(s))
    return a.div_(s), s


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
    shift = 1e-12 if x.dtype == torch.float64 else 1e-6
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


def top_eigh(g: torch.Tensor, k: int, iters: int = 4, exact_orth: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
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
    """
    b, d, _ = g.shape
    g, s = _unit_scale(0.5 * (g + g.transpose(1, 2)))
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
    return method == "gram" and a.is_cuda and want is not None and want < min(n, d) and d > BATCHED_EIG_MAX and want <= BATCHED_EIG_MAX


def _decompose(a: torch.Tensor, method: str, want: int | None = None, rows_at_least_want: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """a [B, n, d] -> (U*sigma [B, n, k], sigma [B, k], Vt [B, k, d]), sigma descending, k = min(n, d).

    On CUDA, when only ``want`` < min(n, d) components are needed and d exceeds what cuSOLVER's batched
    eigensolver takes, the leading ones come from :func:`top_eigh` (k = want); ``rows_at_least_want`` (every
    matrix of the batch has at least ``want`` real, unpadded rows) lets it orthonormalise by Cholesky QR.
    Every block is factorised at unit scale (max-abs 1) and scaled back; blocks whose factors come out non-finite
    are redone by the float64 SVD on the host (:func:`_host_svd`).
    """
    if method not in ("gram", "svd"):
        raise ValueError(f"unknown factorisation method {method!r}")
    an, s = _unit_scale(a)
    if _subspace_path(a, method, want):
        # float32 and 3 iterations: 99.5% of the optimal rank-32 energy on average on key-like spectra with an
        # outlier dimension, as float64 gives (docs/gpu.md); the exact float64 path stays for full rank and the CPU
        af = an.float()
        evals, v = top_eigh(af.transpose(1, 2) @ af, want, iters=3, exact_orth=not rows_at_least_want)
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


def offsets(rank: torch.Tensor, span_len: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(us_off, vt_off, row_off) [Hkv, S] int64: where block (g, i) starts in us / vt, and its first token row."""
    r = rank.long()
    n = span_len.view(1, -1).long().expand_as(r)
    us_sz, vt_sz = (n * r).flatten(), (r * d).flatten()
    us_off = (torch.cumsum(us_sz, 0) - us_sz).view_as(r)
    vt_off = (torch.cumsum(vt_sz, 0) - vt_sz).view_as(r)
    rows = n.flatten()
    row_off = (torch.cumsum(rows, 0) - rows).view_as(r)
    return us_off, vt_off, row_off


def decompose_spans(x: torch.Tensor, span_len: torch.Tensor, rank_max: int = 32, method: str = "gram") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every span's leading singular triplets, zero-padded.

    x [Hkv, T, d] (span order) -> U*sigma [Hkv, S, n_max, R], sigma [Hkv, S, R], Vt [Hkv, S, R, d]
    (float32, R = min(rank_max, d, n_max); components past a span's own min(n_i, d) are zero).
    One batched decomposition per length bucket: no loop per span or head.
    """
    hkv, t, d = x.shape
    n_host = span_len.long().cpu()  # sizes and buckets are decided on the host: no device sync for them
    n = n_host.to(x.device)
    s = n.numel()
    x = x.float()
    first = torch.cumsum(n, 0) - n
    n_max = int(n_host.max()) if s else 0
    n_min = int(n_host.min()) if s else 0
    r_cap = max(0, min(rank_max, d, n_max))
    us_pad = x.new_zeros(hkv, s, n_max, r_cap)
    sig_pad = x.new_zeros(hkv, s, r_cap)
    vt_pad = x.new_zeros(hkv, s, r_cap, d)
    bl = _bucket_len(n_host)
    if x.is_cuda:  # one batched call per stage beats a few smaller ones on a GPU (launches, not FLOPs, dominate)
        bl = torch.full_like(bl, int(bl.max()) if s else 0)
    xz = torch.cat([x, x.new_zeros(hkv, 1, d)], dim=1)  # row t is the zero row used for padding
    for nb in torch.unique(bl).tolist():  # a handful of buckets, not spans
        ids = torch.nonzero(bl == nb).flatten().to(x.device)
        j = torch.arange(nb, device=x.device)
        valid = j.view(1, -1) < n[ids].view(-1, 1)
        src = torch.where(valid, first[ids].view(-1, 1) + j.view(1, -1), torch.full_like(valid, t, dtype=torch.long))
        a = xz[:, src]  # [hkv, Sb, nb, d]
        with single_thread():
            us, sigma, vt = _decompose(a.reshape(-1, nb, d), method, want=r_cap, rows_at_least_want=n_min >= r_cap)
        k = min(r_cap, us.shape[-1])
        m = min(nb, n_max)
        us_pad[:, ids, :m, :k] = us.reshape(hkv, -1, nb, us.shape[-1])[:, :, :m, :k]
        sig_pad[:, ids, :k] = sigma.reshape(hkv, -1, sigma.shape[-1])[:, :, :k]
        vt_pad[:, ids, :k] = vt.reshape(hkv, -1, vt.shape[-2], d)[:, :, :k]
    # a span of n_i rows has at most n_i nonzero components: clear numerical noise past that
    live = torch.arange(r_cap, device=x.device).view(1, 1, -1) < n.view(1, -1, 1)
    return us_pad * live.unsqueeze(2), sig_pad * live, vt_pad * live.unsqueeze(-1)


def factorize(
    x: torch.Tensor,
    span_len: torch.Tensor,
    *,
    energy: float,
    rank_max: int = 32,
    int8: bool = False,
    dtype: torch.dtype = torch.float16,
    method: str = "gram",
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Factors:
    """x [Hkv, T, d]: the compressed tokens of one layer in span order (span i has span_len[i] rows).

    Rank rule: the energy rule (:func:`choose_rank`), further narrowed, where given, by
    ``keep(sigma [Hkv, S, R]) -> bool [Hkv, S, R]``, a per-component decision (the trained rank gate,
    sekv/rank_gate.py); kept components need not be a prefix: they are moved to the front before packing.
    """
    n = span_len.long().to(x.device)
    us_pad, sig_pad, vt_pad = decompose_spans(x, span_len, rank_max, method)
    hkv, s, _, r_cap = us_pad.shape
    rank = torch.minimum(choose_rank(sig_pad.reshape(hkv * s, r_cap), energy, rank_max).view(hkv, s), n.view(1, -1))
    if keep is not None:  # the gate may only drop components the energy rule keeps (the rule bounds the pack size)
        within = torch.arange(r_cap, device=sig_pad.device).view(1, 1, -1) < rank.to(sig_pad.device).unsqueeze(-1)
        mask = keep(sig_pad) & (sig_pad > 0) & within
        order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # kept components first, in order
        us_pad = us_pad.gather(3, order.unsqueeze(2).expand_as(us_pad))
        vt_pad = vt_pad.gather(2, order.unsqueeze(-1).expand_as(vt_pad))
        rank = mask.sum(-1)
    return pack(us_pad, vt_pad, rank, n, int8=int8, dtype=dtype)


def pack(us_pad: torch.Tensor, vt_pad: torch.Tensor, rank: torch.Tensor, n: torch.Tensor, *, int8: bool, dtype: torch.dtype) -> Factors:
    """Padded factors (leading ``rank`` components valid) -> the ragged packed layout."""
    hkv, s, n_max, r_cap = us_pad.shape
    d = vt_pad.shape[-1]
    dev = us_pad.device
    if s == 0 or n_max == 0 or r_cap == 0:  # no spans (a very short document): empty factors, zero ranks
        empty = lambda dt: torch.zeros(0, dtype=dt, device=dev)  # noqa: E731
        rank16 = torch.zeros(hkv, s, dtype=torch.int16, device=dev)
        if not int8:
            return Factors(empty(dtype), empty(dtype), rank16)
        return Factors(empty(torch.int8), empty(torch.int8), rank16, torch.zeros(int(n.sum()) * hkv, dtype=torch.float16, device=dev), empty(torch.float16))
    # the packed layout walks (g, i, row, col) in row-major order over the valid rows and columns; its index is built
    # from the block sizes, which cost one device -> host copy of the ranks (boolean selection would sync per tensor)
    n = n.to(dev).long()
    rank = rank.to(dev).long()
    rank_host = rank.cpu()
    n_host = n.cpu()
    t = int(n_host.sum())
    sid = torch.repeat_interleave(torch.arange(s, device=dev), n, output_size=t)  # token row -> span
    j = torch.arange(t, device=dev) - torch.repeat_interleave(_excl_cumsum(n), n, output_size=t)  # row in its span
    g = torch.arange(hkv, device=dev).view(-1, 1)
    row_lens = rank[:, sid]  # [Hkv, T]: each valid row keeps its block's rank columns
    row_starts = ((g * s + sid) * n_max + j) * r_cap
    us_idx = _ragged(row_starts.flatten(), row_lens.flatten(), int((rank_host * n_host.view(1, -1)).sum()))
    gi = torch.arange(hkv * s, device=dev)
    comp = _ragged(gi * r_cap, rank.flatten(), int(rank_host.sum()))  # flat (g, i, c) of the kept components
    vt_idx = (comp.view(-1, 1) * d + torch.arange(d, device=dev)).flatten()
    rank16 = rank.to(torch.int16)
    if not int8:
        return Factors(us_pad.flatten()[us_idx].to(dtype), vt_pad.flatten()[vt_idx].to(dtype), rank16)
    cols_ok = torch.arange(r_cap, device=dev).view(1, 1, -1) < rank.unsqueeze(-1)  # [Hkv, S, r_cap]
    us_scale = (torch.where(cols_ok.unsqueeze(2), us_pad.abs(), 0.0).amax(-1) / INT8_MAX).clamp_min(1e-8).to(torch.float16)  # [Hkv, S, n_max]
    us_q = torch.round(us_pad / us_scale.float().unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    vt_scale = (vt_pad.abs().amax(-1) / INT8_MAX).clamp_min(1e-8).to(torch.float16)  # [Hkv, S, r_cap]
    vt_q = torch.round(vt_pad / vt_scale.float().unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Factors(us_q.flatten()[us_idx], vt_q.flatten()[vt_idx], rank16, us_scale[:, sid, j].flatten(), vt_scale.flatten()[comp])


def _ragged(starts: torch.Tensor, lens: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenation of arange(starts[e], starts[e] + lens[e]) over e (lens may be 0), given its length: no sync."""
    if total == 0:
        return torch.empty(0, dtype=torch.long, device=starts.device)
    first = torch.repeat_interleave(starts - _excl_cumsum(lens), lens, output_size=total)
    return first + torch.arange(total, device=starts.device)


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(starts[e], starts[e] + lens[e]) over e, without a loop.

    A cumulative sum of steps: +1 inside a range, a jump to the next start where one begins.
    """
    keep = lens > 0
    starts, lens = starts[keep], lens[keep]
    total = int(lens.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.long, device=starts.device)
    step = torch.ones(total, dtype=torch.long, device=starts.device)
    first = _excl_cumsum(lens)
    step[first[1:]] = starts[1:] - (starts[:-1] + lens[:-1] - 1)
    step[0] = starts[0]
    return torch.cumsum(step, 0)


@dataclass
class Layout:
    """Load-time offsets into one layer's packed factors (see :func:`offsets`)."""

    rank: torch.Tensor  # [Hkv, S] int64
    us_off: torch.Tensor
    vt_off: torch.Tensor
    row_off: torch.Tensor

    @classmethod
    def of(cls, f: Factors, span_len: torch.Tensor, d: int) -> "Layout":
        rank = f.rank.long()
        return cls(rank, *offsets(rank, span_len, d))


def stack_kv(fk: Factors, fv: Factors) -> Factors:
    """One factor set holding K (heads 0..Hkv-1) then V (heads Hkv..2Hkv-1), so that one gather and
    one batched product reconstruct both (the packed layout is head-major, so this is concatenation)."""
    sc = fk.us_scale is not None
    return Factors(
        torch.cat([fk.us, fv.us]),
        torch.cat([fk.vt, fv.vt]),
        torch.cat([fk.rank, fv.rank]),
        torch.cat([fk.us_scale, fv.us_scale]) if sc else None,
        torch.cat([fk.vt_scale, fv.vt_scale]) if sc else None,
    )


@dataclass
class Fetch:
    """The compact factor blocks of a set of (KV head, span) pairs: what moves to the compute device."""

    us: torch.Tensor
    vt: torch.Tensor
    us_scale: torch.Tensor | None
    vt_scale: torch.Tensor | None
    n: torch.Tensor  # [E] int64, rows per block
    r: torch.Tensor  # [E] int64, rank per block
    n_max: int
    r_max: int

    def nbytes(self) -> int:
        ts = [self.us, self.vt, self.us_scale, self.vt_scale]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device, non_blocking: bool = False) -> "Fetch":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Fetch(mv(self.us), mv(self.vt), mv(self.us_scale), mv(self.vt_scale), mv(self.n), mv(self.r), self.n_max, self.r_max)


def gather(
    f: Factors,
    lay: Layout,
    span_len: torch.Tensor,
    g: torch.Tensor,
    i: torch.Tensor,
    d: int,
    out: dict | None = None,
    row0: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> Fetch:
    """Select the blocks of pairs (g[e], i[e]) from the packed (CPU) factors, compactly.

    ``row0`` / ``rows`` [E]: only the token rows row0[e] .. row0[e] + rows[e] - 1 of span i[e] (a zoom block,
    sekv/segment.py ``zoom_blocks``): those rows of U*sigma and the span's whole Vt.  Default: every row.
    ``out`` may hold preallocated (pinned) 1-D buffers named like the fields; they are
    used (and grown) in place so a CUDA copy can be asynchronous.
    """
    r = lay.rank[g, i]
    if row0 is None:
        n = span_len[i].long()
        row0 = torch.zeros_like(n)
    else:
        n = rows.long()
        row0 = row0.long()
    parts = {
        "us": (f.us, ranges(lay.us_off[g, i] + row0 * r, n * r)),
        "vt": (f.vt, ranges(lay.vt_off[g, i], r * d)),
    }
    if f.us_scale is not None:
        parts["us_scale"] = (f.us_scale, ranges(lay.row_off[g, i] + row0, n))
        parts["vt_scale"] = (f.vt_scale, ranges(torch.div(lay.vt_off[g, i], d, rounding_mode="floor"), r))
    got: dict[str, torch.Tensor | None] = {"us_scale": None, "vt_scale": None}
    for name, (src, idx) in parts.items():
        if out is None:
            got[name] = src.index_select(0, idx)
            continue
        buf = out.get(name)
        if buf is None or buf.dtype != src.dtype or buf.numel() < idx.numel():
            buf = torch.empty(max(idx.numel(), 2 * (buf.numel() if buf is not None else 0)), dtype=src.dtype, pin_memory=bool(out.get("_pin")))
            out[name] = buf
        got[name] = torch.index_select(src, 0, idx, out=buf[: idx.numel()])
    return Fetch(got["us"], got["vt"], got["us_scale"], got["vt_scale"], n, r, int(n.max()) if n.numel() else 0, int(r.max()) if r.numel() else 0)


def expand(fe: Fetch, d: int, dtype=torch.float32) -> torch.Tensor:
    """Reconstruct the fetched blocks on their device: [E, n_max, d] (rows past n[e] are zero)."""
    dev = fe.us.device
    e = fe.n.numel()
    if e == 0 or fe.n_max == 0:
        return torch.zeros(e, fe.n_max, d, dtype=dtype, device=dev)
    if fe.r_max == 0:
        return torch.zeros(e, fe.n_max, d, dtype=dtype, device=dev)
    n, r = fe.n.view(-1, 1, 1), fe.r.view(-1, 1, 1)
    j = torch.arange(fe.n_max, device=dev).view(1, -1, 1)
    c = torch.arange(fe.r_max, device=dev).view(1, 1, -1)
    cu = _excl_cumsum(fe.n * fe.r).view(-1, 1, 1)
    ok = (j < n) & (c < r)
    idx = torch.where(ok, cu + j * r + c, torch.zeros((), dtype=torch.long, device=dev))
    us = fe.us[idx].to(dtype) * ok
    c2 = torch.arange(fe.r_max, device=dev).view(1, -1, 1)
    ee = torch.arange(d, device=dev).view(1, 1, -1)
    cv = _excl_cumsum(fe.r * d).view(-1, 1, 1)
    okv = (c2 < r).expand(-1, -1, d)
    vidx = torch.where(okv, cv + c2 * d + ee, torch.zeros((), dtype=torch.long, device=dev))
    vt = fe.vt[vidx].to(dtype) * okv
    if fe.us_scale is not None:
        rows = torch.where(j < n, _excl_cumsum(fe.n).view(-1, 1, 1) + j, torch.zeros((), dtype=torch.long, device=dev))
        us = us * fe.us_scale[rows].to(dtype)
        comp = torch.where(c2 < r, _excl_cumsum(fe.r).view(-1, 1, 1) + c2, torch.zeros((), dtype=torch.long, device=dev))
        vt = vt * fe.vt_scale[comp].to(dtype)
    return torch.bmm(us, vt)


def reconstruct_all(f: Factors, span_len: torch.Tensor, d: int) -> torch.Tensor:
    """Every span's reconstruction [Hkv, T, d] float32 (reference / tests; the runtime gathers subsets)."""
    hkv, s = f.rank.shape
    lay = Layout.of(f, span_len, d)
    g = torch.arange(hkv).repeat_interleave(s)
    i = torch.arange(s).repeat(hkv)
    rows = expand(gather(f, lay, span_len, g, i, d), d)
    valid = torch.arange(rows.shape[1]).view(1, -1) < span_len.long()[i].view(-1, 1)
    return rows[valid].view(hkv, -1, d)
