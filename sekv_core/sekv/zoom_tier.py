"""The zoom tier: the prefill's own K / V of span tokens, stored in the pack and read in place of their factors'
rebuild when their zoom block is zoomed (``zoom_tier``: "exact" in the store dtype, "int8" with one scale a row).

The factors (sekv/factorize.py, coded 4-bit, sekv/codec.py) stay what the scout ranks with and what a pack without
the tier rebuilds from; the tier only changes what a zoomed block holds: the tokens the model reads at full
resolution are then the prefill's (up to the tier's rounding), not a rank-<=32, 4/3-bit approximation of them
(relative error ~0.05-0.13 on keys, ~0.35 on values: docs/long-documents.md, "Why sekv misses needles full KV
finds").  It costs pack bytes, not resident ones: the tier lives in host memory like the factors, and a zoomed
block takes the same resident rows whichever source filled them.

Pack tensors (sekv/layout.py):  zoom.idx [P] int64, the covered tokens' global positions (sorted; every span
token); per layer zoom.k.l / zoom.v.l [Hkv, P, d] (pre-RoPE keys where the pack's keys are, values): the store dtype
("exact") or int8 with zoom.ks.l / zoom.vs.l [Hkv, P] float16 scales, x = q * s ("int8").
"""

from __future__ import annotations

import torch

from ..chunk_stream import ChunkStream
from .blocks import device_view

TIERS = ("factors", "int8", "exact")


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """x [..., d] float -> (int8 codes [..., d], float16 scales [...]): symmetric, one scale a row, x ~ q * s."""
    x = x.float()
    s = (x.abs().amax(-1) / 127.0).to(torch.float16).float()
    q = torch.where(s.unsqueeze(-1) > 0, torch.round(x / s.clamp_min(1e-30).unsqueeze(-1)), torch.zeros_like(x))
    return q.clamp(-127, 127).to(torch.int8), s.to(torch.float16)


def window_tensors(kind: str, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, undo, chunks, sdt: torch.dtype, li: int) -> dict[str, torch.Tensor]:
    """One layer's tier rows of a window: its span tokens ``pos`` (span order) of the prefill's post-RoPE keys and
    values k, v [Hkv, N, d] -> pre-RoPE keys (``undo(rows, p0, p1)``: RoPE undone on rows p0:p1; None: post-RoPE
    packs) and values [Hkv, M, d], made in compress's row chunks (sekv/compress.py plan) into their final tensors."""
    hkv, d, M, dev = k.shape[0], k.shape[-1], int(pos.numel()), k.device
    if kind == "exact":
        out = {f"zoom.k.{li}": torch.empty(hkv, M, d, dtype=sdt, device=dev), f"zoom.v.{li}": torch.empty(hkv, M, d, dtype=sdt, device=dev)}
    else:
        out = {f"zoom.k.{li}": torch.empty(hkv, M, d, dtype=torch.int8, device=dev), f"zoom.ks.{li}": torch.empty(hkv, M, dtype=torch.float16, device=dev),
               f"zoom.v.{li}": torch.empty(hkv, M, d, dtype=torch.int8, device=dev), f"zoom.vs.{li}": torch.empty(hkv, M, dtype=torch.float16, device=dev)}
    for _, _, p0, p1 in chunks:
        if p1 <= p0:
            continue
        kx = k[:, pos[p0:p1]].float()
        if undo is not None:
            kx = undo(kx, p0, p1)
        for name, x in (("k", kx), ("v", v[:, pos[p0:p1]])):
            if kind == "exact":
                out[f"zoom.{name}.{li}"][:, p0:p1] = x.to(sdt)
            else:
                q, sc = quantize_rows(x)
                out[f"zoom.{name}.{li}"][:, p0:p1] = q
                out[f"zoom.{name}s.{li}"][:, p0:p1] = sc
        del kx
    return out


LAYER_PARTS = ("k", "ks", "v", "vs")


class ZoomTier:
    """An opened pack's tier: ``lookup(layer, group, token, valid)`` gives the rows of covered tokens.

    A layer's rows are read from the store when first needed and kept on the host as one table [Hkv * P, row] of
    int64 words (K and V side by side, the scales after them where int8); on CUDA the table is pinned and read through
    its device alias (sekv/blocks.py device_view: a gather over PCIe of the rows asked for, no host sync), else
    moved to the device once per layer (that costs device memory the ledger does not count; only without UVA).  On
    CUDA the tables are made on a second thread from the open on, so the first question seldom waits for them."""

    def __init__(self, store, names: set[str], shape, device):
        self.store, self.names, self.shape = store, names, shape
        self.device = torch.device(device)
        self.pos = store.get("sekv.zoom.idx").long()
        self.P = int(self.pos.numel())
        self.pos_dev = self.pos.to(self.device)
        self.int8 = "sekv.zoom.ks.0" in names
        self.dtype = shape.dtype if self.int8 else store.get("sekv.zoom.k.0").dtype if self.P else shape.dtype
        self._tables: dict = {}
        self._ahead = None
        if self.device.type == "cuda" and self.P:  # read and pin every layer's table on a second thread from the open on
            from concurrent.futures import ThreadPoolExecutor

            pool = ThreadPoolExecutor(1)
            self._ahead = {li: pool.submit(self._table, li, self.device) for li in range(shape.n_layers)}
            pool.shutdown(wait=False)

    @classmethod
    def of(cls, store, names: set[str], shape, device) -> "ZoomTier | None":
        return cls(store, names, shape, device) if "sekv.zoom.idx" in names else None

    def nbytes(self) -> int:
        """Host bytes of the whole tier (what the pack stores)."""
        n = 0
        for li in range(self.shape.n_layers):
            for p in LAYER_PARTS:
                name = f"sekv.zoom.{p}.{li}"
                if name in self.names:
                    t = self.store.get(name)
                    n += t.numel() * t.element_size()
        return n

    def _table(self, layer: int, device: torch.device):
        key = (layer, device)
        t = self._tables.get(key)
        if t is not None:
            return t
        hkv, P = self.shape.n_kv_heads, self.P
        g = lambda p: self.store.get(f"sekv.zoom.{p}.{layer}").reshape(hkv * P, -1)  # noqa: E731
        cols = [g("k").view(torch.uint8), g("v").view(torch.uint8)]
        if self.int8:
            cols += [g("ks").view(torch.uint8), g("vs").view(torch.uint8)]
        raw = torch.cat(cols, 1)  # [Hkv * P, row bytes]
        pad = (-raw.shape[1]) % 8
        if pad:
            raw = torch.cat([raw, torch.zeros(raw.shape[0], pad, dtype=torch.uint8)], 1)
        words = raw.contiguous().view(torch.int64)  # [Hkv * P, W]
        W = words.shape[1]
        src = None
        if device.type == "cuda":
            try:
                words = words.pin_memory()
                src = device_view(words.flatten(), device)
            except RuntimeError:
                src = None
            if src is None:
                src = words.flatten().to(device)
        else:
            src = words.flatten()
        t = self._tables[key] = (words, src, W)
        return t

    def lookup(self, layer: int, group: torch.Tensor, token: torch.Tensor, valid: torch.Tensor):
        """Rows of (KV group, document token) pairs [M] (on the compute device): (hit [M] bool: the token is covered
        and valid, K [M, d] pre-RoPE, V [M, d]) in the model dtype; rows not hit hold some covered token's K / V."""
        return self.rows(layer, *self.locate(group, token, valid))

    def locate(self, group: torch.Tensor, token: torch.Tensor, valid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What :meth:`rows` reads for those pairs, the same in every layer: (hit [M], the tier row [M])."""
        if self.P == 0:
            return torch.zeros_like(valid), torch.zeros_like(token)
        pos = self.pos_dev if self.pos_dev.device == token.device else self.pos.to(token.device)
        i = torch.searchsorted(pos, token).clamp_max(self.P - 1)
        return valid & (pos[i] == token), group * self.P + i

    def rows(self, layer: int, hit: torch.Tensor, row: torch.Tensor):
        """:meth:`lookup` of one layer from :meth:`locate`'s (hit, row)."""
        dev = row.device
        d = self.shape.head_dim
        if self.P == 0:
            z = torch.zeros(row.numel(), d, dtype=self.shape.dtype, device=dev)
            return hit, z, z
        ahead = self._ahead.get(layer) if self._ahead is not None and dev == self.device else None
        words, src, W = ahead.result() if ahead is not None else self._table(layer, dev)
        idx = (row.view(-1, 1) * W + torch.arange(W, device=dev).view(1, -1)).flatten()
        got = src.index_select(0, idx).view(-1, W).view(torch.uint8)
        if self.int8:
            k = got[:, :d].view(torch.int8).float()
            v = got[:, d : 2 * d].view(torch.int8).float()
            sc = got[:, 2 * d : 2 * d + 4].contiguous().view(torch.float16).float()  # [M, 2]: K's scale, V's
            k, v = k * sc[:, :1], v * sc[:, 1:2]
            return hit, k.to(self.shape.dtype), v.to(self.shape.dtype)
        isz = torch.empty(0, dtype=self.dtype).element_size()
        k = got[:, : d * isz].contiguous().view(self.dtype)
        v = got[:, d * isz : 2 * d * isz].contiguous().view(self.dtype)
        return hit, k.to(self.shape.dtype), v.to(self.shape.dtype)


class TierStream(ChunkStream):
    """The zoom tier made while the prefill runs and written into the pack as it goes (sekv_core/chunk_stream.py).
    It covers every document token (``zoom.idx`` = 0..N-1): which tokens the spans take is known only after the
    prefill (the segmentation's statistics are the whole document's), and the rows of the few tokens kept at full
    resolution (sinks, anchors, the recent window) are never read.  Each row is made by the arithmetic of
    :func:`window_tensors` (RoPE's cos / sin of its position made on the host, undone on the device, one scale a
    row), so a span token's row is bit for bit the sequential path's."""

    def __init__(self, kind: str, shape, n_tokens: int, sdt: torch.dtype, pre_rope: bool):
        from . import rope

        super().__init__(shape, n_tokens)
        self.kind, self.sdt = kind, sdt
        self.inv = rope.inv_freq_of(shape) if pre_rope else None
        self.parts = ("k", "ks", "v", "vs") if kind == "int8" else ("k", "v")
        self._cs: dict = {}  # (a, device) -> RoPE's cos / sin of the chunk's positions there

    def tensors(self) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
        hkv, d, out = self.shape.n_kv_heads, self.shape.head_dim, {}
        for li in range(self.shape.n_layers):
            for p in self.parts:
                scale = p.endswith("s")
                dt = torch.float16 if scale else torch.int8 if self.kind == "int8" else self.sdt
                out[f"sekv.zoom.{p}.{li}"] = (dt, (hkv, self.n) if scale else (hkv, self.n, d))
        return out

    def layer_rows(self, li: int, k: torch.Tensor, v: torch.Tensor, a: int, b: int) -> list[tuple[str, torch.Tensor]]:
        from . import rope

        kx = k.float()
        if self.inv is not None:  # as compress's rot: cos / sin on the host, rounded through k's dtype
            key = (a, k.device)
            if key not in self._cs:
                c, s = rope.cos_sin(torch.arange(a, b), self.inv, self.shape.rope_attention_scaling, dtype=k.dtype)
                if k.device.type == "cuda":  # page-locked first: a pageable copy would wait for the prefill's kernels
                    c, s = c.pin_memory(), s.pin_memory()
                self._cs = {key: (c.to(k.device, non_blocking=True), s.to(k.device, non_blocking=True))}
            kx = rope.undo(kx, *self._cs[key])
        out = []
        for name, x in (("k", kx), ("v", v)):
            if self.kind == "exact":
                out.append((f"sekv.zoom.{name}.{li}", x.to(self.sdt)))
            else:
                q, sc = quantize_rows(x)
                out += [(f"sekv.zoom.{name}.{li}", q), (f"sekv.zoom.{name}s.{li}", sc)]
        return out

    def finish_tensors(self) -> dict[str, torch.Tensor]:
        """The covered tokens' index (every document token)."""
        return {"sekv.zoom.idx": torch.arange(self.n, dtype=torch.long)}
