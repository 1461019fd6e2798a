"""`rag`: the baseline a user would pick instead of a KV cache - BM25 over the document's text chunks.

Ingest does not run the model over the document: it cuts the document's tokens into chunks (whole sentences
- sentencekv.sentence_bounds - packed up to ``chunk_tokens``, closed early at a paragraph end once half full) and
stores a BM25 index of their words (bm25.py, sekv's lexical terms) with the token ids.  Any length of document
ingests; the pack holds no KV.

At ask time the question's words score the chunks; the best ones that fit the resident-token budget - the same
``budget`` x document tokens as every method's resident KV, capped by the model's window less the question /
answer reserve - are prefilled in document order between the prompt's own header and closing tag (the tokens
ingest cut them from), then the question: the model reads ``[header + chosen chunks + tail] + question`` with
contiguous positions from 0.  That prefill runs inside the answer's first forward, so it is in TTFT.  The
resident KV is that of the prefilled tokens (a budget's worth) and the question and answer.

Pack tensors (prefix ``rag.``): ``tokens`` [N] int32 (the prompt's token ids, equal to the manifest's), ``doc``
[2] int64 (the document's tokens [start, end) within them), ``chunks`` [C+1] int64 (chunk boundaries from start
to end), ``post_chunk`` / ``post_term`` / ``post_tf`` [P] int32 (the index, bm25.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..errors import SekvError
from . import bm25
from .base import CacheMethod, KVMemory, ModelShape, PrefillResult, StepStats, TensorStore, per_layer
from .full import FullMemory
from .params import DEFAULT_BUDGET, BudgetParams, ask_time
from .sentencekv import sentence_bounds

#: tokens per forward while the chosen chunks are prefilled at ask time
PREFILL_CHUNK = 2048


@dataclass(frozen=True)
class RagParams(BudgetParams):
    method = "rag"
    budget: float = ask_time(DEFAULT_BUDGET)
    #: the largest chunk, in tokens (a sentence longer than this is cut)
    chunk_tokens: int = 128

    def __post_init__(self):
        if not 0 < self.budget <= 1:
            raise SekvError(f"rag: budget must be in (0, 1], not {self.budget}")
        if not 16 <= self.chunk_tokens <= 8192:
            raise SekvError(f"rag: chunk_tokens must be in [16, 8192], not {self.chunk_tokens}")


def chunk_bounds(token_text: list[str], start: int, end: int, size: int) -> list[int]:
    """Chunk boundaries [start, ..., end] over the document's tokens [start, end): whole sentences up to ``size``
    tokens per chunk, a chunk closed at a paragraph end (a blank line) once it holds half of that."""
    if end <= start:
        return [start]
    sents = [start + b for b in sentence_bounds(token_text[start:end], min_len=4, max_len=size)]
    out = [start]
    for a, b in zip(sents, sents[1:]):
        if b - out[-1] > size and a > out[-1]:
            out.append(a)
        last, nxt = token_text[b - 1], (token_text[b] if b < end else "")
        paragraph = "\n\n" in last or (last.endswith("\n") and nxt.startswith("\n"))
        if paragraph and b - out[-1] >= size // 2 and b < end:
            out.append(b)
    if out[-1] != end:
        out.append(end)
    return out


class RagMemory(KVMemory):
    """The chosen chunks' KV, prefilled when a question comes (prepare_question), plus the question and answer.

    Before a question, n_tokens() is the document's length (what ask reports and truncates back to); once the
    chunks are prefilled it is the next position of the prefilled context.  truncate(n) with n at most the
    document's length drops everything (back to the pack's state).  ``device``: one device, or one per layer (a
    model placed across devices: each layer's KV on its own; the chunks' token ids go to the first layer's)."""

    def __init__(self, tokens: torch.Tensor, doc: tuple[int, int], bounds: list[int], index: bm25.Index, budget: float,
                 shape: ModelShape, device):
        self.shape, self.device = shape, per_layer(device, shape.n_layers)[0]
        self.tokens, self.doc, self.bounds, self.index = tokens.long(), doc, bounds, index
        self.n_doc = int(tokens.numel())
        from ..ingest import RESERVE_TOKENS

        cap = int(budget * self.n_doc)
        if shape.context_window:
            cap = min(cap, max(shape.context_window - RESERVE_TOKENS, 0))
        self.cap = max(cap, doc[0] + self.n_doc - doc[1])  # the header and the closing tag always come
        self.kv = FullMemory.empty(shape, device, capacity=min(self.cap, self.n_doc) + 256)
        self.active = False
        self.n_ctx = self.last_ctx = 0
        self.chosen: list[int] = []
        self.order: list[int] = []
        self.allowed: set[int] | None = None  # restrict(): the chunks that may be retrieved

    def restrict(self, ranges: list[tuple[int, int]] | None) -> bool:
        """Retrieve only chunks with a token in ``ranges``."""
        b = self.bounds
        self.allowed = None if ranges is None else {c for c in range(len(b) - 1) if any(b[c] < y and x < b[c + 1] for x, y in ranges)}
        return True

    def select(self, question: str | None) -> tuple[list[int], list[int]]:
        """(chosen chunks in document order, every chunk by score): the best-scoring chunks (ties: earlier first)
        whose tokens fit the budget beside the header and the tail."""
        from ..sekv.lexical import text_terms

        scores = self.index.scores(text_terms(question or ""))
        order = sorted((c for c in range(len(self.bounds) - 1) if self.allowed is None or c in self.allowed), key=lambda c: (-float(scores[c]), c))
        room = self.cap - self.doc[0] - (self.n_doc - self.doc[1])
        chosen = []
        for c in order:
            n = self.bounds[c + 1] - self.bounds[c]
            if n <= room:
                chosen.append(c)
                room -= n
        return sorted(chosen), order

    def context_ids(self, chosen: list[int]) -> list[int]:
        """[header + chunks + tail] token ids."""
        t = self.tokens
        parts = [t[: self.doc[0]]] + [t[self.bounds[c] : self.bounds[c + 1]] for c in chosen] + [t[self.doc[1] :]]
        return torch.cat(parts).tolist()

    def prepare_question(self, forward, question: str | None = None) -> None:
        self.chosen, self.order = self.select(question)
        ids = torch.tensor(self.context_ids(self.chosen), device=self.device)
        self.kv.truncate(0)
        self.active = True
        for a in range(0, ids.numel(), PREFILL_CHUNK):
            forward(ids[a : a + PREFILL_CHUNK].view(1, -1))
        self.n_ctx = self.last_ctx = int(ids.numel())

    def attend(self, layer, query, key, value, scaling):
        return self.kv.attend(layer, query, key, value, scaling)

    def n_tokens(self) -> int:
        return self.kv.n_tokens() if self.active else self.n_doc

    def window_tokens(self) -> int:
        return min(self.cap, self.n_doc)

    def truncate(self, n_tokens: int) -> None:
        if n_tokens <= self.n_doc:
            self.kv.truncate(0)
            self.active, self.n_ctx = False, 0
        elif self.active:
            self.kv.truncate(self.n_ctx + n_tokens - self.n_doc)

    def resident_bytes(self) -> int:
        return self.kv.resident_bytes()

    def full_bytes(self) -> int:
        appended = self.kv.n_tokens() - self.n_ctx if self.active else 0
        return (self.n_doc + appended) * self.shape.kv_bytes_per_token()

    def spans(self) -> list[tuple[int, int]]:
        """The chunks as token ranges of the pack (sekv_core/evidence.py lists the ones used)."""
        return list(zip(self.bounds[:-1], self.bounds[1:]))

    def step_stats(self) -> StepStats:
        rank = {c: i for i, c in enumerate(self.order)}
        extra = {"rag_chunks": len(self.chosen), "rag_chunks_total": len(self.bounds) - 1, "rag_context_tokens": self.last_ctx,
                 # evidence rows (sekv_core/evidence.py): the chunks read, best-scoring first
                 "span_zoom_counts": {c: 1 for c in self.chosen}, "span_order": sorted(self.chosen, key=rank.get)}
        return StepStats(resident_bytes=self.resident_bytes(), extra=extra)


class RagMethod(CacheMethod):
    name = "rag"
    per_layer_devices = True  # its KV is the full cache's (GrowingKV), prefilled at ask time
    summary = "BM25 over text chunks; the best that fit the budget are prefilled with the question (no KV at ingest)"
    params_type = RagParams
    needs_prefill = False
    needs_scores = ("token_text", "lex_terms", "doc_range")
    #: any length ingests (nothing is prefilled); what is prefilled at ask time fits the window
    length_policy = "any"

    def compress(self, prefill: PrefillResult, params: RagParams) -> dict[str, torch.Tensor]:
        s = prefill.scores
        start, end = (int(x) for x in s["doc_range"])
        bounds = chunk_bounds(s["token_text"], start, end, params.chunk_tokens)
        chunk, term, tf = bm25.postings(bounds, s["lex_terms"])
        return {
            "rag.tokens": prefill.token_ids.to(torch.int32).clone(),
            "rag.doc": torch.tensor([start, end], dtype=torch.int64),
            "rag.chunks": torch.tensor(bounds, dtype=torch.int64),
            "rag.post_chunk": chunk, "rag.post_term": term, "rag.post_tf": tf,
        }

    def validate(self, store: TensorStore, params, shape: ModelShape, n_tokens: int) -> None:
        from ..errors import PackError
        from ..pack import TensorSpec as T, check_tensors, model_dims

        dims = check_tensors(store, [
            T("rag.tokens", ("int32",), ("N",), values=(0, 2**31 - 1)),
            T("rag.doc", ("int64",), (2,), values=(0, n_tokens), increasing=True),
            T("rag.chunks", ("int64",), ("C1",), values=(0, n_tokens), increasing=True),
            T("rag.post_chunk", ("int32",), ("P",), values=(0, max(n_tokens, 1)), increasing=True),
            T("rag.post_term", ("int32",), ("P",), values=(0, 2**31 - 1)),
            T("rag.post_tf", ("int32",), ("P",), values=(1, n_tokens)),
        ], model_dims(shape, n_tokens))
        doc, b = store.get("rag.doc"), store.get("rag.chunks")
        c = dims["C1"] - 1
        if c < 0 or int(b[0]) != int(doc[0]) or int(b[-1]) != int(doc[1]) or bool((b.diff() <= 0).any()):
            raise PackError("tensor 'rag.chunks' does not cut the document into chunks; re-ingest the document")
        if dims["P"] and int(store.get("rag.post_chunk")[-1]) >= c:
            raise PackError("tensor 'rag.post_chunk' names a chunk the pack does not have; re-ingest the document")
        ids = getattr(store, "token_ids", None)  # a pack: its manifest's ids are the ones checked against the model
        if ids is not None and store.get("rag.tokens").tolist() != list(ids):
            raise PackError("tensor 'rag.tokens' differs from the manifest's token ids; re-ingest the document")

    def open(self, store: TensorStore, params: RagParams, shape: ModelShape, device) -> KVMemory:
        bounds = store.get("rag.chunks").tolist()
        doc = tuple(int(x) for x in store.get("rag.doc").tolist())
        index = bm25.Index.of(store.get("rag.post_chunk"), store.get("rag.post_term"), store.get("rag.post_tf"), len(bounds) - 1)
        return RagMemory(store.get("rag.tokens"), doc, bounds, index, params.budget, shape, device)

    def describe(self, store: TensorStore, params: RagParams) -> dict[str, Any]:
        b = store.get("rag.chunks")
        doc = store.get("rag.doc")
        lens = b.diff().float()
        return {"budget": params.budget, "doc_tokens": int(doc[1] - doc[0]), "chunks": int(lens.numel()),
                "mean_chunk_tokens": round(float(lens.mean()), 1) if lens.numel() else 0.0,
                "index_postings": int(store.info("rag.post_term").shape[0]) if hasattr(store, "info") else int(store.get("rag.post_term").numel())}
