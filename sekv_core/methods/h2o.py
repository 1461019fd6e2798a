"""`h2o`: Heavy-Hitter Oracle - heavy hitters by accumulated attention + a recent window (Zhang et al., 2023).

Paper: Z. Zhang, Y. Sheng, T. Zhou, T. Chen, L. Zheng, R. Cai, Z. Song, Y. Tian, C. Ré,
C. Barrett, Z. Wang, B. Chen, "H2O: Heavy-Hitter Oracle for Efficient Generative
Inference of Large Language Models", NeurIPS 2023 (arXiv:2306.14048).
Hyper-parameters: the paper's equal split of the cache between heavy hitters and
recent tokens (``heavy_ratio=0.5``: its 20% budget = 10% heavy + 10% recent).

Query-agnostic one-shot variant: the paper evicts greedily during generation; a
context pack is built at ingest, before any question is known, so the score of a
document token is its attention accumulated over *all* prefill queries (each causal
softmax row of every query head, summed; GQA: summed over the KV head's query group),
recorded chunk-wise during the one prefill (``attn_mass``, sekv_core.methods.scores).
Kept per layer and KV head: k = floor(budget * N_doc) = k - floor(heavy_ratio * k)
most recent document tokens + floor(heavy_ratio * k) heavy hitters chosen among the
older ones.  The question and generated tokens are appended at full resolution and
count in resident_bytes().
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scores import EvictionMethod, kept_tokens, topk_sorted
from .params import BudgetParams


def h2o_positions(mass: torch.Tensor, k: int, heavy_ratio: float = 0.5) -> torch.Tensor:
    """mass [Hkv, N] accumulated attention -> kept positions [Hkv, k]: top heavy hitters before the recent window + the window."""
    hkv, n = mass.shape
    heavy = int(heavy_ratio * k)
    recent = k - heavy
    top = topk_sorted(mass[:, : n - recent], heavy)
    return torch.cat([top, torch.arange(n - recent, n).expand(hkv, recent)], dim=1)


@dataclass(frozen=True)
class H2OParams(BudgetParams):
    method = "h2o"
    heavy_ratio: float = 0.5  # share of the kept tokens that are heavy hitters (the rest: the most recent)


class H2OMethod(EvictionMethod):
    name = "h2o"
    summary = "baseline: heavy hitters by accumulated prefill attention + recent tokens (H2O)"
    needs_scores = ("attn_mass",)
    params_type = H2OParams

    def select(self, prefill, params):
        n, shape = prefill.n_tokens, prefill.shape
        k = kept_tokens(params.budget, n)
        g = shape.n_heads // shape.n_kv_heads
        out = []
        for mass in prefill.scores["attn_mass"]:
            out.append(h2o_positions(mass.view(shape.n_kv_heads, g, n).sum(1), k, params.heavy_ratio))
        return out
