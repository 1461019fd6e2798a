"""The reference zoom-in step (the CPU's): decisions on the host, ragged gathers of the factors.

Per layer: route (the scout's ranking of zoom blocks, or the layer's own gates over whole spans), keep the
(KV group, block) pairs in priority order while their bytes fit the layer's cap (attention.select), gather and
rebuild the kept pairs' rows from the host factors, re-apply RoPE, place them per KV group and attend over
[full-res | coarse | appended | rebuilt] under one additive mask (sekv/attention.py).  A layer whose kept set is the
same as at its last step reuses the rows it rebuilt then.
"""

from __future__ import annotations

import torch

from . import factorize as fz
from . import scout
from .attention import build_mask, mixed_attention, place, select
from .budget import ZoomLedger
from .residents import Residents
from .scout import Ranking


class CpuStep:
    def __init__(self, res: Residents, ledger: ZoomLedger, ranking: Ranking | None):
        self.res, self.ledger, self.ranking = res, ledger, ranking
        self.cap: int | None = None
        self.held: list[tuple | None] = [None] * res.shape.n_layers  # per layer: (keep, rows K, rows V, slot blocks)
        self.base: torch.Tensor | None = None  # re-positioned: the last layer's rotated base keys (the scout reads them)
        self._kept: list[torch.Tensor | None] = [None] * res.shape.n_layers  # per layer: the last forward's keep [Hkv, B]

    def new_ask(self) -> None:
        self.held = [None] * self.res.shape.n_layers
        self._kept = [None] * self.res.shape.n_layers

    def kept(self, layer: int) -> torch.Tensor | None:
        """The (KV group, zoom block) pairs the layer's last forward read at full resolution [Hkv, B] bool (None: no
        forward this ask)."""
        return self._kept[layer]

    def begin_forward(self, n_new: int) -> None:
        self.cap = self.ledger.layer_cap()

    def resident_bytes(self) -> int:
        return 0

    def fold_stats(self) -> None:
        """The ledger is up to date after every layer."""

    def attend(self, layer, query, key, value, scaling):
        r = self.res.at_layer(layer)  # the pack on the layer's device
        keys, values = r.kv.append(layer, key, value)
        keep, expanded = self._choose(r, layer, query)
        self._kept[layer] = keep
        slots = None
        if r.layout is not None:  # re-positioned (sekv/positions.py): the base keys rotated to this kept set's slots
            base_slots, slots = r.layout.place(keep)
            self.base = r.base_keys(layer, base_slots)
            keys = torch.cat([self.base.unsqueeze(0), keys[:, :, r.n_base :]], 2)
            self.ledger.count_positions(r.layout.tokens(keep))
        slot_span, h2d = None, 0
        if keep.any():
            cached = self.held[layer]
            if cached is not None and torch.equal(cached[0], keep):  # the same blocks as this layer's last step
                rk, rv, slot_span = cached[1:]
            else:
                self.held[layer] = None  # release the old set before building the new one
                rk, rv, slot_span, h2d = self._rebuild(r, layer, keep, slots)
                self.held[layer] = (keep, rk, rv, slot_span)
            keys = torch.cat([keys, rk.unsqueeze(0)], 2)
            values = torch.cat([values, rv.unsqueeze(0)], 2)
        else:
            self.held[layer] = None
        mask = build_mask(
            n_heads=query.shape[1], n_q=query.shape[2], n_full=r.n_full, log_n=r.log_n, expanded=expanded,
            n_tail=r.kv.len[layer] - r.n_base, slot_span=slot_span, dtype=query.dtype, coarse=r.coarse_mask(expanded),
            hidden=r.hidden.row(r.device),
        )
        out = mixed_attention(query, keys, values, mask, scaling)
        self._account(r, layer, keep, expanded, h2d)
        return out

    def _choose(self, r: Residents, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """-> keep [Hkv, B] (the (group, block) pairs to rebuild), expanded [H, B] (what each query head sees)."""
        cap = self.cap
        H, hkv, B, dev = query.shape[1], r.shape.n_kv_heads, r.n_blocks, query.device
        if B == 0 or cap == 0:  # nothing to zoom / the persistent part fills the budget
            return torch.zeros(hkv, B, dtype=torch.bool, device=dev), torch.zeros(H, B, dtype=torch.bool, device=dev)
        if self.ranking is not None and self.ranking.ranks():  # one ranking of zoom blocks for every layer
            cand = torch.ones(H, B, dtype=torch.bool, device=dev)
            prio = self.ranking.on(dev).view(1, -1).expand(hkv, -1)
            keep = select(prio, r.block_cost, cap)
        else:  # the layer's gates over whole spans; a kept span is all of its blocks
            lay = r.layout  # re-positioned: the coarse keys at their slots with nothing zoomed
            cand, prio = r.gate_priorities(layer, query, None if lay is None else r.base_keys(layer, lay.place(torch.zeros(hkv, B, dtype=torch.bool, device=dev))[0]))
            keep = select(prio, r.cost, cap)
            if not r.whole_spans:
                cand, keep, prio = cand[:, r.block_span_dev], keep[:, r.block_span_dev], prio[:, r.block_span_dev]
        if r.layout is not None:  # the window is the cap
            keep = r.layout.cap(keep, prio)
        expanded = keep.unsqueeze(1).expand(hkv, H // hkv, B).reshape(H, B)
        if r.head_masks:  # SPEC §2.6: each head sees the tokens only of spans it wanted itself
            expanded = expanded & cand
        return keep, expanded

    def _fetch(self, layer: int, g: torch.Tensor, b: torch.Tensor) -> fz.Fetch:
        """The factor rows of (factor head g, zoom block b) pairs (host indices; g >= Hkv: value heads)."""
        r = self.res
        f, lay = r.factors[layer]
        return fz.gather(f, lay, r.span_len, g, r.block_span[b], r.shape.head_dim, row0=r.block_off[b], rows=r.block_len[b])

    def _rebuild(self, r: Residents, layer: int, keep: torch.Tensor, slots: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """Fetch + rebuild the kept (group, block) pairs -> rows K / V [Hkv, U, d], slot block ids [Hkv, U], bytes
        moved to the compute device.  slots [Hkv, B]: each block's first position where they are re-positioned."""
        d, hkv = r.shape.head_dim, r.shape.n_kv_heads
        g, i = torch.nonzero(keep.cpu(), as_tuple=True)  # sorted by group, then block
        g2, i2 = torch.cat([g, g + hkv]), torch.cat([i, i])  # K blocks, then V blocks
        dev = self._fetch(layer, g2, i2).to(r.device)
        rows = fz.expand(dev, d, torch.float32)  # [2E, n_max, d]
        e = g.numel()
        idev = i.to(r.device)
        scouting = self.ranking is not None and self.ranking.scouting
        if r.zoom_tier is not None and not scouting:  # the pack's zoom tier: the covered tokens' own K / V replace the
            # rebuilt rows (not in the scout pass, which ranks by the factors, as the batched step's)
            n_max = rows.shape[1]
            j = torch.arange(n_max, device=r.device).view(1, -1)
            tok = (r.block_start_dev[idev].view(-1, 1) + j).expand(e, n_max)
            grp = g.to(r.device).view(-1, 1).expand(e, n_max)
            hit, tk, tv = r.zoom_tier.lookup(layer, grp.flatten(), tok.flatten(), (j < r.block_len_dev[idev].view(-1, 1)).flatten())
            hit = hit.view(e, n_max, 1)
            rows[:e] = torch.where(hit, tk.view(e, n_max, d).float(), rows[:e])
            rows[e:] = torch.where(hit, tv.view(e, n_max, d).float(), rows[e:])
        rows[:e] = self._rotate(r, rows[:e], r.block_start_dev[idev] if slots is None else slots[g.to(r.device), idev])
        out, blk, _ = place(rows.to(r.shape.dtype), g2.to(r.device), r.block_len_dev[i2.to(r.device)], 2 * hkv)
        slot_span = torch.where(blk[:hkv] >= 0, idev[blk[:hkv].clamp_min(0)], torch.full_like(blk[:hkv], -1))
        return out[:hkv], out[hkv:], slot_span, dev.nbytes()

    def _rotate(self, r: Residents, rows: torch.Tensor, start: torch.Tensor) -> torch.Tensor:
        """Rebuilt key rows [E, n_max, d] of blocks starting at token positions start [E], rotated to their positions."""
        pos = start.view(-1, 1) + torch.arange(rows.shape[1], device=rows.device).view(1, -1)
        return r.rotate(rows, pos)

    def _account(self, r: Residents, layer: int, keep: torch.Tensor, expanded: torch.Tensor, h2d: int) -> None:
        if keep.numel() == 0:
            return
        led = self.ledger
        led.resident += int((keep.long() * r.block_len_dev.view(1, -1)).sum()) * r.entry_bytes
        led.count(layer, r.span_level(keep), r.span_level(expanded), h2d)  # a span is zoomed when any of its blocks is

    # -- the scout pass -------------------------------------------------------------------------------------

    def block_lse(self, layer: int, q: torch.Tensor, scaling: float):
        """The scout's logsumexps of every zoom block's rebuilt keys (post-RoPE) for queries q [Hkv, M, d], in
        chunks of about the layer's cap in rebuilt keys (at least one block): -> (lse [E, M], group [E], block [E])."""
        r = self.res.at_layer(layer)
        d, hkv = r.shape.head_dim, r.shape.n_kv_heads
        per_block = hkv * int(r.block_len.max()) * d * 4
        chunk = max(1, int((self.cap or per_block) // per_block))
        start = r.block_start_dev if r.layout is None else r.layout.scout_positions()
        lse, grp, sid = [], [], []
        for a in range(0, r.n_blocks, chunk):
            b = torch.arange(a, min(a + chunk, r.n_blocks)).repeat(hkv)
            g = torch.arange(hkv).repeat_interleave(b.numel() // hkv)
            gd, bd = g.to(r.device), b.to(r.device)
            rows = self._rotate(r, fz.expand(self._fetch(layer, g, b).to(r.device), d, torch.float32), start[bd])
            lse.append(scout.span_logsumexp(q, rows, r.block_len_dev[bd], gd, scaling))
            grp.append(gd)
            sid.append(bd)
        return torch.cat(lse), torch.cat(grp), torch.cat(sid)
