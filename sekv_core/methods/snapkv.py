"""`snapkv`: per-head importance from the observation window's attention (Li et al., 2024).

Paper: Y. Li, Y. Huang, B. Yang, B. Venkitesh, A. Locatelli, H. Ye, T. Cai, P. Lewis,
D. Chen, "SnapKV: LLM Knows What You are Looking for Before Generation", NeurIPS 2024
(arXiv:2404.14469).  Hyper-parameters: the paper's configuration - observation window
``window=32``, 1-D max pooling ``kernel=7`` (``pooling="max"``).  kvpress's
SnapKVPress defaults to window 64, kernel 5, average pooling; the parameters
``window=64, kernel=5, pooling="avg"`` reproduce it (benchmarks/studies/crosscheck_kvpress.py
passes them through ``ingest(..., params=...)``).

Scoring (as kvpress): softmax attention of the last ``window`` queries over all keys
(causal inside the window), averaged over the window's queries, pooled per query head,
then averaged over each KV head's query group (GQA; SnapKV issue #22).  Kept per layer
and KV head: k = floor(budget * N_doc) = the window itself + the top (k - window)
prefix tokens (if k < window: the last k tokens).

Query-agnostic: SnapKV's paper puts the question inside the observation window; a
context pack is compressed at ingest, before any question is known, so the window is
the last ``window`` tokens of the document prefix (as in kvpress when no question is
given at compression time).  The question and generated tokens are appended at full
resolution and count in resident_bytes().
"""

from __future__ import annotations

from dataclasses import dataclass

from .params import BudgetParams
from .scores import EvictionMethod, kept_tokens, select_with_window, snapkv_scores


@dataclass(frozen=True)
class SnapKVParams(BudgetParams):
    method = "snapkv"
    window: int = 32  # observation window: the document's last tokens whose queries score the rest
    kernel: int = 7  # pooling kernel over positions
    pooling: str = "max"


def snapkv_layer_scores(prefill, params) -> list:
    """Per layer the SnapKV prefix scores [Hkv, N - w]."""
    sc = prefill.scores
    return [snapkv_scores(q, k, sc["scaling"], params.kernel, params.pooling) for q, k in zip(sc["obs_queries"], prefill.keys)]


class SnapKVMethod(EvictionMethod):
    name = "snapkv"
    summary = "baseline: observation-window attention, pooled, top-k per KV head (SnapKV)"
    needs_scores = ("obs_queries",)
    params_type = SnapKVParams

    def select(self, prefill, params):
        n = prefill.n_tokens
        k = kept_tokens(params.budget, n)
        return [select_with_window(s, n, k) for s in snapkv_layer_scores(prefill, params)]
