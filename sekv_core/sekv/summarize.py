"""Span summaries (SPEC §1.3-1.4): surprisal-weighted mean key and value per span.

w_t = s_t / sum_{j in span} s_j (s clamped at 1e-6), or 1/n_i with
``weighting="mean"`` (the ablation).  Means are taken in the original
(post-RoPE) key space -- the space queries meet keys in -- so that q . k-_i is
exactly the weighted mean of the span's attention logits.  Segment sums via
``index_add_`` on the CPU and a sparse (span x token) weight matrix times the
tokens on CUDA (cuSPARSE; index_add_'s atomics serialise on the many tokens of a
span there): no loop over spans.
"""

from __future__ import annotations

import warnings

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


def weighted_means(x: torch.Tensor, pos: torch.Tensor, sid: torch.Tensor, weights: torch.Tensor, n_spans: int, sparse: bool | None = None) -> torch.Tensor:
    """x [H, N, d] -> per-span weighted means [H, S, d] (float32); ``sid`` non-decreasing (tokens in span order)."""
    h, _, d = x.shape
    dev = x.device
    pos, sid, weights = pos.to(dev), sid.to(dev), weights.to(dev).float()
    if sparse is None:
        sparse = dev.type == "cuda"
    if sparse and pos.numel():  # tokens are in span order (span_tokens()): a CSR row per span
        t = pos.numel()
        crow = torch.zeros(n_spans + 1, dtype=torch.long, device=dev)
        crow[1:] = torch.cumsum(torch.bincount(sid, minlength=n_spans), 0)
        with warnings.catch_warnings():  # "sparse CSR support is in beta": a user-facing warning at every ingest
            warnings.simplefilter("ignore", UserWarning)
            a = torch.sparse_csr_tensor(crow, torch.arange(t, device=dev), weights, size=(n_spans, t))
        xs = x.transpose(0, 1)[pos].float().reshape(t, h * d)  # [T, H*d]
        return (a @ xs).view(n_spans, h, d).transpose(0, 1).contiguous()
    xs = x[:, pos].float() * weights.view(1, -1, 1)
    return torch.zeros(h, n_spans, d, dtype=torch.float32, device=dev).index_add_(1, sid, xs)
