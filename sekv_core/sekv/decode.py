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

Budget: the flat buffers are sized once from the cap (U = what the per-layer cap
holds once the tail's reserved capacity is used, so the size stays within the
budget for the whole ask) and they, their slot tables and the block tables are
all counted as resident, allocated or not filled.  Stats are accumulated on the
device and read only when asked for.
"""

from __future__ import annotations

import torch

from . import blocks as fb
from . import rope, router
from .attention import build_mask, flat_attention, route, select_topk

_SLOT_META = 8  # bytes per slot: group id + span id (int32)


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
        self.span_tokens = int(mem.span_len.sum())
        self.U = -1
        self.P = 0
        self.rk: list[torch.Tensor] = []
        self.rv: list[torch.Tensor] = []
        self.gid: list[torch.Tensor] = []
        self.sid: list[torch.Tensor] = []
        dev = mem.device
        self.head_group = torch.arange(sh.n_heads, device=dev) // (sh.n_heads // self.hkv)
        self.reset_stats()

    # -- budget ---------------------------------------------------------------------------------------------

    def _slots_for(self, n_appended: int) -> int | None:
        """Token slots per layer the cap holds with n_appended tail tokens (None: no cap)."""
        m = self.mem
        if m.budget is None or m.zoom == "all":
            return None
        full = (m.n_doc + n_appended) * m.shape.kv_bytes_per_token()
        persistent = (m.n_base + n_appended) * self.hkv * m.entry_bytes * self.L + m.router_bytes + self.table_bytes
        return max(0, int(m.budget * full) - persistent) // self.L // (m.entry_bytes + _SLOT_META)

    def begin_forward(self, n_new: int) -> None:
        m = self.mem
        self.d_step.zero_()
        self.d_h2d_step.zero_()
        m._held = [None] * self.L  # the reference path's reconstructions are not kept alongside
        appended = m.kv.len[-1] - m.n_base  # before this forward's tokens
        self.n_new = n_new
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
        self.rk = self.rv = self.gid = self.sid = []
        self.U = u
        self.P = 0 if u == 0 else min(self.hkv * m.n_spans, u // max(1, self.min_len) + 1)
        self.rk = [torch.zeros(u + 1, self.d, dtype=m.shape.dtype, device=dev) for _ in range(self.L)]  # row u: padding sink
        self.rv = [torch.zeros_like(t) for t in self.rk]
        self.gid = [torch.zeros(u + 1, dtype=torch.int32, device=dev) for _ in range(self.L)]
        self.sid = [torch.zeros(u + 1, dtype=torch.int32, device=dev) for _ in range(self.L)]

    def resident_bytes(self) -> int:
        """Device bytes beyond the resident KV + router: block tables, slot buffers (capacity) and slot tables."""
        return self.table_bytes + self.L * max(0, self.U) * (self.mem.entry_bytes + _SLOT_META)

    # -- stats ----------------------------------------------------------------------------------------------

    def reset_stats(self) -> None:
        m, dev = self.mem, self.mem.device
        s = m.n_spans
        self.d_step = torch.zeros(s, dtype=torch.bool, device=dev)
        self.d_ask = torch.zeros(s, dtype=torch.bool, device=dev)
        self.d_counts = torch.zeros(s, dtype=torch.long, device=dev)
        self.d_rate = torch.zeros(self.L, dtype=torch.float64, device=dev)
        self.d_h2d_step = torch.zeros((), dtype=torch.long, device=dev)
        self.d_h2d_total = torch.zeros((), dtype=torch.long, device=dev)

    def fold_stats(self) -> None:
        """Copy the device-side stats into the memory's host fields (one sync; only when stats are read)."""
        m = self.mem
        m._step_spans = self.d_step.cpu()
        m._ask_spans = self.d_ask.cpu()
        m._span_counts = self.d_counts.cpu()
        m._rate_sum = self.d_rate.cpu()
        m._h2d_step = int(self.d_h2d_step)
        m._h2d_total = int(self.d_h2d_total)

    # -- the step -------------------------------------------------------------------------------------------

    def attend(self, layer: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scaling: float) -> torch.Tensor:
        m = self.mem
        if layer == 0:
            self.begin_forward(query.shape[-2])
        keys, values = m.kv.append(layer, key, value)
        h, q = query.shape[1], query.shape[2]
        hkv, s, d = self.hkv, m.n_spans, self.d
        dev = query.device
        n_tail = m.kv.len[layer] - m.n_base
        if self.U <= 0:
            expanded = torch.zeros(h, s, dtype=torch.bool, device=dev)
            mask = build_mask(n_heads=h, n_q=q, n_full=m.n_full, log_n=m.log_n, expanded=expanded, n_tail=n_tail, slot_span=None, dtype=torch.float32)
            empty = keys.new_zeros(0, d)
            return flat_attention(query, keys, values, mask, empty, empty, torch.zeros(h, 0, dtype=torch.bool, device=dev), scaling)
        if m.zoom == "all":
            cand = torch.ones(h, s, dtype=torch.bool, device=dev)
            prio = torch.zeros(hkv, s, device=dev)
        else:
            kbar = m.kv.k[layer][0, :, m.n_full : m.n_base]
            logits = router.gate_logits(query[0], m.w[layer], kbar, m.inv_norm[layer], m.log_n)
            cand, prio = route(logits, m.logit_tau[layer], hkv)
        u = self.U
        pair, ok = select_topk(prio, m.span_len_dev, None if m.zoom == "all" else u, self.P)
        g, i = pair // s, pair % s
        keep = torch.zeros(hkv * s, dtype=torch.bool, device=dev).index_put_((pair,), ok).view(hkv, s)
        expanded = keep.repeat_interleave(h // hkv, 0)
        if m.head_masks:
            expanded = expanded & cand

        b = self.blocks[layer]
        rows, words = fb.fetch(b, pair, ok)
        n = m.span_len_dev[i]
        us, vt = fb.unpack(b, rows)
        rec = torch.matmul(us, vt)  # [P, 2, n_max, d] float32 (rows past n_i: discarded below)
        nm = b.n_max
        krows = rec[:, 0].reshape(-1, d)
        if m.pre_rope:
            pos = m.span_start_dev[i].view(-1, 1) + torch.arange(nm, device=dev).view(1, -1)
            cos, sin = rope.cos_sin(pos.flatten(), m.inv_freq, m.rope_scaling, dtype=m.shape.dtype)
            krows = rope.apply(krows, cos, sin)
        n_ok = torch.where(ok, n, torch.zeros_like(n))
        start = torch.cumsum(n_ok, 0) - n_ok
        j = torch.arange(nm, device=dev).view(1, -1)
        dest = torch.where(j < n_ok.view(-1, 1), start.view(-1, 1) + j, torch.full_like(j, u)).flatten()
        rk, rv, gid, sid = self.rk[layer], self.rv[layer], self.gid[layer], self.sid[layer]
        rk.index_copy_(0, dest, krows.to(rk.dtype))
        rv.index_copy_(0, dest, rec[:, 1].reshape(-1, d).to(rv.dtype))
        gid.index_copy_(0, dest, g.to(torch.int32).repeat_interleave(nm))
        sid.index_copy_(0, dest, i.to(torch.int32).repeat_interleave(nm))
        rk[u].zero_()  # the padding sink took the discarded rows: keep it finite (its weight is 0, not its value)
        rv[u].zero_()
        slot_ok = torch.arange(u + 1, device=dev) < n_ok.sum()
        sidl = sid.long().clamp(0, max(s - 1, 0))
        visible = slot_ok.view(1, -1) & (gid.long().view(1, -1) == self.head_group.view(-1, 1)) & expanded.gather(1, sidl.view(1, -1).expand(h, -1))
        mask = build_mask(n_heads=h, n_q=q, n_full=m.n_full, log_n=m.log_n, expanded=expanded, n_tail=n_tail, slot_span=None, dtype=torch.float32)
        out = flat_attention(query, keys, values, mask, rk, rv, visible, scaling)

        spans = keep.any(0)
        self.d_step |= spans
        self.d_ask |= spans
        self.d_counts += expanded.sum(0)
        self.d_rate[layer] += expanded.double().mean()
        self.d_h2d_step += words * 8
        self.d_h2d_total += words * 8
        return out
