"""What an ask read of given document tokens: at full resolution, zoomed, or only through their span's coarse entry.

A diagnostic (``sekv bench``'s ``needle_coverage``): for each token position, from the memory's state after an answer
whose first forward was recorded (``ZoomMemory.record_kept``: each layer's kept (KV group, zoom block) pairs, the
ranking and the hidden columns of that forward; nothing is recomputed, no forward is run).

* ``exact``: a full-resolution token of the pack (sinks, anchors, number tokens, the end window: ``sekv.full_idx``),
  read as the prefill made it (``hidden`` says whether the question hid it: sekv/residents.py HiddenColumns).
* ``zoomed``: a span token whose zoom block every layer's every KV group held at full resolution; its rows came from
  the pack's zoom tier (``zoom_source`` "tier int8" / "tier exact": the prefill's own K / V) or from the factors'
  rebuild ("factors").
* ``partly zoomed``: held by some (layer, group) pairs, not all (``zoom_share``: the share that held it).
* ``coarse``: a span token no pair held: read only through its span's coarse entry.
* ``unknown``: a span token, but no ranked forward was recorded (record_kept off, or no ranking: per-layer routing).
* ``outside``: not a document position (appended tokens, out of range).
"""

from __future__ import annotations

import torch


def _index_in(sorted_vals: torch.Tensor, order: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
    """For each pos, the index (into the unsorted values) of an equal value, or -1."""
    if sorted_vals.numel() == 0:
        return torch.full_like(pos, -1)
    i = torch.searchsorted(sorted_vals, pos).clamp_max(sorted_vals.numel() - 1)
    return torch.where(sorted_vals[i] == pos, order[i], torch.full_like(pos, -1))


def token_coverage(mem, positions) -> dict:
    """mem: a ZoomMemory; positions: document token positions.  -> {"resolution", "hidden", "zoom_share",
    "zoom_source", "span", "block", "block_rank": per position (None where not applicable), "blocks": {block id:
    {"span", "start", "end", "rank", "share", "layers_held"}} for the blocks of the positions, "zoomed_per_layer":
    per layer the positions zoomed there by every KV group, "kept_blocks": [min, max] blocks a (layer, group) held,
    "n_blocks": the pack's zoom blocks}."""
    r = mem.res
    pos = torch.as_tensor(list(positions), dtype=torch.long).reshape(-1)
    n = int(pos.numel())
    rec = getattr(mem, "_kept_first", None)
    kept = None
    if rec is not None and all(k is not None for k in rec["kept"]):
        kept = torch.stack([k.cpu() for k in rec["kept"]])  # [L, Hkv, B]
    # full-resolution tokens
    fp = r.full_pos.long().cpu()
    f_sorted, f_order = torch.sort(fp)
    full_col = _index_in(f_sorted, f_order, pos)
    hidden_cols = set() if rec is None or rec["hidden"] is None else set(rec["hidden"].tolist())
    if rec is None and r.hidden.cols is not None:
        hidden_cols = set(r.hidden.cols.tolist())
    # zoom blocks (in span order: sorted by start, they tile the spans)
    bstart, blen, bspan = r.block_start.long().cpu(), r.block_len.long().cpu(), r.block_span.long().cpu()
    blk = torch.full_like(pos, -1)
    if bstart.numel():
        b_sorted, b_order = torch.sort(bstart)
        cand = b_order[(torch.searchsorted(b_sorted, pos, right=True) - 1).clamp_min(0)]
        inside = (pos >= bstart[cand]) & (pos < bstart[cand] + blen[cand])
        blk = torch.where(inside, cand, blk)
    # the ranking's order (stable: ties in block order, as select / select_topk take them)
    prio = rec["prio"] if rec is not None else (mem.ranking.prio if mem.ranking is not None else None)
    rank_of = None
    if prio is not None and r.n_blocks:
        order = torch.argsort(prio.float().cpu(), descending=True, stable=True)
        rank_of = torch.empty_like(order)
        rank_of[order] = torch.arange(order.numel())
    tier = r.zoom_tier
    tier_pos = tier.pos.long().cpu() if tier is not None else torch.zeros(0, dtype=torch.long)
    t_sorted, t_order = torch.sort(tier_pos)
    in_tier = _index_in(t_sorted, t_order, pos) >= 0
    tier_name = None if tier is None else "tier int8" if tier.int8 else "tier exact"

    out = {k: [None] * n for k in ("resolution", "zoom_share", "zoom_source", "span", "block", "block_rank")}
    out["hidden"] = [False] * n
    blocks: dict[int, dict] = {}
    for t in range(n):
        if full_col[t] >= 0:
            out["resolution"][t] = "exact"
            out["hidden"][t] = int(full_col[t]) in hidden_cols
            continue
        b = int(blk[t])
        if b < 0:
            out["resolution"][t] = "outside"
            continue
        out["block"][t], out["span"][t] = b, int(bspan[b])
        out["block_rank"][t] = None if rank_of is None else int(rank_of[b])
        if kept is None:
            out["resolution"][t] = "unknown"
        else:
            held = kept[:, :, b]  # [L, Hkv]
            share = float(held.float().mean())
            out["zoom_share"][t] = round(share, 4)
            out["resolution"][t] = "zoomed" if share == 1.0 else "coarse" if share == 0.0 else "partly zoomed"
            if share > 0:
                out["zoom_source"][t] = tier_name if tier is not None and bool(in_tier[t]) else "factors"
        if b not in blocks:
            s0 = int(bstart[b])
            blocks[b] = {"span": int(bspan[b]), "start": s0, "end": s0 + int(blen[b]), "rank": out["block_rank"][t],
                         "share": out["zoom_share"][t],
                         "layers_held": None if kept is None else int(kept[:, :, b].all(1).sum())}
    res = {**out, "blocks": blocks, "n_blocks": int(r.n_blocks), "zoomed_per_layer": None, "kept_blocks": None}
    if kept is not None:
        valid = blk >= 0
        per = kept[:, :, blk.clamp_min(0)].all(1) & valid.view(1, -1)  # [L, n]: zoomed by every group of the layer
        res["zoomed_per_layer"] = per.sum(1).tolist()
        counts = kept.sum(-1)  # [L, Hkv]
        res["kept_blocks"] = [int(counts.min()), int(counts.max())]
    return res
