"""Undo / redo the rotary embedding on cached keys (Llama / Qwen2 "rotate_half" convention).

Keys arrive post-RoPE: k_post = k * cos + rotate_half(k) * sin with cos/sin of the
token's absolute position.  The model builds cos/sin from ``inv_freq`` (rope
scaling included) in float32, multiplies by ``attention_scaling`` and casts them
to the model dtype before rotating; we do the same (``dtype``), so that undoing
and re-applying reproduce the model's keys up to the key dtype's rounding.
The inverse divides by cos^2 + sin^2, which is exact also when
``attention_scaling`` != 1 or when the dtype rounding makes the map not quite a
rotation.
"""

from __future__ import annotations

import torch


def inv_freq_of(shape) -> torch.Tensor | None:
    """The model's rotary inverse frequencies [d/2] (float32) from a ModelShape, or None."""
    inv = getattr(shape, "rope_inv_freq", None)
    return None if inv is None else torch.tensor(inv, dtype=torch.float32)


def cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin [T, d] (float32 values, rounded through ``dtype`` like the model does)."""
    freqs = positions.reshape(-1, 1).float() * inv_freq.to(positions.device, torch.float32).reshape(1, -1)
    emb = torch.cat([freqs, freqs], dim=-1)
    cos, sin = emb.cos(), emb.sin()
    if scaling != 1.0:  # x * 1.0 is x: two ops fewer a call (a layer, in the scout pass) where the model has no scaling
        cos, sin = cos * scaling, sin * scaling
    if dtype is not None and dtype != torch.float32:
        cos, sin = cos.to(dtype).float(), sin.to(dtype).float()
    return cos, sin


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    h = x.shape[-1] // 2
    return torch.cat([-x[..., h:], x[..., :h]], dim=-1)


def cos_sin_half(positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float = 1.0, dtype=None) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`cos_sin`'s first halves [T, d/2] (its two halves are equal), the same values at half the memory, worked
    in place (two tables alive, not three: the scout's chunks at 128K tokens make ~33 MiB ones)."""
    freqs = positions.reshape(-1, 1).float() * inv_freq.to(positions.device, torch.float32).reshape(1, -1)
    sin = freqs.sin()
    cos = freqs.cos_()
    del freqs
    for x in (cos, sin):
        if scaling != 1.0:
            x.mul_(scaling)
        if dtype is not None and dtype != torch.float32:
            x.copy_(x.to(dtype))  # rounded through dtype, as .to(dtype).float()
    return cos, sin


def pairs_order(d: int, device=None) -> torch.Tensor:
    """The head dimension's order with RoPE's pairs side by side: 0, d/2, 1, d/2 + 1, ... ([d] long)."""
    h = d // 2
    return torch.stack([torch.arange(h, device=device), torch.arange(h, 2 * h, device=device)], dim=1).flatten()


def pairs_phase(cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """:func:`cos_sin_half`'s tables [..., d/2] as one table [..., d/2, 2] of (cos, sin) pairs, in their dtype: its float32
    copy viewed as complex (``torch.view_as_complex``) is the rotation :func:`apply_pairs_` multiplies by."""
    return torch.stack([cos, sin], dim=-1)


def apply_pairs_(x: torch.Tensor, phase: torch.Tensor) -> torch.Tensor:
    """:func:`apply` in place on a float32 x [..., T, d] whose last dimension is in :func:`pairs_order` (each pair
    (x1_j, x2_j) side by side), with :func:`pairs_phase`'s table [T, d/2, 2]: each pair times cos + i sin, one complex
    product (x1 cos - x2 sin, x1 sin + x2 cos: rope.apply's values, permuted), one pass over x where the half-split
    rotation takes six; the only temporary is the table's float32 copy."""
    torch.view_as_complex(x.view(*x.shape[:-1], x.shape[-1] // 2, 2)).mul_(torch.view_as_complex(phase.float()))
    return x


def apply(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate x [..., T, d] to the positions of cos/sin [T, d]."""
    return x * cos + rotate_half(x) * sin


def swapped(cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What :func:`apply_swapped` reads: (cos, sin with its first half negated, the halves' swap [d] long), made once
    for many rotations (a layer each) of the same positions."""
    h = sin.shape[-1] // 2
    sign = torch.ones(sin.shape[-1], device=sin.device)
    sign[:h] = -1.0
    perm = torch.cat([torch.arange(h, 2 * h, device=sin.device), torch.arange(h, device=sin.device)])  # made there: no copy, no sync
    return cos, sin * sign, perm


def apply_swapped(x: torch.Tensor, cos: torch.Tensor, signed_sin: torch.Tensor, perm: torch.Tensor) -> torch.Tensor:
    """:func:`apply` with :func:`swapped`'s tables, the same values in four ops instead of five: rotate_half(x) * sin
    is x with its halves swapped times sin with its first half negated ((-a) b = a (-b) exactly)."""
    return x * cos + x.index_select(-1, perm) * signed_sin


def undo(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`apply` (x [..., T, d] post-RoPE -> pre-RoPE)."""
    # apply() is, per pair (i, i + d/2), the matrix [[c, -s], [s, c]]; its inverse is [[c, s], [-s, c]] / (c^2 + s^2)
    # where the pair shares c, s (both halves of cos/sin are equal by construction)
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


def rotate(rows: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float, dtype) -> torch.Tensor:
    """Pre-RoPE key rows [..., d] (any float dtype) rotated to their token positions [...]: float32 [..., d]."""
    d = rows.shape[-1]
    cos, sin = cos_sin(positions.flatten(), inv_freq, scaling, dtype=dtype)
    return apply(rows.reshape(-1, d).float(), cos, sin).view(rows.shape)
