"""`chunkkv`: keep whole fixed-size chunks scored by observation-window attention (Liu et al., 2025).

Paper: X. Liu, Z. Tang, P. Dong, Z. Li, B. Li, X. Hu, X. Chu, "ChunkKV: Semantic-Preserving
KV Cache Compression for Efficient Long-Context LLM Inference" (arXiv:2502.00299).
Hyper-parameters: the paper's chunk size ``chunk=10`` and SnapKV-style observation
window ``window=32``; token score = mean attention of the window's queries (no pooling:
the chunk sum already smooths); chunk score = sum of its tokens' scores over all KV heads
of the layer, so a layer keeps the same chunks in every head (as the paper and kvpress's
ChunkKVPress).  The paper's optional layer-wise index reuse: ``reuse=2`` makes layers
2i+1 reuse layer 2i's chunks (default 1: no reuse).

Kept per layer and KV head: exactly k = floor(budget * N_doc) tokens = the observation
window + whole top-scoring prefix chunks while they fit; the < chunk slots left over are
given to the best remaining tokens by token score (so every baseline gets the same
budget; kvpress rounds to whole chunks instead).  Query-agnostic (compressed at ingest;
the window is the end of the document prefix).  The question and generated tokens are
appended at full resolution and count in resident_bytes().
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from .scores import EvictionMethod, kept_tokens, window_attention
from .params import BudgetParams


def chunk_positions(tok_scores: torch.Tensor, n: int, k: int, chunk: int) -> torch.Tensor:
    """tok_scores [N - w] (prefix, summed over heads) -> kept positions [k] int64, increasing."""
    m = tok_scores.shape[0]
    w = n - m
    if k <= w:
        return torch.arange(n - k, n)
    room = k - w
    n_chunks = -(-m // chunk)
    sums = F.pad(tok_scores, (0, n_chunks * chunk - m)).view(n_chunks, chunk).sum(1)
    chosen = torch.zeros(m, dtype=torch.bool)
    for c in sums.argsort(descending=True, stable=True).tolist():
        s, e = c * chunk, min(m, c * chunk + chunk)
        if e - s <= room:
            chosen[s:e] = True
            room -= e - s
        if room == 0:
            break
    if room > 0:  # fill the last slots with the best remaining tokens
        rest = tok_scores.masked_fill(chosen, float("-inf"))
        chosen[rest.topk(room).indices] = True
    return torch.cat([chosen.nonzero().flatten(), torch.arange(m, n)])


@dataclass(frozen=True)
class ChunkKVParams(BudgetParams):
    method = "chunkkv"
    window: int = 32  # observation window
    chunk: int = 10  # tokens per chunk
    reuse: int = 1  # layers that share one layer's selection


class ChunkKVMethod(EvictionMethod):
    name = "chunkkv"
    summary = "baseline: whole 10-token chunks ranked by observation-window attention (ChunkKV)"
    needs_scores = ("obs_queries",)
    params_type = ChunkKVParams

    def select(self, prefill, params):
        n, shape, sc = prefill.n_tokens, prefill.shape, prefill.scores
        k = kept_tokens(params.budget, n)
        reuse = max(1, params.reuse)
        out: list[torch.Tensor] = []
        for layer, (q, keys) in enumerate(zip(sc["obs_queries"], prefill.keys)):
            if layer % reuse:
                out.append(out[-1].clone())
                continue
            w = q.shape[1]
            s = window_attention(q, keys, sc["scaling"])[..., : n - w].mean(1).sum(0).cpu()  # [N - w]
            out.append(chunk_positions(s, n, k, params.chunk).expand(shape.n_kv_heads, -1).clone())
        return out
