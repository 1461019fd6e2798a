"""`kvzip`: query-agnostic eviction scored by context reconstruction (Kim et al., 2025).

Paper: J.-H. Kim, J. Kim, S. Kwon, J. W. Lee, S. Yun, H. O. Song, "KVzip: Query-Agnostic
KV Cache Compression with Context Reconstruction", NeurIPS 2025 (arXiv:2505.23416); code
snu-mllab/KVzip; also ``KVzipPress`` in NVIDIA kvpress 0.5.5 (cross-checked against it:
benchmarks/crosscheck_kvpress.py, docs/baselines.md).  KVzip+ normalisation: kvpress's
``KVzipPress(kvzip_plus_normalization=True)`` (the scores KVzap is trained on).

After the one prefill, the model is asked to repeat the document and re-reads it, teacher
forced, chunk by chunk: for the chunk ``[a, b)`` of the *context* (the document prefix after
the chat template's head, i.e. the user message: positions ``P..N``), the input

    "\\n\\nRepeat the previous context exactly."                                  (first chunk)
    "\\n\\nRepeat the part of the previous context exactly, starting with" + the
     previous chunk's last ``OVERLAP`` tokens                                    (later chunks)
    + the template's end of the user turn and assistant header + the chunk's tokens

runs at positions ``N..`` over the whole document cache (a real forward: every layer sees the
model's own attention), and is dropped afterwards.  In every layer, the softmax attention of
these reconstruction queries over the keys ``S + chunk + the reconstruction tokens`` (causal
among the latter; ``S`` = the first ``min(sinks, a)`` tokens) is taken, as in the paper and
kvpress; a chunk key's score is the maximum attention it receives from any reconstruction
query of its KV head's query group (GQA).  Tokens of the template head that are not sinks are
never reconstructed and score 0; the first ``sinks`` tokens are always kept.

KVzip+ (``plus=True``): each attention probability is multiplied by ``||W_O^h v_i||`` (the
key's value through the head's slice of the output projection) and divided by ``||x_t||``
(the attention input of query ``t``), before the maximum.

Eviction (real: the pack and the resident KV hold only what is kept), at the accounting of the
other eviction baselines: ``floor(budget * N)`` document tokens per layer and KV head *on
average*, so the same resident KV.  ``level`` says how the kept pairs are spread:

* ``pair`` (default; the paper's and kvpress's default): one threshold over every layer and
  KV head, so layers and heads keep different counts (total ``L * Hkv * floor(budget * N)``);
* ``layer`` (kvpress ``layerwise=True``): the same count per layer, spread over its heads;
* ``head``: ``floor(budget * N)`` per layer and KV head (the paper's "uniform" variant).

The kept keys keep their positions; the question and generated tokens are appended at full
resolution after position N and count in resident_bytes().  Compress cost: the
reconstruction passes re-read N + (prompt) tokens over the N-token cache, about one to two
more prefills.  Our scores are computed in float32 (kvpress and the reference code take the
softmax in the model dtype).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from ..errors import SekvError
from .base import CacheMethod, GrowingKV, KVMemory, ModelShape, PrefillResult, StepStats, TensorStore, causal_attention, per_layer
from .full import FullMemory
from .scores import check_budget, kept_tokens
from .params import BudgetParams, Params

FIRST_PROMPT = "\n\nRepeat the previous context exactly."
NEXT_PROMPT = "\n\nRepeat the part of the previous context exactly, starting with"
#: tokens of the previous chunk quoted in a later chunk's prompt
OVERLAP = 8
LEVELS = ("pair", "layer", "head")
#: float32 attention probabilities per block of reconstruction query rows (64 MiB)
_SCORE_BLOCK = 1 << 24


@dataclass(frozen=True)
class KVzipParams(BudgetParams):
    """budget: kept document KV / full document KV (on average per layer and KV head)."""

    method = "kvzip"
    sinks: int = 4  # first tokens always kept
    chunk: int = 2048  # context tokens reconstructed per pass
    level: str = "pair"  # how kept pairs spread over layers and heads: pair | layer | head
    plus: bool = False  # KVzip+ normalisation of the scores

    def __post_init__(self):
        check_budget(float(self.budget))
        if self.sinks < 0:
            raise SekvError(f"kvzip: sinks must be >= 0, got {self.sinks}")
        if self.chunk < 1:
            raise SekvError(f"kvzip: chunk must be >= 1, got {self.chunk}")
        self._one_of("level", LEVELS)

    @classmethod
    def of(cls, params: "Mapping[str, Any] | Params") -> "KVzipParams":
        return params if isinstance(params, cls) else cls.from_dict(params)


# ---------------------------------------------------------------------------- the reconstruction prompts (text)


def _turn_end(tokenizer) -> str:
    """The chat template's text between a user message's content and the assistant's answer."""
    if tokenizer.chat_template is None:
        return "\n"
    mark = "\x00SEKV_KVZIP\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": mark}], tokenize=False, add_generation_prompt=True,
                                         enable_thinking=False)
    return text.split(mark, 1)[1]


def reconstruction_prompts(tokenizer, text: str, ids: list[int], system: str | None = None) -> dict[str, Any]:
    """What compress() needs from the tokenizer, for the document prefix ``text`` tokenized as ``ids``:
    ``context_start`` (tokens of the chat template's head, before the user message) and the token ids of
    the two prompts and of the template's end of turn."""
    from .. import prompt

    head = prompt.template_head(tokenizer, system)
    head_ids = prompt.encode(tokenizer, head) if head else []
    if not text.startswith(head) or list(ids[: len(head_ids)]) != head_ids:
        raise SekvError("kvzip: the document prefix's tokens do not start with the chat template's head's tokens "
                        "(a tokenizer that merges across it); kvzip cannot tell where the context starts")
    return {"context_start": len(head_ids), "first": prompt.encode(tokenizer, FIRST_PROMPT),
            "next": prompt.encode(tokenizer, NEXT_PROMPT), "turn_end": prompt.encode(tokenizer, _turn_end(tokenizer))}


def reconstruction_inputs(ids: list[int], prompts: Mapping[str, Any], chunk: int) -> list[tuple[int, int, list[int]]]:
    """(a, b, input ids) of every reconstruction pass: the context [context_start, N) in chunks of ``chunk``."""
    n, p = len(ids), int(prompts["context_start"])
    out = []
    for a in range(p, n, chunk):
        b = min(n, a + chunk)
        lead = list(prompts["first"]) if a == p else list(prompts["next"]) + list(ids[max(p, a - OVERLAP) : a])
        out.append((a, b, lead + list(prompts["turn_end"]) + list(ids[a:b])))
    return out


# ---------------------------------------------------------------------------- scores


def chunk_scores(query: torch.Tensor, keys: torch.Tensor, scaling: float, n_doc: int, span: tuple[int, int], sinks: int,
                 x_norm: torch.Tensor | None = None, wov_norm: torch.Tensor | None = None) -> torch.Tensor:
    """KVzip scores of the chunk's keys from one reconstruction pass: [Hkv, b - a] float32.

    query [H, q, d]: the q reconstruction tokens' queries (post-RoPE) at positions n_doc..;
    keys [Hkv, >= n_doc + q, d]: the document's then the reconstruction tokens' keys.
    Softmax over S = keys[:min(sinks, a)], the chunk keys[a:b] and the reconstruction keys
    (causal); the chunk's columns, max over the queries and each KV head's group.
    KVzip+: x_norm [q] (||x_t|| of each query's attention input), wov_norm [H, b - a]
    (||W_O^h v_i||).
    """
    h, q, d = query.shape
    hkv = keys.shape[0]
    g = h // hkv
    a, b = span
    s, c = min(sinks, a), b - a
    sub = torch.cat([keys[:, :s], keys[:, a:b], keys[:, n_doc : n_doc + q]], dim=1).float()  # [Hkv, s + c + q, d]
    qf = query.float().view(hkv, g, q, d)
    t = s + c + q
    rows = max(1, _SCORE_BLOCK // max(1, h * t))
    best = torch.full((hkv, g, c), float("-inf"), device=keys.device)
    own = torch.arange(q, device=keys.device)
    for r0 in range(0, q, rows):
        r1 = min(q, r0 + rows)
        logits = torch.einsum("kgqd,ktd->kgqt", qf[:, :, r0:r1], sub) * scaling
        logits[..., s + c :].masked_fill_(own[None, :] > own[r0:r1, None], float("-inf"))
        p = logits.softmax(-1)[..., s : s + c]  # [Hkv, g, rows, c]
        if x_norm is not None:
            p = p / x_norm[r0:r1].float().view(1, 1, -1, 1)
        best = torch.maximum(best, p.amax(2))
    if wov_norm is not None:  # a factor per (head, key), >= 0: it commutes with the max over queries
        best = best * wov_norm.float().view(hkv, g, c)
    return best.amax(1)


def output_gram(o_weight: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Per query head h the Gram matrix W_h^T W_h [H, d, d] of its slice of the output projection
    (o_weight [hidden, H * d]), so that ||W_h v||^2 = v^T G_h v."""
    w = o_weight.float().view(o_weight.shape[0], n_heads, -1)  # [hidden, H, d]
    return torch.einsum("ohd,ohe->hde", w, w)


def wov_norms(values: torch.Tensor, gram: torch.Tensor) -> torch.Tensor:
    """||W_O^h v_i|| for values [Hkv, c, d] and gram [H, d, d] -> [H, c] float32."""
    hkv, c, d = values.shape
    g = gram.shape[0] // hkv
    v = values.float()
    sq = torch.einsum("kcd,kgde,kce->kgc", v, gram.view(hkv, g, d, d), v)
    return sq.clamp_min(0).sqrt().reshape(hkv * g, c)


class ReconstructionMemory(FullMemory):
    """The document's full KV (a copy) + one reconstruction pass's tokens; scores the pass's attention.

    ``span`` is the chunk being reconstructed; ``x_norm`` (per layer, filled by a pre-hook on the
    attention modules) and ``grams`` are set for KVzip+.
    """

    def __init__(self, prefill: PrefillResult, sinks: int, extra: int):
        device = prefill.keys[0].device
        super().__init__(GrowingKV.from_tensors(prefill.keys, prefill.values, device, extra=extra), prefill.shape)
        self.n_doc = prefill.n_tokens
        self.sinks = sinks
        self.scores = [torch.zeros(self.shape.n_kv_heads, self.n_doc, device=device) for _ in range(self.shape.n_layers)]
        self.span = (0, 0)
        self.grams: list[torch.Tensor] | None = None
        self.x_norm: dict[int, torch.Tensor] = {}

    def attend(self, layer, query, key, value, scaling):
        keys, values = self.kv.append(layer, key, value)
        out = causal_attention(query, keys, values, scaling, query.shape[-2])
        a, b = self.span
        wov = wov_norms(values[0, :, a:b], self.grams[layer]) if self.grams is not None else None
        self.scores[layer][:, a:b] = chunk_scores(query[0], keys[0], scaling, self.n_doc, self.span, self.sinks,
                                                  self.x_norm.get(layer) if self.grams is not None else None, wov)
        return out


def kvzip_scores(prefill: PrefillResult, p: KVzipParams) -> list[torch.Tensor]:
    """Per layer the KVzip score of every document token [Hkv, N] float32 (sinks +inf, the template head 0).

    A window of a windowed ingest (``prefill.start > 0``, its keys at global positions) is reconstructed over its
    own KV alone, the prompts at the positions after it; its first tokens score as any other (no sinks)."""
    from .. import runtime

    model = prefill.model
    prompts = prefill.scores.get("kvzip_prompts")
    if model is None or prompts is None:
        raise SekvError("kvzip reruns the model over the document at compress time: it needs the prefill's model and "
                        "its 'kvzip_prompts' (ingest and `sekv bench` provide both)")
    ids = prefill.token_ids.tolist()
    if prefill.start > 0:  # a later window of a windowed ingest (sekv_core/windows.py): its tokens are all context
        prompts = dict(prompts, context_start=0)
    passes = reconstruction_inputs(ids, prompts, p.chunk)
    memory = ReconstructionMemory(prefill, p.sinks, extra=max((len(x) for _, _, x in passes), default=1))
    layers = model.get_decoder().layers
    hooks = []
    if p.plus:
        memory.grams = [output_gram(layer.self_attn.o_proj.weight, prefill.shape.n_heads) for layer in layers]

        def grab(module, args, kwargs):
            x = kwargs.get("hidden_states", args[0] if args else None)
            memory.x_norm[int(module.layer_idx)] = x[0].float().norm(dim=-1)

        hooks = [layer.self_attn.register_forward_pre_hook(grab, with_kwargs=True) for layer in layers]
    device = prefill.keys[0].device
    try:
        for a, b, x in passes:
            memory.span = (a, b)
            runtime.forward_hidden(model, torch.tensor([x], device=device), prefill.start + memory.n_doc, memory)
            memory.truncate(memory.n_doc)
    finally:
        for hk in hooks:
            hk.remove()
    for s in memory.scores if prefill.start == 0 else ():
        s[:, : p.sinks] = float("inf")
    return [s.cpu() for s in memory.scores]


# ---------------------------------------------------------------------------- selection


def select_kept(scores: list[torch.Tensor], k: int, level: str) -> list[list[torch.Tensor]]:
    """Per layer and KV head the kept positions (int64, increasing), k per layer and head on average.

    scores: per layer [Hkv, N].  level "head": top-k in each head; "layer": top-(Hkv k) over a
    layer's heads; "pair": top-(L Hkv k) over everything.
    """
    n_layers, (hkv, n) = len(scores), scores[0].shape
    k = max(0, min(k, n))
    if level == "head":
        masks = []
        for s in scores:
            m = torch.zeros(hkv, n, dtype=torch.bool)
            m.scatter_(1, s.topk(k, dim=1).indices, True)
            masks.append(m)
    elif level == "layer":
        masks = []
        for s in scores:
            m = torch.zeros(hkv * n, dtype=torch.bool)
            m[s.reshape(-1).topk(hkv * k).indices] = True
            masks.append(m.view(hkv, n))
    elif level == "pair":
        flat = torch.stack(scores).reshape(-1)
        m = torch.zeros(flat.numel(), dtype=torch.bool)
        m[flat.topk(n_layers * hkv * k).indices] = True
        masks = list(m.view(n_layers, hkv, n))
    else:
        raise SekvError(f"kvzip: unknown level '{level}'")
    return [[row.nonzero().view(-1) for row in mask] for mask in masks]


# ---------------------------------------------------------------------------- runtime memory


#: a layer's buffer holds a multiple of this many rows per KV head, and every forward attends over the whole buffer
#: with a mask: one attention shape per layer until its buffer grows.  With a shape that grows by a row at every token
#: (and one attention call per KV head), kvzip decoded 0.7-2.6 tok/s on an H200 where snapkv did 26-29.
ROW_QUANTUM = 256


def _quantum(rows: int) -> int:
    return -(-max(1, rows) // ROW_QUANTUM) * ROW_QUANTUM


class RaggedEvictedMemory(KVMemory):
    """Kept document K/V per layer and KV head (counts may differ between heads) + the appended tokens.

    Each layer owns one buffer [1, Hkv, capacity, d]: KV head j's kept rows, then the appended tokens, then zeros up
    to the capacity (a multiple of ROW_QUANTUM); a forward writes the new tokens after each head's own rows and
    attends once per layer (GQA) over the whole buffer, each head's rows past its tokens masked.

    ``device``: one device, or one per layer (a model placed across devices): each layer's buffers on its own.
    """

    def __init__(self, keys: list[list[torch.Tensor]], values: list[list[torch.Tensor]], n_doc: int, shape: ModelShape,
                 device, extra: int = 256):
        self.shape, self.n_doc = shape, n_doc
        devices = per_layer(device, shape.n_layers)
        self.kept = [[int(k.shape[0]) for k in layer] for layer in keys]
        self._kept_t = [torch.tensor(layer, device=dev) for layer, dev in zip(self.kept, devices)]
        self.bk = [self._buffer(layer, extra, dev) for layer, dev in zip(keys, devices)]
        self.bv = [self._buffer(layer, extra, dev) for layer, dev in zip(values, devices)]
        self.appended = [0] * shape.n_layers
        #: per device: the KV heads' indices [Hkv, 1], the buffers' column indices (as long as the longest buffer)
        on = {b.device for b in self.bk}  # the buffers' own devices (indexed: "cuda" is made "cuda:0")
        self._heads = {dev: torch.arange(shape.n_kv_heads, device=dev).view(-1, 1) for dev in on}
        self._cols = {dev: torch.arange(max(b.shape[2] for b in self.bk), device=dev) for dev in on}

    def _buffer(self, heads: list[torch.Tensor], extra: int, device) -> torch.Tensor:
        rows = _quantum(max(t.shape[0] for t in heads) + extra)
        buf = torch.zeros(1, len(heads), rows, self.shape.head_dim, dtype=self.shape.dtype, device=device)
        for j, t in enumerate(heads):
            buf[0, j, : t.shape[0]].copy_(t)
        return buf

    def _fit(self, layer: int, rows: int) -> None:
        """Room for ``rows`` rows per KV head in the layer's buffers."""
        for bufs in (self.bk, self.bv):
            buf = bufs[layer]
            if rows > buf.shape[2]:
                new = buf.new_zeros(1, buf.shape[1], _quantum(max(2 * buf.shape[2], rows)), buf.shape[3])
                new[:, :, : buf.shape[2]] = buf
                bufs[layer] = new
        dev = self.bk[layer].device
        if self.bk[layer].shape[2] > self._cols[dev].numel():
            self._cols[dev] = torch.arange(self.bk[layer].shape[2], device=dev)

    def attend(self, layer, query, key, value, scaling):
        q, g = query.shape[-2], self.shape.n_heads // self.shape.n_kv_heads
        a = self.appended[layer]
        self._fit(layer, max(self.kept[layer]) + a + q)
        bk, bv = self.bk[layer], self.bv[layer]
        at = self._kept_t[layer].view(-1, 1) + a + torch.arange(q, device=query.device)  # [Hkv, q]: each head's new rows
        heads = self._heads[bk.device]
        bk[0, heads, at] = key[0]
        bv[0, heads, at] = value[0]
        visible = self._cols[bk.device][: bk.shape[2]].view(1, 1, -1) <= at.unsqueeze(-1)  # [Hkv, q, capacity]: causal, no padding
        mask = visible.repeat_interleave(g, dim=0).unsqueeze(0)  # [1, H, q, capacity]
        self.appended[layer] = a + q
        return F.scaled_dot_product_attention(query, bk, bv, attn_mask=mask, scale=scaling, enable_gqa=True)

    def n_tokens(self) -> int:
        return self.n_doc + self.appended[-1]

    def truncate(self, n_tokens: int) -> None:
        extra = max(0, n_tokens - self.n_doc)
        self.appended = [min(a, extra) for a in self.appended]

    def resident_bytes(self) -> int:
        per = 2 * self.shape.head_dim * torch.empty(0, dtype=self.shape.dtype).element_size()
        return per * sum(sum(kept) + len(kept) * a for kept, a in zip(self.kept, self.appended))

    def step_stats(self) -> StepStats:
        total = sum(map(sum, self.kept))
        return StepStats(self.resident_bytes(), {"kept_doc_tokens": total / (self.shape.n_layers * self.shape.n_kv_heads),
                                                 "doc_tokens": self.n_doc})


# ---------------------------------------------------------------------------- the method


class KVzipMethod(CacheMethod):
    name = "kvzip"
    summary = "baseline: context-reconstruction attention, per-pair eviction (KVzip)"
    needs_scores = ("kvzip_prompts",)
    params_type = KVzipParams
    per_layer_devices = True

    def compress(self, prefill: PrefillResult, params):
        p = KVzipParams.of(params)
        kept = select_kept(kvzip_scores(prefill, p), kept_tokens(p.budget, prefill.n_tokens), p.level)
        out: dict[str, torch.Tensor] = {
            "kvzip.n_doc": torch.tensor([prefill.n_tokens], dtype=torch.int64),
            "kvzip.counts": torch.tensor([[int(ix.numel()) for ix in layer] for layer in kept], dtype=torch.int64),
        }
        for i, (k, v, layer) in enumerate(zip(prefill.keys, prefill.values, kept)):
            rows = [(j, ix.to(k.device)) for j, ix in enumerate(layer)]
            out[f"kvzip.k.{i}"] = torch.cat([k[j].index_select(0, ix) for j, ix in rows]).contiguous()
            out[f"kvzip.v.{i}"] = torch.cat([v[j].index_select(0, ix) for j, ix in rows]).contiguous()
            out[f"kvzip.idx.{i}"] = torch.cat(layer).to(torch.int32).contiguous()
        return out

    def validate(self, store: TensorStore, params, shape: ModelShape, n_tokens: int) -> None:
        """The pack's kept pairs: per layer S_l rows of K, V and positions, S_l the sum of that layer's counts."""
        from ..errors import PackError
        from ..pack import FLOATS, INTS, TensorSpec as T, check_tensors, model_dims

        dims = check_tensors(store, [T("kvzip.n_doc", ("int64",), (1,), values=(n_tokens, n_tokens)),
                                     T("kvzip.counts", ("int64",), ("L", "Hkv"), values=(0, n_tokens)),
                                     *(T(f"kvzip.{kv}.{{l}}", FLOATS, ("S{l}", "d"), finite=True) for kv in "kv"),
                                     T("kvzip.idx.{l}", INTS, ("S{l}",), values=(0, max(0, n_tokens - 1)))],
                             model_dims(shape, n_tokens), shape.n_layers)
        counts = store.get("kvzip.counts").sum(1).tolist()
        if any(int(c) != dims[f"S{i}"] for i, c in enumerate(counts)):
            raise PackError("tensor 'kvzip.counts' does not match the kept pairs stored per layer; re-ingest the document")

    def _split(self, store: TensorStore, name: str, layer: int) -> list[torch.Tensor]:
        counts = store.get("kvzip.counts")[layer].tolist()
        return list(torch.split(store.get(f"kvzip.{name}.{layer}"), counts))

    def open(self, store: TensorStore, params, shape: ModelShape, device) -> KVMemory:
        keys = [self._split(store, "k", i) for i in range(shape.n_layers)]
        values = [self._split(store, "v", i) for i in range(shape.n_layers)]
        return RaggedEvictedMemory(keys, values, int(store.get("kvzip.n_doc")[0]), shape, device)

    def kept_indices(self, store: TensorStore, n_layers: int) -> list[list[torch.Tensor]]:
        """Per layer and KV head the stored kept positions (int64)."""
        return [[ix.long() for ix in self._split(store, "idx", i)] for i in range(n_layers)]

    def describe(self, store: TensorStore, params) -> dict[str, Any]:
        counts = store.get("kvzip.counts")
        n_doc = int(store.get("kvzip.n_doc")[0])
        return {"budget": params.budget, "level": params.level, "plus": params.plus, "doc_tokens": n_doc,
                "kept_tokens_per_layer": [round(float(c), 1) for c in counts.float().mean(1)],
                "kept_per_head_min_max": [int(counts.min()), int(counts.max())],
                "kept_fraction": round(int(counts.sum()) / max(1, n_doc * counts.numel()), 4)}

