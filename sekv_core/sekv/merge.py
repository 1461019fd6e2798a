"""Merge: the compressed windows of a document -> the tensors of ONE sekv pack (sekv/layout.py).

Each window of a windowed ingest (sekv_core/windows.py) is compressed on its own (sekv/compress.py
compress_window: its spans, full-resolution tokens, coarse entries, factors, key moments), so no span straddles
two windows and only one window's KV exists at a time.  Merging puts them at their global token indices: one
span table, one full-resolution index, per-layer tensors concatenated in token order, factors concatenated per
KV head (their packed layout is (head, span) ordered, sekv/factorize.py) and coded once, the untrained router's
PCA from the summed key moments, the lexical terms of the whole document.  A one-window document merges to
exactly the tensors of compressing it at once.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..methods.base import ModelShape
from . import codec, layout, rope, router, zoom_tier
from . import factorize as fz
from .params import SekvParams
from .segment import Segmentation

_FACTOR_PARTS = ("us", "vt", "rank", "us_scale", "vt_scale")


@dataclass
class Piece:
    """One compressed window: its first token's global index, its token count, its (local) segmentation and its
    host tensors (``full.k.l``, ``coarse.k.l`` float32, ``fk.l.us`` ..., ``scout.profile`` ...)."""

    start: int
    n: int
    seg: Segmentation
    tensors: dict[str, torch.Tensor]
    arena_bytes: int = 0  # of the host arena it was given (sekv/host_copies.py), the bytes its tensors took
    emitted: set = field(default_factory=set)  # layers whose final_layer() tensors were handed on already (written)


def merge_factors(parts: list[tuple[dict[str, torch.Tensor], torch.Tensor]], d: int) -> fz.Factors:
    """Factors of consecutive windows (each: its tensors by part name, its span lengths [S_w]) -> the factors of all
    their spans, in the packed (KV head, span) order."""
    pieces: dict[str, list[list[torch.Tensor]]] = {k: [] for k in _FACTOR_PARTS}
    for t, span_len in parts:
        r = t["rank"].long()
        span_len = span_len.to(r.device)  # a layer's span chunks merged on the GPU (sekv/compress.py)
        sizes = {
            "us": (r * span_len.view(1, -1)).sum(1),
            "vt": r.sum(1) * d,
            "us_scale": span_len.sum().expand(r.shape[0]),
            "vt_scale": r.sum(1),
        }
        for k, sz in sizes.items():
            if k in t:
                pieces[k].append(list(torch.split(t[k], sz.tolist())))
        pieces["rank"].append([t["rank"]])
    out = {k: None for k in _FACTOR_PARTS}
    out["rank"] = torch.cat([p[0] for p in pieces["rank"]], 1)
    for k in ("us", "vt", "us_scale", "vt_scale"):
        if pieces[k]:
            heads = len(pieces[k][0])
            out[k] = torch.cat([p[g] for g in range(heads) for p in pieces[k]])
    return fz.Factors(out["us"], out["vt"], out["rank"], out["us_scale"], out["vt_scale"])


def final_layer(t: dict[str, torch.Tensor], li: int, params: SekvParams) -> dict[str, torch.Tensor]:
    """Layer li's pack tensors that need no other layer, of a whole document compressed as one window with its factors
    coded there (compress._code_factors): the full-resolution tokens, coarse entries (keys in the store dtype) and
    factor codes with their row scales coded (codec.code_scales).  What :func:`merge` makes of them; the pipelined
    ingest writes them as compress makes them (compress_windows's ``emit``)."""
    from .compress import codec_configs

    sdt = t[f"full.k.{li}"].dtype
    out = {f"sekv.full.{kv}.{li}": t[f"full.{kv}.{li}"] for kv in "kv"}
    out[f"sekv.coarse.k.{li}"] = t[f"coarse.k.{li}"].to(sdt)
    out[f"sekv.coarse.v.{li}"] = t[f"coarse.v.{li}"]
    for kind, cfg in zip(("fk", "fv"), codec_configs(params)):
        names = codec.code_names(cfg["levels"]) + ("vt.lead", "rank")
        coded = {n: t[f"{kind}.{li}.{n}"] for n in names}
        coded.update(codec.code_scales({n: t[f"{kind}.{li}.{n}"] for n in ("us_scale", "vt_scale")}, cfg["scales"]))
        out.update({f"sekv.{kind}.{li}.{n}": v for n, v in coded.items()})
    return out


def merge(pieces: list[Piece], moments: list[torch.Tensor], params: SekvParams, shape: ModelShape, n_tokens: int, lex_terms: torch.Tensor | None, trained,
          device=None, on_layer=None) -> dict[str, torch.Tensor]:
    """The pack's tensors (``sekv.*``) from the windows' pieces, in token order (consumed: their tensors are freed
    layer by layer).  ``moments``: per layer the keys' second moment summed over the windows (router.second_moment);
    ``device``: where the router's PCA and the factor codec run (the prefill's); ``on_layer(li)``: called as each
    layer is merged (progress)."""
    from .compress import codec_configs, lengths

    L, hkv, d, H = shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.n_heads
    mn, mx, w = lengths(n_tokens, params)
    seg = _global_segmentation(pieces, n_tokens)
    inv = rope.inv_freq_of(shape)
    pre = params.key_space == "pre_rope" and inv is not None
    out: dict[str, torch.Tensor] = {
        "sekv.config": torch.tensor([n_tokens, L, hkv, d, mn, mx, w, params.n_sink if params.anchors else 0], dtype=torch.long),
        "sekv.key_space": torch.tensor([int(pre)], dtype=torch.long),
        "sekv.span_start": seg.span_start,
        "sekv.span_end": seg.span_end,
        "sekv.full_idx": seg.full_idx,
        "sekv.anchor_idx": seg.anchor_idx,
    }
    kcfg, vcfg = codec_configs(params)
    if params.coded:
        out[codec.CONFIG] = codec.config_tensor(**kcfg)
        if vcfg != kcfg:
            out[codec.config_name("fv")] = codec.config_tensor(**vcfg)
    if pre:
        out["sekv.rope_inv_freq"] = inv
        out["sekv.rope_scaling"] = torch.tensor([shape.rope_attention_scaling], dtype=torch.float32)
    out["sekv.router.tau"] = torch.full((L, H), params.tau or router.TAU_DEFAULT, dtype=torch.float32)
    out["sekv.scout.profile"] = _cat([p.tensors.pop("scout.profile") for p in pieces])
    if all("prior.kvzip" in p.tensors for p in pieces):  # the scout's KVzip prior (4 bytes a token, sekv/prior.py)
        out["sekv.prior.kvzip"] = _cat([p.tensors.pop("prior.kvzip") for p in pieces])
    if all("zoom.idx" in p.tensors for p in pieces):  # the zoom tier's tokens (sekv/zoom_tier.py)
        out["sekv.zoom.idx"] = _cat([p.tensors.pop("zoom.idx") + p.start for p in pieces])
    if lex_terms is not None:  # the scout's lexical evidence (4 bytes a token)
        out["sekv.lex.terms"] = lex_terms.to(torch.int32).cpu()
    unit = max(0, params.zoom_unit)
    if unit > 0 and seg.n_spans:
        out["sekv.scout.profile_blocks"] = torch.cat([p.tensors.pop("scout.profile_blocks", torch.zeros(0)) for p in pieces])
        out["sekv.scout.profile_unit"] = torch.tensor([unit], dtype=torch.long)
    if trained is not None:  # its W stays in the file: router.load reads it from there, found by this sha256
        from . import router_file

        out["sekv.router.ttau"] = trained.tau.float()
        out["sekv.router.sha256"] = layout.sha256_tensor(router_file.file_sha256(trained.path))
    sdt = pieces[0].tensors["full.k.0"].dtype
    # the untrained router's directions: every layer's eigenproblems in one batch (one decomposition's launches and
    # host syncs, not one per layer); each layer's scale below, from its span means
    dev = device if device is not None else moments[0].device
    dirs = router.pca_directions(torch.stack(moments).to(dev), n_tokens, params.d_r)
    span_len = seg.span_len
    lens = [p.seg.span_len for p in pieces]
    emitted = pieces[0].emitted if len(pieces) == 1 else set()
    for li in range(L):
        t = [p.tensors for p in pieces]
        if li in emitted:  # its final_layer() tensors are written already; the router is made from its span means here
            kbar = t[0][f"coarse.k.{li}"]
            ref = kbar if seg.n_spans else t[0][f"keys.{li}"]
            for k in [k for k in t[0] if f".{li}." in f".{k}." and not k.startswith("zoom.")]:
                del t[0][k]
            wl = router.pca_scaled(dirs[li], ref.to(dev)).cpu()
            out[f"sekv.router.w.{li}"] = wl.to(sdt)
            out[f"sekv.router.norm.{li}"] = router.span_norms(wl, kbar.to(sdt))
            if on_layer is not None:
                on_layer(li)
            continue
        for kv in "kv":
            out[f"sekv.full.{kv}.{li}"] = _cat([x.pop(f"full.{kv}.{li}") for x in t], 1)
        for part in zoom_tier.LAYER_PARTS:
            if f"zoom.{part}.{li}" in t[0]:
                out[f"sekv.zoom.{part}.{li}"] = _cat([x.pop(f"zoom.{part}.{li}") for x in t], 1)
        kbar = _cat([x.pop(f"coarse.k.{li}") for x in t], 1)
        out[f"sekv.coarse.k.{li}"] = kbar.to(sdt)
        out[f"sekv.coarse.v.{li}"] = _cat([x.pop(f"coarse.v.{li}") for x in t], 1)
        ref = kbar if seg.n_spans else _cat([x.pop(f"keys.{li}") for x in t], 1)
        for x in t:
            x.pop(f"keys.{li}", None)
        wl = router.pca_scaled(dirs[li], ref.to(dev)).cpu()
        out[f"sekv.router.w.{li}"] = wl.to(sdt)  # cast to the model's dtype at open
        out[f"sekv.router.norm.{li}"] = router.span_norms(wl, kbar.to(sdt))
        for kind, cfg in (("fk", kcfg), ("fv", vcfg)):
            if f"{kind}.{li}.vt.lead" in t[0]:  # one window, the whole document: coded where it was compressed
                names = codec.code_names(cfg["levels"]) + ("vt.lead", "rank")
                coded = {n: t[0].pop(f"{kind}.{li}.{n}") for n in names}
                coded.update(codec.code_scales({n: t[0].pop(f"{kind}.{li}.{n}") for n in ("us_scale", "vt_scale")}, cfg["scales"]))
                out.update({f"sekv.{kind}.{li}.{n}": v for n, v in coded.items()})
                continue
            parts = [({k: x.pop(f"{kind}.{li}.{k}") for k in _FACTOR_PARTS if f"{kind}.{li}.{k}" in x}, n) for x, n in zip(t, lens)]
            f = merge_factors(parts, d)
            if params.coded:  # at rest 4-bit (values: value_bits); decoded to int8 at open (layout.read_factors)
                out.update({f"sekv.{kind}.{li}.{n}": v for n, v in encode_factors(f, span_len, d, cfg, device).items()})
            else:
                out.update(f.tensors(f"sekv.{kind}.{li}"))
        if on_layer is not None:
            on_layer(li)
    return out


def encode_factors(f: fz.Factors, span_len: torch.Tensor, d: int, cfg: dict, device=None) -> dict[str, torch.Tensor]:
    """codec.encode_factors of a layer's merged (host) factors -> host tensors.  On a CUDA ``device`` the codes are
    made there: the CPU codes ~15-20 M elements/s on one thread, 5-10 minutes for the 160 factor tensors of a 70B
    model at 128K tokens (benchmarks/compress_ops.py's coded_per_s, docs/multi-gpu.md).  The same codes: the codec's steps on the int8
    factors are integer arithmetic, comparisons and IEEE float32 divisions, exact on both; the row scales' log8
    codes (log2, whose last bit may differ between libraries) stay on the host, as the layout's cheap part."""
    if device is None or torch.device(device).type != "cuda" or f.us_scale is None:
        return codec.encode_factors(f, span_len, d, **cfg)
    # the ranks stay on the host, where codec.encode_factors reads every size and index from them (no host sync)
    on = fz.Factors(f.us.to(device, non_blocking=True), f.vt.to(device, non_blocking=True), f.rank, f.us_scale, f.vt_scale)
    return {k: v.cpu() for k, v in codec.encode_factors(on, span_len, d, **cfg).items()}


def _cat(ts: list[torch.Tensor], dim: int = 0) -> torch.Tensor:
    """torch.cat, without the copy of one window's tensor (a whole document's: its pieces are consumed)."""
    return ts[0] if len(ts) == 1 else torch.cat(ts, dim)


def _global_segmentation(pieces: list[Piece], n_tokens: int) -> Segmentation:
    """The windows' segmentations at global token indices, as one."""
    cat = lambda name: torch.cat([getattr(p.seg, name) + p.start for p in pieces])  # noqa: E731
    return Segmentation(n_tokens, cat("full_idx"), cat("anchor_idx"), cat("span_start"), cat("span_end"))
