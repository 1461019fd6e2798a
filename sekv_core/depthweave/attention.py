"""The plain PyTorch attention path over a DepthWeave-KV layer (any device; the reference for the fused kernel).

The document part is reconstructed chunk by chunk (``chunk`` tokens at a time: basis
lookup + coefficient and residual dequantisation + RoPE), attended with a numerically
stable partial softmax, and the partials are merged with the exact part (the exact first
tokens, the question and the generated tokens).  Only one chunk of reconstructed K/V
exists at a time; its bytes are what ``transient_bytes`` reports.  The loop is over
token chunks (a handful per layer), never over tokens, spans or heads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..sekv import rope
from . import codec
from . import quantize as qz


@dataclass
class Rotary:
    """The model's RoPE for compressed token t (absolute position offset + t), computed on the fly (no table)."""

    inv_freq: torch.Tensor  # [d/2] float32, on the compute device
    scaling: float
    dtype: torch.dtype  # the model rounds cos/sin to its dtype; so do we
    offset: int  # position of compressed token 0 (= the number of exact tokens)

    def cos_sin(self, t0: int, t1: int) -> tuple[torch.Tensor, torch.Tensor]:
        pos = torch.arange(self.offset + t0, self.offset + t1, device=self.inv_freq.device)
        return rope.cos_sin(pos, self.inv_freq, self.scaling, self.dtype)


@dataclass
class ZCodes:
    """One layer's resident representation of keys or values."""

    basis: torch.Tensor  # [Hkv, r, d] float32 on the device (the window's shared basis; float16 in the pack)
    resbasis: torch.Tensor  # [Hkv, R, d] float32 on the device
    coef: torch.Tensor  # [Hkv, Nc, r] int8 | float32
    coef_scale: torch.Tensor | None  # [Hkv, Nc, r/block] float16
    pool: torch.Tensor  # [G, g/2] uint8 | [G, g] float32 (routed residual groups)
    pool_scale: torch.Tensor | None  # [G] float16
    group: int  # channels per residual group
    rank: int

    def nbytes(self, shared_basis: bool = False) -> int:
        return qz.nbytes(self.resbasis, self.coef, self.coef_scale, self.pool, self.pool_scale, None if shared_basis else self.basis)


def dequant_coef(z: ZCodes, t0: int, t1: int) -> torch.Tensor:
    c = z.coef[:, t0:t1]
    if z.coef_scale is None:
        return c.float()
    return qz.dequantize_blocks(c, z.coef_scale[:, t0:t1], z.rank)


def dequant_residual(pool: torch.Tensor, pool_scale: torch.Tensor | None, group: int, ng: torch.Tensor, goff: torch.Tensor,
                     max_groups: int) -> torch.Tensor:
    """Routed residual coordinates [Hkv, C, max_groups * group] float32 (zeros past each token's level)."""
    codes, valid = codec.gather_pool(pool, ng, goff, max_groups)
    if pool_scale is None:
        vals = codes.float()
    else:
        sc, _ = codec.gather_pool(pool_scale.float(), ng, goff, max_groups)  # zero for invalid groups
        vals = qz.unpack_groups4(codes, group).view(*codes.shape[:-1], group).float() * sc.unsqueeze(-1)
    return vals.reshape(*ng.shape, max_groups * group)


def dequant_dense_residual(res: torch.Tensor, res_scale: torch.Tensor | None, group: int) -> torch.Tensor:
    """The top-level tier [Hkv, Nc, R/2] (+ scales) -> [Hkv, Nc, R] float32."""
    if res_scale is None:
        return res.float()
    return qz.dequantize_groups4(res, res_scale, group)


def reconstruct(z: ZCodes, t0: int, t1: int, ng: torch.Tensor, goff: torch.Tensor, max_groups: int,
                rot: Rotary | None, dense: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> torch.Tensor:
    """Reconstructed vectors of compressed tokens t0..t1 [Hkv, C, d] float32 (keys rotated when rot is given).

    ``dense`` = (res, res_scale) of the top-level tier instead of the routed pool (the probe's reference).
    """
    x = dequant_coef(z, t0, t1) @ z.basis
    if z.resbasis.shape[1]:
        if dense is not None:  # the CPU tier: this chunk is copied to the device for the moment
            dev = x.device
            r = dequant_dense_residual(dense[0][:, t0:t1].to(dev), None if dense[1] is None else dense[1][:, t0:t1].to(dev), z.group)
        else:
            r = dequant_residual(z.pool, z.pool_scale, z.group, ng[:, t0:t1], goff[:, t0:t1], max_groups)
        x = x + r @ z.resbasis[:, : r.shape[-1]]
    if rot is not None:
        x = rope.apply(x, *rot.cos_sin(t0, t1))
    return x


def partial(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None):
    """Unnormalised softmax partial: q [Hkv, Gq, d] (pre-scaled), k/v [Hkv, T, d] -> (o [Hkv,Gq,d], m [Hkv,Gq], l [Hkv,Gq], s)."""
    s = q @ k.transpose(1, 2)
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m = s.amax(-1)
    m = torch.where(torch.isfinite(m), m, torch.zeros_like(m))
    p = torch.exp(s - m.unsqueeze(-1))
    return p @ v, m, p.sum(-1), s


def merge(parts: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]) -> tuple[torch.Tensor, torch.Tensor]:
    """Combine softmax partials -> (output [Hkv, Gq, d], log-sum-exp [Hkv, Gq])."""
    m = torch.stack([p[1] for p in parts]).amax(0)
    o = torch.zeros_like(parts[0][0])
    l = torch.zeros_like(parts[0][2])
    for po, pm, pl in parts:
        w = torch.exp(pm - m)
        o = o + po * w.unsqueeze(-1)
        l = l + pl * w
    return o / l.unsqueeze(-1), m + torch.log(l)


def doc_partials(q: torch.Tensor, zk: ZCodes, zv: ZCodes, ng: torch.Tensor, max_groups: int,
                 rot, chunk: int, keep_scores: bool = False, heads: torch.Tensor | None = None, dense=None):
    """Partials of q [Hkv', Gq, d] over the compressed document, chunk by chunk.

    heads: the KV heads q belongs to (a probe's subset), else all.  dense: {"k": (res, scale), "v": ...}
    to use the top-level tier (higher fidelity) instead of the routed pools.
    Returns (list of partials, list of raw score chunks if keep_scores, peak transient bytes).
    """
    nc = zk.coef.shape[1]
    goff = codec.token_offsets(ng)  # over all heads, before any head selection
    parts, scores, peak = [], [], goff.numel() * 8
    sel = (lambda t: t) if heads is None else (lambda t: t[heads])
    zk_h, zv_h = (zk, zv) if heads is None else (_heads(zk, heads), _heads(zv, heads))
    ng_h, goff_h = sel(ng), sel(goff)
    dk = dv = None
    if dense is not None:
        sel_cpu = (lambda t: t) if heads is None else (lambda t: t[heads.cpu()])
        dk = tuple(None if t is None else sel_cpu(t) for t in dense["k"])
        dv = tuple(None if t is None else sel_cpu(t) for t in dense["v"])
    for t0 in range(0, nc, chunk):
        t1 = min(nc, t0 + chunk)
        k = reconstruct(zk_h, t0, t1, ng_h, goff_h, max_groups, rot, dk)
        v = reconstruct(zv_h, t0, t1, ng_h, goff_h, max_groups, None, dv)
        peak = max(peak, goff.numel() * 8 + (k.numel() + v.numel()) * 4)
        o, m, l, s = partial(q, k, v)
        parts.append((o, m, l))
        if keep_scores:
            scores.append(s)
    return parts, scores, peak


def _heads(z: ZCodes, heads: torch.Tensor) -> ZCodes:
    """A ZCodes view restricted to some KV heads (the pool stays whole: offsets index it)."""
    return ZCodes(z.basis[heads], z.resbasis[heads], z.coef[heads], None if z.coef_scale is None else z.coef_scale[heads],
                  z.pool, z.pool_scale, z.group, z.rank)
