"""Fixed sets of the batched step: the kept blocks under a ranking, rebuilt once, attended many times.

Under scout routing (and zoom "all") the kept set depends only on the question's ranking and the cap, not on
the step's query, so it is the same for every forward of an answer.  Its rows live in the *annex* of the
resident K/V buffers (``GrowingKV.set_annex``), U / Hkv rows per KV group: each group keeps the top of the
ranking that fits its share, its rows written group-major after the resident capacity.  The forward that fills
the set records it (the kept blocks, each group's row count); later forwards with the same slots and ranking
only attend, with **one** SDPA call over resident memory and slots together (an additive mask: coarse entries
with +log n_i or hidden, the tail by length, each group's filled rows): no fetch, no rebuild, nothing crosses
PCIe.  A reused forward counts the stats its fill recorded (folded into the ledger when stats are read).
"""

from __future__ import annotations

import time

import torch
import torch.nn.functional as F

from . import blocks as fb
from . import rope
from .budget import ZoomLedger, zoom_stats
from .residents import Residents
from .scout import Ranking


#: how the one SDPA call is made, for comparing the kernels a device picks (benchmarks/cli_probe.py sets it from
#: $SEKV_PROBE_FIXED_SDPA): "gqa", ``enable_gqa`` under the per-head mask (a masked GQA call has no flash or
#: memory-efficient kernel on CUDA: torch takes cuDNN's, whose plan is built per new shape, or the math one);
#: "packed", :func:`grouped_attention` (plain multi-head attention, which the memory-efficient kernel takes, but
#: with one thread block per KV head and query tile: little parallelism for one token over a long memory);
#: "math", the math kernel forced.  All three are the same attention (tests).
SDPA_LAYOUT = "gqa"
#: the same for a forward of several tokens (the question's, which fills the sets), None: SDPA_LAYOUT.  cuDNN builds
#: its plan per new shape (tens to hundreds of ms, more where a kernel variant is compiled: docs/gpu.md, "The zoom
#: tier's read"), and every question has its own length; "packed" is plain multi-head attention, which
#: :func:`grouped_attention` gives on CUDA to the memory-efficient kernel through its own operator (no plan; through
#: SDPA torch 2.11 on an H200 picks cuDNN for it: docs/gpu.md, "The first token").  benchmarks/cli_probe.py sets
#: this from $SEKV_PROBE_FILL_SDPA, to compare on a device
FILL_SDPA_LAYOUT: str | None = "packed"

#: the host's seconds in a fill's parts, summed over layers: the plan (made by the first layer), the fetch and
#: rebuild (the tier's rows waited for included), the attention of the forward that filled (its masks, the SDPA call)
HOST_TIMES = ("plan_s", "fill_s", "fill_attention_s")


class FixedSets:
    """Each layer's set, masks and tables on its layer's device (a model placed across devices: the plan made once a
    device); the recorded stats on the ledger's device."""

    def __init__(self, res: Residents, ledger: ZoomLedger, ranking: Ranking, blocks: list[fb.Blocks]):
        self.res, self.ledger, self.ranking, self.blocks = res, ledger, ranking, blocks
        L, S, dev = res.shape.n_layers, res.n_spans, res.device
        self.hkv = res.shape.n_kv_heads
        self.min_block = int(res.block_len.min()) if res.n_blocks else 1
        self.max_block = int(res.block_len.max()) if res.n_blocks else 1
        self.keep: list[torch.Tensor] = []  # per layer: the kept (group, block) pairs [Hkv, B]
        self.n: list[torch.Tensor] = []  # per layer: each group's filled rows [Hkv]
        self.filled_for: list = [None] * L  # per layer: the key() its set was filled for
        self.mask: list = [None] * L  # per layer: [1, H, 1, capacity + rows] (a step only unmasks its own token)
        self.reused_now = [False] * L
        self._folded_for = None  # the key whose first fill folded every layer's reuses
        # what each layer's fill recorded, added to the ledger once per reuse (reuses counts them)
        self.reuses = torch.zeros(L, dtype=torch.long, device=dev)
        self.spans = torch.zeros(L, S, dtype=torch.bool, device=dev)
        self.counts = torch.zeros(L, S, dtype=torch.long, device=dev)
        self.rate = torch.zeros(L, dtype=torch.float64, device=dev)
        #: one device: every layer's block table [L, Hkv * S] (the batched step stacks them), else None
        self.last_all: torch.Tensor | None = None
        #: host seconds of this ask's fills (HOST_TIMES): where a first forward's launches wait (step_stats' first_token_parts)
        self.host_s = dict.fromkeys(HOST_TIMES, 0.0)

    def key(self, u: int):
        """Identity of this forward's kept set when it cannot depend on the query (under a ranking), else None:
        (slot count, ranking version, resident buffers' generation, truncations: a truncated tail must be
        hidden again, which the fill's mask does; the full-resolution columns hidden for the question, which the
        fill's mask hides: sekv/residents.py HiddenColumns)."""
        if not self.ranking.ranks():
            return None
        return (u, self.ranking.version, self.res.kv.generation, self.res.kv.truncations, self.res.hidden.key)

    def reusable_layers(self, key) -> list[bool]:
        return [key is not None and x == key for x in self.filled_for]

    def allocate(self, rows: int) -> None:
        r, L, devs = self.res, self.res.shape.n_layers, self.res.layer_devices
        r.kv.set_annex(rows)  # a realloc of the resident buffers
        if r.split:
            self.keep = [torch.zeros(self.hkv, r.n_blocks, dtype=torch.bool, device=dev) for dev in devs]
            self.n = [torch.zeros(self.hkv, dtype=torch.long, device=dev) for dev in devs]
        else:  # one device: every layer's table a view of one tensor, a fill's (the same for every layer) written once
            self._keep_all = torch.zeros(L, self.hkv, r.n_blocks, dtype=torch.bool, device=r.device)
            self._n_all = torch.zeros(L, self.hkv, dtype=torch.long, device=r.device)
            self.keep, self.n = list(self._keep_all.unbind(0)), list(self._n_all.unbind(0))
        self.filled_for = [None] * L
        self.mask = [None] * L
        self._mask_all = None
        self._folded_for = None
        #: re-positioned: each layer's base entries' slots under its set
        self.base_slots = [torch.zeros(self.hkv, r.n_base, dtype=torch.long, device=dev) for dev in devs]

    def mask_bytes(self, cap: int, rows: int) -> int:
        """The masks: one column per resident entry (capacity cap) and per annex row, every head, every layer."""
        r = self.res
        isz = r.entry_bytes // (2 * r.shape.head_dim)
        return r.shape.n_layers * r.shape.n_heads * (cap + rows) * isz

    def static_begin(self, key) -> None:
        self.reused_now = self.reusable_layers(key)  # what a replayed step does
        # every layer reuses its set, and every layer's mask is a view of one tensor (one device): the step's first
        # layer unmasks the new token's column and counts the reuse for all layers at once (two kernels a step, not
        # three a layer)
        self.all_reused = all(self.reused_now) and getattr(self, "_mask_all", None) is not None and not self.res.split

    # -- stats ----------------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        for t in (self.reuses, self.spans, self.counts, self.rate):
            t.zero_()
        self.host_s = dict.fromkeys(HOST_TIMES, 0.0)

    def _fold(self, layer: int | None = None) -> None:
        """Add the reuses counted (all layers, or one) to the ledger: each is one forward of the recorded stats."""
        sl = slice(None) if layer is None else slice(layer, layer + 1)
        w, led = self.reuses[sl], self.ledger
        led.span_counts += (w.view(-1, 1) * self.counts[sl]).sum(0)
        led.rate_sum[sl] += w.double() * self.rate[sl]
        led.ask_spans |= ((w.view(-1, 1) > 0) & self.spans[sl]).any(0)
        w.zero_()

    def fold_stats(self) -> None:
        with torch.inference_mode():  # the stats tensors were made inside a forward
            self._fold()
            now = [layer for layer, reused in enumerate(self.reused_now) if reused]
            if now:  # this step's spans include the reused sets'
                self.ledger.step_spans |= self.spans[now].any(0)

    # -- the step -------------------------------------------------------------------------------------------

    def attend(self, layer: int, query: torch.Tensor, scaling: float, lim, key) -> torch.Tensor:
        r = self.res.at_layer(layer)
        reuse = self.filled_for[layer] == key
        self.reused_now[layer] = reuse
        if reuse:
            if getattr(self, "all_reused", False) and torch.is_tensor(lim):  # a static step over reused sets only
                if layer == 0:
                    self.reuses.add_(1)
                    self._mask_all.index_fill_(-1, (lim - 1).view(1), 0.0)
                return self._joint_attention(layer, query, scaling, lim, fresh=False, unmasked=True)
            self.reuses[layer].add_(1)
            return self._joint_attention(layer, query, scaling, lim, fresh=False)
        if self._folded_for != key:  # before any layer's recorded stats are replaced: every layer at the key's first
            self._fold()  # fill, one fold for all (a layer that fills later for this key cannot have been reused since)
            self._folded_for = key
        t0 = time.perf_counter()
        plan = self._plan(r, key, r.kv.annex_kv(layer)[0].shape[-2], query.shape[1])
        t1 = time.perf_counter()
        words = self._fill(r, layer, plan)
        t2 = time.perf_counter()
        spans, counts, rate = plan["stats"]
        one = not self.res.split
        if not one:
            self.keep[layer].copy_(plan["keep"])
            self.n[layer].copy_(plan["n"])
            self.spans[layer].copy_(spans)
            self.counts[layer].copy_(counts)
            self.rate[layer].copy_(rate)
        elif not plan.get("written"):  # one device: every layer fills the plan's set; its tables and stats at once
            self._keep_all.copy_(plan["keep"])
            self._n_all.copy_(plan["n"])
            self.spans.copy_(spans)
            self.counts.copy_(counts)
            self.rate.copy_(rate)
            plan["written"] = True
        self.filled_for[layer] = key
        out = self._joint_attention(layer, query, scaling, lim, fresh=True, expanded=plan["expanded"])
        h = self.host_s
        h["plan_s"] += t1 - t0
        h["fill_s"] += t2 - t1
        h["fill_attention_s"] += time.perf_counter() - t2
        if one:  # the stats of the layers that filled it counted together when the plan is done with (_count_filled)
            plan.setdefault("filled", []).append(layer)
            if words is not None:
                self.ledger.add_h2d(words * 8)
        else:
            self.ledger.count(layer, plan["keep_s"], plan["exp_s"], words * 8, stats=plan["stats"])
        if layer == len(self.filled_for) - 1:  # the last layer: the plan's tables (rotations of every row) are not kept
            self._count_filled()
            self._plans = {}
        return out

    def _count_filled(self, device=None) -> None:
        """Count in the ledger the layers that filled the plans (of one device, or all) with their plan's stats."""
        for dev, (_, plan) in getattr(self, "_plans", {}).items():
            if device is None or dev == device:
                layers = plan.pop("filled", None)
                if layers:
                    self.ledger.count_layers(plan["stats"], layers)
                    if "words" in plan:  # the words each layer fetched, made once in the plan
                        w = plan["words"]
                        self.ledger.add_h2d((w.sum() if len(layers) == w.numel() else w[layers].sum()) * 8)

    def _plan(self, r: Residents, key, ug: int, h: int) -> dict:
        """What a fill takes from the ranking alone, the same for every layer (their block tables and row counts
        are): each group's top blocks that fit its ug rows, which pair fetches each span, each row's source row
        and position, the kept set at block and span level.  Computed by the first layer a key fills (on each
        device: r, the pack on the layer's), reused by the others: a layer's own work is its fetch, rebuild and copies."""
        cached = getattr(self, "_plans", {}).get(r.device)
        if cached is not None and cached[0] == (key, ug, h):
            return cached[1]
        self._count_filled(r.device)  # the plan replaced
        hkv, s, nb, dev = self.hkv, r.n_spans, r.n_blocks, r.device
        prio = self.ranking.on(dev).view(1, -1).expand(hkv, -1)
        pg = min(nb, ug // max(1, self.min_block) + 1)
        top, idx = torch.topk(prio, pg, dim=1, sorted=True)  # [Hkv, pg] blocks, the same for every group
        n = r.block_len_dev[idx]
        ok = torch.cumprod((torch.cumsum(n, 1) <= (ug if r.layout is None else min(ug, r.layout.room))).to(torch.int8), 1).bool()
        ok &= top > float("-inf")  # a block the ranking left out (Ranking.restrict)
        grp = torch.arange(hkv, device=dev).view(-1, 1)
        # a span's factor block is fetched once, by its first kept block; its other blocks read those rows (first
        # occurrence from a [pg, pg] comparison: no host sync)
        span = r.block_span_dev[idx]  # [Hkv, pg]
        first = (span.unsqueeze(2) == span.unsqueeze(1)).to(torch.int8).argmax(2)  # [Hkv, pg]: first pair of the same span
        fetch_ok = ok & (first == torch.arange(pg, device=dev).view(1, -1))
        n_ok = torch.where(ok, n, torch.zeros_like(n))
        ends = torch.cumsum(n_ok, 1)  # [Hkv, pg]
        t = torch.arange(ug, device=dev).view(1, -1).expand(hkv, -1).contiguous()
        p_of = torch.searchsorted(ends, t, right=True).clamp_max(pg - 1)  # row t of group g <- its pair p, row j
        j_of = t - (ends - n_ok).gather(1, p_of)
        slot_ok = (t < ends[:, -1:]).view(-1, 1)
        blk = idx.gather(1, p_of)  # row t of group g <- block blk, its row j_of, from the pair that fetched its span
        keep = torch.zeros(hkv, nb, dtype=torch.bool, device=dev).scatter_(1, idx, ok)
        plan = {"pair": (grp * s + span).flatten(), "fetch_ok": fetch_ok.flatten(), "slot_ok": slot_ok, "keep": keep, "n": ends[:, -1]}
        if self.last_all is not None and not self.res.split:  # each layer's last word of each pair, and words fetched
            plan["last"] = torch.where(plan["fetch_ok"], self.last_all[:, plan["pair"]], 0)  # [L, Hkv * pg]
            plan["words"] = plan["last"].sum(1) + plan["pair"].numel()
        # each row's source in the rebuilt [Hkv * pg, n_max] rows: pair, row (n_max: each layer's own, at the fill)
        ok_t = slot_ok.view(hkv, ug)
        plan["src_pair"] = torch.where(ok_t, grp * pg + first.gather(1, p_of), torch.zeros_like(t)).flatten()
        plan["src_row"] = torch.where(ok_t, r.block_off_dev[blk] + j_of, torch.zeros_like(t)).flatten()
        # _fill rebuilds only each kept block's rows: pair p's rows are its block's, from its span's fetched factors
        plan["own_pair"] = torch.where(ok_t, grp * pg + p_of, torch.zeros_like(t)).flatten()
        plan["own_row"] = torch.where(ok_t, j_of, torch.zeros_like(t)).flatten()
        plan["fetched_by"] = (grp * pg + first).flatten()  # [Hkv * pg]: the pair whose fetch holds pair p's span
        plan["block_off"] = r.block_off_dev[idx].flatten()  # [Hkv * pg]: pair p's first row in its span
        if r.zoom_tier is not None:  # each row's (group, document token): the pack's zoom tier replaces covered rows
            plan["tier_rows"] = r.zoom_tier.locate(grp.expand(-1, ug).flatten(), (r.block_start_dev[blk] + j_of).flatten(), ok_t.flatten())  # once for all layers
            # one device: every layer's rows gathered on the host and sent from now on (sekv/zoom_tier.py StagedRows)
            plan["tier"] = r.zoom_tier.fetch(*plan["tier_rows"], len(self.filled_for)) if not self.res.split else None
        if r.layout is None:
            start = r.block_start_dev[blk]
        else:  # re-positioned (sekv/positions.py): the set's slots, fixed while it is
            base_slots, slots = r.layout.place(keep)
            plan["base_slots"], plan["tokens"] = base_slots, r.layout.tokens(keep)
            start = slots.gather(1, blk)
        if r.pre_rope:  # each row's rotation, as Residents.rotate gives it
            plan["rot"] = rope.swapped(*rope.cos_sin((start + j_of).flatten(), r.inv_freq, r.rope_scaling, dtype=r.shape.dtype))
        expanded = keep.repeat_interleave(h // hkv, 0)
        plan["expanded"], plan["keep_s"], plan["exp_s"] = expanded, r.span_level(keep), r.span_level(expanded)
        plan["stats"] = zoom_stats(plan["keep_s"], plan["exp_s"])  # the same for every layer: made once
        self._plans = {**getattr(self, "_plans", {}), r.device: ((key, ug, h), plan)}
        return plan

    def _fill(self, r: Residents, layer: int, plan: dict) -> torch.Tensor:
        """Fetch and rebuild a layer's set into the annex (the blocks of :meth:`_plan`), written group-major; a
        block's rows come from its span's factor block.  -> words moved."""
        hkv, d = self.hkv, r.shape.head_dim
        ak, av = r.kv.annex_kv(layer)
        ug = ak.shape[-2]
        b = self.blocks[layer]
        if "last" in plan:  # one device: the words are counted for all layers at once (_count_filled)
            rows, words = fb.gather(b, plan["pair"], plan["last"][layer]), None
        else:
            rows, words = fb.fetch(b, plan["pair"], plan["fetch_ok"])
        us, vt = fb.unpack(b, rows, r.shape.dtype)
        rec, n = self._rebuild(plan, us, vt, b.n_max)
        del rows, us, vt  # the fetched words and factors go before the rows are picked
        src = plan.get(("src", b.n_max))  # each row's K and V source rows: the same for every layer of a block length
        if src is None:
            if n < b.n_max:  # row j of kept pair p
                k = plan["own_pair"] * (2 * n) + plan["own_row"]
            else:  # row block_off + j of the pair that fetched the span
                k = plan["src_pair"] * (2 * n) + plan["src_row"]
            src = plan[("src", b.n_max)] = (k, k + n)
        if r.layout is not None:
            self.base_slots[layer].copy_(plan["base_slots"])
            self.ledger.count_positions(plan["tokens"])
        krows = rec.index_select(0, src[0])
        vrows = rec.index_select(0, src[1])
        if r.zoom_tier is not None:  # the pack's zoom tier replaces the rows it covers (sekv/zoom_tier.py)
            staged = plan.get("tier")
            hit, tk, tv = staged.layer(layer) if staged is not None else r.zoom_tier.rows(layer, *plan["tier_rows"])
            krows = torch.where(hit.view(-1, 1), tk.to(krows.dtype), krows)
            vrows = torch.where(hit.view(-1, 1), tv.to(vrows.dtype), vrows)
        if r.pre_rope:
            krows = rope.apply_swapped(krows.float(), *plan["rot"])
        slot_ok = plan["slot_ok"]  # empty rows come from an unfetched block: any bits, so select zeros
        ak[0].copy_(torch.where(slot_ok, krows, 0).view(hkv, ug, d))
        zero = plan.get(("zero", rec.dtype))
        if zero is None:
            zero = plan[("zero", rec.dtype)] = torch.zeros((), dtype=rec.dtype, device=rec.device)
        torch.where(slot_ok.view(hkv, ug, 1), vrows.view(hkv, ug, d), zero, out=av[0])
        return words

    def _rebuild(self, plan: dict, us: torch.Tensor, vt: torch.Tensor, n_max: int) -> tuple[torch.Tensor, int]:
        """The K and V rows of the plan's pairs -> ([Hkv * pg * 2 * n, d] rows, n): each kept pair's own block (n, the
        longest block's rows, from its span's U*sigma rows and Vt) where a block is shorter than a span (a span is up to
        ~10 blocks: a tenth of the rows and transient), else each fetched span whole (n = n_max).  A row is the same
        product of its U*sigma row and its Vt either way (tests/test_fixed_fill.py).  Rows past a block's length, and
        rows of pairs not kept, are unused."""
        d = vt.shape[-1]
        n = self.max_block
        if n >= n_max:
            return torch.matmul(us, vt).view(-1, d), n_max  # [Hkv * pg, 2, n_max, d]
        rows = plan.get(("rows", n_max))  # [Hkv * pg, n]: each pair's rows in its span (clamped: past the block, unused)
        if rows is None:
            ar = torch.arange(n, device=us.device).view(1, -1)
            rows = plan[("rows", n_max)] = torch.clamp_max(plan["block_off"].view(-1, 1) + ar, n_max - 1)
        fb_ = plan["fetched_by"]
        own = us.transpose(1, 2)[fb_.view(-1, 1), rows].transpose(1, 2)  # [Hkv * pg, 2, n, r]
        return torch.matmul(own, vt.index_select(0, fb_)).view(-1, d), n

    def _causal(self, q: int, dtype, dev) -> torch.Tensor:
        """[q, q]: -inf above the diagonal (a new token hides the later ones), 0 elsewhere; made once for every layer."""
        c = getattr(self, "_causal_t", None)
        if c is None or c.shape[0] != q or c.dtype != dtype or c.device != dev:
            c = self._causal_t = torch.full((q, q), float("-inf"), device=dev).triu(1).to(dtype)
        return c

    def _joint_attention(self, layer: int, query: torch.Tensor, scaling: float, lim, fresh: bool, expanded=None, unmasked: bool = False) -> torch.Tensor:
        """One SDPA over a layer's resident buffer and its annex, under the set's mask: full-resolution tokens (but the
        columns hidden for the question);
        coarse entries with +log n_i, hidden where the group expanded the span; the tail up to lim (the resident
        length after this forward; causal among its q new tokens); each group's filled annex rows.
        fresh: build the mask (a fill); else unmask only the new token(s) (unmasked: done already, for all layers)."""
        r = self.res.at_layer(layer)
        jk, jv = r.kv.jk[layer], r.kv.jv[layer]
        h, q = query.shape[1], query.shape[2]
        cap = r.kv.k[layer].shape[-2]
        ug = jk.shape[-2] - cap
        dev = query.device
        if fresh:
            one = not self.res.split
            if self.mask[layer] is None or self.mask[layer].shape[-1] != cap + ug:
                if one:  # every layer's mask a view of one tensor: a plan's mask (the same for every layer) copied once
                    self._mask_all = torch.empty(len(self.mask), 1, h, 1, cap + ug, dtype=query.dtype, device=dev)
                    self.mask = list(self._mask_all.unbind(0))
                else:
                    self.mask[layer] = torch.empty(1, h, 1, cap + ug, dtype=query.dtype, device=dev)
            plan = getattr(self, "_plans", {}).get(r.device, (None, {}))[1]
            mk = plan.get("mask") if plan.get("expanded") is expanded else None
            if mk is None or mk[0] != (cap, ug, lim) or torch.is_tensor(lim):  # the same for every layer of a plan
                p = torch.arange(cap, device=dev)
                m = torch.empty(h, cap + ug, device=dev)
                m[:, :cap] = torch.where(p < lim, 0.0, float("-inf")).view(1, cap)
                m[:, r.n_full : r.n_base] = r.coarse_mask(expanded)
                hidden = r.hidden.row(dev)
                if hidden is not None:  # the columns hidden for the question (below lim: 0 until now)
                    m[:, : r.n_full] = hidden.view(1, -1)
                rows = torch.arange(ug, device=dev).view(1, -1) < self.n[layer].index_select(0, r.head_group).view(-1, 1)
                m[:, cap:] = torch.where(rows, 0.0, float("-inf"))
                mk = (cap, ug, lim), m.view(1, h, 1, -1)
                if plan.get("expanded") is expanded and not torch.is_tensor(lim):
                    plan["mask"] = mk
            if not one or torch.is_tensor(lim) or plan.get("mask") is not mk:
                self.mask[layer].copy_(mk[1])
            elif plan.get("mask_written", (None, None)) != (id(mk), id(self._mask_all)):
                self._mask_all.copy_(mk[1])
                plan["mask_written"] = (id(mk), id(self._mask_all))
        mask = self.mask[layer]
        if r.layout is not None:  # the base entries rotated to the set's slots (a copy: the buffer keeps them de-rotated)
            jk = jk.clone()
            jk[0, :, : r.n_base] = r.base_keys(layer, self.base_slots[layer])
        if torch.is_tensor(lim):  # one new token at lim - 1 (a device scalar: graphs)
            if not fresh and not unmasked:
                mask.index_fill_(-1, (lim - 1).view(1), 0.0)
        elif not fresh:
            mask[..., lim - q : lim] = 0.0
        if q > 1:  # causal among the new tokens
            shared = fresh and not self.res.split and not torch.is_tensor(lim) and plan.get("mask") is mk
            held = plan.get("causal_mask") if shared else None  # a plan's: the same for every layer (one device)
            if held is None or held[0] != (lim, q):
                built = mask.expand(1, h, q, cap + ug).clone()
                built[0, :, :, lim - q : lim].add_(self._causal(q, mask.dtype, dev))
                held = ((lim, q), built)
                if shared:
                    plan["causal_mask"] = held
            mask = held[1]
        how = FILL_SDPA_LAYOUT if q > 1 and FILL_SDPA_LAYOUT is not None else SDPA_LAYOUT
        if how == "packed":
            return grouped_attention(query, jk, jv, mask, scaling)
        if how == "math":
            from torch.nn.attention import SDPBackend, sdpa_kernel

            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(query, jk, jv, attn_mask=mask, scale=scaling, enable_gqa=jk.shape[1] != h)
        return F.scaled_dot_product_attention(query, jk, jv, attn_mask=mask, scale=scaling, enable_gqa=jk.shape[1] != h)


def grouped_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """SDPA of query [1, H, q, d] over keys / values [1, Hkv, T, d] under an additive mask [1, H, q | 1, T], each
    query head on its KV group (head h on group h // (H / Hkv)), as ``enable_gqa=True`` would -> [1, H, q, d].

    A group's heads are stacked along the query axis ([1, Hkv, G q, d], the mask likewise), so SDPA sees plain
    multi-head attention, which CUDA's memory-efficient kernel takes under a mask (a masked GQA call it does not)."""
    _, h, q, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    g = h // hkv
    qg = query.reshape(1, hkv, g * q, d)
    mg = mask.expand(1, h, q, t).reshape(1, hkv, g * q, t) if g > 1 else mask.expand(1, h, q, t)
    if qg.device.type == "cuda" and EFFICIENT_FILL:
        return efficient_attention(qg, keys, values, mg, scaling).reshape(1, h, q, d)
    return F.scaled_dot_product_attention(qg, keys, values, attn_mask=mg, scale=scaling).reshape(1, h, q, d)


#: grouped_attention on CUDA calls the memory-efficient kernel's own operator (efficient_attention), not SDPA's choice
EFFICIENT_FILL = True


def efficient_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float) -> torch.Tensor:
    """Multi-head attention [1, H, q, d] over keys / values [1, H, T, d] under an additive mask [1, H, q, T], by CUDA's
    memory-efficient kernel called through its own operator.  Through SDPA torch 2.11 picks cuDNN for this call on an
    H200, whose plan is built on the host for every new question length (and its kernel loaded lazily): the question's
    fill paid that on every ask.  Choosing the backend with torch.nn.attention.sdpa_kernel would set process-wide
    flags under the rehearsal threads' calls; the operator chooses nothing.  The kernel reads the mask with aligned
    loads (every stride but the last a multiple of 8 elements): a mask that is not so is laid out again with its rows
    padded to a multiple of 16 columns, as SDPA pads it for this kernel."""
    t = keys.shape[2]
    pad = -t % 16
    if mask.stride(-1) != 1 or any(st % 16 for st in mask.stride()[:-1]) or mask.dtype != query.dtype:
        laid = torch.empty(*mask.shape[:-1], t + pad, dtype=query.dtype, device=mask.device)
        laid[..., :t].copy_(mask)
        mask = laid[..., :t]
    return torch.ops.aten._scaled_dot_product_efficient_attention(query, keys, values, mask, False, 0.0, False, scale=scaling)[0]
