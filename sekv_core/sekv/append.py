"""Append: a sekv pack + the compressed windows of documents added after it -> the tensors of the extended pack.

`sekv add` prefills the added documents on their own, in windows that continue the pack's (sekv_core/windows.py
plan_append), and compresses each window as windowed ingest does (sekv/compress.py compress_window, with the pack's
span lengths and window).  Here they join the pack's tensors at their global token indices, the pack's own tensors
kept as they are:

* spans, full-resolution tokens, anchors, coarse entries, scout profiles, lexical terms: concatenated in token order;
* factors: appended to every (KV head) run of the packed layout (sekv/merge.py merge_factors); coded (factor_bits
  4) factors as a new segment coded on its own (sekv/codec.py, segments), the pack's segments untouched;
* the zoom tier (sekv/zoom_tier.py), where the pack has one: the added span tokens' rows after the pack's;
* the untrained router's projection W stays the pack's (its PCA was fit on the pack's keys; the key moments it came
  from are not stored), the added spans' norms computed with it; a trained router must be the one the pack names.
"""

from __future__ import annotations

import torch

from ..errors import SekvError
from . import codec, layout, router, zoom_tier
from .merge import Piece, _FACTOR_PARTS, _global_segmentation, merge_factors
from .params import SekvParams


def pack_lengths(store) -> dict[str, int]:
    """The span lengths and window the pack was segmented with (its ``sekv.config``): the added windows use them."""
    cfg = layout.read_config(store)
    return {"min_span": cfg["min_span"], "max_span": cfg["max_span"], "window": cfg["window"]}


def append(store, pieces: list[Piece], params: SekvParams, n_tokens: int, lex_terms: torch.Tensor | None, trained_sha: str) -> dict[str, torch.Tensor]:
    """The extended pack's tensors (``sekv.*``): ``store``'s (an opened, checked pack) with ``pieces`` (the added
    windows, in order, global positions) after them; ``n_tokens`` the extended document's count; ``lex_terms`` the
    added tokens' word terms; ``trained_sha`` the trained router the pieces were compressed with ("" untrained)."""
    names = set(store.keys())
    old = {k: store.get(k) for k in names}
    cfg = layout.read_config(store)
    L, n_old = cfg["n_layers"], cfg["n_tokens"]
    if layout.router_sha256(store, names) != trained_sha:
        raise SekvError("the pack was made with another router than the one found now (--router); add with the pack's router, or re-ingest")
    seg = _global_segmentation(pieces, n_tokens)
    out = dict(old)
    c = old["sekv.config"].clone()
    c[0] = n_tokens
    out["sekv.config"] = c
    for k in ("span_start", "span_end", "full_idx", "anchor_idx"):
        out[f"sekv.{k}"] = torch.cat([old[f"sekv.{k}"], getattr(seg, k)])
    S_old, S_new = int(old["sekv.span_start"].numel()), seg.n_spans
    out["sekv.scout.profile"] = torch.cat([old["sekv.scout.profile"], *(p.tensors.pop("scout.profile") for p in pieces)])
    blocks = [p.tensors.pop("scout.profile_blocks", torch.zeros(0)) for p in pieces]
    if "sekv.scout.profile_blocks" in names or any(b.numel() for b in blocks):
        out["sekv.scout.profile_blocks"] = torch.cat([old.get("sekv.scout.profile_blocks", torch.zeros(0)), *blocks])
        out.setdefault("sekv.scout.profile_unit", torch.tensor([max(0, params.zoom_unit)], dtype=torch.long))
    if "sekv.lex.terms" in names:
        if lex_terms is None or lex_terms.numel() != n_tokens - n_old:
            raise SekvError("the added documents' word terms are missing")
        out["sekv.lex.terms"] = torch.cat([old["sekv.lex.terms"], lex_terms.to(torch.int32).cpu()])
    tier = "sekv.zoom.idx" in names  # the pack's zoom tier (sekv/zoom_tier.py): the added span tokens join it
    idx = [p.tensors.pop("zoom.idx", None) for p in pieces]
    if tier:
        if any(i is None for i in idx):
            raise SekvError("the pack keeps its span tokens' K / V (zoom tier) and the added documents' are missing; add with the pack's parameters")
        out["sekv.zoom.idx"] = torch.cat([old["sekv.zoom.idx"], *(i + p.start for i, p in zip(idx, pieces))])
    coded = codec.CONFIG in names or codec.config_name("fv") in names
    segs = codec.segments(store, names) or [0, S_old]
    if coded and S_new:
        out[codec.SEGMENTS] = torch.tensor(segs + [S_old + S_new], dtype=torch.long)
    kcfg, vcfg = codec.kind_config(store, names, "fk"), codec.kind_config(store, names, "fv")
    span_len = seg.span_len
    lens = [p.seg.span_len for p in pieces]
    d = cfg["head_dim"]
    for li in range(L):
        t = [p.tensors for p in pieces]
        for x in t:
            x.pop(f"moment.{li}", None)
            x.pop(f"keys.{li}", None)
        sdt = old[f"sekv.full.k.{li}"].dtype
        for kv in "kv":
            out[f"sekv.full.{kv}.{li}"] = torch.cat([old[f"sekv.full.{kv}.{li}"], *(x.pop(f"full.{kv}.{li}").to(sdt) for x in t)], 1)
        kbar = torch.cat([x.pop(f"coarse.k.{li}") for x in t], 1).to(sdt)
        out[f"sekv.coarse.k.{li}"] = torch.cat([old[f"sekv.coarse.k.{li}"], kbar], 1)
        out[f"sekv.coarse.v.{li}"] = torch.cat([old[f"sekv.coarse.v.{li}"], *(x.pop(f"coarse.v.{li}").to(sdt) for x in t)], 1)
        for part in zoom_tier.LAYER_PARTS:
            got = [x.pop(f"zoom.{part}.{li}", None) for x in t]
            if tier and f"sekv.zoom.{part}.{li}" in names:
                out[f"sekv.zoom.{part}.{li}"] = torch.cat([old[f"sekv.zoom.{part}.{li}"], *(g.to(old[f"sekv.zoom.{part}.{li}"].dtype) for g in got)], 1)
        w = old[f"sekv.router.w.{li}"]
        out[f"sekv.router.norm.{li}"] = torch.cat([old[f"sekv.router.norm.{li}"], router.span_norms(w.float(), kbar).float()], 1)
        for kind, kc in (("fk", kcfg), ("fv", vcfg)):
            prefix = f"sekv.{kind}.{li}"
            new = merge_factors([({k: x.pop(f"{kind}.{li}.{k}") for k in _FACTOR_PARTS if f"{kind}.{li}.{k}" in x}, n) for x, n in zip(t, lens)], d)
            if not S_new:
                continue
            if coded:
                j = len(segs) - 1
                for part, v in codec.encode_factors(new, span_len, d, **kc).items():
                    if part != "rank":
                        out[codec.segment_name(prefix, j, part)] = v
                out[f"{prefix}.rank"] = torch.cat([old[f"{prefix}.rank"], new.rank], 1)
            else:  # int8 or float factors: the packed runs joined (merge_factors), exactly
                mine = {k: old[f"{prefix}.{k}"] for k in _FACTOR_PARTS if f"{prefix}.{k}" in names}
                both = merge_factors([(mine, (old["sekv.span_end"] - old["sekv.span_start"]).long()), ({k: getattr(new, k) for k in _FACTOR_PARTS if getattr(new, k) is not None}, span_len)], d)
                out.update(both.tensors(prefix))
    return out
