"""Ingest: the document's full KV cache -> the tensors of a sekv pack (sekv/layout.py).

surprisal -> anchors + spans (sekv/segment.py) -> coarse means (sekv/summarize.py) -> per-span SVD factors of
pre-RoPE keys and of values (sekv/factorize.py, sekv/rope.py), coded 4-bit (sekv/codec.py) -> router W, norms, tau
(sekv/router.py) and the scout's document profile, word terms and optional KVzip prior (sekv/scout.py, sekv/lexical.py,
sekv/prior.py).  Runs on the
prefill's device; only the results move to the host (sekv/host_copies.py).  A document prefilled in windows
(sekv_core/windows.py) is compressed a window at a time (:func:`compress_window`) and merged (sekv/merge.py).
"""

from __future__ import annotations

import torch

from ..methods.base import ModelShape, PrefillResult
from . import codec
from . import factorize as fz
from . import layout, merge, prior, rope, router, router_file, scout
from .host_copies import HostCopies, to_host
from .params import SekvParams
from .segment import Segmentation, auto_lengths, fixed_segment, segment, zoom_blocks
from .summarize import span_weights, weighted_means


#: the float32 factor inputs (keys and values in span order) of the layers decomposed together (sekv/factorize.py):
#: few launches and host syncs per layer, a bounded transient (a few times this: their copy in one batch, its padded
#: blocks; the 0.5B: all 24 layers at 4K, 3 a group at 32K; the 8B shape: one layer a group from 16K)
FACTOR_GROUP_BYTES = 128 << 20
#: the CPU decomposes a layer at a time: its cost is the arithmetic, not launches, and larger batches only add copies
GROUP_ON_CPU = False


def lengths(n_tokens: int, params: SekvParams) -> tuple[int, int, int]:
    """(min_span, max_span, window): the explicit parameters, or the budget-driven defaults."""
    mn, mx, w = auto_lengths(n_tokens, params.layout_budget)
    mn = params.min_span or mn
    mx = params.max_span or 2 * mn
    w = params.window if params.window >= 0 else w
    return mn, mx, w


def segmentation(prefill: PrefillResult, params: SekvParams) -> Segmentation:
    """The spans of a prefill's tokens (local indices).  A window of a windowed ingest (sekv_core/windows.py) is
    segmented on its own, so no span straddles two windows: the sinks only in the document's first window, the
    full-resolution recent window only in its last; span lengths from the whole document's token count."""
    n = prefill.n_tokens
    n_doc = prefill.doc_tokens or n
    mn, mx, w = lengths(n_doc, params)
    n_sink = params.n_sink if prefill.start == 0 else 0
    w = w if prefill.start + n == n_doc else 0
    s = prefill.surprisal if prefill.surprisal is not None else torch.zeros(n)
    seg = segment(s, alpha=params.alpha, min_span=mn, max_span=mx, n_sink=n_sink, window=w, anchors=params.anchors)
    if params.segmentation == "surprisal":
        return seg
    chunk = params.chunk or (float(seg.span_len.float().mean()) if seg.n_spans else 0.0)
    return fixed_segment(n, chunk=chunk, n_sink=n_sink, window=w, anchors=params.anchors)


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
    """The pack's tensors (host memory) of a document prefilled at once; ``arena``: host memory to copy them into
    (sekv/host_copies.py).  The one-window case of :func:`compress_windows`."""
    return compress_windows([prefill], params, arena)


def compress_windows(windows, params: SekvParams, arena: torch.Tensor | None = None) -> dict[str, torch.Tensor]:
    """The pack's tensors of a document given as window prefills (at global positions, one at a time): each window
    compressed on its own (:func:`compress_window`), then merged (sekv/merge.py)."""
    pieces, trained, lex, moments = [], None, None, []
    for prefill in windows:
        if not pieces:
            trained = trained_router(prefill, params, prefill.shape)
        if prefill.scores and prefill.scores.get("lex_terms") is not None:
            lex = prefill.scores["lex_terms"]
        with fz.single_thread():  # many small tensor ops: intra-op threads cost more than they give (the prefill keeps them)
            piece = compress_window(prefill, params, trained, arena if not pieces else None)
        if params.prior == "kvzip":  # KVzip's reconstruction passes: model forwards, with the prefill's threads
            piece.tensors["prior.kvzip"] = prior.window_prior(prefill, params.layout_budget)
        m = [piece.tensors.pop(f"moment.{li}") for li in range(prefill.shape.n_layers)]  # summed as they come
        moments = m if not moments else [a + b for a, b in zip(moments, m)]
        pieces.append(piece)
        shape, n_doc, dev = prefill.shape, prefill.doc_tokens or prefill.n_tokens, prefill.keys[0].device
        del prefill  # one window's KV at a time
    with fz.single_thread():
        return merge.merge(pieces, moments, params, shape, n_doc, lex, trained, dev)


def compress_window(prefill: PrefillResult, params: SekvParams, trained=None, arena: torch.Tensor | None = None) -> merge.Piece:
    """One window's spans, full-resolution tokens, coarse entries, factors (not yet coded) and key moments, on the
    host; global positions from prefill.start."""
    shape = prefill.shape
    seg = segmentation(prefill, params)
    pos, sid = seg.span_tokens()
    inv = rope.inv_freq_of(shape)
    pre = params.key_space == "pre_rope" and inv is not None
    out = _window_tensors(prefill, params, seg)
    dev = prefill.keys[0].device
    weights = span_weights(prefill.surprisal, pos, sid, seg.n_spans, params.weighting).to(dev)
    cos_sin = None
    if pre:  # the keys are at their global positions
        gpos = pos + prefill.start
        cos_sin = tuple(t.to(dev) for t in rope.cos_sin(gpos, inv, shape.rope_attention_scaling, dtype=prefill.keys[0].dtype))
    copies = HostCopies(dev, arena if dev.type == "cuda" else None)
    ctx = (pos.to(dev), sid.to(dev), weights, seg.full_idx.to(dev), seg.span_len, cos_sin, trained)
    # the factors of several layers come from one batched decomposition (its launches and host syncs once per group),
    # the group's float32 inputs within FACTOR_GROUP_BYTES
    per_layer = 2 * shape.n_kv_heads * int(seg.span_len.sum()) * shape.head_dim * 4
    group = max(1, FACTOR_GROUP_BYTES // max(per_layer, 1)) if dev.type != "cpu" or GROUP_ON_CPU else 1
    for l0 in range(0, shape.n_layers, group):
        copies.submit(out)  # the previous group's results travel while this one computes
        todo = []
        for li in range(l0, min(shape.n_layers, l0 + group)):
            tensors, inputs = _layer_tensors(prefill, params, li, *ctx)
            out.update(tensors)
            todo.append((li, inputs))
        out.update(_factors(todo, seg.span_len, params))
    return merge.Piece(prefill.start, prefill.n_tokens, seg, to_host(out, copies))


def _window_tensors(prefill: PrefillResult, params: SekvParams, seg: Segmentation) -> dict[str, torch.Tensor]:
    """A window's scout profiles: its spans' and zoom blocks' attention from its last queries (sekv/scout.py)."""
    out = {"scout.profile": scout.document_profile(prefill, seg.span_start, seg.span_end)}
    unit = max(0, params.zoom_unit)
    if unit > 0 and seg.n_spans:  # the profile of the zoom blocks the pack is made for (another unit at ask time: the span's)
        _, b0, b1 = zoom_blocks(seg.span_start, seg.span_end, unit)
        out["scout.profile_blocks"] = scout.document_profile(prefill, b0, b1)
    return out


def _layer_tensors(prefill: PrefillResult, params: SekvParams, li: int, pos, sid, weights, full_idx, span_len, cos_sin, trained):
    """One layer's full-resolution tokens, coarse entries and key moments (for the router), and what its factors
    are made from: (tensors, ((pre-RoPE keys, energy, gate), (values, energy, gate)) in span order)."""
    L = prefill.shape.n_layers
    sdt = layout.store_dtype(params, prefill.keys[0].dtype)
    k, v = prefill.keys[li], prefill.values[li]
    out = {f"full.k.{li}": k[:, full_idx].to(sdt).contiguous(), f"full.v.{li}": v[:, full_idx].to(sdt).contiguous()}
    kbar = weighted_means(k, pos, sid, weights, int(span_len.numel()))
    out[f"coarse.k.{li}"] = kbar  # float32: the router's PCA scale is read off it (sekv/merge.py)
    out[f"coarse.v.{li}"] = weighted_means(v, pos, sid, weights, int(span_len.numel())).to(sdt)
    out[f"moment.{li}"] = router.second_moment(k)
    if span_len.numel() == 0:
        out[f"keys.{li}"] = k.float()  # no span to scale the router on: the keys themselves (router.pca_init)
    kx = k[:, pos].float()
    if cos_sin is not None:
        kx = rope.undo(kx, *cos_sin)
    keep_k = keep_v = None
    if trained is not None and span_len.numel():  # the trained rank gate G chooses each block's components (sekv/rank_gate.py)
        depth = li / max(L - 1, 1)
        keep_k = trained.gate.keep(kbar.float(), span_len, False, depth)
        keep_v = trained.gate.keep(out[f"coarse.v.{li}"].float(), span_len, True, depth)
    return out, ((kx, params.energy_k, keep_k), (v[:, pos].float(), params.energy_v, keep_v))


def _factors(todo, span_len: torch.Tensor, params: SekvParams) -> dict[str, torch.Tensor]:
    """Key and value factors of the layers in ``todo`` ((layer, ((x, energy, keep) of K, of V)) each), from one
    batched decomposition (sekv/factorize.py factorize_many: each block on its own, the factors those of separate calls)."""
    opts = dict(rank_max=params.rank_max, int8=params.factors_8bit, dtype=getattr(torch, params.factor_dtype), method=params.svd)
    mats = [m for _, kv in todo for m in kv]
    fs = fz.factorize_many([x for x, _, _ in mats], span_len, energies=[e for _, e, _ in mats], keeps=[k for _, _, k in mats], **opts)
    out = {}
    for j, (li, _) in enumerate(todo):
        out.update(fs[2 * j].tensors(f"fk.{li}"))
        out.update(fs[2 * j + 1].tensors(f"fv.{li}"))
    return out
