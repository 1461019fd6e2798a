"""Why `sekv` loses needles at a 10 % budget: routing, not reconstruction.

For each NIAH context (the generator of `sekv bench niah`, same seed and haystack) the
document is prefilled once and compressed as `sekv ingest --method sekv --budget B` does
(shipped trained router).  Then, on the CPU reference step:

* ``router``      the normal ask (greedy, 12 tokens).  The question forward's queries are
                  recorded per layer, and the spans each layer kept for it;
* ``zoom_all``    every span reconstructed, no budget (`zoom=all`): is the SVD memory good enough?
* ``forced_*``    the needle's span(s) put first in the budget cap's order, and made a candidate
                  for every head, in the layers named (all, 0-11, 12-23, 8-16); the rest of the
                  routing as usual.  An oracle: is one span in the right layers enough?
* ``consensus``   an oracle ranking used in every layer: per layer, the teacher's (full-KV)
                  attention mass of each span, max over query heads and question tokens,
                  z-scored over spans and summed over layers.

Per context it also reports, over (layer, KV group) pairs, how often the needle span
was kept by the router, and its rank under the router's priority and under the teacher's
per-layer mass (max over the group's heads and the question tokens).

    python benchmarks/route_diagnosis.py --length 4096 --depths 0,25,50,75,100 --budget 0.1 \\
        --out docs/bench/route-diagnosis-qwen2.5-0.5b.json

CPU, about 1.5 min per 4K context on 2 cores.  Results: docs/sekv.md ("Why sekv loses needles at 10 %").

``--profile-weights 0,0.5,0.75,1`` instead ranks the needle's span under scout routing's rule
(docs/sekv.md §7c) for each weight lambda: per layer, the teacher's span masses (exact keys) for the
scout pass's question queries and for the document end's 32 queries, max over heads and tokens,
z-scored; rank = sum(question) - lambda * sum(document end).  Per context and budget (--budgets):

    python benchmarks/route_diagnosis.py --length 4096 --depths 0,25,50,75 --budgets 0.05,0.1,0.2 \
        --profile-weights 0,0.5,0.75,1 --seed 0
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import torch

from sekv_core import models, prompt
from sekv_core import methods
from sekv_core.bench import tasks
from sekv_core.generate import generate
from sekv_core.methods.base import DictStore, ModelShape
from sekv_core.prefill import prefill

FORCED = {"forced_all": None, "forced_0-11": range(0, 12), "forced_12-23": range(12, 24), "forced_8-16": range(8, 17)}


def needle_tokens(tok, text: str, needle: str) -> tuple[int, int]:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    c0 = text.index(needle)
    c1 = c0 + len(needle)
    hit = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0]
    return hit[0], hit[-1] + 1


def span_mass(q: torch.Tensor, keys: torch.Tensor, span_of: torch.Tensor, n_spans: int, group: int) -> torch.Tensor:
    """Teacher attention mass per (query head, query token, span): q [H, T, d], keys [Hkv, N, d] post-RoPE."""
    k = keys.float().repeat_interleave(group, 0)
    p = torch.softmax(torch.einsum("htd,hnd->htn", q, k) / math.sqrt(q.shape[-1]), -1)
    inside = span_of >= 0
    return torch.zeros(q.shape[0], q.shape[1], n_spans).index_add_(2, span_of[inside], p[:, :, inside])


def rank_of(score: torch.Tensor, targets: list[int]) -> int | None:
    if not targets:  # the needle lies in full-resolution tokens only
        return None
    order = torch.argsort(score, descending=True, stable=True).tolist()
    return min(order.index(i) for i in targets)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--profile-weights", default=None, help="comma-separated lambdas: scout ranking mode (see above)")
    ap.add_argument("--budgets", default=None, help="scout ranking mode: comma-separated budgets (default --budget)")
    a = ap.parse_args()
    if a.profile_weights:
        return profile_weight_ranks(a)
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device="cpu")
    model, tok = lm.model, lm.tokenizer
    shape = ModelShape.of(lm.config, next(model.parameters()).dtype)
    hkv, group = shape.n_kv_heads, shape.n_heads // shape.n_kv_heads
    stop = prompt.stop_token_ids(tok, model.generation_config)
    sekv = methods.get("sekv")
    depths = [float(x) for x in a.depths.split(",")]
    rows = []
    for ctx in tasks.generate("niah", tok, lengths=[a.length], depths=depths, seed=a.seed, essays=tasks.load_haystack(None)):
        t0 = time.perf_counter()
        text = prompt.document_prefix(tok, ctx.document)
        ids = torch.tensor(prompt.encode(tok, text))
        n0, n1 = needle_tokens(tok, text, ctx.meta["needles"][0])
        pre = prefill(model, ids, with_surprisal=True)
        params = sekv.resolve_params({"budget": a.budget})
        tensors = {k: v.cpu() for k, v in sekv.compress(pre, params).items()}
        mem = sekv.open(DictStore(tensors), params, shape, "cpu")
        S = mem.n_spans
        needle = ((mem.span_start < n1) & (mem.span_end > n0)).nonzero().flatten().tolist()
        span_of = torch.full((ids.numel(),), -1, dtype=torch.long)
        for i, (s0, s1) in enumerate(mem.spans()):
            span_of[s0:s1] = i
        qids = prompt.encode(tok, prompt.question_suffix(tok, ctx.probes[0].question))
        base = mem.n_tokens()
        expected = ctx.probes[0].expected

        def ask(memory) -> str:
            out, _ = generate(model, memory, qids, max_new_tokens=12, stop_ids=stop)
            memory.truncate(base)
            return tok.decode(out, skip_special_tokens=True).strip()

        # 1. the router, recording the question forward's queries, router priorities and kept spans
        queries, prios, kept = {}, {}, {}

        def record(layer, cand, prio):
            if layer not in queries:  # the question forward is the first one of the ask
                prios[layer] = prio.clone()
            return cand, prio

        inner = mem._attend

        def spy(layer, query, key, value, scaling):
            out = inner(layer, query, key, value, scaling)
            if layer not in queries:
                queries[layer] = query[0].float().clone()
                held = mem._held[layer]
                kept[layer] = held[0].clone() if held is not None else torch.zeros(hkv, S, dtype=torch.bool)
            return out

        mem.route_hook, mem._attend = record, spy
        answers = {"router": ask(mem)}
        mem.route_hook, mem._attend = None, inner

        # teacher mass per layer and the needle's ranks
        mass = {l: span_mass(queries[l], pre.keys[l], span_of, S, group) for l in range(shape.n_layers)}
        teach_rank, router_rank, kept_needle, n_kept = [], [], [], []
        consensus = torch.zeros(S)
        for l in range(shape.n_layers):
            m = mass[l].reshape(hkv, -1, S).amax(1)  # [Hkv, S]: max over the group's heads and question tokens
            v = mass[l].reshape(-1, S).amax(0)
            consensus += (v - v.mean()) / (v.std() + 1e-9)
            for g in range(hkv):
                teach_rank.append(rank_of(m[g], needle))
                if l in prios:
                    router_rank.append(rank_of(prios[l][g].float(), needle))
                kept_needle.append(bool(kept[l][g, needle].any()))
                n_kept.append(int(kept[l][g].sum()))

        # 2. oracles
        def force(layers, order=None):
            def hook(layer, cand, prio):
                if order is not None:
                    return torch.ones_like(cand), order.view(1, -1).expand(hkv, -1).to(prio.dtype).clone()
                if layers is None or layer in layers:
                    cand, prio = cand.clone(), prio.clone()
                    cand[:, needle] = True
                    prio[:, needle] = 1e4
                return cand, prio
            return hook

        for name, layers in FORCED.items():
            mem.route_hook = force(layers)
            answers[name] = ask(mem)
        mem.route_hook = force(None, consensus)
        answers["consensus"] = ask(mem)
        mem.route_hook = None
        full_mem = sekv.open(DictStore(tensors), sekv.resolve_params({"budget": a.budget, "zoom": "all"}), shape, "cpu")
        answers["zoom_all"] = ask(full_mem)

        def share(xs, k):
            xs = [x for x in xs if x is not None]
            return round(sum(x < k for x in xs) / len(xs), 3) if xs else None

        row = {
            "depth": ctx.depth, "n_tokens": int(ids.numel()), "spans": S, "needle_spans": needle,
            "needle_span_tokens": [int(mem.span_len[i]) for i in needle], "expected": expected,
            "answers": answers, "correct": {k: any(e.lower() in v.lower() for e in expected) for k, v in answers.items()},
            "kept_spans_per_group_mean": round(sum(n_kept) / len(n_kept), 2),
            "needle_kept_share": round(sum(kept_needle) / len(kept_needle), 3) if needle else None,
            "router_rank_top1": share(router_rank, 1), "router_rank_top3": share(router_rank, 3),
            "teacher_rank_top1": share(teach_rank, 1), "teacher_rank_top3": share(teach_rank, 3),
            "consensus_rank": rank_of(consensus, needle), "consensus_top5": torch.argsort(consensus, descending=True)[:5].tolist(),
            "seconds": round(time.perf_counter() - t0, 1),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    keys = ["router", "zoom_all", *FORCED, "consensus"]
    print("\ncorrect: " + ", ".join(f"{k} {sum(r['correct'][k] for r in rows)}/{len(rows)}" for k in keys))
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        meta = {"model": a.model, "length": a.length, "budget": a.budget, "seed": a.seed, "command": "python benchmarks/route_diagnosis.py "
                f"--length {a.length} --depths {a.depths} --budget {a.budget} --out {a.out}"}
        Path(a.out).write_text(json.dumps({"meta": meta, "contexts": rows}, indent=1) + "\n")


def profile_weight_ranks(a) -> None:
    from sekv_core import runtime
    from sekv_core.sekv import scout

    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device="cpu")
    model, tok = lm.model, lm.tokenizer
    shape = ModelShape.of(lm.config, next(model.parameters()).dtype)
    group = shape.n_heads // shape.n_kv_heads
    sekv = methods.get("sekv")
    lams = [float(x) for x in a.profile_weights.split(",")]
    budgets = [float(x) for x in (a.budgets or str(a.budget)).split(",")]
    hits = {lam: 0 for lam in lams}
    cases = 0
    for ctx in tasks.generate("niah", tok, lengths=[a.length], depths=[float(x) for x in a.depths.split(",")], seed=a.seed,
                              essays=tasks.load_haystack(None)):
        text = prompt.document_prefix(tok, ctx.document)
        ids = torch.tensor(prompt.encode(tok, text))
        n0, n1 = needle_tokens(tok, text, ctx.meta["needles"][0])
        pre = prefill(model, ids, with_surprisal=True, capture=("obs_queries",), obs_window=scout.PROFILE_QUERIES)
        qids = torch.tensor([prompt.encode(tok, prompt.question_suffix(tok, ctx.probes[0].question))])
        for b in budgets:
            params = sekv.resolve_params({"budget": b})
            mem = sekv.open(DictStore({k: v.cpu() for k, v in sekv.compress(pre, params).items()}), params, shape, "cpu")
            S = mem.n_spans
            needle = ((mem.span_start < n1) & (mem.span_end > n0)).nonzero().flatten().tolist()
            queries = {}
            inner = mem._attend

            def spy(layer, query, *rest, inner=inner, queries=queries, mem=mem):
                if mem._scouting:
                    queries[layer] = query[0].float().clone()
                return inner(layer, query, *rest)

            mem._attend = spy
            mem.prepare_question(lambda: runtime.forward_hidden(model, qids, mem.n_tokens(), mem))
            span_of = torch.full((ids.numel(),), -1, dtype=torch.long)
            for i, (s0, s1) in enumerate(mem.spans()):
                span_of[s0:s1] = i
            zq, zp = torch.zeros(S), torch.zeros(S)
            for l in range(shape.n_layers):
                zq += scout.zscore(span_mass(queries[l], pre.keys[l], span_of, S, group).reshape(-1, S).amax(0))
                zp += scout.zscore(span_mass(pre.scores["obs_queries"][l].float(), pre.keys[l], span_of, S, group).reshape(-1, S).amax(0))
            ranks = {lam: rank_of(zq - lam * zp, needle) for lam in lams}
            cases += 1
            for lam, r in ranks.items():
                hits[lam] += r is not None and r <= 1
            print(json.dumps({"depth": ctx.depth, "budget": b, "spans": S, "needle_spans": needle, "ranks": {str(k): v for k, v in ranks.items()}}), flush=True)
    print("needle span ranked first or second: " + ", ".join(f"lambda {lam}: {hits[lam]}/{cases}" for lam in lams))


if __name__ == "__main__":
    main()
