"""Ingest: document -> prompt tokens -> prefill (once, or in windows past the model's window) -> cache method -> context pack."""

from __future__ import annotations

import bisect
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from . import __version__, methods, models, placement, prompt, windows, rope_scaling as rope_scale
from .documents import Document, load_document
from .errors import DocumentError, stage
from .methods import scores
from .methods.base import ModelShape, PrefillResult
from .methods.params import Params
from .pack import PackWriter, header_room, prepare_output, write_pack
from .prefill import WarmUp, prefill_window
from .windows import Window

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
    windows: int = 1
    #: from the (last) prefill's end to the pack on disk: what the ingest adds to its prefill, overlap counted once
    after_prefill_s: float = 0.0
    #: pack bytes written before the (last) prefill ended (the pipelined ingest's overlap)
    written_in_prefill: int = 0
    pipelined: bool = False
    write_timeline: list = field(default_factory=list)
    #: what the prefill waited for the model's warm-up (prefill.WarmUp) after the document was tokenized
    warm_wait_s: float = 0.0


def default_pack_path(doc: Path) -> Path:
    """report.pdf -> report.sekv, beside the document."""
    return doc.with_suffix(".sekv")


def tokenize_document(lm: models.LoadedModel, doc: Document, system: str | None = None) -> tuple[list[int], list[list[int]]]:
    """Token ids of the document prefix, and the token -> page map as [page, start, end) runs."""
    ids, runs, _ = _tokenize(lm, doc, system)
    return ids, runs


def _tokenize(lm: models.LoadedModel, doc: Document, system: str | None = None) -> tuple[list[int], list[list[int]], int]:
    """tokenize_document(), and the header's length: the tokens before the document's text (every window's opening)."""
    return _encode(lm, doc, system)[:3]


def _encode(lm: models.LoadedModel, doc: Document, system: str | None = None, appended: bool = False):
    """_tokenize(), a corpus's documents as the manifest records them (document.parts), their token ranges, and the
    tokenized text with every token's character range in it (what the text scores read, so they need not tokenize
    the document again).  ``appended``: the tokens of documents added to a pack (prompt.document_continuation;
    `sekv add`)."""
    if appended:
        text, doc_start = prompt.document_continuation(doc.text), len(prompt.CONTINUATION_OPEN)
    else:
        text = prompt.document_prefix(lm.tokenizer, doc.text, system)
        doc_start = len(prompt.document_header(lm.tokenizer, system))
    enc = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids = enc["input_ids"]
    runs: list[list[int]] = []
    header = len(ids)
    rels = [a - doc_start for a, _b in enc["offset_mapping"]]
    for i, rel in enumerate(rels):
        if rel >= 0 and header == len(ids):
            header = i
        page = doc.page_at(rel) if 0 <= rel < len(doc.text) else 0
        if runs and runs[-1][0] == page:
            runs[-1][2] = i + 1
        else:
            runs.append([page, i, i + 1])
    return ids, runs, header, _part_tokens(doc, rels), text, enc["offset_mapping"]


def _part_tokens(doc: Document, rels: list[int]) -> list[dict]:
    """Each corpus document's token range [token_start, token_end): from the token that starts its heading line to
    where the next document's starts (the last one ends with its text)."""
    starts = [bisect.bisect_left(rels, p.start) for p in doc.parts]
    ends = starts[1:] + [bisect.bisect_left(rels, doc.parts[-1].end)] if doc.parts else []
    return [{"name": p.name, "kind": p.kind, "sha256": p.sha256, "n_pages": p.n_pages, "token_start": a, "token_end": b}
            for p, a, b in zip(doc.parts, starts, ends)]


#: test / measurement knob: plan windows as if the model's context window were this many tokens
WINDOW_ENV = "SEKV_INGEST_WINDOW"


def plan_windows(lm: models.LoadedModel, doc: Document, n_tokens: int, cache_method, header_len: int) -> list[Window]:
    """How the document is prefilled, the one place that decides: one window when it fits the model's context window
    (less RESERVE_TOKENS for the question and answer), else windows (sekv_core/windows.py) for a method that takes
    them, else a one-line DocumentError."""
    window = int(os.environ.get(WINDOW_ENV) or 0) or models.context_window(lm.config)
    whole = [Window(0, 1, 0, n_tokens, 0, 0)]
    if not window or cache_method.length_policy == "any":
        return whole
    reserve = min(RESERVE_TOKENS, window // 4)
    capacity = window - reserve
    if n_tokens <= capacity:
        return whole
    if cache_method.length_policy == "windowed":
        if model_shape(lm).rope_inv_freq is None:
            raise DocumentError(f"{doc.path or doc.name}: the document is {n_tokens} tokens, longer than {lm.model_id}'s context window "
                                f"of {window}, and this model's rotary embedding (dynamic or partial) cannot be re-positioned for windows")
        try:
            return windows.plan(n_tokens, header_len, capacity)
        except ValueError as e:
            raise DocumentError(f"{doc.path or doc.name}: cannot read it in windows of {lm.model_id}'s context: {e}") from None
    raise DocumentError(
        f"{doc.path or doc.name}: the document is {n_tokens} tokens (+{reserve} reserved for the question and answer), "
        f"longer than {lm.model_id}'s context window of {window} tokens; --method {cache_method.name} needs it whole "
        f"(--method sekv reads documents of any length), or split it"
    )


@dataclass(frozen=True)
class IngestProgress:
    """What ingest reports to its progress callback (the CLI's display; tokens/s and ETA are the caller's)."""

    stage: str  # "prefill", "compress", "write"
    tokens_done: int
    tokens_total: int
    pages_done: int
    pages_total: int
    window: int  # 1-based
    windows: int


class _Progress:
    """Turns the prefill's per-window token counts into IngestProgress events (pages from the token -> page runs)."""

    def __init__(self, cb, n_tokens: int, page_runs: list[list[int]], n_pages: int, n_windows: int):
        self.cb, self.n, self.n_pages, self.n_windows = cb, n_tokens, n_pages, n_windows
        self.ends = [r[2] for r in page_runs]
        self.pages = [r[0] for r in page_runs]

    def __call__(self, stage: str, done: int, window: int) -> None:
        if self.cb is None:
            return
        i = bisect.bisect_left(self.ends, max(done, 1))
        page = self.pages[min(i, len(self.pages) - 1)] if self.pages else 0
        pages = self.n_pages if done >= self.n else min(page, self.n_pages)
        self.cb(IngestProgress(stage, done, self.n, pages, self.n_pages, window + 1, self.n_windows))


def ingest(
    doc: Document | str | Path,
    out: str | Path | None = None,
    *,
    lm: models.LoadedModel,
    method: str = methods.DEFAULT_METHOD,
    params: dict[str, Any] | None = None,
    chunk: int | None = None,
    force: bool = False,
    progress: Callable[[IngestProgress], None] | None = None,
    system: str | None = None,
    rope_scaling: str | float | None = "auto",
    offload_kv: bool | None = None,
) -> IngestResult:
    """Document (a loaded one, or a path) -> pack.  The output is checked and reserved before the prefill (see
    pack.prepare_output); each stage's unexpected failure is one error naming it (errors.stage), and nothing is
    left at the output path unless the whole pack was written.  A document longer than the model's window is
    prefilled in windows for a method that takes them (plan_windows).  chunk: the prefill's tokens a forward (None:
    prefill.default_chunk, longer on a GPU).  offload_kv: the prefill's KV in host memory,
    chunk by chunk (sekv_core/kv_offload.py); None: when it would not fit the GPU."""
    t0 = time.perf_counter()
    # the model's kernels loaded on a GPU while the document is read and tokenized
    warm = WarmUp(lm.model if methods.get(method).needs_prefill else None)
    try:
        return _ingest(doc, out, lm, method, params, chunk, force, progress, system, rope_scaling, offload_kv, t0, warm)
    finally:
        warm.join()


def _ingest(doc, out, lm, method, params, chunk, force, progress, system, rope_scaling, offload_kv, t0, warm) -> IngestResult:
    if not isinstance(doc, Document):
        doc = load_document(doc)
    cache_method = methods.get(method)
    params = cache_method.resolve_params(params)
    if out is None and doc.path is None:
        raise DocumentError("several documents, a folder or standard input make a pack only with -o PACK (out=)")
    out_path = Path(out) if out else default_pack_path(doc.path)
    with stage("tokenize"):
        ids, page_runs, header_len, parts, text, offsets = _encode(lm, doc, system)
    rope_scale.prepare(lm, cache_method, len(ids), rope_scaling, reserve=RESERVE_TOKENS, what=str(doc.path or doc.name))
    plan = plan_windows(lm, doc, len(ids), cache_method, header_len)
    shape = model_shape(lm)
    raw_fp16 = len(ids) * shape.kv_bytes_per_token(itemsize=2)
    report = _Progress(progress, len(ids), page_runs, len(doc.pages), len(plan))
    needed = int(raw_fp16 * 1.1) if cache_method.needs_prefill else 64 * len(ids)  # rag: token ids and its index, no KV
    inputs = [p.path for p in doc.parts if p.path] or ([doc.path] if doc.path else [])
    slot = prepare_output(out_path, force=force, inputs=inputs, needed_bytes=needed + (1 << 20))
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
        } | ({"parts": parts} if parts else {}),
        "system": prompt.SYSTEM if system is None else system,  # prefilled with the document; ask's turns follow it
        "n_tokens": len(ids),
        "token_ids": ids,
        "windows": [[w.start, w.end] for w in plan],
    }
    writer = None
    try:
        # the pipelined ingest: what the method makes from each prefill chunk (sekv: the zoom tier) is written into
        # the pack while the prefill runs; compress makes the rest (cparams)
        stream, cparams = None, params
        one_device = len(set(placement.layer_devices(lm.model))) <= 1  # a model across devices: the sequential ingest
        got = cache_method.prefill_stream(params, shape, len(ids)) if pipelined() and cache_method.needs_prefill and one_device else None
        if got is not None:
            stream, cparams = got
            writer = PackWriter(slot, header_room(manifest, 64 * (shape.n_layers + 1)))
            stream.start(writer)
        needs = cache_method.needs(params)
        text_scores = scores.text_scores(lm.tokenizer, text, ids, needs, system, offsets=offsets)
        on_gpu = placement.input_device(lm.model).type == "cuda"
        if on_gpu:  # host memory for compress's results (every window's), ready by the time it runs
            cache_method.reserve_host(len(ids), shape, cparams)
        kw = dict(with_surprisal=cache_method.needs_surprisal, chunk=chunk, capture=scores.capture_kinds(needs),
                  obs_window=cache_method.obs_window(params), offload_kv=offload_kv,
                  on_rows=stream.layer if stream is not None else None)
        spent = {"prefill": 0.0, "end": 0.0, "written": 0}

        def window_prefills():
            for w in plan:
                report("prefill", w.start, w.index)
                ta = time.perf_counter()
                with stage("prefill"):
                    r = prefill_window(lm.model, ids, header_len, w, progress=lambda d, _n, w=w: report("prefill", w.start + d, w.index), **kw)
                r.scores.update(text_scores)
                spent["end"] = time.perf_counter()
                spent["prefill"] += spent["end"] - ta
                spent["written"] = writer.written if writer is not None else 0
                report("compress", w.end, w.index)
                yield r
                del r

        tw = time.perf_counter()
        warm.join()
        t1 = time.perf_counter()
        if cache_method.length_policy == "windowed":
            with stage("compress"):
                tensors = cache_method.compress_windows(window_prefills(), cparams)
        elif not cache_method.needs_prefill:  # rag: no KV at ingest, only the text's statistics
            result = PrefillResult.without_kv(torch.tensor(ids), shape, text_scores, lm)
            with stage("compress"):
                tensors = cache_method.compress(result, cparams)
            del result
        else:
            result = next(window_prefills())
            with stage("compress"):
                tensors = cache_method.compress(result, cparams)
            del result
        tensors = {k: v.cpu() for k, v in tensors.items()}
        t3 = time.perf_counter()
        prefill_s = spent["prefill"]
        tensor_bytes = int(sum(t.numel() * t.element_size() for t in tensors.values()))
        manifest["sizes"] = {"raw_kv_fp16_bytes": raw_fp16, "tensor_bytes": tensor_bytes + (writer.end if writer is not None else 0)}
        manifest["timings"] = {"prefill_s": round(prefill_s, 3), "compress_s": round(t3 - t1 - prefill_s, 3)}
        report("write", len(ids), len(plan) - 1)
        with stage("write"):
            if writer is not None:
                stream.finish()
                for k in sorted(tensors):
                    writer.put(k, tensors.pop(k))
                size = writer.finish(manifest)
            else:
                size = write_pack(out_path, manifest, tensors, slot=slot)
    except BaseException:
        if writer is not None:
            writer.abort()
        slot.discard()
        raise
    t4 = time.perf_counter()
    return IngestResult(out_path, len(ids), size, raw_fp16, prefill_s, t3 - t1 - prefill_s, t4 - t3, t4 - t0, method, params, len(plan),
                        after_prefill_s=t4 - (spent["end"] or t1), written_in_prefill=spent["written"], pipelined=writer is not None,
                        write_timeline=_timeline(writer, t1), warm_wait_s=t1 - tw)


#: "0": the sequential ingest (prefill, then compress, then the pack's write), for comparisons
PIPELINE_ENV = "SEKV_INGEST_PIPELINE"


def pipelined() -> bool:
    """Whether ingest writes what the method makes during the prefill as it is made (the default)."""
    return os.environ.get(PIPELINE_ENV, "1") != "0"


def _timeline(writer, t1: float) -> list[tuple[float, float, int]]:
    """The writer's writes as (start, end) seconds from the prefill's start, and bytes (benchmarks/ingest_stages.py)."""
    return [] if writer is None else [(a - t1, b - t1, n) for a, b, n in writer.timeline]


def model_shape(lm: models.LoadedModel) -> ModelShape:
    return ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
