"""`streamingllm`: attention sinks + the most recent tokens (Xiao et al., 2024).

Paper: G. Xiao, Y. Tian, B. Chen, S. Han, M. Lewis, "Efficient Streaming Language
Models with Attention Sinks", ICLR 2024 (arXiv:2309.17453).  Hyper-parameters: the
paper's 4 initial "sink" tokens (``sinks=4``) and a recent window filling the rest
of the budget; kvpress's StreamingLLMPress makes the same choice (n_sink=4).

Query-agnostic: the cache is cut at ingest, before any question is known (that is
what a context pack is), so the "recent" tokens are the last tokens of the document
prefix.  Kept document tokens per layer and KV head: k = floor(budget * N_doc) =
min(sinks, k) sinks + (k - sinks) most recent; the same positions in every layer and
head.  The question and generated tokens are appended at full resolution and count in
resident_bytes() (the peak resident KV of a step is k + appended tokens per layer).
Kept keys keep their original positions (no re-rotation), as kvpress does by default.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .scores import EvictionMethod, kept_tokens
from .params import BudgetParams


def streaming_positions(n: int, k: int, sinks: int = 4) -> torch.Tensor:
    """The first min(sinks, k) positions and the last k - that many: [k] int64, increasing."""
    s = min(sinks, k)
    return torch.cat([torch.arange(s), torch.arange(n - (k - s), n)])


@dataclass(frozen=True)
class StreamingLLMParams(BudgetParams):
    method = "streamingllm"
    sinks: int = 4  # attention-sink tokens at the document's start


class StreamingLLMMethod(EvictionMethod):
    name = "streamingllm"
    summary = "baseline: 4 attention-sink tokens + the most recent tokens (StreamingLLM)"
    params_type = StreamingLLMParams

    def select(self, prefill, params):
        n, shape = prefill.n_tokens, prefill.shape
        pos = streaming_positions(n, kept_tokens(params.budget, n), params.sinks)
        return [pos.expand(shape.n_kv_heads, -1).clone() for _ in range(shape.n_layers)]
