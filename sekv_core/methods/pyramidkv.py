"""`pyramidkv`: SnapKV scoring with a pyramidal layer budget (Cai et al., 2024).

Paper: Z. Cai, Y. Zhang, B. Gao, Y. Liu, T. Liu, K. Lu, W. Xiong, Y. Dong, B. Chang,
J. Hu, W. Xiao, "PyramidKV: Dynamic KV Cache Compression based on Pyramidal
Information Funneling" (arXiv:2406.02069).  Hyper-parameters: the paper's / its
reference code's ``beta=20`` (top layer gets k/beta tokens, bottom layer 2k - k/beta,
arithmetic in between - KVCache-Factory's formula, also kvpress's PyramidKVPress);
scoring exactly as our `snapkv` (window 32, max pooling kernel 7), so PyramidKV vs
SnapKV isolates the layer allocation.

Budget: the same total as SnapKV: sum over layers of k_l = L * floor(budget * N_doc)
per KV head, with k_0 >= ... >= k_{L-1} (rounded by largest remainder so the total
is exact; where the bottom layer would exceed N_doc it is capped at N_doc and the top
raised, as kvpress does).  Each layer keeps its observation window + its top
(k_l - window) prefix tokens.  Query-agnostic (compressed at ingest; the window is the
end of the document prefix).  The question and generated tokens are appended at full
resolution and count in resident_bytes().
"""

from __future__ import annotations

from dataclasses import dataclass

import math

from .scores import EvictionMethod, kept_tokens, select_with_window
from .snapkv import SnapKVParams, snapkv_layer_scores


def pyramid_budgets(k: int, n: int, n_layers: int, beta: float = 20.0) -> list[int]:
    """Per-layer kept tokens, decreasing with depth, summing to n_layers * k, each in [0, n]."""
    if n_layers == 1:
        return [k]
    lo = k / beta
    hi = 2 * k - lo
    if hi > n:
        hi, lo = float(n), 2 * k - float(n)
    step = (hi - lo) / (n_layers - 1)
    raw = [hi - i * step for i in range(n_layers)]
    out = [min(n, max(0, math.floor(x))) for x in raw]
    short = n_layers * k - sum(out)
    order = sorted(range(n_layers), key=lambda i: (-(raw[i] - math.floor(raw[i])), i))
    for i in order:
        if short <= 0:
            break
        if out[i] < n:
            out[i] += 1
            short -= 1
    return out


@dataclass(frozen=True)
class PyramidKVParams(SnapKVParams):
    method = "pyramidkv"
    beta: float = 20.0  # the pyramid's slope: low layers keep more


class PyramidKVMethod(EvictionMethod):
    name = "pyramidkv"
    summary = "baseline: SnapKV scores with more tokens in low layers, fewer in high layers (PyramidKV)"
    needs_scores = ("obs_queries",)
    params_type = PyramidKVParams

    def select(self, prefill, params):
        n, shape = prefill.n_tokens, prefill.shape
        budgets = pyramid_budgets(kept_tokens(params.budget, n), n, shape.n_layers, params.beta)
        return [select_with_window(s, n, kl) for s, kl in zip(snapkv_layer_scores(prefill, params), budgets)]
