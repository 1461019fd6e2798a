"""Why sekv answers another archive's passphrase on the four-needle task past the window: a CPU proxy.

On the H200 (docs/bench/niah-long-h200-tier/mn_niah.jsonl, 64K-128K tokens) 15 of sekv's 16 misses of ``mn_niah``
answer the passphrase of ANOTHER needle of the same document, often the same one for every question.  This study
forces the product's path past the window on a short ``mn_niah`` context with the real model (windowed ingest with a
small ``--window``, the question re-positioned at the model's window - reserve, as benchmarks/studies/past_window.py
does for one needle) and records, per question and variant:

* the answer, whether it is right, and which needle's value it gives (``answered``: the needle's index, -1: none);
* each needle's best block rank under the scout's final ranking and under its lexical part (``ranks``, ``lex_ranks``:
  the asked needle first, then the others in the context's order);
* the share of each needle's tokens held zoomed, averaged over layers and KV groups at the answer's first forward
  (``zoomed``), and the layout slot of each needle's first zoomed block, as a distance from the question (``dist``).

Variants: ``win@rp`` (the default ask past the window), ``one`` (one prefill, read at the document's own positions:
the path within the window), ``one@rp`` (that pack re-positioned), ``win@rp:KEY=VALUE+KEY=VALUE`` (ask-time sekv parameters), ``win@rp:oracle``
(study only: the other needles' blocks ranked last, as a perfect look-alike test would), ``win@rp:hide`` (the CPU
step: the look-alikes held at full resolution, in the end window, hidden from attention for the question by the
study's own patch of the mask: ``Lexicon.resident_columns``; the product hides them itself now, with
``lookalikes=demote``, so it is the same ask as ``win@rp``, kept to remake the records made before), ``rag``.

    python -m benchmarks.studies.multi_needle --length 8192 --window 2048 --depths 0,50,100 --seeds 0 \\
        --variants win@rp,rag --cache /tmp/mn --out docs/bench/multi-needle-8k-qwen2.5-0.5b.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import sys
import time
from pathlib import Path

import torch

from sekv_core import methods, models, prompt, windows
from sekv_core.bench import scoring, tasks
from sekv_core.generate import generate
from sekv_core.methods import scores as prefill_scores
from sekv_core.methods.base import DictStore, ModelShape, PrefillResult
from sekv_core.prefill import prefill, prefill_window

from benchmarks.studies.needles import needle_tokens
from benchmarks.studies.past_window import Probe, _header_len, _load, _save, rank_of


def _value(v):
    return json.loads(v) if v[:1].isdigit() or v[:1] == "-" or v in ("true", "false") else v


def parse_variant(params, how: str):
    """``KEY=VALUE+KEY=VALUE`` -> params with those ask-time values (``oracle``: study only, see ask_sekv)."""
    for opt in filter(None, how.split("+")):
        k, eq, val = opt.partition("=")
        if k in ("oracle", "hide"):
            continue
        params = params.replace(reposition=k) if not eq else params.replace(**{k: type(getattr(params, k))(_value(val))})
    return params


def hidden_columns(mem, question: str) -> torch.Tensor:
    """The full-resolution columns of the look-alikes no ranking reaches (``Lexicon.resident_lookalikes``: pieces of the
    end window, the sinks), as indices into the pack's full-resolution tokens."""
    res = mem.res
    cols = res.lexicon.resident_columns(question, res.block_start) if res.lexicon is not None else None
    return torch.zeros(0, dtype=torch.long) if cols is None else cols


@contextlib.contextmanager
def hiding(columns: torch.Tensor):
    """Study only, the CPU step: the full-resolution ``columns`` hidden from every query (-inf in the additive mask)."""
    from sekv_core.sekv import cpu_step

    built = cpu_step.build_mask

    def build(**kw):
        m = built(**kw)
        m[..., columns.to(m.device)] = float("-inf")
        return m

    cpu_step.build_mask = build
    try:
        yield
    finally:
        cpu_step.build_mask = built


def ask_sekv(lm, mem, q_ids, pq, needles: list[tuple[int, int]], stop_ids, oracle: bool = False, layout: bool = True,
             hide: bool = False) -> dict:
    """oracle: the other needles' blocks are ranked last (what a perfect look-alike test would do); layout: the
    question re-positioned at the model's window - reserve (past the window), else at the document's end; hide (study
    only, CPU): the look-alikes held at full resolution (the end window) hidden from attention for this question."""
    res = mem.res
    bs, bl = res.block_start.cpu(), res.block_len.cpu()
    blocks = [((bs < n1) & (bs + bl > n0)).nonzero().flatten() for n0, n1 in needles]
    if oracle:
        mask = torch.zeros(res.n_blocks, dtype=torch.bool)
        for b in blocks[1:]:
            mask[b] = True
        mem._lookalikes = lambda question: mask
    if layout:
        window = models.context_window(lm.config)
        mem.question_at(window - (len(q_ids) + pq.max_new_tokens), window)
    cols = hidden_columns(mem, pq.question) if hide else torch.zeros(0, dtype=torch.long)
    with Probe() as p, hiding(cols):
        ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=pq.max_new_tokens, stop_ids=stop_ids, question=pq.question)
    answer = lm.tokenizer.decode(ans, skip_special_tokens=True).strip()
    parts = p.parts
    final = mem.ranking.prio.float().cpu()
    lex = parts["lexical"]
    out = {"answer": answer, "correct": bool(scoring.score(answer, pq)[0]),
           "ranks": [rank_of(final, b) for b in blocks],
           "lex_ranks": [rank_of(lex.float().cpu(), b) for b in blocks] if lex is not None else None}
    if p.keeps:
        keep = torch.stack([k.float() for k in p.keeps])  # [L, Hkv, B]
        share = []
        for (n0, n1), b in zip(needles, blocks):
            if not b.numel():
                share.append(None)
                continue
            lo, hi = torch.maximum(bs[b], torch.tensor(n0)), torch.minimum(bs[b] + bl[b], torch.tensor(n1))
            tok = (hi - lo).clamp_min(0).float()  # needle tokens in each of its blocks
            share.append(round(float((keep[:, :, b] * tok).sum(-1).mean() / (n1 - n0)), 3))
        out["zoomed"] = share
        out["zoomed_blocks_per_group"] = round(float(keep.sum(-1).mean()), 1)
    stats = mem.step_stats().extra
    out["positions"] = stats.get("positions")
    if hide:
        out["hidden_tokens"] = int(cols.numel())
    return out


def which_needle(answer: str, values: list[str]) -> int:
    hits = [i for i, v in enumerate(values) if v.lower() in answer.lower()]
    return hits[0] if len(hits) == 1 else (-2 if hits else -1)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--task", default="mn_niah", choices=["mn_niah", "niah"])
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--window", type=int, default=2048, help="the ingest window forced on the pack")
    ap.add_argument("--depths", default="0,50,100")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--variants", default="win@rp,rag")
    ap.add_argument("--param", action="append", default=[], help="ingest-time sekv parameter KEY=VALUE")
    ap.add_argument("--haystack", default="/work/shared/data/haystack/pg_essays")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None)
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the model, the prefill and the opened memories; sekv "
                    "asks through the reference step, sekv/cpu_step.py, on either, as benchmarks/studies/past_window.py)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device=a.device, dtype=getattr(torch, a.dtype) if a.dtype else None)
    tok = lm.tokenizer
    shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
    stop_ids = prompt.stop_token_ids(tok, getattr(lm.model, "generation_config", None))
    sekv, rag = methods.get("sekv"), methods.get("rag")
    extra = {k: _value(v) for k, v in (x.split("=", 1) for x in a.param)}
    params = sekv.resolve_params({"budget": a.budget, **extra})
    essays = tasks.load_haystack(a.haystack)
    variants = a.variants.split(",")
    gen = tasks.GRID_TASKS[a.task]
    rows, out = [], Path(a.out) if a.out else None
    tally: dict[str, list[int]] = {v: [0, 0] for v in variants}
    for seed in (int(s) for s in a.seeds.split(",")):
        for depth in (float(d) for d in a.depths.split(",")):
            t0 = time.perf_counter()
            ctx = gen(tok, a.length, depth, seed, essays)
            text = prompt.document_prefix(tok, ctx.document)
            ids = prompt.encode(tok, text)
            needles = [needle_tokens(tok, text, n) for n in ctx.meta["needles"]]
            values = [pq.expected[0] for pq in ctx.probes]
            header = _header_len(tok, ctx.document)
            tag = "-".join(f"{k}{v}" for k, v in sorted(extra.items()))
            cached = Path(a.cache) / f"{a.task}-{a.model}-{a.length}-w{a.window}-b{a.budget:g}-d{depth:g}-s{seed}{tag}.safetensors" if a.cache else None
            packs = _load(cached)
            text_sc = prefill_scores.text_scores(tok, text, ids, set(sekv.needs_scores) | set(rag.needs_scores))
            if "win" not in packs and any(v.startswith("win") for v in variants):  # windowed ingest
                kinds = prefill_scores.capture_kinds(sekv.needs_scores)
                plan = windows.plan(len(ids), header, a.window - min(512, a.window // 4), windows.CARRY_TOKENS)
                pres = []
                for w in plan:
                    r = prefill_window(lm.model, ids, header, w, with_surprisal=True, capture=kinds, obs_window=sekv.obs_window(params))
                    r.scores.update(text_sc)
                    pres.append(r)
                packs["win"] = {k: v.cpu() for k, v in sekv.compress_windows(iter(pres), params).items()}
                del pres
                _save(cached, packs)
            if "one" not in packs and any(v.startswith("one") for v in variants):
                one = prefill(lm.model, torch.tensor(ids), with_surprisal=True, capture=prefill_scores.capture_kinds(sekv.needs_scores),
                              obs_window=sekv.obs_window(params))
                one.scores.update(text_sc)
                packs["one"] = {k: v.cpu() for k, v in sekv.compress(one, params).items()}
                del one
                _save(cached, packs)
            row = {"length": a.length, "n_tokens": len(ids), "depth": depth, "seed": seed, "needles": needles,
                   "needle_depths": ctx.meta.get("needle_depths"), "values": values, "questions": []}
            for qi, pq in enumerate(ctx.probes):
                # the asked needle first, then the others in the context's order
                order = [qi] + [j for j in range(len(needles)) if j != qi]
                q_ids = prompt.encode(tok, prompt.question_suffix(tok, pq.question))
                cells = {}
                for v in variants:
                    if v == "rag":
                        rp = rag.resolve_params({"budget": a.budget})
                        made = rag.compress(PrefillResult.without_kv(torch.tensor(ids), shape, text_sc, lm), rp)
                        mem = rag.open(DictStore({k: x.cpu() for k, x in made.items()}), rp, shape, a.device)
                        ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=pq.max_new_tokens, stop_ids=stop_ids, question=pq.question)
                        answer = tok.decode(ans, skip_special_tokens=True).strip()
                        c = {"answer": answer, "correct": bool(scoring.score(answer, pq)[0])}
                    else:
                        kind, _, how = v.partition(":")
                        pack = "one" if kind.startswith("one") else "win"
                        mem = sekv.open(DictStore(dict(packs[pack])), parse_variant(params, how), shape, a.device)
                        mem.batched = False  # the reference step (the probe and the study's hiding read it), on any device
                        c = ask_sekv(lm, mem, q_ids, pq, [needles[j] for j in order], stop_ids, "oracle" in how.split("+"), kind.endswith("@rp"),
                                     "hide" in how.split("+"))
                    w = which_needle(c["answer"], values)
                    c["answered"] = order.index(w) if w >= 0 else w  # 0: the asked needle, k: the k-th other
                    cells[v] = c
                    tally[v][0] += c["correct"]
                    tally[v][1] += 1
                    print(f"{a.length} d{depth:g} s{seed} q{qi} {v:28s} {'Y' if c['correct'] else 'n'} {c['answer'][:24]!r:28s} "
                          f"ans={c['answered']}" + (f" ranks {c['ranks']} lex {c['lex_ranks']} zoomed {c.get('zoomed')}" if "ranks" in c else ""),
                          flush=True)
                row["questions"].append({"item": pq.item, "expected": pq.expected, "order": order, "cells": cells})
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({"command": "python -m benchmarks.studies.multi_needle " + " ".join(sys.argv[1:]),
                                           "model": a.model, "dtype": str(shape.dtype).removeprefix("torch."), "device": a.device, "budget": a.budget,
                                           "params": a.param, "rows": rows}, indent=1))
    for v in variants:
        print(f"{v:28s} found {tally[v][0]}/{tally[v][1]}")


if __name__ == "__main__":
    main()
