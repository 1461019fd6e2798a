"""The batched zoom-in step for accelerators: no host sync, fixed shapes, one fetch per layer.

The reference step (``SekvMemory._attend``) learns on the host which spans were
kept (``nonzero`` + ``.cpu()``), gathers their ragged factors on the CPU and
places them per KV group: a device->host sync and a CPU gather per layer.  Here
every decision stays on the device:

* routing as in the reference; the budget cap is :func:`attention.select_topk`, a
  fixed-size top-P of the (group, span) priorities (P = the most pairs the cap
  can hold), so no shape depends on the data;
* the kept pairs' factor blocks are fetched with one gather from pinned host
  memory (sekv/blocks.py), dequantised and reconstructed with one batched
  product, RoPE re-applied, and written into a **flat, preallocated** buffer of U
  token slots per layer (all KV groups together; slot -> group and span ids);
* one float32 softmax over the resident memory and the flat slots, each query
  head seeing its own group's slots of the spans it expanded
  (:func:`attention.flat_attention`).

Fixed sets: under scout routing (and ``zoom="all"``) the kept set depends only on
the question's ranking and the cap, not on the step's query, so it is the same
for every forward of an answer.  Such a memory keeps its slots in the *annex*
of its resident K/V buffers (``GrowingKV.set_annex``), U / Hkv rows per KV
group: each group keeps the top of the ranking that fits its share, its rows
written group-major after the resident capacity.  The forward that fills the set
records it (the kept pairs, each group's row count); later forwards with the
same slots and ranking only attend, with **one** SDPA call over resident memory
and slots together (an additive mask: coarse entries with +log n_i or hidden,
the tail by length, each group's filled rows): no fetch, no reconstruction,
nothing crosses PCIe.  Forwards of such a memory that are routed per layer (the
scout pass itself) build their rows as workspace and attend with the flat step.

Budget: the flat buffers are sized once from the cap (U = what the per-layer cap
holds once the tail's reserved capacity is used, so the size stays within the
budget for the whole ask) and they, their slot tables and the block tables are
all counted as resident, allocated or not filled.  Stats are accumulated on the
device and read only when asked for.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from . import blocks as fb
from . import rope, router
from .attention import build_mask, flat_attention, route, select_topk

_SLOT_META = 0  # bytes per slot beyond its K and V (slot -> pair is recomputed each step, nothing is stored)


class BatchedDecoder:
    def __init__(self, mem):
        self.mem = mem
        sh = mem.shape
        self.d, self.hkv, self.L = sh.head_dim, sh.n_kv_heads, sh.n_layers
        wd = mem.device if mem.device.type == "cuda" else None
        self.blocks = [fb.build(f, mem.span_len, self.d, mem.device, pin=mem.cuda, work_device=wd) for f, _ in mem.factors]
        self.table_bytes = sum(b.index_bytes() for b in self.blocks)
        self.uva = all(b.uva for b in self.blocks)
        self.min_len = int(mem.span_len.min()) if mem.n_spans else 1
        self.min_block = int(mem.block_len.min()) if mem.n_blocks else 1  # fixed sets keep zoom blocks
        self.span_tokens = int(mem.span_len.sum())
        self.U = -1
        self.P = 0
        self.rk: list[torch.Tensor] = []
        self.rv: list[torch.Tensor] = []
        # fixed sets (scout / zoom all; their slots are the annex of mem.kv): per layer the kept pairs [Hkv, S],
        # each group's filled rows [Hkv] and what they were filled for (fixed_key; None: nothing reusable)
        self.annex = mem.shared_prio is not None or mem.zoom == "all"
        self.fx_keep: list[torch.Tensor] = []
        self.fx_n: list[torch.Tensor] = []
        self.fx_key: list = [None] * self.L
        # ... and its attention mask [1, H, 1, capacity + U / Hkv] (model dtype; a step only unmasks its own
        # token), and its per-forward stats, added to the totals once per reuse (d_reuse counts the reuses)
        self.fx_mask: list = [None] * self.L
        self.fx_spans = self.fx_counts = self.fx_rate = None
        self.reused_now = [False] * self.L
        dev = mem.device
        self.head_group = torch.arange(sh.n_heads, device=dev) // (sh.n_heads // self.hkv)
        self.reset_stats()
        # CUDA graphs of the single-token step, one per layer (sharing one memory pool: replayed in capture order)
        self.graphs_on = mem.cuda
        self.graphs: list = [None] * self.L
        self.graph_key: list = [None] * self.L
        self.g_query: list = [None] * self.L
        self.g_out: list = [None] * self.L
        self.g_pos: list = [None] * self.L
        self.g_len = torch.zeros((), dtype=torch.long, device=dev)
        self.pool = torch.cuda.graph_pool_handle() if mem.cuda else None

    # -- budget ---------------------------------------------------------------------------------------------

    def _slots_for(self, n_appended: int) -> int | None:
        """Token slots per layer the cap holds with n_appended tail tokens (None: no cap)."""
        m = self.mem
        if m.budget is None or m.zoom == "all":
            return None
        # b x the document's full KV against the document's persistent part; the appended tail (question and
        # generated tokens) is resident on top (the reference step's rule, SekvMemory._begin_forward)
        full = m.n_doc * m.shape.kv_bytes_per_token()
        persistent = m.n_base * self.hkv * m.entry_bytes * self.L + m.router_bytes + self.table_bytes
        persistent += self.L * self.hkv * (m.n_blocks + 8)  # the fixed-set tables (fx_keep, fx_n)
        per_slot = m.entry_bytes + _SLOT_META
        if self.annex:  # the fixed set's masks (_mask_bytes): the resident columns, plus a column per group's row
            persistent += self._mask_bytes(m.kv.k[-1].shape[-2], 0)
            per_slot += self._mask_bytes(0, 1) // (self.L * self.hkv)
        return max(0, int(m.budget * full) - persistent) // self.L // per_slot

    def begin_forward(self, n_new: int) -> None:
        m = self.mem
        self.d_step.zero_()
        self.d_h2d_step.zero_()
        m._held = [None] * self.L  # the reference path's reconstructions are not kept alongside
        appended = m.kv.len[-1] - m.n_base  # before this forward's tokens
        self.n_new = n_new
        for layer in range(self.L):  # the capacity this forward needs, now (the annex's mask is sized by it)
            m.kv.reserve(layer, m.kv.len[layer] + n_new)
        now = self._slots_for(appended + n_new)
        if now is None:
            want = self.hkv * self.span_tokens
        else:
            want = None if self.U >= 0 and self.U <= now else self._slots_for(max(appended + n_new, m.kv.k[-1].shape[-2] - m.n_base))
        if m.zoom == "none" or m.n_spans == 0:
            want = 0 if self.U < 0 else None
        if want is not None and want != self.U:
            self._allocate(want)
        m._last_resident = m._persistent + self.resident_bytes()

    def _allocate(self, u: int) -> None:
        m, dev = self.mem, self.mem.device
        self.rk = self.rv = []
        if self.annex:  # U / Hkv rows per group, after the resident capacity (a realloc of the resident buffers)
            u -= u % self.hkv
            m.kv.set_annex(u // self.hkv)
        self.U = u
        self.P = 0 if u == 0 else min(self.hkv * m.n_spans, u // max(1, self.min_len) + 1)
        if not self.annex:
            self.rk = [torch.zeros(u, self.d, dtype=m.shape.dtype, device=dev) for _ in range(self.L)]
            self.rv = [torch.zeros_like(t) for t in self.rk]
        self.fx_keep = [torch.zeros(self.hkv, m.n_blocks, dtype=torch.bool, device=dev) for _ in range(self.L)]
        self.fx_n = [torch.zeros(self.hkv, dtype=torch.long, device=dev) for _ in range(self.L)]
        self.fx_key = [None] * self.L
        self.fx_mask = [None] * self.L

    def fixed_key(self):
        """Identity of this forward's kept set when it cannot depend on the query (scout ranking, zoom all),
        else None: (slot count, ranking version, resident buffers' generation, truncations: a truncated tail
        must be hidden again, which the fill's mask does)."""
        m = self.mem
        if not self.annex or self.U <= 0 or not (m.zoom == "all" or m.scout_ranks()):
            return None
        return (self.U, m.prio_version, m.kv.generation, m.truncations)

    def reusable(self, layer: int) -> bool:
        k = self.fixed_key()
        return k is not None and self.fx_key[layer] == k

    def reusable_layers(self) -> list[bool]:
        """reusable() for every layer, deciding the fixed key once (host work of each static step)."""
        k = self.fixed_key()
        return [k is not None and x == k for x in self.fx_key]

    def _mask_bytes(self, cap: int, rows: int) -> int:
        """A fixed set's masks: one column per resident entry (capacity cap) and per annex row, every head."""
        isz = self.mem.entry_bytes // (2 * self.d)
        return self.L * self.mem.shape.n_heads * (cap + rows) * isz

    def resident_bytes(self) -> int:
        """Device bytes beyond the resident KV + router: block tables, slot buffers (capacity), slot tables and
        the fixed set's masks (at the size they will have)."""
        m = self.mem
        b = self.table_bytes + self.L * (max(0, self.U) * (m.entry_bytes + _SLOT_META) + self.hkv * (m.n_blocks + 8))
        if self.annex and self.U > 0:
            b += self._mask_bytes(m.kv.k[-1].shape[-2], self.U // self.hkv)
        return b

    # -- stats ----------------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        if hasattr(self, "d_step"):  # in place: captured graphs hold these tensors
            for x in self._stat_tensors():
                x.zero_()
            return
        m, dev = self.mem, self.mem.device
        s = m.n_spans
        self.d_step = torch.zeros(s, dtype=torch.bool, device=dev)
        self.d_ask = torch.zeros(s, dtype=torch.bool, device=dev)
        self.d_counts = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_rate = torch.zeros(self.L, dtype=torch.float64, device=dev)
        self.d_h2d_step = torch.zeros((), dtype=torch.long, device=dev)
        self.d_h2d_total = torch.zeros((), dtype=torch.long, device=dev)
        self.d_reuse = torch.zeros(self.L, dtype=torch.long, device=dev)
        self.fx_spans = torch.zeros(self.L, s, dtype=torch.bool, device=dev)
        self.fx_counts = torch.zeros(self.L, s, dtype=torch.long, device=dev)
        self.fx_rate = torch.zeros(self.L, dtype=torch.float64, device=dev)

    def _fold_reuse(self, layer: int | None = None) -> None:
        """Add the reuses counted in d_reuse (all layers, or one) to the totals: each is one forward of the
        fixed set's recorded stats."""
        sl = slice(None) if layer is None else slice(layer, layer + 1)
        w = self.d_reuse[sl]
        self.d_counts += (w.view(-1, 1) * self.fx_counts[sl]).sum(0)
        self.d_rate[sl] += w.double() * self.fx_rate[sl]
        self.d_ask |= ((w.view(-1, 1) > 0) & self.fx_spans[sl]).any(0)
        w.zero_()

    def fold_stats(self) -> None:
        """Copy the device-side stats into the memory's host fields (one sync; only when stats are read)."""
        m = self.mem
        with torch.inference_mode():  # the stats tensors were made inside a forward
            self._fold_reuse()
            now = [layer for layer in range(self.L) if self.reused_now[layer]]
            if now:  # this step's spans include the reused sets'
                self.d_step |= self.fx_spans[now].any(0)
        m._step_spans = self.d_step.cpu()
        m._ask_spans = self.d_ask.cpu()
        m._span_counts = self.d_counts.cpu()
        m._rate_sum = self.d_rate.cpu()
        m._h2d_step = int(self.d_h2d_step)
        m._h2d_total = int(self.d_h2d_total)

    # -- the step -------------------------------------------------------------------------------------------

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        m = self.mem
        if m.kv.static:  # one token, inside a whole-step graph (static_begin ran on the host)
            kb, vb = m.kv.append(layer, key, value)
            with _tf32(query.is_cuda and query.dtype != torch.float32):
                return self._core(layer, query, kb, vb, self._length_mask(query.shape[1], kb.shape[-2]), scaling, self.reusable(layer), self.g_len)
        if layer == 0:
            self.begin_forward(query.shape[-2])
        keys, values = m.kv.append(layer, key, value)
        h, q = query.shape[1], query.shape[2]
        if q == 1 and self.U > 0 and self.graphs_on:
            return self._replay(layer, query, scaling)
        reuse = self.reusable(layer)
        n_tail = m.kv.len[layer] - m.n_base

        def resident_mask(expanded):
            return build_mask(n_heads=h, n_q=q, n_full=m.n_full, log_n=m.log_n, expanded=expanded, n_tail=n_tail, slot_span=None, dtype=torch.float32)

        with _tf32(query.is_cuda and query.dtype != torch.float32):
            return self._core(layer, query, keys, values, resident_mask, scaling, reuse, m.kv.len[layer])

    def _core(self, layer, query, keys, values, resident_mask, scaling, reuse: bool = False, lim=None) -> torch.Tensor:
        """Route, cap, fetch, reconstruct, attend, count: shapes depend only on the memory, never on the data.
        reuse: the annex holds this forward's fixed set already (fixed_key); only attend and count.
        lim: the resident length after this forward's tokens (an int, or a device scalar for one token)."""
        m = self.mem
        h = query.shape[1]
        hkv, s, d = self.hkv, m.n_spans, self.d
        dev = query.device
        if self.U <= 0:
            expanded = torch.zeros(h, s, dtype=torch.bool, device=dev)
            empty = keys.new_zeros(0, d)
            return flat_attention(query, keys, values, resident_mask(expanded), empty, empty, torch.zeros(h, 0, dtype=torch.bool, device=dev), scaling)
        u = self.U
        fixed = self.fixed_key()
        if fixed is not None:  # a fixed set in the annex (scout ranking / zoom all): every head of a kept group sees it
            self.reused_now[layer] = reuse
            if reuse:
                self.d_reuse[layer].add_(1)
                return self._joint_attention(layer, query, scaling, lim, fresh=False)
            self._fold_reuse(layer)  # before its recorded stats are replaced
            keep, words = self._fill_fixed(layer)  # over zoom blocks
            expanded = keep.repeat_interleave(h // hkv, 0)
            keep_s, exp_s = m.span_level(keep), m.span_level(expanded)
            self.fx_spans[layer].copy_(keep_s.any(0))
            self.fx_counts[layer].copy_(exp_s.sum(0))
            self.fx_rate[layer].copy_(exp_s.double().mean())
            self.fx_key[layer] = fixed
            out = self._joint_attention(layer, query, scaling, lim, fresh=True, expanded=expanded)
            self._count(layer, keep_s, exp_s, words)
            return out
        # per-layer routing (the router's gates for this forward's queries)
        kbar = m.kv.k[layer][0, :, m.n_full : m.n_base]
        logits = router.gate_logits(query[0], m.w[layer], kbar, m.inv_norm[layer], m.log_n)
        cand, prio = route(logits, m.logit_tau[layer], hkv)
        pair, ok = select_topk(prio, m.span_len_dev, u, self.P)
        g, i = pair // s, pair % s
        keep = torch.zeros(hkv * s, dtype=torch.bool, device=dev).index_put_((pair,), ok).view(hkv, s)
        expanded = keep.repeat_interleave(h // hkv, 0)
        if m.head_masks:
            expanded = expanded & cand

        b = self.blocks[layer]
        rows, words = fb.fetch(b, pair, ok)
        # dequantised and multiplied in the model dtype (bf16 on GPU: tensor cores; int8 levels are exact in bf16,
        # and the factors' quantisation error dominates bf16 rounding)
        us, vt = fb.unpack(b, rows, m.shape.dtype)
        rec = torch.matmul(us, vt)  # [P, 2, n_max, d]; rows past n_i unused
        nm = b.n_max
        # fill the flat slots by gathering rows (slot t <- pair p(t), row j(t)); a scatter would pile the unused
        # rows onto one sink row, which serialises on the GPU
        n_ok = torch.where(ok, m.span_len_dev[i], torch.zeros_like(i))
        ends = torch.cumsum(n_ok, 0)
        t = torch.arange(u, device=dev)
        p_of = torch.searchsorted(ends, t, right=True).clamp_max(pair.numel() - 1)  # slot -> pair
        j_of = t - (ends - n_ok)[p_of]  # slot -> row within its span
        slot_ok = t < ends[-1]
        src = torch.where(slot_ok, p_of * nm + j_of, torch.zeros_like(t))
        krows = self._rope(rec[:, 0].reshape(-1, d).index_select(0, src), m.span_start_dev[i][p_of] + j_of)
        empty_slot = ~slot_ok.view(-1, 1)  # their rows come from an unfetched block: any bits, so select zeros
        if self.annex:  # a per-layer-routed forward of a fixed-set memory (the scout pass): rows as workspace
            rk = krows.to(m.shape.dtype).masked_fill(empty_slot, 0)
            rv = rec[:, 1].reshape(-1, d).index_select(0, src).masked_fill(empty_slot, 0)
        else:
            rk, rv = self.rk[layer][:u], self.rv[layer][:u]
            rk.copy_(krows.masked_fill(empty_slot, 0))
            torch.index_select(rec[:, 1].reshape(-1, d), 0, src, out=rv)
            rv.masked_fill_(empty_slot, 0)
        # head h sees slot t iff t is filled, t's group is h's and h itself wanted t's span
        mine = self.head_group.view(1, -1) == g.view(-1, 1)  # [P, H]
        if m.head_masks:
            mine = mine & cand.t()[i]
        visible = (mine.index_select(0, p_of) & slot_ok.view(-1, 1)).t()  # [H, U]
        out = flat_attention(query, keys, values, resident_mask(expanded), rk, rv, visible, scaling)
        self._count(layer, keep, expanded, words)
        return out

    def _rope(self, krows: torch.Tensor, tok: torch.Tensor) -> torch.Tensor:
        """Pre-RoPE packs: rotate reconstructed key rows [U, d] to their token positions [U] (float32 out)."""
        m, d = self.mem, self.d
        if not m.pre_rope:
            return krows
        # rotate_half convention: (x1, x2) -> (x1 c - x2 s, x2 c + x1 s), c / s from the table
        ang = tok.float().view(-1, 1) * m.inv_freq.view(1, -1)  # [U, d/2]: the two halves of cos / sin are equal
        c, sn = _round(ang.cos() * m.rope_scaling, m.shape.dtype), _round(ang.sin() * m.rope_scaling, m.shape.dtype)
        x1, x2 = krows[:, : d // 2].float(), krows[:, d // 2 :].float()
        return torch.cat([x1 * c - x2 * sn, x2 * c + x1 * sn], 1)

    def _fill_fixed(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Fetch and rebuild a fixed set into the annex: each KV group keeps the top of the ranking of zoom blocks
        (scout) or every block (zoom all) that fits its U / Hkv rows, written group-major; a block's rows come from
        its span's factor block.  -> (keep [Hkv, B], words moved)."""
        m = self.mem
        hkv, s, nb, d, dev = self.hkv, m.n_spans, m.n_blocks, self.d, m.device
        ug = self.U // hkv
        prio = torch.zeros(hkv, nb, device=dev) if m.zoom == "all" else m.shared_prio.view(1, -1).expand(hkv, -1)
        pg = min(nb, ug // max(1, self.min_block) + 1)
        top, idx = torch.topk(prio, pg, dim=1, sorted=True)  # [Hkv, pg] blocks, the same for every group
        n = m.block_len_dev[idx]
        ok = torch.cumprod((torch.cumsum(n, 1) <= ug).to(torch.int8), 1).bool()
        grp = torch.arange(hkv, device=dev).view(-1, 1)
        b = self.blocks[layer]
        # a span's factor block is fetched once, by its first kept block; its other blocks read those rows (first
        # occurrence from a [pg, pg] comparison: no host sync)
        span = m.block_span_dev[idx]  # [Hkv, pg]
        first = (span.unsqueeze(2) == span.unsqueeze(1)).to(torch.int8).argmax(2)  # [Hkv, pg]: first pair of the same span
        fetch_ok = ok & (first == torch.arange(pg, device=dev).view(1, -1))
        rows, words = fb.fetch(b, (grp * s + span).flatten(), fetch_ok.flatten())
        us, vt = fb.unpack(b, rows, m.shape.dtype)
        rec = torch.matmul(us, vt)  # [Hkv * pg, 2, n_max, d]; rows of pairs not fetched are unused
        nm = b.n_max
        n_ok = torch.where(ok, n, torch.zeros_like(n))
        ends = torch.cumsum(n_ok, 1)  # [Hkv, pg]
        t = torch.arange(ug, device=dev).view(1, -1).expand(hkv, -1).contiguous()
        p_of = torch.searchsorted(ends, t, right=True).clamp_max(pg - 1)  # row t of group g <- its pair p, row j
        j_of = t - (ends - n_ok).gather(1, p_of)
        slot_ok = (t < ends[:, -1:]).view(-1, 1)
        blk = idx.gather(1, p_of)  # row t of group g <- block blk, its row j_of, from the pair that fetched its span
        src = torch.where(slot_ok.view(hkv, ug), (grp * pg + first.gather(1, p_of)) * nm + m.block_off_dev[blk] + j_of, torch.zeros_like(t)).flatten()
        krows = self._rope(rec[:, 0].reshape(-1, d).index_select(0, src), (m.block_start_dev[blk] + j_of).flatten())
        ak, av = m.kv.annex_kv(layer)
        ak[0].copy_(krows.masked_fill(~slot_ok, 0).view(hkv, ug, d))
        av[0].copy_(rec[:, 1].reshape(-1, d).index_select(0, src).masked_fill(~slot_ok, 0).view(hkv, ug, d))
        keep = torch.zeros(hkv, nb, dtype=torch.bool, device=dev).scatter_(1, idx, ok)
        self.fx_keep[layer].copy_(keep)
        self.fx_n[layer].copy_(ends[:, -1])
        return keep, words

    def _joint_attention(self, layer: int, query: torch.Tensor, scaling: float, lim, fresh: bool, expanded=None) -> torch.Tensor:
        """One SDPA over a layer's resident buffer and its annex, under the fixed set's mask: full-resolution
        tokens; coarse entries with +log n_i, hidden where the group expanded the span; the tail up to lim (the
        resident length after this forward; causal among its q new tokens); each group's filled annex rows.
        fresh: build the mask (a fill); else unmask only the new token(s)."""
        m = self.mem
        jk, jv = m.kv.jk[layer], m.kv.jv[layer]
        h, q = query.shape[1], query.shape[2]
        cap = m.kv.k[layer].shape[-2]
        ug = jk.shape[-2] - cap
        dev = query.device
        if fresh:
            if self.fx_mask[layer] is None or self.fx_mask[layer].shape[-1] != cap + ug:
                self.fx_mask[layer] = torch.empty(1, h, 1, cap + ug, dtype=query.dtype, device=dev)
            p = torch.arange(cap, device=dev)
            mk = torch.empty(h, cap + ug, device=dev)
            mk[:, :cap] = torch.where(p < lim, 0.0, float("-inf")).view(1, cap)
            mk[:, m.n_full : m.n_base] = m.coarse_mask(expanded)
            rows = torch.arange(ug, device=dev).view(1, -1) < self.fx_n[layer].index_select(0, self.head_group).view(-1, 1)
            mk[:, cap:] = torch.where(rows, 0.0, float("-inf"))
            self.fx_mask[layer].copy_(mk.view(1, h, 1, -1))
        mask = self.fx_mask[layer]
        if torch.is_tensor(lim):  # one new token at lim - 1 (a device scalar: graphs)
            if not fresh:
                mask.index_fill_(-1, (lim - 1).view(1), 0.0)
        elif not fresh:
            mask[..., lim - q : lim] = 0.0
        if q > 1:  # causal among the new tokens
            mask = mask.expand(1, h, q, cap + ug).clone()
            mask[0, :, :, lim - q : lim] += torch.full((q, q), float("-inf"), device=dev).triu(1).to(mask.dtype)
        return F.scaled_dot_product_attention(query, jk, jv, attn_mask=mask, scale=scaling, enable_gqa=jk.shape[1] != h)

    def _count(self, layer: int, keep: torch.Tensor, expanded: torch.Tensor, words) -> None:
        spans = keep.any(0)
        self.d_step |= spans
        self.d_ask |= spans
        self.d_counts += expanded.sum(0)
        self.d_rate[layer] += expanded.double().mean()
        if words is not None:
            self.d_h2d_step += words * 8
            self.d_h2d_total += words * 8

    # -- one CUDA graph per layer for single-token steps ------------------------------------------------------

    def _replay(self, layer: int, query: torch.Tensor, scaling: float) -> torch.Tensor:
        """The q = 1 step of a layer as a captured CUDA graph: the resident part is attended over the whole
        preallocated buffer with a length mask from a device scalar, so no shape changes from step to step;
        a graph is recaptured only when the buffers are reallocated (tail growth, new slot count)."""
        m = self.mem
        kb, vb = m.kv.k[layer], m.kv.v[layer]
        fixed = self.fixed_key()
        key = (kb.data_ptr(), kb.shape[-2], self.U, float(scaling), fixed is not None, self.reusable(layer))
        if layer == 0:
            self.g_len.fill_(m.kv.len[0])  # every layer has the same length in a decode step
        if self.graph_key[layer] != key:
            self._capture(layer, query, scaling, key)
        self.g_query[layer].copy_(query)
        self.graphs[layer].replay()
        self.reused_now[layer] = key[-1]
        if fixed is not None:  # a replayed fill recorded the set on the device; the host learns it here
            self.fx_key[layer] = fixed
        return self.g_out[layer]

    def static_begin(self) -> None:
        """Host side of a static single-token step (SekvMemory.static_begin): buffers and the visible length."""
        self.begin_forward(1)
        self.g_len.fill_(self.mem.kv.len[0] + 1)
        self.reused_now = self.reusable_layers()  # what a replayed step does

    def static_key(self) -> tuple:
        """What a captured step fixed: the slot buffers, the slot count, fixed set or per-layer routing and, per
        layer, whether its set is reused."""
        return (self.U, tuple(t.data_ptr() for t in self.rk), self.fixed_key() is not None) + tuple(self.reusable_layers())

    def _length_mask(self, h: int, t: int, pos: torch.Tensor | None = None):
        """resident_mask over a whole buffer of capacity t: entries at or past g_len hidden (a device scalar)."""
        m = self.mem

        def resident_mask(expanded):
            p = torch.arange(t, device=expanded.device) if pos is None else pos
            mask = torch.where(p < self.g_len, 0.0, float("-inf")).view(1, t).repeat(h, 1)
            mask[:, m.n_full : m.n_base] = torch.where(expanded, float("-inf"), m.log_n.float().view(1, -1))
            return mask.view(1, h, 1, t)

        return resident_mask

    def _capture(self, layer: int, query: torch.Tensor, scaling: float, key) -> None:
        m = self.mem
        kb, vb = m.kv.k[layer], m.kv.v[layer]
        t = kb.shape[-2]
        n_now = m.kv.len[layer]
        kb[:, :, n_now:].zero_()  # capacity past the tail: finite (masked, but its values enter the product)
        vb[:, :, n_now:].zero_()
        h = query.shape[1]
        self.g_query[layer] = query.clone()
        pos = self.g_pos[layer] = torch.arange(t, device=query.device)  # kept: the graph reads it at every replay
        qv = self.g_query[layer]
        resident_mask = self._length_mask(h, t, pos)

        def run():
            with _tf32(query.dtype != torch.float32):
                return self._core(layer, qv, kb, vb, resident_mask, scaling, key[-1], self.g_len)

        saved = [x.clone() for x in self._stat_tensors()]
        side = torch.cuda.Stream(query.device)
        side.wait_stream(torch.cuda.current_stream(query.device))
        with torch.cuda.stream(side):
            run()  # warm-up outside the capture (allocations, cuBLAS workspaces)
        torch.cuda.current_stream(query.device).wait_stream(side)
        for x, y in zip(self._stat_tensors(), saved):
            x.copy_(y)
        g = torch.cuda.CUDAGraph()
        with torch.cuda.graph(g, pool=self.pool):
            self.g_out[layer] = run()
        self.graphs[layer] = g
        self.graph_key[layer] = key

    def _stat_tensors(self) -> list[torch.Tensor]:
        return [self.d_step, self.d_ask, self.d_counts, self.d_rate, self.d_h2d_step, self.d_h2d_total, self.d_reuse]


def _round(x: torch.Tensor, dtype) -> torch.Tensor:
    """Round through the model dtype like the model's rotary embedding does (sekv/rope.py: cos_sin)."""
    return x if dtype == torch.float32 else x.to(dtype).float()


class _tf32:
    """float32 products on tensor cores (TF32) inside the step: the inputs are bf16 / int8-times-scale values,
    which TF32's 10-bit mantissa holds (bf16: 7 bits) or rounds far below their quantisation error."""

    def __init__(self, on: bool):
        self.on = on

    def __enter__(self):
        if self.on:
            self.old = torch.backends.cuda.matmul.allow_tf32
            torch.backends.cuda.matmul.allow_tf32 = True

    def __exit__(self, *exc):
        if self.on:
            torch.backends.cuda.matmul.allow_tf32 = self.old
