"""What static YaRN costs on documents that fit the native window (the case for `--rope-scaling auto`'s native default).

Two measurements with the real model, native RoPE against YaRN x2 and x4 (models.set_rope_scaling, as ingest
applies it):

* loss: the mean surprisal (nats per token) of a ~4K-token document (Paul Graham essays from
  shared/data/haystack/pg_essays, in sekv's prompt) - one prefill each;
* needles: `sekv bench niah` cells (the benchmark runner itself, method `full`) at the lengths and depths given,
  one results directory per scaling under --out.

Usage (CPU; SEKV_HAYSTACK names the essays where shared/ is not beside the repository):
    SEKV_HAYSTACK=../shared/data/haystack/pg_essays python -m benchmarks.studies.yarn_short --out /tmp/yarn_short
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from sekv_core import models, prompt
from sekv_core.bench import runner, tasks
from sekv_core.prefill import prefill


def essay_prefix(tok, n_tokens: int) -> list[int]:
    text = "\n\n".join(" ".join(essay) for essay in tasks.load_haystack(None))
    ids = prompt.encode(tok, text[: n_tokens * 6])
    doc = tok.decode(ids[:n_tokens])
    return prompt.encode(tok, prompt.document_prefix(tok, doc))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default=models.DEFAULT_MODEL)
    ap.add_argument("--tokens", type=int, default=4000)
    ap.add_argument("--factors", default="none,2,4")
    ap.add_argument("--lengths", default="4096,8192")
    ap.add_argument("--depths", default="10,50,90")
    ap.add_argument("--out", type=Path, default=Path("/tmp/yarn_short"))
    a = ap.parse_args()
    lm = models.load(a.model, device="cpu")
    factors = [None if f == "none" else float(f) for f in a.factors.split(",")]
    ids = torch.tensor(essay_prefix(lm.tokenizer, a.tokens))
    rows = []
    for f in factors:
        models.set_rope_scaling(lm, f)
        t0 = time.perf_counter()
        res = prefill(lm.model, ids, with_surprisal=True, chunk=1024)
        s = res.surprisal[1:].double()
        row = {"factor": f, "tokens": int(ids.numel()), "mean_nll": round(float(s.mean()), 4), "ppl": round(float(s.mean().exp()), 3),
               "prefill_s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        print(json.dumps(row), flush=True)
        cfg = runner.BenchConfig(tasks=["niah"], methods=["full"], budgets=[0.1], lengths=[int(x) for x in a.lengths.split(",")],
                                 depths=[float(x) for x in a.depths.split(",")])
        out = a.out / ("native" if f is None else f"yarn{f:g}")
        runner.run(lm, cfg, out, runner.Reporter())
        recs = [json.loads(x) for x in (out / runner.RESULTS_FILE).read_text().splitlines() if x.strip()]
        for length in cfg.lengths:
            rs = [r for r in recs if r.get("length") == length and not r.get("error")]
            print(json.dumps({"factor": f, "niah_length": length, "correct": sum(bool(r["correct"]) for r in rs), "cells": len(rs),
                              "answers": [r["answer"] for r in rs]}), flush=True)
    models.set_rope_scaling(lm, None)


if __name__ == "__main__":
    main()
