"""The scout's KVzip prior (``prior="kvzip"``): a question-independent importance of each zoom block, added to the
question's ranking (docs/benchmarks.md, "KVzip's scores as a prior for the scout").

At ingest the model re-reads the document under KVzip's "repeat the previous context" prompt (methods/kvzip.py,
:func:`kvzip_scores`); every (layer, KV head, token) gets the attention it receives while being reconstructed.
KVzip itself keeps the top ``budget`` share of those pairs (its default ``level="pair"``: one threshold over every
layer and head).  The prior of a token is the share of (layer, KV head) pairs in which KVzip, at the pack's budget,
would keep it (:func:`token_prior`, one float32 per token in the pack: ``sekv.prior.kvzip``).  At open each zoom
block pools its tokens' priors (mean or max) and the result is z-scored over blocks (:func:`block_prior`).  After a
scout pass the ranking becomes (:func:`add_to`)

    z(question's rank) + prior_weight x z(block prior)

so a block KVzip would keep much of moves up for every question; the question's own evidence still orders the rest.
A pack without the prior, or ``prior_weight`` 0, ranks as before.
"""

from __future__ import annotations

import torch

from ..methods.base import PrefillResult
from ..methods.scores import kept_tokens
from .scout import zscore

#: the pack's tensor of per-token priors
TENSOR = "sekv.prior.kvzip"


def token_prior(scores: list[torch.Tensor], budget: float) -> torch.Tensor:
    """Per token the share of (layer, KV head) pairs KVzip keeps at ``budget`` (level "pair"): [N] float32 in [0, 1].

    scores: per layer [Hkv, N] (methods/kvzip.py kvzip_scores; sinks +inf).  The threshold is the
    (L * Hkv * floor(budget * N))-th highest score over every pair; ties at it are kept."""
    s = torch.stack([x.float().cpu() for x in scores])  # [L, Hkv, N]
    n_layers, hkv, n = s.shape
    k = n_layers * hkv * kept_tokens(budget, n)
    if k <= 0 or n == 0:
        return torch.zeros(n, dtype=torch.float32)
    threshold = s.reshape(-1).topk(k).values[-1]
    return (s >= threshold).float().mean((0, 1))


def window_prior(prefill: PrefillResult, budget: float, chunk: int = 2048) -> torch.Tensor:
    """The token priors of one prefill (a whole document, or one window of a windowed ingest): [N] float32."""
    from ..methods.kvzip import KVzipParams, kvzip_scores

    return token_prior(kvzip_scores(prefill, KVzipParams(budget=budget, chunk=chunk)), budget)


def block_prior(tokens: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor, pool: str) -> torch.Tensor:
    """The z-scored prior of each zoom block, its tokens' priors pooled (``mean`` or ``max``): [B] float32."""
    b = int(block_start.numel())
    if b == 0:
        return torch.zeros(0)
    lens = block_len.long()
    first = torch.repeat_interleave(torch.cumsum(lens, 0) - lens, lens)
    idx = torch.repeat_interleave(block_start.long(), lens) + torch.arange(int(lens.sum())) - first
    bid = torch.repeat_interleave(torch.arange(b), lens)
    reduce = "amax" if pool == "max" else "mean"
    pooled = torch.zeros(b).scatter_reduce(0, bid, tokens.float()[idx], reduce, include_self=False)
    return zscore(pooled)


def add_to(prio: torch.Tensor, prior: torch.Tensor | None, weight: float) -> None:
    """The scout's ranking ``prio`` [B] (in place) -> z(prio) + weight x prior; unchanged without a prior."""
    if prior is None or weight == 0 or prio.numel() == 0:
        return
    prio.copy_(zscore(prio) + weight * prior.to(prio.device, prio.dtype))
