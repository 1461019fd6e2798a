"""DepthWeave-KV storage layout: encode a prefill into pack tensors, and the resident residual pools.

Pack tensors (prefix ``depthweave.``; L layers, M windows, Nc = N - n_exact compressed tokens):

  config [16] int64 (Spec fields), levels [n_levels] int64
  basis.{k,v}.m      [Hkv, r_b, d] float32   shared window bases (orthonormal rows)
  resbasis.{k,v}.l   [Hkv, R, d]   float32   per-layer residual bases (complement, by energy)
  coef.{k,v}.l       [Hkv, Nc, r_b] int8 (+ coef_scale [Hkv, Nc, r_b/block] float16), or float32
  res.{k,v}.l        [Hkv, Nc, R/2] uint8 4-bit (+ res_scale [Hkv, Nc, R/g] float16, gate folded in),
                     or float32 [Hkv, Nc, R] - the *top-level* residual of every token: the CPU
                     tier from which the resident pools (routed ranks) are cut and the probes'
                     higher-fidelity reference is materialised
  exact.{k,v}.l      [Hkv, n_exact, d] model dtype: the first tokens (attention sink), exact
  feat.{mass,spike,energy} [M, Hkv, Nc] float16, feat.delim [Nc] uint8: router features
  level [M, Hkv, Nc] uint8, tau [M] float32: the routing at the ingest budget

Resident residual pool of window m (what the routed ranks keep on the compute device): a
token-major ragged array - token (h, t) at level i owns groups_of_level[i] consecutive
groups starting at goff[h, t] (exclusive cumulative sum over (h, t); one int32 is stored per 64
tokens, the rest is a cumulative sum of the per-token group counts); per layer and K/V
``codes`` [G, g/2] uint8 + ``scale`` [G] float16 (or float32 values [G, g]).  Built from
the dense top-level tier with one boolean-mask select: no loop over tokens or heads.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from ..sekv import rope
from . import factorize as fz
from . import quantize as qz


@dataclass(frozen=True)
class Spec:
    n_tokens: int
    n_exact: int
    n_layers: int
    n_kv_heads: int
    head_dim: int
    rank_k: int
    rank_v: int
    depth_window: int
    depth_overlap: int
    unit_k: int
    unit_v: int
    coef_block: int
    coef_bits: int  # 8, or 0 = float32 (unquantised)
    res_bits: int  # 4, or 0 = float32
    pre_rope: int  # 1 = keys factorised before RoPE
    gate: int  # 1 = least-squares residual gate folded into the residual scales
    levels: tuple[int, ...] = (0, 2, 4, 8)

    # -- derived --------------------------------------------------------------------------------------------
    @property
    def n_compressed(self) -> int:
        return self.n_tokens - self.n_exact

    def rank(self, z: str) -> int:
        return min(self.rank_k if z == "k" else self.rank_v, self.head_dim)

    def unit(self, z: str) -> int:
        return self.unit_k if z == "k" else self.unit_v

    def channels(self, z: str) -> int:
        """Residual channels at the top level."""
        return self.levels[-1] * self.unit(z)

    def group(self, z: str) -> int:
        """Channels per residual group = the increment of the first non-zero level."""
        return self.levels[1] * self.unit(z) if len(self.levels) > 1 else 0

    @property
    def groups_of_level(self) -> tuple[int, ...]:
        return tuple(lv // self.levels[1] for lv in self.levels) if len(self.levels) > 1 and self.levels[1] else (0,)

    @property
    def max_groups(self) -> int:
        return self.groups_of_level[-1]

    @property
    def basis_itemsize(self) -> int:
        """Bases are float16 in quantised packs, float32 in unquantised (lossless) ones."""
        return 2 if self.coef_bits else 4

    def block(self, z: str) -> int:
        """Coefficient quantisation block: the largest divisor of the rank <= coef_block (no padding)."""
        r = self.rank(z)
        return max([b for b in range(1, min(self.coef_block, max(r, 1)) + 1) if r % b == 0] or [1])

    @property
    def windows(self) -> list[tuple[int, int]]:
        return fz.windows(self.n_layers, self.depth_window)

    @property
    def n_windows(self) -> int:
        return len(self.windows)

    def window_of(self, layer: int) -> int:
        return layer // max(1, self.depth_window)

    # -- (de)serialisation ----------------------------------------------------------------------------------
    def tensors(self) -> dict[str, torch.Tensor]:
        vals = [int(getattr(self, f.name)) for f in fields(self) if f.name != "levels"]
        return {"depthweave.config": torch.tensor(vals, dtype=torch.int64),
                "depthweave.levels": torch.tensor(self.levels, dtype=torch.int64)}

    @classmethod
    def load(cls, store) -> "Spec":
        names = [f.name for f in fields(cls) if f.name != "levels"]
        vals = store.get("depthweave.config").tolist()
        return cls(**dict(zip(names, vals)), levels=tuple(store.get("depthweave.levels").tolist()))

    @classmethod
    def build(cls, params: dict, n_tokens: int, n_layers: int, n_kv_heads: int, head_dim: int, pre_rope: bool) -> "Spec":
        levels = tuple(int(x) for x in str(params["levels"]).split(","))
        if levels[0] != 0 or any(b <= a for a, b in zip(levels, levels[1:])) or (len(levels) > 1 and any(x % levels[1] for x in levels)):
            raise ValueError(f"levels must start at 0, increase, and be multiples of the first non-zero level; got {levels}")
        d = head_dim
        units = []
        for z in ("k", "v"):
            r = min(int(params[f"rank_{z}"]), d)
            room = d - r
            unit = int(params["level_unit"]) if int(params["level_unit"]) > 0 else (room // levels[-1] if len(levels) > 1 else 0)
            if len(levels) > 1 and levels[-1] * unit > room:
                raise ValueError(f"rank_{z} {r} + top residual level {levels[-1]} x {unit} channels exceeds head_dim {d}")
            if int(params["res_bits"]) and len(levels) > 1 and (levels[1] * unit) % 2:
                raise ValueError(f"4-bit residual groups need an even width; rank_{z}={r} gives {levels[1] * unit}")
            units.append(unit)
        n_exact = min(max(0, int(params["exact_tokens"])), n_tokens - 1)  # at least one compressed token (the router's scores)
        return cls(n_tokens, n_exact, n_layers, n_kv_heads, d, min(int(params["rank_k"]), d), min(int(params["rank_v"]), d),
                   max(1, int(params["depth_window"])), max(0, int(params["depth_overlap"])), units[0], units[1],
                   int(params["coef_block"]), 8 if int(params["coef_bits"]) else 0, 4 if int(params["res_bits"]) else 0,
                   int(pre_rope), int(bool(params["gate"])), levels)


# ------------------------------------------------------------------------------------------------ encoding


def key_rotation(shape, n_tokens: int, device=None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """cos, sin [N, d] of the model's RoPE (rounded like the model does), or None when not static."""
    inv = rope.inv_freq_of(shape)
    if inv is None:
        return None
    return rope.cos_sin(torch.arange(n_tokens, device=device), inv, shape.rope_attention_scaling, shape.dtype)


def storable(basis: torch.Tensor, spec: Spec) -> torch.Tensor:
    """A basis as the pack stores it (float16 in quantised packs); encoding projects onto exactly this."""
    return basis.to(torch.float16).float() if spec.coef_bits else basis.float()


def encode_layer(x: torch.Tensor, basis: torch.Tensor, spec: Spec, z: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """One layer's compressed vectors x [Hkv, Nc, d] (float32, pre-RoPE keys or values) -> pack tensors + residual energy [Hkv, Nc]."""
    out: dict[str, torch.Tensor] = {}
    a = fz.project(x, basis)  # [Hkv, Nc, r]
    if spec.coef_bits:
        out["coef"], out["coef_scale"] = qz.quantize_blocks(a, spec.block(z))
    else:
        out["coef"] = a.contiguous()
    ch = spec.channels(z)
    resbasis = storable(fz.complement_basis(x, basis, ch), spec) if ch else torch.zeros(x.shape[0], 0, x.shape[-1], device=x.device)
    out["resbasis"] = resbasis.to(torch.float16) if spec.coef_bits else resbasis
    c = fz.project(x, resbasis)  # [Hkv, Nc, R]
    energy = (c**2).sum(-1)
    if ch and spec.res_bits:
        g = spec.group(z)
        codes, scale = qz.quantize_groups4(c, g)
        if spec.gate:
            gt = fz.gate(c, qz.dequantize_groups4(codes, scale, g))  # [Hkv, Nc]
            scale = (scale.float() * gt.unsqueeze(-1)).to(torch.float16)
        out["res"], out["res_scale"] = codes, scale
    else:
        out["res"] = c.contiguous()
    return out, energy


def to_model_space(x: torch.Tensor, rot, pre_rope: bool) -> torch.Tensor:
    """Pre-RoPE keys from post-RoPE keys x [Hkv, N, d] (float32)."""
    if not pre_rope:
        return x.float()
    return rope.undo(x.float(), rot[0].to(x.device), rot[1].to(x.device))


# ------------------------------------------------------------------------------------------------ runtime pools


#: tokens per stored pool offset: a token's offset is its block's offset + the groups of the block's earlier tokens
OFF_BLOCK = 64


def token_offsets(ng: torch.Tensor) -> torch.Tensor:
    """Exclusive cumulative sum of groups per token over (h, t): ng [Hkv, Nc] -> first group of each token, int64."""
    flat = ng.flatten().long()
    return (torch.cumsum(flat, 0) - flat).view(ng.shape)


def group_offsets(level: torch.Tensor, groups_of_level: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, int]:
    """level [Hkv, Nc] uint8 -> (groups per token [Hkv, Nc] uint8, block offsets [Hkv, ceil(Nc/OFF_BLOCK)] int32, total).

    Only one int32 per OFF_BLOCK tokens is kept resident; token offsets are rebuilt with a cumulative sum
    (token_offsets on the PyTorch path, an in-block tl.cumsum in the kernel).
    """
    ng = groups_of_level.to(level.device)[level.long()]
    off = token_offsets(ng)
    total = int(ng.long().sum())
    if total >= 2**31:
        raise ValueError("residual pool too large for int32 offsets")
    return ng.to(torch.uint8), off[:, ::OFF_BLOCK].to(torch.int32).contiguous(), total


def cut_pool(dense: torch.Tensor, level: torch.Tensor, groups_of_level: torch.Tensor, max_groups: int) -> torch.Tensor:
    """Ragged pool of the routed groups: dense [Hkv, Nc, max_groups, ...] -> [G, ...] in (h, t, group) order."""
    ng = groups_of_level.to(level.device)[level.long()]
    keep = torch.arange(max_groups, device=level.device).view(1, 1, -1) < ng.unsqueeze(-1)
    return dense[keep.to(dense.device)]


def gather_pool(pool: torch.Tensor, ng: torch.Tensor, goff: torch.Tensor, max_groups: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense view of a pool: pool [G, ...] -> ([Hkv, Nc, max_groups, ...] with invalid groups zeroed, valid mask)."""
    j = torch.arange(max_groups, device=ng.device).view(1, 1, -1)
    valid = j < ng.long().unsqueeze(-1)
    if pool.shape[0] == 0:
        return pool.new_zeros(*valid.shape, *pool.shape[1:]), valid
    idx = torch.where(valid, goff.long().unsqueeze(-1) + j, torch.zeros_like(j))
    out = pool[idx]
    mask = valid.view(*valid.shape, *([1] * (pool.dim() - 1)))
    return out * mask.to(out.dtype) if out.is_floating_point() else torch.where(mask, out, torch.zeros_like(out)), valid


# ------------------------------------------------------------------------------------------------ accounting


def level_cost(spec: Spec) -> torch.Tensor:
    """Resident residual bytes of one (token, KV head) of window m at each level: [M, n_levels] float64."""
    per_group = 0.0
    for z in ("k", "v"):
        g = spec.group(z)
        if g:
            per_group += (g / 2 + 2) if spec.res_bits else g * 4
    groups = torch.tensor(spec.groups_of_level, dtype=torch.float64)
    sizes = torch.tensor([e - s for s, e in spec.windows], dtype=torch.float64)
    return sizes.view(-1, 1) * groups.view(1, -1) * per_group


def fixed_bytes(spec: Spec, itemsize: int) -> dict[str, int]:
    """Resident bytes that do not depend on the routing (compute device), by part."""
    L, M, hkv, d, nc = spec.n_layers, spec.n_windows, spec.n_kv_heads, spec.head_dim, spec.n_compressed
    coef = 0
    for z in ("k", "v"):
        r = spec.rank(z)
        coef += L * hkv * nc * (r + 2 * (r // spec.block(z)) if spec.coef_bits else 4 * r)
    bases = spec.basis_itemsize * hkv * d * (M * (spec.rank("k") + spec.rank("v")) + L * (spec.channels("k") + spec.channels("v")))
    return {
        "coefficients": coef,
        "bases": bases,
        "routing": M * hkv * (nc + 4 * -(-nc // OFF_BLOCK)),  # groups per token (uint8) + one int32 offset per block
        "exact_tokens": L * 2 * hkv * spec.n_exact * d * itemsize,
    }


def chunk_tokens(spec: Spec, chunk: int) -> int:
    """Reconstruction chunk of the PyTorch path: ``chunk``, or (0) ~1/8 of the document, at least 256 tokens."""
    return chunk if chunk > 0 else max(256, -(-spec.n_compressed // 8 // 256) * 256)


def transient_bytes(spec: Spec, chunk: int) -> int:
    """The PyTorch path's working set: one chunk of reconstructed K and V (float32) + the token offsets (int64)."""
    nc = max(spec.n_compressed, 0)
    return (2 * min(chunk_tokens(spec, chunk), nc) * spec.head_dim * 4 + 8 * nc) * spec.n_kv_heads
