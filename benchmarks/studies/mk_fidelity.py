"""Why sekv misreads multi-key numbers: fidelity of the asked needle's zoomed blocks vs. ranking and budget.

On the H200, mk_niah 8K (four "The special magic number for KEY is: NNNNNNN." needles, one asked) answered with near
misses of the asked number (6560127 -> '6570127').  Per cell (seed, depth) this study prefills the context once and
asks it through sekv variants (``--variant NAME:key=value,key=value``; ingest-time parameters make their own pack,
shared by variants with the same ingest-time parameters).  Per variant it records:

* the answer and whether it is right; the nearest number among the four needles' values (is it another key's?);
* the scout's rank of the asked needle's best block, and in how many layers the needle's blocks were zoomed (any /
  all of them), at the answer's first forward (benchmarks/studies/past_window.py Probe);
* the relative Frobenius error of the rebuilt pre-RoPE keys and values of the needle's compressed tokens (all
  layers and KV heads together; ``digits``: the number's tokens only) and how many of the needle's tokens are kept at
  full resolution (anchors) instead;
* pack bytes and the ingest (compress) seconds of the variant's pack.

    python -m benchmarks.studies.mk_fidelity --cells 0:25 --variant base: --variant v4:value_bits=4 --out /tmp/x.json

Study-only keys in a variant: ``x_restrict=asked`` (only the asked needle's blocks may be zoomed: ZoomMemory.restrict),
``x_full=digits`` / ``x_full=sA`` (every digit token / every token with surprisal > mu + A sigma taken out of its span
and kept at full resolution: a mechanism simulated by patching compress.segmentation).  ``--margins``: the ask again
with the expected number forced, each digit's logit minus the best other token's.

``--batched`` asks through the accelerators' step (sekv/gpu_step.py) on the CPU, as the H200 bench does.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch

from sekv_core import methods, models, prompt
from sekv_core.bench import scoring, tasks
from sekv_core.generate import generate
from sekv_core.methods import scores as prefill_scores
from sekv_core.methods.base import DictStore, ModelShape
from sekv_core.prefill import prefill
from sekv_core.sekv import factorize as fz
from sekv_core.sekv import compress as compress_mod
from sekv_core.sekv import rope

from benchmarks.studies.past_window import Probe, rank_of
from benchmarks.studies.needles import needle_tokens


def parse_variant(s: str) -> tuple[str, dict]:
    name, _, rest = s.partition(":")
    over = {}
    for kv in filter(None, rest.split(",")):
        k, v = kv.split("=", 1)
        over[k] = json.loads(v) if re.fullmatch(r"-?[\d.e-]+|true|false", v) else v
    return name, over


def span_errors(res, pre, tokens: torch.Tensor) -> dict:
    """Relative Frobenius errors of the rebuilt pre-RoPE keys / values of ``tokens`` (document positions) that lie in
    compressed spans, over all layers and KV heads; and how many of ``tokens`` are full-resolution instead."""
    pos = torch.cat([torch.arange(a, b) for a, b in zip(res.span_start.tolist(), res.span_end.tolist())]) if res.n_spans else torch.empty(0, dtype=torch.long)
    where = torch.full((res.n_doc,), -1, dtype=torch.long)
    where[pos] = torch.arange(pos.numel())
    idx = where[tokens]
    sel = idx[idx >= 0]
    out = {"tokens": int(tokens.numel()), "full_res": int((idx < 0).sum())}
    if sel.numel() == 0:
        return out
    hkv, d = res.shape.n_kv_heads, res.shape.head_dim
    inv = rope.inv_freq_of(res.shape)
    cos, sin = rope.cos_sin(tokens[idx >= 0], inv, res.shape.rope_attention_scaling, dtype=pre.keys[0].dtype)
    ek = nk = ev = nv = 0.0
    for li in range(res.shape.n_layers):
        f, _ = res.factors[li]
        rec = fz.reconstruct_all(f, res.span_len, d)[:, sel]  # [2 Hkv, t, d]
        k = pre.keys[li][:, tokens[idx >= 0]].float()
        if res.pre_rope:
            k = rope.undo(k, cos, sin)
        v = pre.values[li][:, tokens[idx >= 0]].float()
        ek += float(((rec[:hkv] - k) ** 2).sum()); nk += float((k ** 2).sum())
        ev += float(((rec[hkv:] - v) ** 2).sum()); nv += float((v ** 2).sum())
    spans = torch.unique(torch.searchsorted(res.span_start, tokens[idx >= 0], right=True) - 1)
    rk = torch.stack([res.factors[li][0].rank[:, spans].float() for li in range(res.shape.n_layers)])  # [L, 2 Hkv, s]
    out.update(key_err=round((ek / nk) ** 0.5, 4), value_err=round((ev / nv) ** 0.5, 4),
               rank_k=round(float(rk[:, :hkv].mean()), 1), rank_v=round(float(rk[:, hkv:].mean()), 1),
               span_len=res.span_len[spans].tolist())
    return out


def carve(seg, extra: torch.Tensor):
    """The segmentation with the positions ``extra`` taken out of their spans and kept at full resolution (a span
    is cut at each of them; empty pieces vanish): the "exact tokens as extra anchors" mechanism, simulated."""
    from sekv_core.sekv.segment import Segmentation, span_token_index

    n = seg.n_tokens
    pos, sid = span_token_index(seg.span_start, seg.span_end)
    owner = torch.full((n,), -1, dtype=torch.long)
    owner[pos] = sid
    owner[extra[(extra >= 0) & (extra < n)]] = -1
    keep = owner >= 0
    prev = torch.cat([torch.tensor([-2]), owner[:-1]])
    nxt = torch.cat([owner[1:], torch.tensor([-2])])
    start = torch.nonzero(keep & (prev != owner)).flatten()
    end = torch.nonzero(keep & (nxt != owner)).flatten() + 1
    full = torch.nonzero(~keep).flatten()
    return Segmentation(n, full, seg.anchor_idx, start, end)


def extra_tokens(how: str, pre, text_tokens: list[str]) -> torch.Tensor:
    """Positions to keep exact: ``digits`` (every token that is a digit string), ``sA`` (surprisal > mu + A sigma)."""
    if how == "digits":
        return torch.tensor([i for i, t in enumerate(text_tokens) if t.strip().isdigit()], dtype=torch.long)
    a = float(how[1:])
    s = pre.surprisal.float()
    return torch.nonzero(s > s[4:].mean() + a * s[4:].std()).flatten()


def char_tokens(tok, text: str, c0: int, c1: int) -> torch.Tensor:
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    return torch.tensor([i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--cells", default="0:25", help="seed:depth,...")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--variant", action="append", default=[], help="NAME:key=value,... (sekv parameters)")
    ap.add_argument("--no-full", action="store_true", help="skip the full-KV reference answer")
    ap.add_argument("--batched", action="store_true", help="the accelerators' step, as on the GPU")
    ap.add_argument("--haystack", default="/work/shared/data/haystack/pg_essays")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--margins", action="store_true", help="also force the expected number: each digit's logit margin")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device="cpu")
    tok = lm.tokenizer
    shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
    stop_ids = prompt.stop_token_ids(tok, getattr(lm.model, "generation_config", None))
    sekv, full = methods.get("sekv"), methods.get("full")
    variants = [parse_variant(v) for v in (a.variant or ["base:"])]
    essays = tasks.load_haystack(a.haystack)
    out = Path(a.out) if a.out else None
    rows = []
    print(f"dtype {shape.dtype}", flush=True)
    for cell in a.cells.split(","):
        seed, depth = int(cell.split(":")[0]), float(cell.split(":")[1])
        ctx = tasks.gen_mk_niah(tok, a.length, depth, seed, essays)
        text = prompt.document_prefix(tok, ctx.document)
        ids = prompt.encode(tok, text)
        pq = ctx.probes[0]
        q_ids = prompt.encode(tok, prompt.question_suffix(tok, pq.question))
        values = [n.rstrip(".").split(": ")[-1] for n in ctx.meta["needles"]]
        n0, n1 = needle_tokens(tok, text, ctx.meta["needles"][0])
        needle_ranges = [needle_tokens(tok, text, nd) for nd in ctx.meta["needles"]]
        c0 = text.index(ctx.meta["needles"][0])
        c_num = c0 + ctx.meta["needles"][0].index(values[0])
        digits = char_tokens(tok, text, c_num, c_num + len(values[0]))
        t0 = time.perf_counter()
        pre = prefill(lm.model, torch.tensor(ids), with_surprisal=True, capture=prefill_scores.capture_kinds(sekv.needs_scores),
                      obs_window=sekv.obs_window(sekv.resolve_params({"budget": a.budget})))
        pre.scores.update(prefill_scores.text_scores(tok, text, ids, set(sekv.needs_scores) | {"token_text"}))
        row = {"seed": seed, "depth": depth, "expected": values[0], "others": values[1:], "needle": [n0, n1],
               "digits": digits.tolist(), "prefill_s": round(time.perf_counter() - t0, 1), "cells": {}}
        if not a.no_full:
            fp = full.resolve_params({})
            mem = full.open(DictStore(dict(full.compress(pre, fp))), fp, shape, "cpu")
            ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=pq.max_new_tokens, stop_ids=stop_ids, question=pq.question)
            answer = tok.decode(ans, skip_special_tokens=True).strip()
            row["cells"]["full"] = {"answer": answer, "correct": bool(scoring.score(answer, pq)[0])}
            print(f"s{seed} d{depth:g} full {answer!r}", flush=True)
        packs: dict = {}
        for name, over in variants:
            over = dict(over)
            x_full = over.pop("x_full", None)  # study-only: extra exact tokens (carve)
            x_restrict = over.pop("x_restrict", None)
            params = sekv.resolve_params({"budget": a.budget, **over})
            ingest = tuple(sorted((k, v) for k, v in params.__dict__.items() if k not in params.ask_time_names() or k == "budget")) + (x_full,)
            if ingest not in packs:
                t1 = time.perf_counter()
                orig = compress_mod.segmentation
                if x_full:
                    extra = extra_tokens(x_full, pre, pre.scores["token_text"])
                    compress_mod.segmentation = lambda pf, pp: carve(orig(pf, pp), extra)
                try:
                    made = {k: v.cpu() for k, v in sekv.compress(pre, params).items()}
                finally:
                    compress_mod.segmentation = orig
                packs[ingest] = (made, round(time.perf_counter() - t1, 2), sum(t.numel() * t.element_size() for t in made.values()))
            made, comp_s, nbytes = packs[ingest]
            mem = sekv.open(DictStore(dict(made)), params, shape, "cpu")
            mem.batched = a.batched
            res = mem.res
            if x_restrict == "asked":  # study-only: only the asked needle's blocks may be zoomed
                mem.restrict([(n0, n1)])
            bs, bl = res.block_start, res.block_len
            blocks = ((bs < n1) & (bs + bl > n0)).nonzero().flatten()
            needle_blocks = [((bs < b) & (bs + bl > a_)).nonzero().flatten() for a_, b in needle_ranges]
            dblocks = ((bs < int(digits.max()) + 1) & (bs + bl > int(digits.min()))).nonzero().flatten()
            with Probe() as p:
                ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=pq.max_new_tokens, stop_ids=stop_ids, question=pq.question,
                                  graphs=a.batched)
            answer = tok.decode(ans, skip_special_tokens=True).strip()
            if a.margins:  # the same ask, the expected number forced: per digit, its logit minus the best other's
                forced = tok.encode(values[0], add_special_tokens=False)
                marg: list[float] = []

                def force(logits, forced=forced, marg=marg):
                    t = len(marg)
                    if t >= len(forced):
                        return next(iter(stop_ids))
                    lg = logits.float()
                    other = lg.clone()
                    other[forced[t]] = -float("inf")
                    marg.append(round(float(lg[forced[t]] - other.max()), 2))
                    return forced[t]

                mem.truncate(0)
                generate(lm.model, mem, q_ids, max_new_tokens=len(forced) + 1, stop_ids=stop_ids, question=pq.question,
                         graphs=a.batched, sampler=force)
            c = {"answer": answer, "margins": marg if a.margins else None, "correct": bool(scoring.score(answer, pq)[0]), "params": over,
                 "nearest": min(values, key=lambda v: sum(x != y for x, y in zip(v, answer.ljust(7))))}
            if p.parts:
                final = p.parts["question"].float() - p.parts["pw"] * p.parts["profile"].float()
                c["rank_needle"] = rank_of(mem.ranking.prio.float().cpu(), blocks) if mem.ranking is not None else None
                c["rank_question"] = rank_of(final, blocks)
            c["zoomed_any"] = sum(bool(k[:, blocks].any()) for k in p.keeps)
            # every needle (asked first): the share of its (layer, KV group, block) pairs zoomed at the first forward
            c["needle_zoom_share"] = [round(sum(float(k[:, nb].float().mean()) for k in p.keeps) / max(len(p.keeps), 1), 2)
                                      for nb in needle_blocks]
            c["zoomed_digits_all"] = sum(bool(k[:, dblocks].all()) for k in p.keeps)
            c["layers_probed"] = len(p.keeps)
            c["needle_err"] = span_errors(res, pre, torch.arange(n0, n1))
            c["digit_err"] = span_errors(res, pre, digits)
            c.update(pack_bytes=nbytes, compress_s=comp_s, resident_bytes=int(mem.step_stats().resident_bytes),
                     n_spans=res.n_spans, n_full=res.n_full)
            row["cells"][name] = c
            print(f"s{seed} d{depth:g} {name:10s} {'Y' if c['correct'] else 'n'} {answer!r:12s} near {c['nearest']} rank {c.get('rank_needle')} "
                  f"zoom any {c['zoomed_any']}/{c['layers_probed']} needles {c['needle_zoom_share']} digits-all {c['zoomed_digits_all']} "
                  f"err K/V needle {c['needle_err'].get('key_err')}/{c['needle_err'].get('value_err')} "
                  f"digits {c['digit_err'].get('key_err')}/{c['digit_err'].get('value_err')} full-res {c['digit_err']['full_res']}/{c['digit_err']['tokens']} "
                  f"margins {c['margins']} rank K/V {c['digit_err'].get('rank_k')}/{c['digit_err'].get('rank_v')} pack {nbytes / 1e6:.1f}MB {comp_s}s", flush=True)
        rows.append(row)
        if out:
            out.write_text(json.dumps({"command": "python -m benchmarks.studies.mk_fidelity " + " ".join(sys.argv[1:]),
                                       "dtype": str(shape.dtype), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
