"""DepthWeave-KV quantisers: 8-bit block absmax (coefficients) and 4-bit group absmax (residuals).

Both are symmetric round-to-nearest with one float16 scale per block/group:

* ``quantize_blocks``: x [..., n] -> int8 [..., n'] (n' = n rounded up to ``block``) and
  scale [..., n'/block]; q = round(x / s), s = absmax / 127.
* ``quantize_groups4``: x [..., n] (n a multiple of ``group``, ``group`` even) -> packed
  uint8 [..., n/2] and scale [..., n/group]; q = round(x / s) in [-7, 7], s = absmax / 7,
  stored as the nibble q + 8.  Nibble layout *per group*: byte b of a group holds channel
  b in its low nibble and channel group/2 + b in its high nibble, so a prefix of whole
  groups is a prefix of the bytes (a token kept at a lower residual rank keeps the first
  groups) and a kernel dequantises the low and high nibbles as two planes.

Error bound (both): the scale is rounded *up* to float16 (``_scale16``), so |x / s| never
exceeds the largest code and nothing clips; round-to-nearest then gives, per element,

    |x - s * q| <= s / 2        (s the stored float16 scale of the element's block/group)

up to float32 rounding of the division and product (|x| * 2^-22 at most).  With
s = absmax * (1 + 2^-10) / 127 (or / 7) at most (plus the float16 floor below), that is
|err| <= absmax / 254 per element for 8 bits and absmax / 14 for 4 bits.  Through an
orthonormal basis the error norm is preserved: ||(A - A^) B|| = ||A - A^||.
"""

from __future__ import annotations

import torch

INT8_MAX = 127
INT4_MAX = 7
#: smallest stored scale: the float16 normal range (keeps the relative rounding of scales at 2^-11)
MIN_SCALE = 2.0**-14


def _scale16(absmax: torch.Tensor, qmax: int) -> torch.Tensor:
    """float16 scale >= absmax / qmax (rounded up, floored at MIN_SCALE)."""
    s = (absmax.float() / qmax).clamp_min(MIN_SCALE)
    # nearest-rounding of s * (1 + 2^-10) is >= s: float16 has a relative spacing <= 2^-10
    return (s * (1.0 + 2.0**-10)).clamp(max=65504.0).to(torch.float16)


def _pad_to(x: torch.Tensor, multiple: int) -> torch.Tensor:
    n = x.shape[-1]
    pad = (-n) % multiple
    return torch.nn.functional.pad(x, (0, pad)) if pad else x


def quantize_blocks(x: torch.Tensor, block: int) -> tuple[torch.Tensor, torch.Tensor]:
    """8-bit block absmax: x [..., n] -> (int8 [..., n'], float16 scale [..., n'/block])."""
    xp = _pad_to(x.float(), block)
    xb = xp.view(*xp.shape[:-1], -1, block)
    scale = _scale16(xb.abs().amax(-1), INT8_MAX)
    q = torch.round(xb / scale.float().unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return q.view(xp.shape), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, n: int | None = None, dtype=torch.float32) -> torch.Tensor:
    """Inverse of quantize_blocks: [..., n'] int8 + [..., n'/block] scales -> [..., n] (first n channels)."""
    nb = scale.shape[-1]
    x = q.view(*q.shape[:-1], nb, -1).to(dtype) * scale.to(dtype).unsqueeze(-1)
    x = x.view(q.shape)
    return x if n is None or n == x.shape[-1] else x[..., :n]


def quantize_groups4(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """4-bit group absmax: x [..., n] -> (uint8 [..., n/2] per-group planar nibbles, float16 scale [..., n/group])."""
    n = x.shape[-1]
    if group % 2 or n % group:
        raise ValueError(f"4-bit groups need an even group size dividing the width (group {group}, width {n})")
    xg = x.float().reshape(*x.shape[:-1], n // group, group)
    scale = _scale16(xg.abs().amax(-1), INT4_MAX)
    q = torch.round(xg / scale.float().unsqueeze(-1)).clamp(-INT4_MAX, INT4_MAX).to(torch.int16) + 8  # 1..15
    half = group // 2
    packed = (q[..., :half] | (q[..., half:] << 4)).to(torch.uint8)
    return packed.reshape(*x.shape[:-1], n // 2), scale


def unpack_groups4(packed: torch.Tensor, group: int) -> torch.Tensor:
    """uint8 [..., n/2] -> signed codes int8 [..., n] in channel order (per-group planar layout undone)."""
    half = group // 2
    p = packed.reshape(*packed.shape[:-1], -1, half)
    lo = (p & 0x0F).to(torch.int8) - 8
    hi = (p >> 4).to(torch.int8) - 8
    return torch.cat([lo, hi], -1).reshape(*packed.shape[:-1], -1)


def dequantize_groups4(packed: torch.Tensor, scale: torch.Tensor, group: int, dtype=torch.float32) -> torch.Tensor:
    """Inverse of quantize_groups4: -> [..., n] in ``dtype``."""
    q = unpack_groups4(packed, group)
    x = q.view(*q.shape[:-1], -1, group).to(dtype) * scale.to(dtype).unsqueeze(-1)
    return x.view(q.shape)


def nbytes(*tensors: torch.Tensor | None) -> int:
    return int(sum(t.numel() * t.element_size() for t in tensors if t is not None))
