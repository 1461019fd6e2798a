"""Ingest: the document's full KV cache -> the tensors of a sekv pack (sekv/layout.py).

surprisal -> anchors + spans (sekv/segment.py) -> coarse means (sekv/summarize.py) -> per-span SVD factors of
pre-RoPE keys and of values (sekv/factorize.py, sekv/rope.py), coded 4-bit (sekv/codec.py) -> router W, norms, tau
(sekv/router.py) and the scout's document profile and word terms (sekv/scout.py, sekv/lexical.py).  Runs on the
prefill's device; only the results move to the host (sekv/host_copies.py).
"""

from __future__ import annotations

import torch

from ..methods.base import ModelShape, PrefillResult
from . import codec
from . import factorize as fz
from . import layout, rope, router, router_file, scout
from .host_copies import HostCopies, to_host
from .params import SekvParams
from .segment import Segmentation, auto_lengths, fixed_segment, segment, zoom_blocks
from .summarize import span_weights, weighted_means


def lengths(n_tokens: int, params: SekvParams) -> tuple[int, int, int]:
    """(min_span, max_span, window): the explicit parameters, or the budget-driven defaults."""
    mn, mx, w = auto_lengths(n_tokens, params.layout_budget)
    mn = params.min_span or mn
    mx = params.max_span or 2 * mn
    w = params.window if params.window >= 0 else w
    return mn, mx, w


def segmentation(prefill: PrefillResult, params: SekvParams) -> Segmentation:
    n = prefill.n_tokens
    mn, mx, w = lengths(n, params)
    s = prefill.surprisal if prefill.surprisal is not None else torch.zeros(n)
    seg = segment(s, alpha=params.alpha, min_span=mn, max_span=mx, n_sink=params.n_sink, window=w, anchors=params.anchors)
    if params.segmentation == "surprisal":
        return seg
    chunk = params.chunk or (float(seg.span_len.float().mean()) if seg.n_spans else 0.0)
    return fixed_segment(n, chunk=chunk, n_sink=params.n_sink, window=w, anchors=params.anchors)


def host_bound(n: int, shape: ModelShape, params: SekvParams) -> int:
    """An upper bound of the pack's tensor bytes for n tokens (spans at least min_span long)."""
    mn, _, w = lengths(n, params)
    L, hkv, d = shape.n_layers, shape.n_kv_heads, shape.head_dim
    isz = torch.empty(0, dtype=shape.dtype).element_size()
    s = n // max(mn, 1) + 2
    f = min(n, w + params.n_sink + 2 * s + mn)
    r = params.rank_max
    es = 1 if params.factors_8bit else torch.empty(0, dtype=getattr(torch, params.factor_dtype)).element_size()
    per_kind = hkv * n * r * es + hkv * s * r * d * es + 2 * hkv * n + 2 * hkv * s * r + 2 * hkv * s
    per_layer = 2 * per_kind + 2 * hkv * (f + s) * d * isz + hkv * params.d_r * d * 4 + hkv * s * 4
    return L * (per_layer + 64 * 16)


def trained_router(prefill: PrefillResult, params: SekvParams, shape: ModelShape):
    """The trained router file ``params.router`` resolves to for this model, or None (untrained)."""
    spec = router_file.resolve(params.router, prefill.model_fingerprint, shape, prefill.model_id)
    return None if spec == "untrained" else router_file.load(spec)


def codec_configs(params: SekvParams) -> tuple[dict, dict]:
    """The 4-bit code of the key factors and of the value factors (sekv/codec.py)."""
    kcfg = dict(codec.DEFAULT, scales="log8" if params.scale_bits == 8 else "fp16")
    vcfg = dict(codec.VALUES_3BIT, scales=kcfg["scales"]) if params.value_bits == 3 else kcfg
    return kcfg, vcfg


def compress(prefill: PrefillResult, params: SekvParams, arena: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The pack's tensors (host memory); ``arena``: host memory to copy them into (sekv/host_copies.py)."""
    shape = prefill.shape
    seg = segmentation(prefill, params)
    pos, sid = seg.span_tokens()
    inv = rope.inv_freq_of(shape)
    pre = params.key_space == "pre_rope" and inv is not None
    trained = trained_router(prefill, params, shape)
    out = _document_tensors(prefill, params, seg, pre, inv, trained)
    dev = prefill.keys[0].device
    weights = span_weights(prefill.surprisal, pos, sid, seg.n_spans, params.weighting).to(dev)
    cos_sin = None
    if pre:
        cos_sin = tuple(t.to(dev) for t in rope.cos_sin(pos, inv, shape.rope_attention_scaling, dtype=prefill.keys[0].dtype))
    copies = HostCopies(dev, arena if dev.type == "cuda" else None)
    ctx = (pos.to(dev), sid.to(dev), weights, seg.full_idx.to(dev), seg.span_len, cos_sin, trained)
    for li in range(shape.n_layers):
        copies.submit(out)  # the previous layer's results travel while this layer computes
        out.update(_layer_tensors(prefill, params, li, *ctx))
    return to_host(out, copies)


def _document_tensors(prefill: PrefillResult, params: SekvParams, seg: Segmentation, pre: bool, inv, trained) -> dict[str, torch.Tensor]:
    """Everything but the per-layer tensors: configuration, spans, router thresholds, scout evidence."""
    shape = prefill.shape
    L, hkv, d, H = shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.n_heads
    mn, mx, w = lengths(prefill.n_tokens, params)
    out: dict[str, torch.Tensor] = {
        "sekv.config": torch.tensor([prefill.n_tokens, L, hkv, d, mn, mx, w, params.n_sink if params.anchors else 0], dtype=torch.long),
        "sekv.key_space": torch.tensor([int(pre)], dtype=torch.long),
        "sekv.span_start": seg.span_start.clone(),
        "sekv.span_end": seg.span_end.clone(),
        "sekv.full_idx": seg.full_idx.clone(),
        "sekv.anchor_idx": seg.anchor_idx.clone(),
    }
    if params.coded:
        kcfg, vcfg = codec_configs(params)
        out[codec.CONFIG] = codec.config_tensor(**kcfg)
        if vcfg != kcfg:
            out[codec.config_name("fv")] = codec.config_tensor(**vcfg)
    if pre:
        out["sekv.rope_inv_freq"] = inv
        out["sekv.rope_scaling"] = torch.tensor([shape.rope_attention_scaling], dtype=torch.float32)
    out["sekv.router.tau"] = torch.full((L, H), params.tau or router.TAU_DEFAULT, dtype=torch.float32)
    out["sekv.scout.profile"] = scout.document_profile(prefill, seg.span_start, seg.span_end)
    if prefill.scores and prefill.scores.get("lex_terms") is not None:  # the scout's lexical evidence (4 bytes a token)
        out["sekv.lex.terms"] = prefill.scores["lex_terms"].to(torch.int32).cpu()
    unit = max(0, params.zoom_unit)
    if unit > 0 and seg.n_spans:  # the profile of the zoom blocks the pack is made for (another unit at ask time: the span's)
        _, b0, b1 = zoom_blocks(seg.span_start, seg.span_end, unit)
        out["sekv.scout.profile_blocks"] = scout.document_profile(prefill, b0, b1)
        out["sekv.scout.profile_unit"] = torch.tensor([unit], dtype=torch.long)
    if trained is not None:  # its W stays in the file: router.load reads it from there, found by this sha256
        out["sekv.router.ttau"] = trained.tau.float()
        out["sekv.router.sha256"] = layout.sha256_tensor(router_file.file_sha256(trained.path))
    return out


def _layer_tensors(prefill: PrefillResult, params: SekvParams, li: int, pos, sid, weights, full_idx, span_len, cos_sin, trained) -> dict[str, torch.Tensor]:
    """One layer's full-resolution tokens, coarse entries, untrained router and key / value factors."""
    L, d, S = prefill.shape.n_layers, prefill.shape.head_dim, int(span_len.numel())
    sdt = layout.store_dtype(params, prefill.keys[0].dtype)
    k, v = prefill.keys[li], prefill.values[li]
    out = {f"sekv.full.k.{li}": k[:, full_idx].to(sdt).contiguous(), f"sekv.full.v.{li}": v[:, full_idx].to(sdt).contiguous()}
    kbar = weighted_means(k, pos, sid, weights, S)
    out[f"sekv.coarse.k.{li}"] = kbar.to(sdt)
    out[f"sekv.coarse.v.{li}"] = weighted_means(v, pos, sid, weights, S).to(sdt)
    w = router.pca_init(k, params.d_r, kbar)
    out[f"sekv.router.w.{li}"] = w.to(sdt)  # cast to the model's dtype at open
    out[f"sekv.router.norm.{li}"] = router.span_norms(w, kbar.to(sdt))
    kx = k[:, pos].float()
    if cos_sin is not None:
        kx = rope.undo(kx, *cos_sin)
    opts = dict(rank_max=params.rank_max, int8=params.factors_8bit, dtype=getattr(torch, params.factor_dtype), method=params.svd)
    keep_k = keep_v = None
    if trained is not None:  # the trained rank gate G chooses each block's components (sekv/rank_gate.py)
        depth = li / max(L - 1, 1)
        keep_k = trained.gate.keep(kbar.float(), span_len, False, depth)
        keep_v = trained.gate.keep(out[f"sekv.coarse.v.{li}"].float(), span_len, True, depth)
    fk = fz.factorize(kx, span_len, energy=params.energy_k, keep=keep_k, **opts)
    fv = fz.factorize(v[:, pos].float(), span_len, energy=params.energy_v, keep=keep_v, **opts)
    kcfg, vcfg = codec_configs(params)
    for f, kind, cfg in ((fk, "fk", kcfg), (fv, "fv", vcfg)):
        if params.coded:  # at rest 4-bit (values: value_bits); decoded to int8 at open (layout.read_factors)
            out.update({f"sekv.{kind}.{li}.{n}": t for n, t in codec.encode_factors(f, span_len, d, **cfg).items()})
        else:
            out.update(f.tensors(f"sekv.{kind}.{li}"))
    return out
