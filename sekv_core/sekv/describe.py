"""`sekv inspect` for a sekv pack: spans, zoom blocks, ranks, at-rest storage (factors, zoom tier), sizes."""

from __future__ import annotations

from typing import Any

import torch

from . import codec, layout
from .params import SekvParams
from .segment import zoom_blocks


def _rank_histogram(r: torch.Tensor) -> dict[str, int]:
    return {
        "0-4": int((r <= 4).sum()),
        "5-8": int(((r >= 5) & (r <= 8)).sum()),
        "9-16": int(((r >= 9) & (r <= 16)).sum()),
        "17-32": int(((r >= 17) & (r <= 32)).sum()),
        **({">32": int((r > 32).sum())} if bool((r > 32).any()) else {}),
    }


def _factor_storage(store, names: set[str]) -> str:
    if codec.CONFIG in names:
        c, cv = (codec.kind_config(store, names, k) for k in ("fk", "fv"))
        vals = f"values {codec.bits_of(cv['levels'])}-bit {cv['levels']} in groups of {cv['group']}, keys " if cv != c else ""
        return (f"4-bit at rest ({c['levels']}, {vals}groups of {c['group']}, us {c['order']}-major, {c['lead']} leading vt row(s) int8, "
                f"row scales {c['scales']}), int8 in memory")
    return "int8" if "sekv.fk.0.us_scale" in names else "float"


def describe(store, params: SekvParams) -> dict[str, Any]:
    cfg = layout.read_config(store)
    n, L, hkv, d = cfg["n_tokens"], cfg["n_layers"], cfg["n_kv_heads"], cfg["head_dim"]
    names = set(store.keys())
    start, end = store.get("sekv.span_start"), store.get("sekv.span_end")
    lens = (end - start).float()
    n_full = int(store.get("sekv.full_idx").numel())
    hist = {}
    for kind, label in (("fk", "keys"), ("fv", "values")):
        r = torch.cat([store.get(f"sekv.{kind}.{i}.rank").flatten().long() for i in range(L)]) if lens.numel() else torch.zeros(0)
        hist[label] = _rank_histogram(r)
    nbytes = {k: store.get(k).numel() * store.get(k).element_size() for k in names if k.startswith("sekv.")}
    tensor_bytes = sum(nbytes.values())
    factor_bytes = sum(b for k, b in nbytes.items() if k.startswith(("sekv.fk.", "sekv.fv.")))
    raw = n * 2 * L * hkv * d * 2
    unit = max(0, params.zoom_unit)
    lex = store.get("sekv.lex.terms") if "sekv.lex.terms" in names else None
    sha = layout.router_sha256(store, names)
    return {
        "spans": int(lens.numel()),
        "mean_span_tokens": round(float(lens.mean()), 1) if lens.numel() else 0.0,
        "zoom_unit": unit,
        "zoom_blocks": int(zoom_blocks(start, end, unit)[0].numel()),
        "lexical_terms": int((lex >= 0).sum()) if lex is not None else 0,  # tokens with a word term for the scout
        "full_resolution_tokens": n_full,
        "full_resolution_share": round(n_full / max(n, 1), 4),
        "anchors": int(store.get("sekv.anchor_idx").numel()),
        "window": cfg["window"],
        "key_space": "pre_rope" if int(store.get("sekv.key_space")[0]) else "post_rope",
        "router": f"trained (sha256 {sha[:12]})" if sha else "untrained",
        "effective_rank_histogram": hist,
        "factors": _factor_storage(store, names),
        "factor_bytes": int(factor_bytes),
        "factor_share": round(factor_bytes / max(tensor_bytes, 1), 4),
        # what a zoomed block is read from (sekv/zoom_tier.py): the span tokens' own K / V, or the factors alone
        "zoom_tier": ("int8" if "sekv.zoom.ks.0" in names else "exact") if "sekv.zoom.idx" in names else "factors",
        "zoom_tier_bytes": int(sum(b for k, b in nbytes.items() if k.startswith("sekv.zoom."))),
        "pack_tensor_bytes": int(tensor_bytes),
        "raw_kv_fp16_bytes": int(raw),
        "pack_vs_raw": round(tensor_bytes / max(raw, 1), 4),
    }
