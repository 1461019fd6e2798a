"""Entropy-guided segmentation (SPEC §1.1-1.2): surprisal -> anchors + spans.

Every document position ends up in exactly one of two places:

* ``full_idx`` -- kept at full resolution: the first ``n_sink`` tokens
  (attention sinks), the kept boundary ("anchor") tokens, the tokens of any
  region too short to form a span, and the last ``window`` tokens;
* one compressed span ``[span_start[i], span_end[i])``.

Boundaries are the positions with s_t > mu + alpha * sigma (statistics over the
document without the sinks).  A boundary that would leave fewer than
``min_span`` tokens since the previous kept boundary is dropped (its token joins
the span); a span longer than ``max_span`` is split evenly (no anchor at the cut).
The greedy merge walks the candidate boundaries once (O(#boundaries)); all
per-token work is vectorised.

``auto_lengths`` gives the budget-driven defaults (docs/design.md has the measured
shares behind the constants).

Ablations (sekv/params.py ABLATIONS): ``anchors=False`` keeps no anchor at
full resolution -- no sinks and no boundary tokens: the boundaries are the
anchored segmentation's, the sinks join the first span and each kept boundary
token starts the next span instead (``n_sink=0`` alone only drops the sinks;
the boundary anchors stay).  ``fixed_segment`` cuts the same region into chunks of
one fixed length instead of at surprisal boundaries.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

#: share of the budget b*N the persistent anchors + coarse entries may take (docs/design.md)
SPAN_SHARE = 0.25
#: share of the budget b*N the local window takes (a quarter took room from the zoom and cost answers on short
#: documents and pack size; a tenth kept the needles: docs/design.md, segmentation)
WINDOW_SHARE = 0.10
WINDOW_MAX = 512


@dataclass
class Segmentation:
    n_tokens: int
    full_idx: torch.Tensor  # [F] int64, sorted
    anchor_idx: torch.Tensor  # [A] int64, the kept boundary tokens (a subset of full_idx)
    span_start: torch.Tensor  # [S] int64, sorted
    span_end: torch.Tensor  # [S] int64, exclusive

    @property
    def n_spans(self) -> int:
        return int(self.span_start.numel())

    @property
    def span_len(self) -> torch.Tensor:
        return self.span_end - self.span_start

    def span_tokens(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(positions, span id) of every compressed token, in span order."""
        return span_token_index(self.span_start, self.span_end)


def span_token_index(start: torch.Tensor, end: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions covered by the spans, concatenated in span order, and each one's span id."""
    n = end - start
    sid = torch.repeat_interleave(torch.arange(n.numel(), device=start.device), n)
    first = torch.cumsum(n, 0) - n  # offset of each span in the flat list
    pos = start[sid] + torch.arange(int(n.sum()), device=start.device) - first[sid]
    return pos, sid


def auto_lengths(n_tokens: int, budget: float) -> tuple[int, int, int]:
    """(min_span, max_span, window) for a document of n_tokens at a budget fraction b.

    * window = min(512, floor(0.1 * b * N)): a tenth of the budget;
    * min_span = max(4, ceil(2 / (0.25 * b))): each span costs two persistent
      entries (its anchor and its coarse mean), so spans of at least 2/(0.25 b)
      tokens keep anchors + coarse entries within 25% of b*N (less in practice:
      the measured mean span is longer than the minimum);
    * max_span = 2 * min_span: even splits then never produce a piece shorter
      than min_span, and one span stays a small fraction of the expansion budget.
    """
    b = max(float(budget), 1e-4)
    window = int(min(WINDOW_MAX, math.floor(WINDOW_SHARE * b * n_tokens)))
    min_span = max(4, math.ceil(2.0 / (SPAN_SHARE * b)))
    return min_span, 2 * min_span, window


def boundary_candidates(surprisal: torch.Tensor, alpha: float, n_sink: int, lo: int, hi: int) -> torch.Tensor:
    """Positions in [lo, hi) whose surprisal exceeds mu + alpha * sigma (stats without the sinks)."""
    s = surprisal.float()
    body = s[n_sink:] if s.numel() > n_sink else s
    if body.numel() < 2:
        return torch.empty(0, dtype=torch.long)
    mu, sigma = body.mean(), body.std()
    if not torch.isfinite(sigma) or sigma <= 0:
        return torch.empty(0, dtype=torch.long)
    hit = s[lo:hi] > mu + alpha * sigma
    return torch.nonzero(hit).flatten() + lo


def _merge(cands: list[int], lo: int, hi: int, min_span: int) -> list[int]:
    """Greedy: keep a boundary only if >= min_span tokens lie between it and the previous kept one."""
    kept: list[int] = []
    prev = lo - 1  # virtual boundary just before the region
    for p in cands:
        if p - prev - 1 >= min_span:
            kept.append(p)
            prev = p
    # the last span must be long enough too: merge it into its left neighbour
    if kept and hi - kept[-1] - 1 < min_span:
        kept.pop()
    return kept


def _split(start: torch.Tensor, end: torch.Tensor, max_span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Split spans longer than max_span into ceil(n / max_span) nearly equal pieces."""
    _, a, b = split_pieces(start, end, max_span)
    return a, b


def split_pieces(start: torch.Tensor, end: torch.Tensor, max_len: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each range [start, end) into ceil(n / max_len) nearly equal contiguous pieces (lengths differ by at
    most one) -> (range id, piece start, piece end) of every piece, in order."""
    n = end - start
    pieces = torch.clamp((n + max_len - 1) // max_len, min=1)
    sid = torch.repeat_interleave(torch.arange(n.numel()), pieces)
    k = torch.arange(int(pieces.sum())) - (torch.cumsum(pieces, 0) - pieces)[sid]
    # piece k of span covers [start + floor(k*n/p), start + floor((k+1)*n/p))
    a = start[sid] + (k * n[sid]) // pieces[sid]
    b = start[sid] + ((k + 1) * n[sid]) // pieces[sid]
    return sid, a, b


def zoom_blocks(span_start: torch.Tensor, span_end: torch.Tensor, unit: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The units zoom-in decoding expands: each span cut into pieces of at most ``unit`` tokens (``unit`` <= 0:
    one block per span) -> (span of each block, block start, block end), blocks in token order."""
    if unit <= 0 or span_start.numel() == 0:
        return torch.arange(span_start.numel()), span_start.clone(), span_end.clone()
    return split_pieces(span_start, span_end, int(unit))


def segment(
    surprisal: torch.Tensor,
    *,
    alpha: float = 1.0,
    min_span: int,
    max_span: int,
    n_sink: int = 4,
    window: int,
    anchors: bool = True,
) -> Segmentation:
    s = surprisal.detach().float().cpu().flatten()
    n = int(s.numel())
    min_span = max(1, int(min_span))
    max_span = max(min_span, int(max_span))
    lo = min(max(int(n_sink), 0), n)
    hi = max(lo, n - max(int(window), 0))
    empty = torch.empty(0, dtype=torch.long)
    if hi - lo < min_span:  # nothing long enough to compress
        return Segmentation(n, torch.arange(n), empty, empty.clone(), empty.clone())

    cands = boundary_candidates(s, alpha, lo, lo, hi).tolist()
    kept = torch.tensor(_merge(cands, lo, hi, min_span), dtype=torch.long)
    if anchors:
        start = torch.cat([torch.tensor([lo]), kept + 1])
        end = torch.cat([kept, torch.tensor([hi])])
    else:  # the same boundaries; the sinks join the first span and each boundary token opens the next one
        start = torch.cat([torch.tensor([0]), kept])
        end = torch.cat([kept, torch.tensor([hi])])
        kept = empty
    start, end = _split(start, end, max_span)
    return Segmentation(n, _uncovered(n, start, end), kept, start, end)


def _uncovered(n: int, start: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """Positions in [0, n) outside every span [start, end)."""
    covered = torch.zeros(n + 1, dtype=torch.long)
    covered.index_add_(0, start, torch.ones_like(start))
    covered.index_add_(0, end, -torch.ones_like(end))
    return torch.nonzero(torch.cumsum(covered, 0)[:n] == 0).flatten()


def fixed_segment(n_tokens: int, *, chunk: float, n_sink: int = 4, window: int, anchors: bool = True) -> Segmentation:
    """The fixed-size-chunk ablation: the region between the sinks and the window in equal chunks.

    With ``anchors``, the region [n_sink, N - window) of R tokens is laid out as
    chunk, anchor, chunk, anchor, ..., chunk: S = max(1, round((R + 1) / (chunk + 1)))
    chunks whose lengths differ by at most one, with one anchor token (full
    resolution) between neighbours.  Given the surprisal segmentation's mean span
    length as ``chunk``, this has the same number of spans and anchors as that
    segmentation whenever it split no span at ``max_span`` (then R = S * chunk + S - 1).
    Without anchors: [0, N - window) in S = max(1, round(R / chunk)) chunks, no anchor.
    ``chunk <= 0`` or a region shorter than ``chunk``: nothing is compressed.
    """
    n = max(int(n_tokens), 0)
    lo = min(max(int(n_sink), 0), n) if anchors else 0
    hi = max(lo, n - max(int(window), 0))
    r = hi - lo
    empty = torch.empty(0, dtype=torch.long)
    if chunk <= 0 or r < max(chunk, 1):
        return Segmentation(n, torch.arange(n), empty, empty.clone(), empty.clone())
    if anchors:
        s_ = max(1, math.floor((r + 1) / (float(chunk) + 1) + 0.5))  # rounded half up
        t = r - (s_ - 1)  # tokens in chunks
    else:
        s_ = max(1, math.floor(r / float(chunk) + 0.5))
        t = r
    k = torch.arange(s_)
    gap = k if anchors else torch.zeros_like(k)  # anchors before chunk k
    start = lo + (k * t) // s_ + gap
    end = lo + ((k + 1) * t) // s_ + gap
    anchor_idx = end[:-1].clone() if anchors else empty
    return Segmentation(n, _uncovered(n, start, end), anchor_idx, start, end)


def keep_exact(seg: Segmentation, exact: torch.Tensor) -> Segmentation:
    """``seg`` with the positions ``exact`` taken out of their spans and kept at full resolution: a span is cut at
    each of them, and a piece of one token left between two of them is kept at full resolution too (a one-token
    span's coarse entry costs what its token does, and its factors buy nothing).  The anchors stay as they are."""
    n = seg.n_tokens
    if exact.numel() == 0 or seg.n_spans == 0:
        return seg
    pos, sid = seg.span_tokens()
    owner = torch.full((n,), -1, dtype=torch.long)
    owner[pos] = sid
    exact = exact[(exact >= 0) & (exact < n)]
    owner[exact] = -1
    for _ in range(2):  # the pieces, then the one-token pieces dropped (dropping them makes no new one-token piece)
        keep = owner >= 0
        prev = torch.cat([torch.tensor([-2]), owner[:-1]])
        nxt = torch.cat([owner[1:], torch.tensor([-2])])
        start = torch.nonzero(keep & (prev != owner)).flatten()
        end = torch.nonzero(keep & (nxt != owner)).flatten() + 1
        single = start[end - start == 1]
        if single.numel() == 0:
            break
        owner[single] = -1
    return Segmentation(n, _uncovered(n, start, end), seg.anchor_idx, start, end)
