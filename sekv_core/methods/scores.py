"""Prefill statistics for the attention-score baselines, and the eviction plumbing they share.

Capture (used by ``sekv_core.prefill.prefill(capture=...)``)
------------------------------------------------------------
A cache method lists what it needs in ``CacheMethod.needs_scores``; ingest runs
the one prefill through a :class:`ScoreMemory` (a :class:`FullMemory` that
attends exactly as ``full`` does, so the stored K/V are bit-identical) and
the statistics land in ``PrefillResult.scores``:

``"obs_queries"``
    per layer ``[H, w, d]`` float32: the post-RoPE queries of the last ``w``
    document tokens (``w = obs_window``), the observation window of SnapKV /
    PyramidKV / ChunkKV.  Also ``scores["obs_window"] = w`` and
    ``scores["scaling"]`` (the attention scale the model used).
``"attn_mass"``
    per layer ``[H, N]`` float32: the attention each key received, summed over
    *all* prefill queries (causal softmax, each query head separately) - H2O's
    accumulated attention.  Computed inside ``attend``, chunk by chunk and in
    blocks of query rows, so the N x N matrix never exists.
``"token_text"``
    the decoded text of every document token (filled by ingest, which has the
    tokenizer) - SentenceKV's sentence splitter.
``"lex_terms"``
    ``[N]`` int32, the word term of every document token (sekv/lexical.py; filled
    by ingest too) - the lexical evidence of sekv's scout, and rag's BM25 terms.
``"doc_range"``
    ``(start, end)``: the document's own tokens within the prompt (filled by
    ingest) - rag's chunks lie inside it.

Eviction plumbing
-----------------
Every eviction baseline (StreamingLLM, H2O, SnapKV, PyramidKV, ChunkKV) is an
:class:`EvictionMethod`: it only implements ``select()`` - per layer the kept
document positions ``[Hkv, k_l]`` - and inherits storage (kept K/V plus their
positions) and the runtime :class:`EvictedMemory`.  Kept tokens keep their
original positions (their keys already carry RoPE) and new tokens continue at
``N_doc``, as in kvpress.
"""

from __future__ import annotations

import math
from typing import Any, Sequence

import torch
import torch.nn.functional as F

from .base import CacheMethod, GrowingKV, KVMemory, ModelShape, PrefillResult, StepStats, TensorStore, causal_attention
from .full import FullMemory
from .params import BudgetParams

SCORE_KINDS = ("obs_queries", "attn_mass", "token_text", "lex_terms", "kvzip_prompts", "doc_range")
#: the statistics read off the text, not captured by the prefill: :func:`text_scores` fills them
TEXT_SCORES = ("token_text", "lex_terms", "kvzip_prompts", "doc_range")
#: float32 elements of one block of attention probabilities while accumulating attn_mass (64 MiB)
_MASS_BLOCK = 1 << 24


def text_scores(tokenizer, text: str, ids: list[int], needs, system: str | None = None, offsets=None) -> dict[str, Any]:
    """The TEXT_SCORES named in ``needs`` for the document prefix ``text`` tokenized as ``ids`` (made with the
    system prompt ``system``, None: the default); ``offsets``: the tokens' character ranges in ``text`` when the
    caller tokenized it with them (ingest), else the lexical terms tokenize it again."""
    out: dict[str, Any] = {}
    if "token_text" in needs:
        out["token_text"] = tokenizer.batch_decode([[t] for t in ids])
    if "lex_terms" in needs:
        from ..sekv import lexical

        terms = lexical.document_terms(tokenizer, text, offsets)
        if terms.numel() != len(ids):
            raise ValueError(f"lex_terms: {terms.numel()} token terms for {len(ids)} tokens (another tokenization of the text?)")
        out["lex_terms"] = terms
    if "doc_range" in needs:  # [start, end) of the document's own tokens between the prompt's header and closing tag
        from ..prompt import document_token_range

        out["doc_range"] = document_token_range(tokenizer, text)
    if "kvzip_prompts" in needs:
        from .kvzip import reconstruction_prompts

        out["kvzip_prompts"] = reconstruction_prompts(tokenizer, text, ids, system)
    return out


def capture_kinds(needs) -> tuple[str, ...]:
    """What the prefill itself records of ``needs`` (all but the text scores)."""
    return tuple(sorted(x for x in needs if x not in TEXT_SCORES))


class ScoreMemory(FullMemory):
    """FullMemory that also records the statistics named in ``capture`` during a prefill of ``n_total`` tokens."""

    def __init__(self, kv: GrowingKV, shape: ModelShape, n_total: int, capture: Sequence[str], obs_window: int = 64):
        super().__init__(kv, shape)
        unknown = set(capture) - set(SCORE_KINDS)
        if unknown:
            raise ValueError(f"unknown prefill statistics {sorted(unknown)}; known: {SCORE_KINDS}")
        self.n_total = n_total
        self.capture = tuple(capture)
        self.obs_window = max(0, min(int(obs_window), n_total))
        self.scaling: float | None = None
        h, d, L = shape.n_heads, shape.head_dim, shape.n_layers
        # each layer's recorded queries stay where the layer computes until export() (no host sync inside the prefill)
        self.obs_queries: list[torch.Tensor | None] | None = [None] * L if "obs_queries" in capture else None
        self.attn_mass = [torch.zeros(h, n_total) for _ in range(L)] if "attn_mass" in capture else None

    @classmethod
    def for_prefill(cls, shape: ModelShape, device, n_total: int, capture: Sequence[str], obs_window: int = 64) -> "ScoreMemory":
        kv = GrowingKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, device, max(n_total, 1))
        return cls(kv, shape, n_total, capture, obs_window)

    def attend(self, layer, query, key, value, scaling):
        start = self.kv.len[layer]
        keys, values = self.kv.append(layer, key, value)
        out = causal_attention(query, keys, values, scaling, query.shape[-2])
        self.scaling = float(scaling)
        if self.obs_queries is not None:
            self._record_queries(layer, query, start)
        if self.attn_mass is not None:
            mass = accumulated_attention(query[0], keys[0], scaling, start)
            self.attn_mass[layer][:, : mass.shape[1]] += mass.cpu()
        return out

    def _record_queries(self, layer: int, query: torch.Tensor, start: int) -> None:
        w0 = self.n_total - self.obs_window
        a, b = max(start, w0), min(start + query.shape[-2], self.n_total)
        if a < b:
            if self.obs_queries[layer] is None:
                self.obs_queries[layer] = torch.zeros(query.shape[1], self.obs_window, query.shape[-1], device=query.device)
            self.obs_queries[layer][:, a - w0 : b - w0] = query[0, :, a - start : b - start].float()

    def _queries_on_host(self) -> list[torch.Tensor]:
        """The recorded queries, per layer [H, w, d] float32 on the host (zeros for a layer that recorded none)."""
        h, d = self.shape.n_heads, self.shape.head_dim
        qs = [q if q is not None else torch.zeros(h, self.obs_window, d) for q in self.obs_queries]
        return _host_layers(qs)

    def export(self) -> dict[str, Any]:
        out: dict[str, Any] = {"scaling": self.scaling if self.scaling is not None else self.shape.head_dim**-0.5}
        if self.obs_queries is not None:
            out["obs_queries"] = self._queries_on_host()
            out["obs_window"] = self.obs_window
        if self.attn_mass is not None:
            out["attn_mass"] = self.attn_mass
        return out


def _host_layers(xs: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-layer tensors -> host tensors: those on one device stacked and copied in one transfer (one host sync)."""
    out: list[torch.Tensor | None] = [None] * len(xs)
    by_device: dict[torch.device, list[int]] = {}
    for i, x in enumerate(xs):
        by_device.setdefault(x.device, []).append(i)
    for dev, idx in by_device.items():
        if dev.type == "cpu" or len(idx) == 1:
            for i in idx:
                out[i] = xs[i].cpu()
            continue
        for i, x in zip(idx, torch.stack([xs[i] for i in idx]).cpu().unbind(0)):
            out[i] = x
    return out


def accumulated_attention(query: torch.Tensor, keys: torch.Tensor, scaling: float, start: int) -> torch.Tensor:
    """Sum over queries of their causal softmax attention: query [H,q,d] at positions start.., keys [Hkv,T,d] -> [H,T] float32.

    Query i (absolute position start+i) sees keys 0..start+i.  Processed in blocks of
    query rows so that at most ``_MASS_BLOCK`` probabilities exist at once.
    """
    h, q, d = query.shape
    hkv, t = keys.shape[0], keys.shape[1]
    g = h // hkv
    qf = query.float().view(hkv, g, q, d)
    kf = keys.float()
    acc = torch.zeros(hkv, g, t, device=keys.device)
    rows = max(1, _MASS_BLOCK // max(1, h * t))
    cols = torch.arange(t, device=keys.device)
    for a in range(0, q, rows):
        b = min(q, a + rows)
        s = torch.einsum("kgqd,ktd->kgqt", qf[:, :, a:b], kf) * scaling
        pos = torch.arange(start + a, start + b, device=keys.device)
        s.masked_fill_(cols[None, :] > pos[:, None], float("-inf"))
        acc += s.softmax(-1).sum(2)
    return acc.view(h, t)


# ---------------------------------------------------------------------------- observation-window scores


def window_attention(obs_q: torch.Tensor, keys: torch.Tensor, scaling: float) -> torch.Tensor:
    """Softmax attention of the last w document queries over all N keys: obs_q [H,w,d], keys [Hkv,N,d] -> [H,w,N] float32.

    The window is causal among itself (query j sits at position N-w+j), as in SnapKV / kvpress.
    """
    h, w, d = obs_q.shape
    hkv, n = keys.shape[0], keys.shape[1]
    s = torch.einsum("kgwd,knd->kgwn", obs_q.to(keys.device).float().reshape(hkv, h // hkv, w, d), keys.float()) * scaling
    pos = torch.arange(n - w, n, device=keys.device)
    s.masked_fill_(torch.arange(n, device=keys.device)[None, :] > pos[:, None], float("-inf"))
    return s.softmax(-1).reshape(h, w, n)


def snapkv_scores(obs_q: torch.Tensor, keys: torch.Tensor, scaling: float, kernel: int = 7, pooling: str = "max") -> torch.Tensor:
    """SnapKV importance of the prefix keys (window excluded): [Hkv, N-w] float32, on the CPU.

    Mean attention of the window's queries, 1-D pooling (kernel, stride 1, same length)
    per query head, then the mean over each KV head's query group (kvpress's order,
    SnapKV issue #22).
    """
    h, w, _ = obs_q.shape
    hkv, n = keys.shape[0], keys.shape[1]
    s = window_attention(obs_q, keys, scaling)[..., : n - w].mean(1)  # [H, N-w]
    if kernel > 1 and s.shape[-1] > 0:
        pool = {"max": F.max_pool1d, "avg": F.avg_pool1d}[pooling]
        s = pool(s[:, None], kernel_size=kernel, padding=kernel // 2, stride=1)[:, 0, : n - w]
    return s.view(hkv, h // hkv, n - w).mean(1).cpu()


# ---------------------------------------------------------------------------- budgets and selection


def kept_tokens(budget: float, n: int) -> int:
    """floor(budget * n), clamped to [0, n] (with a 1e-9 guard against 0.29 * 100 = 28.999...)."""
    return max(0, min(n, math.floor(budget * n + 1e-9)))


def topk_sorted(scores: torch.Tensor, k: int) -> torch.Tensor:
    """Positions of the k highest scores per row, in increasing position order: [R, N] -> [R, k] int64."""
    k = min(k, scores.shape[-1])
    if k <= 0:
        return torch.zeros(*scores.shape[:-1], 0, dtype=torch.long)
    return scores.topk(k, dim=-1).indices.sort(-1).values


def select_with_window(prefix_scores: torch.Tensor, n: int, k: int) -> torch.Tensor:
    """Keep the last w = n - prefix_len tokens (the observation window) + the top (k - w) prefix tokens.

    If k < w only the last k tokens of the window are kept.  [Hkv, n-w] -> [Hkv, k] sorted.
    """
    hkv, m = prefix_scores.shape
    w = n - m
    if k <= w:
        return torch.arange(n - k, n).expand(hkv, k).clone()
    top = topk_sorted(prefix_scores, k - w)
    return torch.cat([top, torch.arange(m, n).expand(hkv, w)], dim=1)


def check_budget(budget: float) -> None:
    if not (0.0 < budget <= 1.0):
        from ..errors import SekvError

        raise SekvError(f"--budget must be in (0, 1] (a fraction of the full KV cache), got {budget}")


# ---------------------------------------------------------------------------- eviction method + memory


class EvictedMemory(KVMemory):
    """Kept document K/V per layer (a different count per layer allowed) + the appended tokens, all full resolution."""

    def __init__(self, kv: GrowingKV, kept: list[int], n_doc: int, shape: ModelShape):
        self.kv, self.kept, self.n_doc, self.shape = kv, kept, n_doc, shape

    @classmethod
    def from_kept(cls, keys: list[torch.Tensor], values: list[torch.Tensor], n_doc: int, shape: ModelShape, device, extra: int = 256):
        kv = GrowingKV(shape.n_layers, shape.n_kv_heads, shape.head_dim, shape.dtype, device, capacity=1)
        for i, (k, v) in enumerate(zip(keys, values)):  # device: one, or one per layer (GrowingKV.devices)
            kv.load_layer(i, k.to(kv.devices[i], shape.dtype), v.to(kv.devices[i], shape.dtype), extra)
        return cls(kv, [k.shape[1] for k in keys], n_doc, shape)

    def attend(self, layer, query, key, value, scaling):
        keys, values = self.kv.append(layer, key, value)
        return causal_attention(query, keys, values, scaling, query.shape[-2])

    def n_appended(self) -> int:
        return self.kv.len[-1] - self.kept[-1]

    def n_tokens(self) -> int:
        return self.n_doc + self.n_appended()

    def truncate(self, n_tokens: int) -> None:
        extra = max(0, n_tokens - self.n_doc)
        self.kv.len = [min(length, k + extra) for length, k in zip(self.kv.len, self.kept)]

    def resident_bytes(self) -> int:
        return self.kv.nbytes()

    def step_stats(self) -> StepStats:
        return StepStats(self.resident_bytes(), {"kept_doc_tokens": sum(self.kept) / len(self.kept), "doc_tokens": self.n_doc})


class EvictionMethod(CacheMethod):
    """A query-agnostic eviction baseline: select() decides, at ingest, which document tokens each layer/KV head keeps.

    Budget: ``budget`` = peak resident KV of a decoding step / full KV bytes.  The
    kept document tokens are floor(budget * N_doc) per layer and KV head (PyramidKV
    moves them between layers, same total); the question and generated tokens are
    appended at full resolution and count in resident_bytes() too.
    """

    params_type = BudgetParams
    per_layer_devices = True

    def select(self, prefill: PrefillResult, params: BudgetParams) -> list[torch.Tensor]:
        """Per layer the kept document positions [Hkv, k_l], int64, increasing along each row."""
        raise NotImplementedError

    def compress(self, prefill: PrefillResult, params):
        check_budget(params.budget)
        out: dict[str, torch.Tensor] = {f"{self.name}.n_doc": torch.tensor([prefill.n_tokens], dtype=torch.int64)}
        for i, (k, v, ix) in enumerate(zip(prefill.keys, prefill.values, self.select(prefill, params))):
            gi = ix.to(k.device).unsqueeze(-1).expand(-1, -1, k.shape[-1])
            out[f"{self.name}.k.{i}"] = k.gather(1, gi).contiguous()
            out[f"{self.name}.v.{i}"] = v.gather(1, gi).contiguous()
            out[f"{self.name}.idx.{i}"] = ix.to(torch.int32).cpu().contiguous()
        return out

    def tensor_specs(self, params, shape: ModelShape, n_tokens: int) -> list:
        from ..pack import FLOATS, INTS, TensorSpec

        p = self.name
        return [TensorSpec(f"{p}.n_doc", ("int64",), (1,), values=(n_tokens, n_tokens)),
                TensorSpec(f"{p}.idx.{{l}}", INTS, ("Hkv", "K{l}"), values=(0, n_tokens - 1)),
                *(TensorSpec(f"{p}.{kv}.{{l}}", FLOATS, ("Hkv", "K{l}", "d"), finite=True) for kv in "kv")]

    def open(self, store: TensorStore, params, shape: ModelShape, device) -> KVMemory:
        keys = [store.get(f"{self.name}.k.{i}").to(shape.dtype) for i in range(shape.n_layers)]
        values = [store.get(f"{self.name}.v.{i}").to(shape.dtype) for i in range(shape.n_layers)]
        n_doc = int(store.get(f"{self.name}.n_doc")[0])
        return EvictedMemory.from_kept(keys, values, n_doc, shape, device)

    def kept_indices(self, store: TensorStore, n_layers: int) -> list[torch.Tensor]:
        """Per layer the stored kept positions [Hkv, k_l] (for inspection and cross-checks)."""
        return [store.get(f"{self.name}.idx.{i}").long() for i in range(n_layers)]

    def describe(self, store: TensorStore, params) -> dict[str, Any]:
        n_layers = sum(1 for k in store.keys() if k.startswith(f"{self.name}.idx."))
        kept = [int(store.get(f"{self.name}.idx.{i}").shape[1]) for i in range(n_layers)]
        n_doc = int(store.get(f"{self.name}.n_doc")[0])
        return {"budget": params.budget, "doc_tokens": n_doc, "kept_tokens_per_layer": kept,
                "kept_fraction": round(sum(kept) / max(1, n_doc * n_layers), 4)}
