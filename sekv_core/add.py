"""Add: documents appended to a pack without reading its documents again (`sekv add PACK DOC...`).

The added documents are one corpus (each under its ``## file: NAME`` line) in a ``<document>`` tag of their own
after the pack's closing tag (prompt.document_continuation): the pack's token ids, then theirs.  What each method
does with them (docs/long-documents.md, "Adding documents"):

* ``sekv``: the added tokens are prefilled in windows that continue the pack's (windows.plan_append: one that
  re-reads every pack token id when the whole text fits the model's window, else each opened by the pack's header
  and the last tokens before it), compressed as windowed ingest compresses a window, and joined to the pack's
  tensors at their global indices (sekv/append.py); the pack's tensors unchanged.
* ``full``: the prefill continues over the stored KV cache (the added tokens attend to every earlier one): the KV
  of one prefill of the whole text.
* ``rag``: the added tokens are cut into chunks after the pack's and indexed; the pack's chunks unchanged.
* the eviction baselines keep one compressed document, chosen over all of it: the whole text is read again from
  the pack's token ids (what one ingest of the joined text gives), and the caller says so; ``kvzip`` (its
  reconstruction prompts need the text) is refused.

The pack is rewritten atomically (pack.prepare_output / write_pack): on any error or interruption it is left as it was.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from . import __version__, methods, models, prompt, windows
from . import rope_scaling as rope_scale
from .documents import Document
from .errors import DocumentError, SekvError, stage
from .evidence import document_tokens
from .ingest import RESERVE_TOKENS, WINDOW_ENV, IngestProgress, _encode, _Progress, model_shape, plan_windows
from .methods import scores
from .pack import Pack, check_manifest, check_model, prepare_output, read_pack, write_pack
from .prefill import DEFAULT_CHUNK, prefill, prefill_window


@dataclass
class AddResult:
    pack_path: Path
    n_tokens: int  # the pack's tokens now
    added_tokens: int
    documents: int  # documents added
    pack_bytes: int
    prefill_s: float
    total_s: float
    method: str
    windows: int  # windows the added tokens were prefilled in (sekv)
    note: str = ""  # what the method did beyond appending (the eviction baselines: read the whole text again)


def old_parts(m: dict) -> list[dict]:
    """The pack's documents as document.parts records: its parts, or its one document as one."""
    d = m["document"]
    if d.get("parts"):
        return [dict(q) for q in d["parts"]]
    a, b = document_tokens(d["token_pages"], m["n_tokens"])
    return [{"name": d["name"], "kind": d["kind"], "sha256": d["sha256"], "n_pages": d["n_pages"], "token_start": a, "token_end": b}]


def add(
    pack_path: str | Path,
    doc: Document,
    *,
    lm: models.LoadedModel,
    chunk: int = DEFAULT_CHUNK,
    progress: Callable[[IngestProgress], None] | None = None,
) -> AddResult:
    """Append ``doc`` (a corpus: documents.load_corpus(..., headings=True)) to the pack at ``pack_path``."""
    from .session import check_pack_tensors, resolve_method

    t0 = time.perf_counter()
    path = Path(pack_path)
    if not doc.parts:
        raise SekvError("sekv add takes documents as a corpus (documents.load_corpus(..., headings=True))")
    pack = read_pack(path)
    seen = os.fstat(pack._file.fileno())  # the file read: it must still be the one at `path` when the new one replaces it
    try:
        check_manifest(pack)
        rope_scale.apply(lm, pack.manifest, str(path))
        shape = model_shape(lm)
        check_model(pack, lm.model_id, lm.fingerprint, lm.tokenizer_fingerprint, shape)
        method, params = resolve_method(pack, None, None)
        check_pack_tensors(pack, shape)
        m = pack.manifest
        before = old_parts(m)
        for q in doc.parts:
            if any(p["sha256"] == q.sha256 and Path(p["name"]).name == Path(q.name).name for p in before):
                raise SekvError(f"{q.name}: already in {path} (the same file); nothing was added")
        with stage("tokenize"):
            new_ids, runs, _, parts = _encode(lm, doc, appended=True)[:4]
        n_old = pack.n_tokens()
        ids = list(pack.token_ids) + new_ids
        n = len(ids)
        header_len = document_tokens(m["document"]["token_pages"], n_old)[0]
        cache_method = methods.get(method)
        report = _Progress(progress, len(new_ids), runs, len(doc.pages), 1)
        inputs = [q.path for q in doc.parts if q.path]
        slot = prepare_output(path, inputs=inputs, needed_bytes=pack.file_bytes + 2 * len(ids) * shape.kv_bytes_per_token(itemsize=2) + (1 << 20))
        try:
            os.chmod(slot.tmp, stat.S_IMODE(seen.st_mode))  # the pack keeps its permissions
            text = prompt.document_continuation(doc.text)
            run = {"sekv": _sekv, "full": _full, "rag": _rag}.get(method, _whole)
            tensors, wins, spent, note = run(pack, lm, cache_method, params, ids, n_old, header_len, text, parts, doc, chunk, report)
            tensors = {k: v.cpu() for k, v in tensors.items()}
            manifest = _manifest(m, doc, new_ids, runs, parts, before, wins, tensors, shape, lm)
            report("write", len(new_ids), 0)
            now = os.stat(path)
            if (now.st_ino, now.st_mtime_ns, now.st_size) != (seen.st_ino, seen.st_mtime_ns, seen.st_size):
                raise SekvError(f"{path}: the pack changed while documents were added to it (another sekv add?); nothing was added, run it again")
            with stage("write"):
                size = write_pack(path, manifest, tensors, slot=slot)
        except BaseException:
            slot.discard()
            raise
    finally:
        pack.close()
    n_windows = len(wins) - len(m.get("windows") or [[0, n_old]]) if method == "sekv" else 1
    return AddResult(path, n, len(new_ids), len(doc.parts), size, spent, time.perf_counter() - t0, method, n_windows, note)


def _manifest(m, doc, new_ids, runs, parts, before, wins, tensors, shape, lm) -> dict:
    n_old = m["n_tokens"]
    d = m["document"]
    pages0 = d["n_pages"]
    added = [dict(q, token_start=q["token_start"] + n_old, token_end=q["token_end"] + n_old) for q in parts]
    every = before + added
    digest = hashlib.sha256("".join(f"{q['sha256']} {q['name']}\n" for q in every).encode()).hexdigest()
    n = n_old + len(new_ids)
    out = {k: v for k, v in m.items() if k not in ("tensors", "magic", "format_version")}
    out["sekv_version"] = __version__
    out["document"] = dict(
        d, name=f"{every[0]['name']} and {len(every) - 1} more", kind="corpus", sha256=digest, n_chars=d["n_chars"] + len(doc.text),
        n_pages=pages0 + len(doc.pages), token_pages=d["token_pages"] + [[p + pages0 if p else 0, a + n_old, b + n_old] for p, a, b in runs],
        parts=every,
    )
    out["n_tokens"], out["token_ids"] = n, list(m["token_ids"]) + new_ids
    out["windows"] = wins
    out["model"] = dict(m["model"], rope_scaling=rope_scale.manifest_entry(lm), context_window=models.context_window(lm.config))
    out["sizes"] = {"raw_kv_fp16_bytes": n * shape.kv_bytes_per_token(itemsize=2),
                    "tensor_bytes": int(sum(t.numel() * t.element_size() for t in tensors.values()))}
    return out


def _capacity(lm) -> int:
    window = int(os.environ.get(WINDOW_ENV) or 0) or models.context_window(lm.config)
    return window - min(RESERVE_TOKENS, window // 4) if window else 0


def _sekv(pack: Pack, lm, cache_method, params, ids, n_old, header_len, text, parts, doc, chunk, report):
    """The added tokens in windows of their own, compressed and joined to the pack's tensors (sekv/append.py)."""
    from .sekv import append, compress, layout, router_file
    from .sekv import factorize as fz

    old_windows = pack.manifest.get("windows") or [[0, n_old]]
    try:
        plan = windows.plan_append(n_old, len(ids), header_len, _capacity(lm), len(old_windows))
    except ValueError as e:
        raise DocumentError(f"cannot read the added documents in windows of {lm.model_id}'s context: {e}") from None
    report.n_windows = len(plan)
    if any(w.offset for w in plan) and model_shape(lm).rope_inv_freq is None:
        raise DocumentError(f"{lm.model_id}'s rotary embedding (dynamic or partial) cannot be re-positioned for the added documents' windows")
    p = dataclasses.replace(params, **append.pack_lengths(pack))  # the pack's span lengths and window, not the new length's
    kw = dict(with_surprisal=True, chunk=chunk, capture=scores.capture_kinds(cache_method.needs_scores), obs_window=cache_method.obs_window(params))
    pieces, trained, spent = [], None, 0.0
    # the added tokens' text, at their global indices: the number tokens kept exact (sekv/numbers.py)
    token_text = [""] * n_old + lm.tokenizer.batch_decode([[t] for t in ids[n_old:]]) if p.number_share > 0 else None
    pack_router = layout.router_sha256(pack, set(pack.keys()))  # a pack made untrained stays so, whatever ships now
    for i, w in enumerate(plan):
        ta = time.perf_counter()
        with stage("prefill"):
            r = prefill_window(lm.model, ids, header_len, w, progress=lambda dn, _n, w=w: report("prefill", w.start - n_old + dn, i), **kw)
        spent += time.perf_counter() - ta
        report("compress", w.end - n_old, i)
        if token_text is not None:
            r.scores["token_text"] = token_text
        if i == 0 and pack_router:
            trained = compress.trained_router(r, p, r.shape)
        with stage("compress"), fz.single_thread():
            pieces.append(compress.compress_window(r, p, trained))
        del r
    lex = scores.text_scores(lm.tokenizer, text, ids[n_old:], ("lex_terms",))["lex_terms"] if "lex_terms" in cache_method.needs_scores else None
    sha = router_file.file_sha256(trained.path) if trained is not None else ""
    with stage("compress"):
        tensors = append.append(pack, pieces, params, len(ids), lex, sha)
    return tensors, old_windows + [[w.start, w.end] for w in plan], spent, ""


def _full(pack: Pack, lm, cache_method, params, ids, n_old, header_len, text, parts, doc, chunk, report):
    """The prefill continued over the stored KV cache: the KV of one prefill of the whole text."""
    from . import runtime

    plan_windows(lm, doc, len(ids), cache_method, header_len)  # the whole text must fit the model's window
    shape = model_shape(lm)
    dev = next(lm.model.parameters()).device
    ta = time.perf_counter()
    memory = cache_method.open(pack, params, shape, dev)
    t = torch.tensor(ids, device=dev)
    with stage("prefill"):
        for a in range(n_old, len(ids), chunk):
            runtime.forward_hidden(lm.model, t[a : a + chunk].view(1, -1), a, memory)
            report("prefill", min(a + chunk, len(ids)) - n_old, 0)
    n = len(ids)
    tensors = {}
    for i in range(shape.n_layers):
        tensors[f"full.k.{i}"] = memory.kv.k[i][0, :, :n].contiguous()
        tensors[f"full.v.{i}"] = memory.kv.v[i][0, :, :n].contiguous()
    return tensors, [[0, n]], time.perf_counter() - ta, ""


def _rag(pack: Pack, lm, cache_method, params, ids, n_old, header_len, text, parts, doc, chunk, report):
    """The added tokens cut into chunks after the pack's (from the pack's document end) and indexed."""
    from .methods import bm25
    from .methods.rag import chunk_bounds
    from .sekv import lexical

    old = {k: pack.get(k) for k in pack.keys()}
    start, end = (int(x) for x in old["rag.doc"].tolist())
    doc_end = n_old + parts[-1]["token_end"]  # the added documents' text ends; their closing tag is the tail
    token_text = lm.tokenizer.batch_decode([[t] for t in ids])
    bounds = chunk_bounds(token_text, end, doc_end, params.chunk_tokens)
    terms = torch.full((len(ids),), -1, dtype=torch.long)
    terms[n_old:] = lexical.document_terms(lm.tokenizer, text).long()
    chunk_ids, term, tf = bm25.postings(bounds, terms)
    c_old = int(old["rag.chunks"].numel()) - 1
    tensors = dict(old)
    tensors.update({
        "rag.tokens": torch.tensor(ids, dtype=torch.int32),
        "rag.doc": torch.tensor([start, doc_end], dtype=torch.int64),
        "rag.chunks": torch.cat([old["rag.chunks"], torch.tensor(bounds[1:], dtype=torch.int64)]),
        "rag.post_chunk": torch.cat([old["rag.post_chunk"], (chunk_ids + c_old).to(torch.int32)]),
        "rag.post_term": torch.cat([old["rag.post_term"], term.to(torch.int32)]),
        "rag.post_tf": torch.cat([old["rag.post_tf"], tf.to(torch.int32)]),
    })
    return tensors, [[0, len(ids)]], 0.0, ""


def _whole(pack: Pack, lm, cache_method, params, ids, n_old, header_len, text, parts, doc, chunk, report):
    """An eviction baseline: its one compressed document chosen over the whole text, read again from the pack's ids."""
    needs = cache_method.needs_scores
    if set(needs) & (set(scores.TEXT_SCORES) - {"token_text"}):
        raise SekvError(f"--method {cache_method.name} packs cannot be extended (its scores need the documents' text): ingest every "
                        f"document into a new pack (sekv ingest DOC... -o PACK), or use --method sekv")
    n = len(ids)
    rope_scale.prepare(lm, cache_method, n, "auto", reserve=RESERVE_TOKENS, what=str(pack.path))
    plan_windows(lm, doc, n, cache_method, header_len)
    ta = time.perf_counter()
    with stage("prefill"):
        r = prefill(lm.model, torch.tensor(ids), with_surprisal=cache_method.needs_surprisal, chunk=chunk, capture=scores.capture_kinds(needs),
                    obs_window=cache_method.obs_window(params), progress=lambda dn, _n: report("prefill", max(0, dn - n_old), 0))
    if "token_text" in needs:
        r.scores["token_text"] = lm.tokenizer.batch_decode([[t] for t in ids])
    spent = time.perf_counter() - ta
    with stage("compress"):
        tensors = cache_method.compress(r, params)
    note = f"--method {cache_method.name} keeps one compressed document: the whole text ({n} tokens) was read again"
    return tensors, [[0, n]], spent, note
