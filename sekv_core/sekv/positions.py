"""Re-positioned attention: a pack longer than the model's window is read at positions inside it.

RoPE makes attention depend only on the distance between a query and a key, and sekv keeps its keys before RoPE
(the factors) or can undo it (the full-resolution tokens and coarse entries, once, at the first ask that needs it:
:meth:`Residents.reposition`).  So when the document plus the question and answer would pass the window, every
forward lays out what a layer's KV group actually holds -- full-resolution tokens (sinks, anchors, the end window),
coarse entries still visible, zoomed blocks -- in document order at consecutive positions that end right before the
question, which starts at ``p0 = window - reserve`` (the reserve: the question and the answer's tokens).  Each key is
rotated to its slot; the question and answer run at p0, p0 + 1, ... as usual.  Every query-key distance is then
below the window.  Why consecutive and right-aligned (docs/long-documents.md, "Re-positioned attention"): the end
window and the question keep exactly the distances they had in the document, order is kept, and nothing the layer
does not hold takes a position, so a budget's worth of a 250K-token document fits a 32K window.

A coarse entry (a mean of its span's rotated keys) is de-rotated by its span's first position and takes one slot
before the span's zoomed blocks; a span whose blocks are all zoomed hides its coarse entry, which then takes none.
The zoomed tokens of a group are capped at what the window leaves (:meth:`Layout.cap`): "the window is the cap".
What the coarse entries stand for past the window is the ask-time ``coarse_mass`` (:attr:`Layout.coarse_shift`):
every hidden token as within the window (the default), a window's worth, or nothing.
When even the full-resolution tokens and coarse entries exceed p0 (past ~10x the window at the default budget),
they share positions, spread evenly over [0, p0) in order.

Everything is tensor ops on the step's device (no host sync): the batched step and its captured graphs use it too.
"""

from __future__ import annotations

import copy
import math

import torch


class Layout:
    """The document order of a pack's resident units and the map from a (KV group x zoom block) kept set to slots.

    Units, indexed [full-resolution tokens (F) | coarse entries (S) | zoom blocks (B)]; ``p0`` the question's
    position (set per ask), ``room`` the zoomed tokens a group may hold."""

    def __init__(self, full_pos: torch.Tensor, span_start: torch.Tensor, span_len: torch.Tensor, block_start: torch.Tensor,
                 block_len: torch.Tensor, block_span: torch.Tensor, n_kv_heads: int, device, n_doc: int = 0, spread: bool = False,
                 coarse_mass: str = "document"):
        dev = torch.device(device)
        self.F, self.S, self.B = int(full_pos.numel()), int(span_start.numel()), int(block_start.numel())
        self.hkv = n_kv_heads
        # a coarse entry sorts just before its span's first block (2p vs 2p + 1); full tokens lie in no span
        key = torch.cat([2 * full_pos.long() + 1, 2 * span_start.long(), 2 * block_start.long() + 1])
        self.order = torch.argsort(key, stable=True).to(dev)
        #: spread: the document's gaps between units kept, scaled (:meth:`place`); n_doc: the document's tokens
        self.spread, self.n_doc = bool(spread and n_doc), int(n_doc)
        self.doc_sorted = torch.cat([full_pos.long(), span_start.long(), block_start.long()]).to(dev)[self.order]
        self.rank = torch.argsort(self.order)  # unit -> its place in document order
        #: the document positions of the base units [F + S]: where their stored keys were rotated
        self.base_doc_pos = torch.cat([full_pos.long(), span_start.long()]).to(dev)
        self.block_len = block_len.long().to(dev)
        self.block_span = block_span.long().to(dev)
        self.span_len = span_len.long().to(dev)
        counts = torch.bincount(block_span.long(), minlength=self.S)
        self.span_first_block = (torch.cumsum(counts, 0) - counts).to(dev)  # a span's blocks are consecutive, in order
        self.p0 = 0
        self.room = 0
        #: added to every coarse entry's score (its log of the tokens it stands for) while re-positioned, when the
        #: document is longer than p0 (:meth:`set_question_at`): coarse_mass "window" log(p0 / n_doc), "none" -inf
        #: (hidden), "document" 0
        self.coarse_mass = coarse_mass
        self.coarse_shift = 0.0

    def to(self, device) -> "Layout":
        """A copy with its tables on ``device`` (the question's position is the caller's to keep up to date)."""
        out = copy.copy(self)
        for name, value in vars(self).items():
            if torch.is_tensor(value):
                setattr(out, name, value.to(device))
        return out

    def set_question_at(self, p0: int) -> None:
        self.p0 = int(p0)
        self.room = max(0, self.p0 - self.F - self.S)
        self.coarse_shift = 0.0
        if self.n_doc > self.p0 > 0 and self.coarse_mass != "document":
            self.coarse_shift = math.log(self.p0 / self.n_doc) if self.coarse_mass == "window" else float("-inf")

    def place(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keep [Hkv, B] bool (the zoom blocks each KV group holds) -> (slots of the base units [Hkv, F + S],
        first slot of each block [Hkv, B]: where it sits when kept, and where it would start if it were the only
        block added, before the units after it, for blocks not kept)."""
        hkv, dev = keep.shape[0], keep.device
        blen = self.block_len.to(dev)
        _, coarse = self._spans_held(keep)
        coarse = coarse.long()
        size = torch.cat([torch.ones(hkv, self.F, dtype=torch.long, device=dev), coarse, keep.long() * blen.view(1, -1)], 1)
        order = self.order.to(dev)
        s = size[:, order]
        off = torch.empty_like(size).scatter_(1, order.view(1, -1).expand(hkv, -1), torch.cumsum(s, 1) - s)
        total = s.sum(1, keepdim=True)
        p0 = self.p0
        if self.spread and s.shape[1]:  # each unit also moved on by its share of the hidden tokens before it
            g = self._gaps(s, total)
            off = off + g.gather(1, self.rank.to(dev).view(1, -1).expand(hkv, -1))
            total = total + g[:, -1:]  # still right-aligned: the last unit ends right before the question
        pos = torch.where(total <= p0, p0 - total + off, off * p0 // total.clamp_min(1))
        base, blocks = pos[:, : self.F + self.S], pos[:, self.F + self.S :]
        blocks = torch.where(keep, blocks, (blocks - blen.view(1, -1)).clamp_min(0))  # never before position 0
        return base, blocks

    def _gaps(self, s: torch.Tensor, total: torch.Tensor) -> torch.Tensor:
        """Spread layout: the positions each unit is moved on, in document order [Hkv, U]: the document tokens before it
        that no unit holds (e, non-decreasing) x min(1, room / hidden tokens), floored.  When the last document token is
        held the last unit gets all of min(room, hidden): the layout still ends right before the question, and with
        room for every hidden token (p0 >= the document's length) each unit sits at its document position."""
        e = torch.cummax(self.doc_sorted.view(1, -1) - (torch.cumsum(s, 1) - s), dim=1).values.clamp_min(0)
        hidden = (self.n_doc - total).clamp_min(0)
        room = torch.minimum((self.p0 - total).clamp_min(0), hidden)
        return torch.where(hidden > 0, e * room // hidden.clamp_min(1), torch.zeros_like(e))

    def scout_positions(self) -> torch.Tensor:
        """Where the scout scores each zoom block [B]: the slot it would take were it the only one zoomed."""
        return self.place(torch.zeros(1, self.B, dtype=torch.bool, device=self.order.device))[1][0]

    def cap(self, keep: torch.Tensor, priority: torch.Tensor, lengths: torch.Tensor | None = None) -> torch.Tensor:
        """keep [Hkv, X] cut, per KV group, to the units of highest priority [Hkv, X] while their tokens fit ``room``
        (a prefix, as attention.select); X: zoom blocks, or spans with their ``lengths``."""
        blen = (self.block_len if lengths is None else lengths).to(keep.device)
        order = torch.argsort(priority, dim=1, descending=True, stable=True)
        k = keep.gather(1, order)
        fits = torch.cumsum(k.long() * blen[order], 1) <= self.room
        return torch.zeros_like(keep).scatter_(1, order, k & fits)

    def tokens(self, keep: torch.Tensor) -> torch.Tensor:
        """Positions a kept set occupies per group [Hkv] (before the question)."""
        zoomed, coarse = self._spans_held(keep)
        return self.F + coarse.sum(1) + zoomed.sum(1)

    def _spans_held(self, keep: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """keep [Hkv, B] -> (zoomed tokens of each span [Hkv, S], whether its coarse entry is still visible [Hkv, S]:
        not every one of its tokens zoomed)."""
        dev = keep.device
        zoomed = torch.zeros(keep.shape[0], self.S, dtype=torch.long, device=dev).index_add_(
            1, self.block_span.to(dev), keep.long() * self.block_len.to(dev).view(1, -1))
        return zoomed, zoomed < self.span_len.to(dev).view(1, -1)


def block_positions(first: torch.Tensor, n: int) -> torch.Tensor:
    """Token positions of blocks starting at ``first`` [...]: [..., n] (rows past a block's length are unused)."""
    return first.unsqueeze(-1) + torch.arange(n, device=first.device)
