"""Ingest and ask costs of a context pack versus plain transformers, on this machine.

Measures, for one document:
  * ingest time (sekv prefill + compress + write) vs one plain transformers prefill of the same tokens;
  * `ask` time to first token from the pack (question tokens only) vs re-prefilling document + question;
  * pack bytes per token.

    python -m benchmarks.pack_vs_prefill --model qwen2.5-0.5b --doc sample_docs/halden_hx40_manual.pdf --method full
"""

from __future__ import annotations

import argparse
import json
import platform
import tempfile
import time
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM

from sekv_core import models, prompt
from sekv_core.ingest import ingest
from sekv_core.session import Session


def plain_forward_s(model, ids: list[int], repeats: int) -> float:
    x = torch.tensor([ids])
    times = []
    with torch.inference_mode():
        for _ in range(repeats):
            t = time.perf_counter()
            model(x, use_cache=True, logits_to_keep=1)
            times.append(time.perf_counter() - t)
    return min(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--doc", default="sample_docs/halden_hx40_manual.pdf")
    ap.add_argument("--method", default="full")
    ap.add_argument("--question", default="What is the maximum inlet water pressure of the HX-40?")
    ap.add_argument("--repeats", type=int, default=2)
    a = ap.parse_args()
    torch.manual_seed(0)
    lm = models.load(a.model, device="cpu")
    dtype = next(lm.model.parameters()).dtype
    plain = AutoModelForCausalLM.from_pretrained(lm.path, dtype=dtype, attn_implementation="sdpa").eval()
    with tempfile.TemporaryDirectory() as tmp:
        pack = Path(tmp) / "doc.sekv"
        ingest_s = []
        for _ in range(a.repeats):
            t = time.perf_counter()
            r = ingest(a.doc, pack, lm=lm, method=a.method)
            ingest_s.append(time.perf_counter() - t)
        session = Session.open(pack, lm=lm)
        q_ids = prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, a.question))
        doc_ids = session.pack.token_ids
        ttft_pack = min(session.ask(a.question, max_new_tokens=1).stats.ttft_s for _ in range(a.repeats + 1))
        prefill_plain = plain_forward_s(plain, doc_ids, a.repeats)
        reprefill = plain_forward_s(plain, doc_ids + q_ids, a.repeats)
        result = {
            "machine": f"{platform.processor() or platform.machine()}, {torch.get_num_threads()} threads, torch {torch.__version__}",
            "model": a.model,
            "dtype": str(dtype),
            "method": a.method,
            "doc_tokens": r.n_tokens,
            "question_tokens": len(q_ids),
            "ingest_s": round(min(ingest_s), 2),
            "ingest_prefill_s": round(r.prefill_s, 2),
            "plain_prefill_s": round(prefill_plain, 2),
            "ingest_over_plain": round(min(ingest_s) / prefill_plain, 3),
            "ttft_from_pack_s": round(ttft_pack, 3),
            "ttft_reprefill_s": round(reprefill, 2),
            "ttft_ratio": round(ttft_pack / reprefill, 4),
            "pack_bytes": r.pack_bytes,
            "pack_bytes_per_token": round(r.pack_bytes / r.n_tokens),
            "raw_fp16_kv_bytes_per_token": round(r.raw_kv_fp16_bytes / r.n_tokens),
        }
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
