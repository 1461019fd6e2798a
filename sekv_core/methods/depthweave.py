"""`depthweave`: DepthWeave-KV (Córdoba et al., 2026) - token-adaptive cross-layer residual factorisation.

Per depth window of ``depth_window`` neighbouring layers and per KV head, shared low-rank
channel bases for keys (before RoPE) and values; per token and layer an 8-bit
block-quantised coefficient vector and a 4-bit group-quantised residual kept at the rank
level (0/2/4/8) a token-conditional router assigns from attention mass, attention
spikes, delimiter indicators, residual energy and online probe error.  Design,
deviations from the paper and measurements: docs/depthweave.md.  The stages live in
sekv_core/depthweave/ (factorize, quantize, router, probe, codec, attention,
kernel_triton, memory).

``budget`` is the same resident-KV fraction as for every other method: peak bytes on the
compute device during a decoding step / the full KV cache of the same tokens.  The
router's threshold is solved so that bases + coefficients + routed residuals + routing
offsets + RoPE table + exact tokens + one reconstruction chunk fit it; the question and
answer tokens are appended at full precision on top, as for every method.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..depthweave import codec, router
from ..depthweave import factorize as fz
from ..errors import SekvError
from .base import CacheMethod, KVMemory, ModelShape, PrefillResult, TensorStore
from .params import Params, ask_time

P = "depthweave."


#: auto ranks: the largest basis rank whose routing-independent bytes stay within this share of the budget
AUTO_FLOOR_SHARE = 0.85
_RANKS = (4, 8, 12, 16, 24, 32, 48, 64)


def floor_fraction(spec: codec.Spec, shape: ModelShape, chunk: int) -> float:
    """Resident fraction of the full KV that does not depend on the routing (bases, coefficients, offsets, exact tokens, one chunk)."""
    itemsize = torch.empty(0, dtype=shape.dtype).element_size()
    full = spec.n_tokens * shape.kv_bytes_per_token()
    return (sum(codec.fixed_bytes(spec, itemsize).values()) + codec.transient_bytes(spec, chunk)) / max(full, 1)


def auto_rank(params: dict[str, Any], n_tokens: int, shape: ModelShape, pre_rope: bool) -> int:
    """Basis rank (keys = values) for a budget: the largest in _RANKS (<= head_dim / 2) whose floor is at most
    AUTO_FLOOR_SHARE of the budget, leaving the rest to routed residuals (measured in docs/depthweave.md)."""
    budget = float(params["budget"])
    top = int(str(params["levels"]).split(",")[-1])
    cands = [r for r in _RANKS if r <= shape.head_dim // 2] or [max(1, shape.head_dim // 2)]
    # ranks whose complement splits evenly into the top level's channels first (the top level then restores
    # the whole residual; rank 12 of 64 would leave 4 channels out), the others only when nothing else fits
    whole = [r for r in cands if (shape.head_dim - r) % top == 0]
    for group in (whole, [r for r in cands if r not in whole]):
        for r in reversed(group):
            spec = codec.Spec.build(dict(params, rank_k=r, rank_v=r), n_tokens, shape.n_layers, shape.n_kv_heads, shape.head_dim, pre_rope)
            if floor_fraction(spec, shape, int(params["chunk"])) <= AUTO_FLOOR_SHARE * min(budget, 1.0):
                return r
    return cands[0]


@dataclass(frozen=True)
class DepthWeaveParams(Params):
    method = "depthweave"
    budget: float = ask_time(0.25)
    rank_k: int = 0  # shared-basis rank for keys; 0 = auto from the budget (auto_rank)
    rank_v: int = 0
    depth_window: int = 1  # layers per depth window (the paper's cross-depth sharing: 2, 4; docs/depthweave.md)
    depth_overlap: int = 0  # extra neighbouring layers on each side that a window's bases are fitted on
    levels: str = "0,2,4,8"
    level_unit: int = 0  # channels per level unit; 0 = (head_dim - rank) / top level (the top level restores the residual)
    coef_bits: int = 8
    coef_block: int = 16
    res_bits: int = 4
    gate: int = 1
    exact_tokens: int = 4
    router: str = ask_time("mass=2,spike=0.5,delim=1,energy=1,probe=4")
    spacing: float = ask_time(1.0)
    online_weight: float = ask_time(1.0)
    question_routing: int = ask_time(1)
    probe_every: int = ask_time(16)
    probe_tolerance: float = ask_time(0.05)
    probe_step: float = ask_time(0.5)
    probe_quiet: int = ask_time(3)
    chunk: int = ask_time(0)  # reconstruction chunk of the PyTorch path, tokens (0: ~1/8 of the document, >= 256)
    fused: str = ask_time("auto")

    def __post_init__(self) -> None:
        """The ask-time choices the memory parses (a pack's, or the command line's): one SekvError naming them."""
        self._one_of("fused", ("auto", "on", "off"))
        try:
            router.RouterWeights.parse(self.router)
        except ValueError as e:
            raise SekvError(f"depthweave: router {self.router!r}: {e}") from None


class DepthWeaveMethod(CacheMethod):
    name = "depthweave"
    per_layer_devices = True  # each layer's codes, pools and tokens on its layer's device (depthweave/memory.py)
    summary = "DepthWeave-KV: cross-layer low-rank bases + routed quantised residuals, online probes"
    needs_scores = ("attn_mass", "obs_queries", "token_text")
    params_type = DepthWeaveParams

    def compress(self, prefill: PrefillResult, params: DepthWeaveParams) -> dict[str, torch.Tensor]:
        shape, n = prefill.shape, prefill.n_tokens
        rot = codec.key_rotation(shape, n)
        params = params.to_dict()  # sekv_core/depthweave/ reads its parameters as a dict
        if int(params["rank_k"]) <= 0 or int(params["rank_v"]) <= 0:
            r = auto_rank(params, n, shape, rot is not None)
            params["rank_k"] = r if int(params["rank_k"]) <= 0 else params["rank_k"]
            params["rank_v"] = r if int(params["rank_v"]) <= 0 else params["rank_v"]
        try:
            spec = codec.Spec.build(params, n, shape.n_layers, shape.n_kv_heads, shape.head_dim, pre_rope=rot is not None)
        except ValueError as e:
            raise SekvError(f"depthweave: {e}") from None
        ne, hkv, L = spec.n_exact, spec.n_kv_heads, spec.n_layers
        out = spec.tensors()
        if rot is not None:
            out[P + "rope"] = torch.tensor(list(shape.rope_inv_freq) + [shape.rope_attention_scaling], dtype=torch.float32)
        scores = prefill.scores or {}
        energy = []
        for m, (s, e) in enumerate(spec.windows):
            fit = range(max(0, s - spec.depth_overlap), min(L, e + spec.depth_overlap))
            xs = {z: {i: self._space(prefill, i, z, rot, ne) for i in fit} for z in "kv"}
            en = torch.zeros(hkv, spec.n_compressed, device=prefill.keys[0].device)
            for z in "kv":
                basis = codec.storable(fz.sketch_basis(torch.cat([xs[z][i] for i in fit], 1), spec.rank(z), seed=m), spec)
                out[f"{P}basis.{z}.{m}"] = (basis.to(torch.float16) if spec.coef_bits else basis).cpu().contiguous()
                for i in range(s, e):
                    t, en_z = codec.encode_layer(xs[z][i], basis, spec, z)
                    for k, v in t.items():
                        out[f"{P}{k}.{z}.{i}"] = v.cpu().contiguous()
                    en += en_z / en_z.mean().clamp_min(1e-12)
            for i in range(s, e):
                for z, src in (("k", prefill.keys), ("v", prefill.values)):
                    out[f"{P}exact.{z}.{i}"] = src[i][:, :ne].cpu().contiguous()
            energy.append((en / (2 * (e - s))).cpu())
        feats = self._features(prefill, spec, scores, torch.stack(energy))
        out.update({f"{P}feat.{k}": v for k, v in feats.items()})
        # the routing at the ingest budget (what the pack describes; open() re-solves it for the ask's budget)
        lv, tau = self._routing(spec, feats, params, shape)
        out[P + "level"] = lv
        out[P + "tau"] = torch.tensor([tau], dtype=torch.float32)
        return out

    @staticmethod
    def _space(prefill: PrefillResult, layer: int, z: str, rot, ne: int) -> torch.Tensor:
        """Compressed tokens of one layer in factorisation space: pre-RoPE keys or values, float32 [Hkv, Nc, d]."""
        x = (prefill.keys if z == "k" else prefill.values)[layer].float()
        if z == "k":
            x = codec.to_model_space(x, rot, rot is not None)
        return x[:, ne:]  # on the prefill's device (the GPU at a GPU ingest); outputs go to the CPU

    @staticmethod
    def _features(prefill: PrefillResult, spec: codec.Spec, scores: dict, energy: torch.Tensor) -> dict[str, torch.Tensor]:
        n, ne, hkv = spec.n_tokens, spec.n_exact, spec.n_kv_heads
        mass, spike = [], []
        keys = [k.cpu() for k in prefill.keys] if scores.get("obs_queries") else prefill.keys
        for s, e in spec.windows:
            mass.append(router.mass_feature(scores.get("attn_mass"), range(s, e), hkv, n)[:, ne:])
            spike.append(router.spike_feature(scores.get("obs_queries"), keys, range(s, e), float(scores.get("scaling", spec.head_dim**-0.5)), n)[:, ne:])
        return {
            "mass": torch.stack(mass).to(torch.float16),
            "spike": torch.stack(spike).to(torch.float16),
            "energy": energy.clamp(max=60000).to(torch.float16),
            "delim": router.delimiter_flags(scores.get("token_text"), n)[ne:].to(torch.uint8),
        }

    @staticmethod
    def _routing(spec: codec.Spec, feats: dict, params: dict, shape: ModelShape) -> tuple[torch.Tensor, float]:
        budget = float(params["budget"])
        if budget <= 0:
            raise SekvError(f"--budget must be > 0 (a fraction of the full KV cache), got {budget:g}")
        full = spec.n_tokens * shape.kv_bytes_per_token()
        floor = floor_fraction(spec, shape, int(params["chunk"])) * full
        if budget < 1 and budget * full < floor:
            raise SekvError(f"--budget {budget:g} is below depthweave's floor of {floor / max(full, 1):.3f} of the full KV for this "
                            f"document (bases + coefficients at rank_k={spec.rank_k}, rank_v={spec.rank_v}); raise --budget or lower the ranks")
        s = router.score({k: v.float() for k, v in feats.items()}, router.RouterWeights.parse(params["router"]))
        delta = torch.zeros(spec.n_windows)
        cost = codec.level_cost(spec)
        tau = -1e9 if budget >= 1 else router.solve_offset(s, delta, float(params["spacing"]), cost, budget * full - floor)
        return router.levels(s, tau + delta, float(params["spacing"]), len(spec.levels)), tau

    def validate(self, store: TensorStore, params, shape: ModelShape, n_tokens: int) -> None:
        """Every tensor open() and describe() read: config and levels against the document and model, dtypes and
        shapes (codes, scales, bases) from them, indices and flags in range, the budget above its floor
        (sekv_core/depthweave/checks.py)."""
        from ..depthweave import checks

        checks.validate(store, params.to_dict(), shape, n_tokens)

    def open(self, store: TensorStore, params, shape: ModelShape, device) -> KVMemory:
        from ..depthweave.memory import DepthWeaveMemory  # here: memory.py imports methods.base (no import cycle)

        return DepthWeaveMemory(store, params.to_dict(), shape, device)

    def describe(self, store: TensorStore, params) -> dict[str, Any]:
        spec = codec.Spec.load(store)
        lv = store.get(P + "level").long()
        n, L, hkv, d = spec.n_tokens, spec.n_layers, spec.n_kv_heads, spec.head_dim
        raw = n * 2 * L * hkv * d * 2
        tensor_bytes = sum(store.get(k).numel() * store.get(k).element_size() for k in store.keys() if k.startswith(P))
        fixed = codec.fixed_bytes(spec, 2)
        pools = float(codec.level_cost(spec).gather(1, lv.flatten(1)).sum()) if lv.numel() else 0.0
        resident = sum(fixed.values()) + pools
        return {
            "depth_windows": spec.n_windows,
            "layers_per_window": spec.depth_window,
            "basis_rank": {"keys": spec.rank("k"), "values": spec.rank("v")},
            "key_space": "pre_rope" if spec.pre_rope else "post_rope",
            "residual_channels_per_level": {"keys": [x * spec.unit_k for x in spec.levels], "values": [x * spec.unit_v for x in spec.levels]},
            "level_shares": {str(x): round(float((lv == i).float().mean()), 4) for i, x in enumerate(spec.levels)},
            "exact_tokens": spec.n_exact,
            "resident_bytes_at_ingest_budget": int(resident),
            "resident_reduction_vs_raw_fp16": round(raw / max(resident, 1), 2),
            "pack_tensor_bytes": int(tensor_bytes),
            "pack_reduction_vs_raw_fp16": round(raw / max(tensor_bytes, 1), 2),
            "raw_kv_fp16_bytes": int(raw),
        }
