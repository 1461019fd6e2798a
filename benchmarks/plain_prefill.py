"""The reference `sekv ingest` is measured against: a plain transformers prefill of the same tokens.

The document's tokens are the ingest's own (sekv_core.ingest.tokenize_document: the chat template's document prefix);
the model is loaded by transformers alone (``AutoModelForCausalLM.from_pretrained``, SDPA attention, the dtype and
device `sekv ingest` would use: models.default_dtype), without sekv's attention hook.  Timed (model load and a
1,024-token warm-up excluded, the device synchronised before and after): one forward
``model(ids, use_cache=True, logits_to_keep=1)``, the KV cache of every token built and the last token's logits
computed.  When that forward runs out of device memory, transformers' own chunked prefill instead: the same call a
chunk at a time into one DynamicCache (``mode`` says which was timed).

    python -m benchmarks.plain_prefill --model qwen2.5-0.5b --doc bench_docs/niah_16384.txt --device cuda
    # one JSON line: {"plain_prefill_s": ..., "mode": "one forward" | "chunked 4096", "tokens": ..., ...}

benchmarks/gpu_cli.py runs it in a process of its own for every document (``plain_prefill_s``, ``ingest_over_plain``).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import torch

WARMUP_TOKENS = 1024


def document_ids(tokenizer, doc_path: str | Path, system: str | None = None) -> list[int]:
    """The token ids `sekv ingest` prefills for ``doc_path`` (its tokenization, through the same function)."""
    from sekv_core.documents import load_document
    from sekv_core.ingest import tokenize_document

    ids, _ = tokenize_document(SimpleNamespace(tokenizer=tokenizer), load_document(Path(doc_path)), system)
    return ids


def load_plain(model: str, device: str | None = None, dtype=None):
    """(transformers model with SDPA attention, tokenizer, device, dtype): sekv's model resolution and defaults, no
    sekv code in the model."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from sekv_core import models

    models.quiet_transformers()
    device = models.check_device(device)
    _, where = models.resolve(model)
    dtype = dtype or models.default_dtype(device)
    local = isinstance(where, Path)
    tok = AutoTokenizer.from_pretrained(where, local_files_only=local)
    kw = {"device_map": torch.device(device)} if device.startswith("cuda") else {}
    m = AutoModelForCausalLM.from_pretrained(where, dtype=dtype, local_files_only=local, attn_implementation="sdpa", **kw)
    m.to(device).eval().requires_grad_(False)
    return m, tok, torch.device(device), dtype


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def one_forward(model, ids: torch.Tensor):
    """The whole prefill as one forward: the DynamicCache of every token, the last token's logits."""
    return model(ids, use_cache=True, logits_to_keep=1)


def chunked(model, ids: torch.Tensor, chunk: int):
    """transformers' chunked prefill: the same call a chunk at a time into one DynamicCache."""
    from transformers import DynamicCache

    import inspect

    cache, out = DynamicCache(), None
    name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # renamed in transformers 5.2x
    for a in range(0, ids.shape[1], chunk):
        out = model(ids[:, a : a + chunk], use_cache=True, logits_to_keep=1, **{name: cache})
    return out


def timed_prefill(model, ids: list[int] | torch.Tensor, device: torch.device, chunk: int | None = None) -> dict:
    """Seconds of the plain prefill of ``ids`` (warm-up excluded): one forward, or (``chunk``, or the one forward out
    of device memory) the chunked one -> {plain_prefill_s, mode, tokens}."""
    from sekv_core.prefill import default_chunk

    x = torch.as_tensor(ids, dtype=torch.long).view(1, -1).to(device)
    with torch.inference_mode():
        one_forward(model, x[:, :WARMUP_TOKENS])
        _sync(device)
        mode, out = None, None
        if not chunk:
            try:
                t = time.perf_counter()
                out = one_forward(model, x)
                _sync(device)
                dt, mode = time.perf_counter() - t, "one forward"
            except torch.OutOfMemoryError:
                out = None
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        if mode is None:
            chunk = chunk or default_chunk(device)
            t = time.perf_counter()
            out = chunked(model, x, chunk)
            _sync(device)
            dt, mode = time.perf_counter() - t, f"chunked {chunk}"
    del out
    return {"plain_prefill_s": dt, "mode": mode, "tokens": int(x.shape[1])}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.plain_prefill", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help="embedded model name or a local model directory")
    ap.add_argument("--doc", required=True, help="the document `sekv ingest` reads")
    ap.add_argument("--device", default=None)
    ap.add_argument("--chunk", type=int, default=0, help="time transformers' chunked prefill with this chunk (0: one forward, chunked only if it does not fit)")
    ap.add_argument("--out", default=None, help="also write the JSON here")
    a = ap.parse_args(argv)
    t0 = time.perf_counter()
    model, tok, device, dtype = load_plain(a.model, a.device)
    load_s = time.perf_counter() - t0
    ids = document_ids(tok, a.doc)
    rec = {"model": a.model, "device": str(device), "dtype": str(dtype).removeprefix("torch."), "load_s": load_s,
           **timed_prefill(model, ids, device, a.chunk or None)}
    if device.type == "cuda":
        rec["gpu_peak_bytes"] = torch.cuda.max_memory_allocated(device)
    line = json.dumps(rec)
    print(line, flush=True)
    if a.out:
        Path(a.out).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
