"""Does KVzip keep the needle?  One NIAH context of `sekv bench` (same text, same prompt), KVzip's reconstruction
scores computed once, and for each selection level (pair / layer / head) and budget: how many of the model's
(layer, KV head) units keep all, some or none of the passphrase value's tokens, and where those tokens' scores rank
within their unit.  With --plus, the KVzip+ scores too.

    python -m benchmarks.studies.kvzip_needle --length 4K --depth 50 --seed 0 --budgets 0.05,0.1,0.2 \
        --out docs/bench/kvzip-needle-qwen2.5-0.5b.json

The selection is methods/kvzip.py's select_kept over methods/kvzip.py's kvzip_scores: what the `kvzip` method keeps.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def value_tokens(tok, ids: list[int], value: str) -> list[int]:
    """The positions of the shortest run of tokens whose text holds ``value``."""
    best = None
    for a in range(len(ids)):
        for k in range(1, 16):
            if value in tok.decode(ids[a : a + k]):
                if best is None or k <= best[1] - best[0]:
                    best = (a, a + k)
                break
    if best is None:
        raise SystemExit(f"the value {value!r} is not in the prompt's tokens")
    return list(range(*best))


def summarise(scores: list[torch.Tensor], pos: list[int], budgets: list[float]) -> dict:
    from sekv_core.methods.kvzip import LEVELS, select_kept
    from sekv_core.methods.scores import kept_tokens

    n = scores[0].shape[1]
    units = sum(s.shape[0] for s in scores)
    p = torch.tensor(pos)
    # rank of each value token's score within its (layer, head): 1.0 = the highest of the document
    pct = torch.cat([(s.unsqueeze(-1) >= s[:, p].unsqueeze(1)).float().mean(1) for s in scores])  # [units, len(pos)]
    out = {"units": units, "value_score_top_fraction": {"median": float(pct.median()), "best": float(pct.min()),
                                                         "worst": float(pct.max())}}
    for b in budgets:
        k = kept_tokens(b, n)
        for level in LEVELS:
            kept = select_kept(scores, k, level)
            counts = [int(torch.isin(ix, p).sum()) for layer in kept for ix in layer]
            out[f"{level}@{b:g}"] = {"all": sum(c == len(pos) for c in counts), "some": sum(0 < c < len(pos) for c in counts),
                                     "none": sum(c == 0 for c in counts),
                                     "value_tokens_kept_share": round(sum(counts) / (len(pos) * units), 4)}
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--length", default="4K")
    ap.add_argument("--depth", type=float, default=50.0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--budgets", default="0.05,0.1,0.2")
    ap.add_argument("--plus", action="store_true", help="also the KVzip+ scores (another set of passes)")
    ap.add_argument("--threads", type=int, default=0)
    ap.add_argument("--out", type=Path)
    a = ap.parse_args(argv)
    from sekv_core import models, prompt
    from sekv_core.bench import tasks
    from sekv_core.methods import scores as score_kinds
    from sekv_core.methods.kvzip import KVzipParams, kvzip_scores
    from sekv_core.prefill import prefill

    if a.threads:
        torch.set_num_threads(a.threads)
    length = int(float(a.length[:-1]) * 1024) if a.length.upper().endswith("K") else int(a.length)
    lm = models.load(a.model, device="cpu")
    tok = lm.tokenizer
    ctx = tasks.generate("niah", tok, lengths=[length], depths=[a.depth], seed=a.seed)[0]
    text = prompt.document_prefix(tok, ctx.document)
    ids = prompt.encode(tok, text)
    value = ctx.probes[0].expected[0]
    pos = value_tokens(tok, ids, value)
    t0 = time.perf_counter()
    pre = prefill(lm.model, torch.tensor(ids), with_surprisal=False)
    pre.scores.update(score_kinds.text_scores(tok, text, ids, ("kvzip_prompts",)))
    t1 = time.perf_counter()
    budgets = [float(b) for b in a.budgets.split(",")]
    report = {"model": a.model, "dtype": str(pre.keys[0].dtype).removeprefix("torch."), "length": length, "depth": a.depth,
              "seed": a.seed, "n_tokens": len(ids), "value": value, "value_positions": pos,
              "value_text": [tok.decode([ids[i]]) for i in pos], "prefill_s": round(t1 - t0, 2)}
    for plus in ([False, True] if a.plus else [False]):
        t = time.perf_counter()
        sc = kvzip_scores(pre, KVzipParams(plus=plus))
        report["kvzip+" if plus else "kvzip"] = {**summarise(sc, pos, budgets), "scores_s": round(time.perf_counter() - t, 2)}
    print(json.dumps(report, indent=1))
    if a.out:
        a.out.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    main()
