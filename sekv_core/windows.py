"""Windowed ingest: a document longer than the model's window is prefilled in windows that fit it.

Every window is opened by the same header (the prompt's tokens before the document text: system prompt and
instructions, prompt.document_prefix), so each one has its attention sinks and its instructions, and runs at
the model's native positions.  Window k >= 1 also re-reads the last ``carry`` tokens before its own part (the
carried context, prefilled again but not kept).  What is kept of a window is its own part of the document,
stored as if ONE prefill at global positions had produced it: document token i at position i, post-RoPE keys
re-rotated by the window's offset (rotations compose, so rotating by delta is exact up to rounding).

    window 0:  [header | doc 0 .......... e0)                     kept: [0, e0)   offset 0
    window k:  [header | carry | doc s_k ... e_k)                  kept: [s_k, e_k) offset s_k - (H + carry)

The plan is one function of the token count, the header's length and the window (:func:`plan`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .sekv import rope

#: tokens of the previous window re-read before a window's own part (docs/long-documents.md, "Windowed ingest")
CARRY_TOKENS = 256
#: a window must keep at least this share of its capacity for new document tokens
MIN_NEW_SHARE = 0.25


@dataclass(frozen=True)
class Window:
    """One window of a plan: it keeps the document's tokens [start, end) (global indices)."""

    index: int
    count: int  # windows in the plan
    start: int
    end: int
    carry: int  # tokens before `start` re-read (not kept)
    header: int  # header tokens that open it (re-read, not kept; 0 for window 0, whose header is document tokens 0..H-1)

    @property
    def n(self) -> int:
        return self.end - self.start

    @property
    def offset(self) -> int:
        """Global position - position in the window's prefill, for the kept tokens."""
        return self.start - self.header - self.carry

    def local_ids(self, ids: list[int], header_len: int) -> list[int]:
        """The token ids this window's prefill reads: header, carried context, its own part."""
        if self.index == 0:
            return ids[: self.end]
        return ids[:header_len] + ids[self.start - self.carry : self.end]


def plan(n_tokens: int, header_len: int, capacity: int, carry: int = CARRY_TOKENS) -> list[Window]:
    """Windows of at most ``capacity`` prefill tokens covering [0, n_tokens): one when it fits.  ValueError when the
    header leaves too little room."""
    if n_tokens <= capacity:
        return [Window(0, 1, 0, n_tokens, 0, 0)]
    carry = max(0, min(carry, capacity // 4))
    room = capacity - header_len - carry
    if room < max(1, int(MIN_NEW_SHARE * capacity)):
        raise ValueError(f"a window of {capacity} tokens leaves {room} for the document after its {header_len}-token header "
                         f"and {carry} carried tokens")
    bounds = [(0, capacity)]
    while bounds[-1][1] < n_tokens:
        s = bounds[-1][1]
        bounds.append((s, min(n_tokens, s + room)))
    n = len(bounds)
    return [Window(i, n, s, e, 0 if i == 0 else min(carry, s - header_len), 0 if i == 0 else header_len)
            for i, (s, e) in enumerate(bounds)]


def shift(x: torch.Tensor, delta: int, inv_freq: torch.Tensor) -> torch.Tensor:
    """Post-RoPE rows x [..., T, d] moved ``delta`` positions on: the rotation R(delta) applied (no attention
    scaling: the rows carry it already).  Computed in float32, returned in x's dtype."""
    if delta == 0:
        return x
    angle = float(delta) * inv_freq.double()  # float64 angles: exact for any offset a document reaches
    emb = torch.cat([angle, angle]).view(1, -1)
    cos, sin = emb.cos().float().to(x.device), emb.sin().float().to(x.device)
    return rope.apply(x.float(), cos, sin).to(x.dtype)


def plan_append(n_old: int, n_tokens: int, header_len: int, capacity: int, after: int, carry: int = CARRY_TOKENS) -> list[Window]:
    """Windows for tokens [n_old, n_tokens) appended to a pack of ``after`` windows (``sekv add``).  When the whole
    text fits one window (``capacity`` 0: no limit), one window that carries every pack token after the header: its
    prefill reads the pack's token ids again, so the added tokens attend to every earlier one, at native positions
    (their KV is what one prefill of the whole text gives them, as :func:`plan`'s one window).  Otherwise windows
    each opened by the header and the ``carry`` tokens before it (the pack's last ones for the first), as
    :func:`plan`'s windows k >= 1 (numbered on from ``after``).  ValueError when the header leaves too little room."""
    if n_tokens <= n_old:
        return []
    if not capacity or n_tokens <= capacity:
        return [Window(after, after + 1, n_old, n_tokens, n_old - header_len, header_len)]
    carry = max(0, min(carry, capacity // 4))
    room = capacity - header_len - carry
    if room < max(1, int(MIN_NEW_SHARE * capacity)):
        raise ValueError(f"a window of {capacity} tokens leaves {room} for the document after its {header_len}-token header "
                         f"and {carry} carried tokens")
    bounds = [(s, min(n_tokens, s + room)) for s in range(n_old, n_tokens, room)]
    n = after + len(bounds)
    return [Window(after + i, n, s, e, min(carry, s - header_len), header_len) for i, (s, e) in enumerate(bounds)]
