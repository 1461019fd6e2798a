"""Span summaries (SPEC §1.3-1.4): surprisal-weighted mean key and value per span.

w_t = s_t / sum_{j in span} s_j (s clamped at 1e-6), or 1/n_i with
``weighting="mean"`` (the ablation).  Means are taken in the original
(post-RoPE) key space -- the space queries meet keys in -- so that q . k-_i is
exactly the weighted mean of the span's attention logits.  Segment sums via
``index_add_``: no loop over spans.
"""

from __future__ import annotations

import torch

WEIGHTINGS = ("surprisal", "mean")


def span_weights(surprisal: torch.Tensor | None, pos: torch.Tensor, sid: torch.Tensor, n_spans: int, weighting: str = "surprisal") -> torch.Tensor:
    """Weights [T] of the compressed tokens ``pos`` (span ids ``sid``), summing to 1 within each span."""
    if weighting not in WEIGHTINGS:
        raise ValueError(f"weighting must be one of {WEIGHTINGS}, not {weighting!r}")
    if weighting == "mean" or surprisal is None:
        raw = torch.ones(pos.numel(), dtype=torch.float32)
    else:
        raw = surprisal.float()[pos].clamp_min(1e-6)
    total = torch.zeros(n_spans, dtype=torch.float32).index_add_(0, sid, raw)
    return raw / total[sid]


def weighted_means(x: torch.Tensor, pos: torch.Tensor, sid: torch.Tensor, weights: torch.Tensor, n_spans: int) -> torch.Tensor:
    """x [H, N, d] -> per-span weighted means [H, S, d] (float32)."""
    h, _, d = x.shape
    dev = x.device
    xs = x[:, pos.to(dev)].float() * weights.to(dev).view(1, -1, 1)
    return torch.zeros(h, n_spans, d, dtype=torch.float32, device=dev).index_add_(1, sid.to(dev), xs)
