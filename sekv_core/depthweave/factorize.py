"""Cross-depth residual factorisation (DepthWeave-KV eq. 1), per KV head, for keys and for values.

Layers are grouped into depth windows W_m of ``w`` neighbouring layers.  For each window
and KV head a shared basis B_m (r_b x d, orthonormal rows) is fitted by a randomised
range-finder sketch of the window's cached vectors (optionally of ``overlap`` further
neighbours on each side: the paper's overlapping windows); every layer l in W_m then
stores, per token t,

    x_{l,t} ~= a_{l,t} B_m  +  g_{l,t} * rho-prefix( c_{l,t} ) C_l

* a = x B_m^T, the coefficient vector (r_b values; 8-bit block-quantised by the caller);
* C_l (R x d) is a per-layer orthonormal basis of the complement of B_m, ordered by the
  layer's residual energy (PCA of x - a B_m restricted to the complement), so
  [B_m; C_l] is an orthonormal basis of R^d and keeping the first rho channels of
  c = x C_l^T is the best rank-rho residual in that ordering;  the full complement
  (rho = R = d - r_b) reproduces x exactly;
* g is the residual gate (see ``gate``).

Keys are factorised before RoPE (``pre_rope``; measured in docs/depthweave.md: pre-RoPE
keys are far lower-rank, as for SeKV's span factors); sekv_core.sekv.rope undoes and
re-applies the rotation.
"""

from __future__ import annotations

import torch


def windows(n_layers: int, w: int) -> list[tuple[int, int]]:
    """Contiguous depth windows [start, end) of w layers (the last may be shorter)."""
    w = max(1, int(w))
    return [(s, min(n_layers, s + w)) for s in range(0, n_layers, w)]


def window_of(n_layers: int, w: int) -> list[int]:
    """Window index of every layer."""
    return [i // max(1, int(w)) for i in range(n_layers)]


def sketch_basis(x: torch.Tensor, rank: int, *, oversample: int = 8, power_iters: int = 2, seed: int = 0) -> torch.Tensor:
    """Randomised range finder (Halko et al. 2011) for the top right singular vectors.

    x [Hkv, M, d] (rows = tokens of the window's layers) -> B [Hkv, rank, d] float32, orthonormal rows.
    rank >= d returns the identity (the factorisation is then exact).
    """
    hkv, m, d = x.shape
    if rank >= d:
        return torch.eye(d, device=x.device).expand(hkv, d, d).clone()
    if rank <= 0:
        return torch.zeros(hkv, 0, d, device=x.device)
    x = x.float()
    k = min(d, rank + oversample)
    g = torch.Generator().manual_seed(seed)
    omega = torch.randn(hkv, d, k, generator=g).to(x.device)
    y = x @ omega  # [Hkv, M, k]
    for _ in range(power_iters):
        y, _ = torch.linalg.qr(y)
        y = x @ (x.transpose(1, 2) @ y)
    q, _ = torch.linalg.qr(y)  # [Hkv, M, k]
    small = q.transpose(1, 2) @ x  # [Hkv, k, d]
    _, _, vt = torch.linalg.svd(small.double(), full_matrices=False)
    return vt[:, :rank].float()


def complement_basis(x: torch.Tensor, basis: torch.Tensor, channels: int) -> torch.Tensor:
    """Per-layer residual basis C [Hkv, channels, d]: orthonormal, orthogonal to ``basis``, by residual energy.

    x [Hkv, N, d] one layer's vectors; basis [Hkv, r, d]; channels <= d - r.
    """
    hkv, _, d = x.shape
    if channels <= 0:
        return torch.zeros(hkv, 0, d, device=x.device)
    b = basis.double().to(x.device)
    proj = torch.eye(d, dtype=torch.float64, device=x.device) - b.transpose(1, 2) @ b  # projector onto the complement
    evals, evecs = torch.linalg.eigh(proj)
    qc = evecs.flip(-1)[..., : d - basis.shape[1]]  # [Hkv, d, R] eigenvalue-1 eigenvectors
    ec = x.double() @ qc  # residual coordinates in the complement
    _, u = torch.linalg.eigh(ec.transpose(1, 2) @ ec)
    u = u.flip(-1)  # descending residual energy
    return (qc @ u).transpose(1, 2)[:, :channels].float().contiguous()


def project(x: torch.Tensor, basis: torch.Tensor) -> torch.Tensor:
    """Coordinates of x [Hkv, N, d] in the rows of basis [Hkv, r, d] -> [Hkv, N, r] float32."""
    return x.float() @ basis.transpose(1, 2).to(x.device)


def gate(target: torch.Tensor, approx: torch.Tensor) -> torch.Tensor:
    """Residual gate g = clip(<c, c^> / ||c^||^2, 0, 1) per token: the least-squares shrinkage of the
    quantised residual c^ towards its target c (calibration-free stand-in for the paper's learned gate).

    target/approx [..., R] -> g [...] float32 (1 where c^ = 0).
    """
    num = (target.float() * approx.float()).sum(-1)
    den = (approx.float() ** 2).sum(-1)
    g = torch.where(den > 0, num / den.clamp_min(1e-30), torch.ones_like(den))
    return g.clamp(0.0, 1.0)
