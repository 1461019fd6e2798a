"""Ingest: document -> prompt tokens -> prefill once -> cache method -> context pack."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__, methods, models, prompt, rope_scaling as rope_scale
from .documents import Document, load_document
from .errors import DocumentError, stage
from .methods import scores
from .methods.base import ModelShape, PrefillResult
from .methods.params import Params
from .pack import prepare_output, write_pack
from .prefill import DEFAULT_CHUNK, prefill

#: tokens kept free after the document for the question and the answer
RESERVE_TOKENS = 512


@dataclass
class IngestResult:
    pack_path: Path
    n_tokens: int
    pack_bytes: int
    raw_kv_fp16_bytes: int
    prefill_s: float
    compress_s: float
    write_s: float
    total_s: float
    method: str
    params: Params


def default_pack_path(doc: Path) -> Path:
    """report.pdf -> report.sekv, beside the document."""
    return doc.with_suffix(".sekv")


def tokenize_document(lm: models.LoadedModel, doc: Document) -> tuple[list[int], list[list[int]]]:
    """Token ids of the document prefix, and the token -> page map as [page, start, end) runs."""
    text = prompt.document_prefix(lm.tokenizer, doc.text)
    doc_start = text.index(doc.text) if doc.text else 0
    enc = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    runs: list[list[int]] = []
    for i, (a, _b) in enumerate(enc["offset_mapping"]):
        rel = a - doc_start
        page = doc.page_at(rel) if 0 <= rel < len(doc.text) else 0
        if runs and runs[-1][0] == page:
            runs[-1][2] = i + 1
        else:
            runs.append([page, i, i + 1])
    return ids, runs


def check_fits(lm: models.LoadedModel, doc: Document, n_tokens: int) -> None:
    window = models.context_window(lm.config)
    if window and n_tokens + RESERVE_TOKENS > window:
        raise DocumentError(
            f"{doc.path or doc.name}: the document is {n_tokens} tokens (+{RESERVE_TOKENS} reserved for the question and answer), "
            f"longer than {lm.model_id}'s context window of {window} tokens; split it or use a model with a longer context"
        )


def ingest(
    doc: Document | str | Path,
    out: str | Path | None = None,
    *,
    lm: models.LoadedModel,
    method: str = methods.DEFAULT_METHOD,
    params: dict[str, Any] | None = None,
    chunk: int = DEFAULT_CHUNK,
    force: bool = False,
    on_tokens: Callable[[int], None] | None = None,
    progress: Callable[[int, int], None] | None = None,
    rope_scaling: str | float | None = "auto",
) -> IngestResult:
    """Document (a loaded one, or a path) -> pack.  The output is checked and reserved before the prefill (see
    pack.prepare_output); each stage's unexpected failure is one error naming it (errors.stage), and nothing is
    left at the output path unless the whole pack was written."""
    t0 = time.perf_counter()
    if not isinstance(doc, Document):
        doc = load_document(doc)
    cache_method = methods.get(method)
    params = cache_method.resolve_params(params)
    if out is None and doc.path is None:
        raise DocumentError("reading the document from stdin needs -o PACK")
    out_path = Path(out) if out else default_pack_path(doc.path)
    with stage("tokenize"):
        ids, page_runs = tokenize_document(lm, doc)
    rope_scale.prepare(lm, cache_method, len(ids), rope_scaling, reserve=RESERVE_TOKENS, what=str(doc.path or doc.name))
    if rope_scale.policy_of(cache_method) != "any":
        check_fits(lm, doc, len(ids))
    shape = model_shape(lm)
    raw_fp16 = len(ids) * shape.kv_bytes_per_token(itemsize=2)
    needed = int(raw_fp16 * 1.1) if cache_method.needs_prefill else 64 * len(ids)  # rag: token ids and its index, no KV
    slot = prepare_output(out_path, force=force, inputs=[doc.path] if doc.path else [], needed_bytes=needed + (1 << 20))
    try:
        if on_tokens:
            on_tokens(len(ids))
        t1 = time.perf_counter()
        with stage("prefill"):
            if next(lm.model.parameters()).device.type == "cuda":  # host memory for compress's results, ready by the time it runs
                cache_method.reserve_host(len(ids), shape, params)
            needs = cache_method.needs_scores
            if cache_method.needs_prefill:
                result = prefill(lm.model, torch.tensor(ids), with_surprisal=cache_method.needs_surprisal, chunk=chunk, progress=progress,
                                 capture=scores.capture_kinds(needs), obs_window=cache_method.obs_window(params))
            else:  # rag: no KV at ingest, only the text's statistics
                result = PrefillResult(torch.tensor(ids), [], [], None, shape, model_fingerprint=lm.fingerprint, model_id=lm.model_id, model=lm.model)
            result.scores.update(scores.text_scores(lm.tokenizer, prompt.document_prefix(lm.tokenizer, doc.text), ids, needs))
        t2 = time.perf_counter()
        with stage("compress"):
            tensors = cache_method.compress(result, params)
            tensors = {k: v.cpu() for k, v in tensors.items()}
        t3 = time.perf_counter()
        shape = result.shape
        manifest = {
            "sekv_version": __version__,
            "method": method,
            "method_params": params.to_dict(),
            "model": {
                "id": lm.model_id,
                "fingerprint": lm.fingerprint,
                "tokenizer_fingerprint": lm.tokenizer_fingerprint,
                "dtype": str(shape.dtype).removeprefix("torch."),
                "shape": {"layers": shape.n_layers, "heads": shape.n_heads, "kv_heads": shape.n_kv_heads, "head_dim": shape.head_dim},
                "context_window": models.context_window(lm.config),
                "rope_scaling": rope_scale.manifest_entry(lm),
            },
            "document": {
                "name": doc.name,
                "kind": doc.kind,
                "sha256": doc.sha256,
                "n_chars": len(doc.text),
                "n_pages": len(doc.pages),
                "token_pages": page_runs,
            },
            "n_tokens": len(ids),
            "token_ids": ids,
            "sizes": {"raw_kv_fp16_bytes": raw_fp16, "tensor_bytes": int(sum(t.numel() * t.element_size() for t in tensors.values()))},
            "timings": {"prefill_s": round(t2 - t1, 3), "compress_s": round(t3 - t2, 3)},
        }
        with stage("write"):
            size = write_pack(out_path, manifest, tensors, slot=slot)
    except BaseException:
        slot.discard()
        raise
    t4 = time.perf_counter()
    return IngestResult(out_path, len(ids), size, raw_fp16, t2 - t1, t3 - t2, t4 - t3, t4 - t0, method, params)


def model_shape(lm: models.LoadedModel) -> ModelShape:
    return ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
