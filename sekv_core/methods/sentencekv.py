"""`sentencekv`: sentence-level semantic KV offloading (Zhu et al., 2025) - the semantic baseline.

Paper: Y. Zhu, A. Falahati, D. H. Yang, M. M. Amiri, "SentenceKV: Efficient LLM
Inference via Sentence-Level Semantic KV Caching" (arXiv:2504.00970).  Tokens are
grouped into sentences; per sentence a semantic vector (the mean key, per layer and
KV head) stays on the compute device while the token K/V are offloaded to the CPU;
at decode the query picks the sentences whose tokens are brought back.

Unlike the eviction baselines this one is NOT query-agnostic: nothing is dropped at
ingest (the pack holds the full K/V, read from CPU memory at ask time); the question
and generated tokens choose what is fetched, at every forward.

Our choices (the paper leaves them to its code):
- Sentences: a token ends a sentence when its text contains a newline, or ends in
  ``. ! ? 。 ！ ？ …`` and the next token starts with whitespace (so ``8.6`` is not
  split).  Sentences shorter than ``min_len=4`` tokens merge into the next one, longer
  than ``max_len=64`` are split; if the sentence means would take more than half the
  ingest budget, neighbouring sentences are merged pairwise until they do not.  We do
  not pre-drop tokens inside sentences (the paper's optional SnapKV-style filter).
- Selection, per layer and KV head, at every forward: score_i = <q, mean_k_i> with q the
  new tokens' queries averaged over tokens and summed over the KV head's query group;
  sentences are taken in decreasing score while their tokens fit the token budget C
  (the paper re-selects per generated sentence; we re-select every step).
- Budget (same accounting as every method: peak resident KV of a step / full KV):
  resident = sentence means (keys only: S * d per layer and KV head, i.e. S/2 tokens'
  worth) + the fetched sentences' tokens (K and V) + the appended question/generated
  tokens.  C = floor(budget * N_doc) - ceil(S / 2), capped at N_doc.  ``budget`` may be
  changed at ask time (the pack holds everything); budget > 1 is allowed here (every
  sentence then fits and the answer equals `full`).
"""

from __future__ import annotations

from dataclasses import dataclass

import math
from typing import Any

import torch
import torch.nn.functional as F

from ..errors import SekvError
from .base import CacheMethod, GrowingKV, KVMemory, ModelShape, StepStats, TensorStore, causal_attention, per_layer
from .params import DEFAULT_BUDGET, Params, ask_time
from .scores import kept_tokens

_ENDS = (".", "!", "?", "。", "！", "？", "…")


def sentence_bounds(token_text: list[str], min_len: int = 4, max_len: int = 64) -> list[int]:
    """Start positions of the sentences plus N at the end: [0, s_1, ..., N]."""
    n = len(token_text)
    ends = []
    for t, text in enumerate(token_text):
        nxt = token_text[t + 1] if t + 1 < n else " "
        if "\n" in text or (text.rstrip().endswith(_ENDS) and (not nxt or nxt[0].isspace())):
            ends.append(t + 1)
    if not ends or ends[-1] != n:
        ends.append(n)
    bounds = [0]
    for e in ends:  # merge short sentences into the next one
        if e - bounds[-1] >= min_len or e == n:
            bounds.append(e)
    if len(bounds) > 2 and bounds[-1] - bounds[-2] < min_len:  # a short tail joins the previous sentence
        del bounds[-2]
    out = [0]
    for e in bounds[1:]:  # split long ones
        while e - out[-1] > max_len:
            out.append(out[-1] + max_len)
        out.append(e)
    return out


def merge_to_fit(bounds: list[int], max_sentences: int) -> list[int]:
    """Merge neighbouring sentences pairwise until there are at most max_sentences."""
    max_sentences = max(1, max_sentences)
    while len(bounds) - 1 > max_sentences:
        bounds = bounds[::2] if (len(bounds) - 1) % 2 == 0 else bounds[::2] + [bounds[-1]]
    return bounds


class SentenceMemory(KVMemory):
    """``device``: one device, or one per layer (a model placed across devices): each layer's sentence means, fetched
    tokens and tail on its own, the sentence tables on each of those devices once."""

    def __init__(self, keys, values, means, bounds: torch.Tensor, budget: float, shape: ModelShape, device):
        self.cpu_k, self.cpu_v = keys, values  # per layer [Hkv, N, d] on the CPU (the pack, memory-mapped)
        self.devices = per_layer(device, shape.n_layers)
        self.means = [m.to(dev) for m, dev in zip(means, self.devices)]  # per layer [Hkv, S, d] on the compute device
        self.shape, self.device = shape, self.devices[0]
        self.n_doc = int(bounds[-1])
        lens = bounds[1:] - bounds[:-1]
        #: per device of a layer: each sentence's length [S], each token's sentence [N]
        self.tables = {m.device: (lens.to(m.device), torch.repeat_interleave(torch.arange(len(lens)), lens).to(m.device)) for m in self.means}
        self.n_sent = len(lens)
        self.capacity = min(self.n_doc, math.floor(budget * self.n_doc + 1e-9) - math.ceil(self.n_sent / 2))
        if self.capacity < 0:
            raise SekvError(f"--budget {budget} is too small for this pack: its {self.n_sent} sentence means alone take "
                            f"{self.n_sent / 2 / self.n_doc:.3f} of the full KV cache")
        self.tail = GrowingKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, self.devices, 256)
        self.fetched = [0] * shape.n_layers
        self.picked = [0] * shape.n_layers

    def select(self, layer: int, query: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Positions to fetch [Hkv, c] (increasing, padded) and their validity [Hkv, c]."""
        hkv, d, n = self.shape.n_kv_heads, self.shape.head_dim, self.n_doc
        q = query[0].float().reshape(hkv, -1, query.shape[-2], d).mean(2).sum(1)  # [Hkv, d]
        sc = torch.einsum("kd,ksd->ks", q, self.means[layer].float())
        order = torch.argsort(sc, dim=-1, descending=True, stable=True)
        lens, sent_of = self.tables[self.means[layer].device]
        fit = lens[order].cumsum(-1) <= self.capacity
        sel = torch.zeros_like(fit).scatter(1, order, fit)  # [Hkv, S]
        self.picked[layer] = int(sel.sum())
        tok = sel[:, sent_of]  # [Hkv, N]
        counts = tok.sum(-1)
        c = int(counts.max()) if counts.numel() else 0
        pos = torch.arange(n, device=tok.device)
        idx = torch.where(tok, pos, pos + n).sort(-1).values[:, :c] % max(n, 1)
        return idx, torch.arange(c, device=tok.device)[None, :] < counts[:, None]

    def attend(self, layer, query, key, value, scaling):
        tk, tv = self.tail.append(layer, key, value)
        idx, valid = self.select(layer, query)
        c = idx.shape[1]
        self.fetched[layer] = c
        gi = idx.cpu().unsqueeze(-1).expand(-1, -1, self.shape.head_dim)
        dk = self.cpu_k[layer].gather(1, gi).to(self.devices[layer], non_blocking=True)
        dv = self.cpu_v[layer].gather(1, gi).to(self.devices[layer], non_blocking=True)
        keys, values = torch.cat([dk[None], tk], 2), torch.cat([dv[None], tv], 2)
        qn = query.shape[-2]
        if bool(valid.all()):
            return causal_attention(query, keys, values, scaling, qn)
        g = self.shape.n_heads // self.shape.n_kv_heads
        t = tk.shape[2]
        doc = valid.repeat_interleave(g, 0)[:, None, :].expand(-1, qn, -1)  # [H, q, c]
        causal = torch.ones(qn, t, dtype=torch.bool, device=query.device).tril(diagonal=t - qn)
        mask = torch.cat([doc, causal.expand(doc.shape[0], -1, -1)], -1)[None]
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=g > 1)

    def n_tokens(self) -> int:
        return self.n_doc + self.tail.len[-1]

    def truncate(self, n_tokens: int) -> None:
        self.tail.truncate(max(0, n_tokens - self.n_doc))

    def resident_bytes(self) -> int:
        item = self.cpu_k[0].element_size()
        per_tok_layer = 2 * self.shape.n_kv_heads * self.shape.head_dim * item
        means = sum(m.numel() for m in self.means) * item
        return means + sum(self.fetched) * per_tok_layer + self.tail.nbytes()

    def step_stats(self) -> StepStats:
        L = self.shape.n_layers
        return StepStats(self.resident_bytes(), {
            "sentences": self.n_sent, "token_budget": self.capacity,
            "fetched_tokens_mean": sum(self.fetched) / L, "picked_sentences_mean": sum(self.picked) / (L * self.shape.n_kv_heads)})


@dataclass(frozen=True)
class SentenceKVParams(Params):
    method = "sentencekv"
    budget: float = ask_time(DEFAULT_BUDGET)  # the sentences fetched per step are chosen at ask time
    min_len: int = 4  # tokens per sentence, at least / at most
    max_len: int = 64


class SentenceKVMethod(CacheMethod):
    name = "sentencekv"
    per_layer_devices = True
    summary = "baseline: sentence mean keys on the device, the query fetches top sentences from CPU (SentenceKV)"
    needs_scores = ("token_text",)
    params_type = SentenceKVParams

    def compress(self, prefill, params):
        budget = params.budget
        if budget <= 0:
            raise SekvError(f"--budget must be positive, got {budget}")
        n = prefill.n_tokens
        bounds = sentence_bounds(prefill.scores["token_text"], params.min_len, params.max_len)
        bounds = merge_to_fit(bounds, kept_tokens(min(budget, 1.0), n))
        b = torch.tensor(bounds, dtype=torch.int64)
        sent_of = torch.repeat_interleave(torch.arange(len(bounds) - 1), b[1:] - b[:-1])
        out: dict[str, torch.Tensor] = {"sentencekv.bounds": b}
        for i, (k, v) in enumerate(zip(prefill.keys, prefill.values)):
            kf = k.float().cpu()
            sums = torch.zeros(kf.shape[0], len(bounds) - 1, kf.shape[2]).index_add_(1, sent_of, kf)
            out[f"sentencekv.mean.{i}"] = (sums / (b[1:] - b[:-1]).view(1, -1, 1)).to(k.dtype)
            out[f"sentencekv.k.{i}"] = k.contiguous()
            out[f"sentencekv.v.{i}"] = v.contiguous()
        return out

    def validate(self, store: TensorStore, params, shape: ModelShape, n_tokens: int) -> None:
        from ..errors import PackError
        from ..pack import FLOATS, TensorSpec as T, check_tensors, model_dims

        dims = check_tensors(store, [T("sentencekv.bounds", ("int64",), ("B",), values=(0, n_tokens), increasing=True),
                                     *(T(f"sentencekv.{kv}.{{l}}", FLOATS, ("Hkv", "N", "d"), finite=True) for kv in "kv"),
                                     T("sentencekv.mean.{l}", FLOATS, ("Hkv", "S", "d"), finite=True)], model_dims(shape, n_tokens), shape.n_layers)
        b = store.get("sentencekv.bounds")
        if dims["B"] < 2 or dims["S"] != dims["B"] - 1 or int(b[0]) != 0 or int(b[-1]) != n_tokens or bool((b.diff() <= 0).any()):
            raise PackError("tensor 'sentencekv.bounds' does not cut the document into its sentences; re-ingest the document")

    def open(self, store: TensorStore, params, shape: ModelShape, device) -> KVMemory:
        L = shape.n_layers
        keys = [store.get(f"sentencekv.k.{i}").to(shape.dtype) for i in range(L)]
        values = [store.get(f"sentencekv.v.{i}").to(shape.dtype) for i in range(L)]
        means = [store.get(f"sentencekv.mean.{i}").to(shape.dtype) for i in range(L)]
        return SentenceMemory(keys, values, means, store.get("sentencekv.bounds"), params.budget, shape, device)

    def describe(self, store: TensorStore, params) -> dict[str, Any]:
        b = store.get("sentencekv.bounds")
        lens = (b[1:] - b[:-1]).float()
        return {"budget": params.budget, "doc_tokens": int(b[-1]), "sentences": int(lens.numel()),
                "mean_sentence_tokens": round(float(lens.mean()), 2)}
