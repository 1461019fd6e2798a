"""Why sekv finds fewer needles past the window: a CPU proxy of the multi-window situation.

The H200 runs (docs/bench/niah-long-h200) put a 64K-120K document in 3-4 ingest windows and read it re-positioned
inside the model's 32K window.  Here the same two mechanisms are forced on a short NIAH context with the real model:
windowed ingest with a small window (``--window``, as SEKV_INGEST_WINDOW plans it: header + carried tokens + own part)
and re-positioned attention with the question where it sits on the H200 (p0 = 32,768 - reserve, the resident set
right-aligned before it).  The variants, on the SAME needles:

* ``one``          one prefill, read at the document's own positions (today's path within the window)
* ``one@rp``       the same pack, re-positioned (isolates the layout)
* ``win``          windowed ingest, read at the document's own positions (isolates the windowing)
* ``win@rp``       windowed ingest, re-positioned (the product's path past the window)
* ``win@rp/cN``    the same with N carried tokens (``--carries``)
* ``...:OPT+OPT``  options of the ask: ``packed`` / ``spread`` (``reposition``), ``KEY=VALUE`` an ask-time sekv
                   parameter (``budget=0.6``, ``zoom_unit=32``, ``read_zoom_tier=false``: the pack's factors, not its
                   zoom tier), ``cb=X`` (study only) X added to every coarse entry's
                   score (its log of the tokens it stands for): ``cb=2.08`` makes an 8K document's coarse entries weigh
                   what a 64K one's do, ``cb=-100`` hides them
* ``rag``, ``full`` the baselines

Per sekv cell: the rank (0 = first) of the best needle block under the scout's final ranking and under its parts
(the question's summed z-scores alone, minus the profile, lexical), whether the needle's blocks are zoomed (in how
many layers), the answer.  Rows go to ``--out`` (JSON) with the command and the dtype the model ran in.

Two checks of the windowed packs, by each token's position in its ingest window (the H200's misses are needles 16K-31K
into a 32K window, docs/long-documents.md): ``--check-prefill`` (:func:`check_prefill`: each window's KV against one
plain transformers forward of its tokens) and ``--recon`` (:func:`recon`: the pack's rebuilt span keys and values
against the window's prefill KV).

    python -m benchmarks.studies.past_window --length 8192 --window 2048 --depths 0,25,50,75,100 \
        --out docs/bench/past-window-qwen2.5-0.5b.json
"""

from __future__ import annotations

import argparse
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
from sekv_core.sekv import cpu_step, scout

from benchmarks.studies.needles import needle_tokens



class Probe:
    """Records, for one ask, the scout ranking's parts and the blocks each layer kept at the answer's first forward."""

    def __init__(self):
        self.parts: dict[str, torch.Tensor] = {}
        self.keeps: list[torch.Tensor] = []
        self._orig_finish = scout.Ranking.finish_pass
        self._orig_choose = cpu_step.CpuStep._choose

    def __enter__(self):
        probe = self

        def finish(rk, profile, pw, lexical, lw):
            probe.parts = {"question": rk._sum.clone(), "profile": profile.clone(),
                           "lexical": None if lexical is None else lexical.clone(), "pw": pw, "lw": lw}
            return probe._orig_finish(rk, profile, pw, lexical, lw)

        def choose(step, r, layer, query):
            keep, expanded = probe._orig_choose(step, r, layer, query)
            if step.ranking is not None and step.ranking.ranks() and len(probe.keeps) < step.res.shape.n_layers:
                probe.keeps.append(keep.cpu())
            return keep, expanded

        scout.Ranking.finish_pass, cpu_step.CpuStep._choose = finish, choose
        return self

    def __exit__(self, *exc):
        scout.Ranking.finish_pass, cpu_step.CpuStep._choose = self._orig_finish, self._orig_choose


def rank_of(score: torch.Tensor, blocks: torch.Tensor) -> int:
    order = torch.argsort(score, descending=True, stable=True)
    pos = torch.empty_like(order)
    pos[order] = torch.arange(order.numel())
    return int(pos[blocks].min()) if blocks.numel() else -1


def sekv_cell(lm, mem, q_ids, probe_q, needle: tuple[int, int], layout: bool, stop_ids, max_new: int, batched: bool = False,
              coarse_bias: float = 0.0) -> dict:
    """One sekv ask; layout: re-positioned with the question at the model's window - reserve, as past the window."""
    res = mem.res
    n0, n1 = needle
    bs, bl = res.block_start.cpu(), res.block_len.cpu()
    blocks = ((bs < n1) & (bs + bl > n0)).nonzero().flatten()
    reserve = len(q_ids) + max_new
    if layout:
        window = models.context_window(lm.config)
        mem.question_at(window - reserve, window)
    if coarse_bias:
        orig = mem.res.coarse_mask
        mem.res.coarse_mask = lambda expanded: orig(expanded) + coarse_bias
    mem.batched = batched  # the accelerators' step (sekv/gpu_step.py, fixed_set.py), run here on the CPU
    with Probe() as p:
        ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=max_new, stop_ids=stop_ids, question=probe_q.question, graphs=batched)
    answer = lm.tokenizer.decode(ans, skip_special_tokens=True).strip()
    parts = p.parts
    q, prof = parts["question"].float().cpu(), parts["profile"].float().cpu()
    lex = parts["lexical"]
    final = q - parts["pw"] * prof
    ranks = {"question": rank_of(q, blocks), "question-profile": rank_of(final, blocks)}
    if lex is not None and parts["lw"] > 0:
        lz = scout.zscore(lex.float().cpu())
        ranks["lexical"] = rank_of(lz, blocks)
        if float(lex.max()) > 0:
            final = scout.zscore(final) + parts["lw"] * lz
    ranks["final"] = rank_of(final, blocks)
    zoomed = [bool(k[:, blocks].any()) for k in p.keeps]
    full_cover = [bool(k[:, blocks].all()) for k in p.keeps]
    kept_tokens = int((p.keeps[0].any(0).long() * bl).sum()) if p.keeps else 0
    stats = mem.step_stats().extra
    return {
        "answer": answer, "correct": bool(scoring.score(answer, probe_q)[0]),
        "n_blocks": res.n_blocks, "n_spans": res.n_spans, "n_full": res.n_full, "needle_blocks": blocks.tolist(),
        "ranks": ranks, "zoomed_layers": sum(zoomed), "all_needle_blocks_layers": sum(full_cover), "kept_tokens": kept_tokens,
        "profile_at_needle": round(float(prof[blocks].max()), 3) if blocks.numel() else None,
        "question_z_at_needle": round(float(q[blocks].max()), 3) if blocks.numel() else None,
        "positions": stats.get("positions"), "window_capped": stats.get("window_capped"),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--length", type=int, default=8192)
    ap.add_argument("--window", type=int, default=2048, help="the ingest window forced on the windowed variants")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--ingest-budget", type=float, default=None, help="the budget the packs are made with (default --budget)")
    ap.add_argument("--cache", default=None, help="a folder where packs are kept (safetensors) and read back by a later run")
    ap.add_argument("--carries", default="", help="extra carried-token counts for win@rp (default carry is windows.CARRY_TOKENS)")
    ap.add_argument("--variants", default="one,one@rp,win,win@rp,rag,full")
    ap.add_argument("--haystack", default="/work/shared/data/haystack/pg_essays")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtype", default=None, help="model dtype (default: models.default_dtype, bfloat16 on CUDA and on a "
                    "CPU with bfloat16 instructions, as this machine's; float32 must be asked for)")
    ap.add_argument("--batched", action="store_true", help="sekv asks through the batched step and its static single-token path")
    ap.add_argument("--param", action="append", default=[], help="sekv parameter KEY=VALUE")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the model, the prefill and the opened memories)")
    ap.add_argument("--recon", action="store_true", help="windowed packs: what they hold against the windows' prefill KV, "
                    "by the tokens' position in their window (recon())")
    ap.add_argument("--check-prefill", action="store_true", help="windowed variants: each window's KV against one plain "
                    "transformers forward (SDPA) of the same tokens, by position in the window (check_prefill())")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device=a.device, dtype=getattr(torch, a.dtype) if a.dtype else None)
    tok = lm.tokenizer
    shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
    stop_ids = prompt.stop_token_ids(tok, getattr(lm.model, "generation_config", None))
    sekv, rag, full = methods.get("sekv"), methods.get("rag"), methods.get("full")
    extra = {k: json.loads(v) if v[:1].isdigit() or v[:1] == "-" or v in ("true", "false") else v for k, v in (x.split("=", 1) for x in a.param)}
    params = sekv.resolve_params({"budget": a.budget, **extra})
    ingest_params = params if a.ingest_budget is None else params.replace(budget=a.ingest_budget)
    variants = a.variants.split(",")
    carries = [int(c) for c in a.carries.split(",") if c]
    variants += [f"win@rp/c{c}" for c in carries]
    essays = tasks.load_haystack(a.haystack)
    rows = []
    out = Path(a.out) if a.out else None
    for seed in (int(s) for s in a.seeds.split(",")):
        for depth in (float(d) for d in a.depths.split(",")):
            t0 = time.perf_counter()
            ctx = tasks.gen_niah(tok, a.length, depth, seed, essays)
            text = prompt.document_prefix(tok, ctx.document)
            ids = prompt.encode(tok, text)
            pq = ctx.probes[0]
            q_ids = prompt.encode(tok, prompt.question_suffix(tok, pq.question))
            needle = needle_tokens(tok, text, ctx.meta["needles"][0])
            header = _header_len(tok, ctx.document)
            row = {"length": a.length, "n_tokens": len(ids), "depth": depth, "seed": seed, "needle": list(needle),
                   "expected": pq.expected, "window": a.window, "cells": {}}
            caps = {"obs_window": sekv.obs_window(ingest_params)}
            cached = _cache_path(a, ingest_params, seed, depth)
            packs = _load(cached)
            kinds = prefill_scores.capture_kinds(sekv.needs_scores)
            text_sc = prefill_scores.text_scores(tok, text, ids, set(sekv.needs_scores) | set(rag.needs_scores))
            one = None
            if any(v.startswith("one") and "one" not in packs or v == "full" for v in variants):
                one = prefill(lm.model, torch.tensor(ids), with_surprisal=True, capture=kinds, **caps)
                one.scores.update(text_sc)
            if one is not None and "one" not in packs:
                packs["one"] = {k: v.cpu() for k, v in sekv.compress(one, ingest_params).items()}
            for carry in sorted({windows.CARRY_TOKENS, *carries}):
                if f"win/c{carry}" in packs or not any(v.startswith("win") and (f"/c{carry}" in v or (carry == windows.CARRY_TOKENS and "/c" not in v)) for v in variants):
                    continue
                reserve = min(512, a.window // 4)
                plan = windows.plan(len(ids), header, a.window - reserve, carry)
                pres = []
                for w in plan:
                    r = prefill_window(lm.model, ids, header, w, with_surprisal=True, capture=kinds, **caps)
                    r.scores.update(text_sc)
                    pres.append(r)
                packs[f"win/c{carry}"] = {k: v.cpu() for k, v in sekv.compress_windows(iter(pres), ingest_params).items()}
                row.setdefault("windows", {})[carry] = [[w.start, w.end] for w in plan]
                if a.check_prefill:
                    row.setdefault("prefill_check", {})[carry] = check_prefill(lm, ids, header, plan, pres, max(64, a.window // 8))
                    print(f"{a.length} d{depth:g} s{seed} windowed prefill vs plain transformers: {row['prefill_check'][carry]}", flush=True)
                if a.recon:
                    row.setdefault("recon", {})[carry] = recon(sekv, packs[f"win/c{carry}"], pres, plan, ingest_params, shape, a.device, max(64, a.window // 8))
                    print(f"{a.length} d{depth:g} s{seed} pack vs prefill by local position: {row['recon'][carry]}", flush=True)
                del pres
            _save(cached, packs)
            for v in variants:
                if v in ("rag", "full"):
                    if v == "full":
                        mem = full.open(DictStore({k: x.cpu() for k, x in full.compress(one, full.resolve_params({})).items()}),
                                        full.resolve_params({}), shape, a.device)
                    else:
                        rp = rag.resolve_params({"budget": a.budget})
                        made = rag.compress(PrefillResult.without_kv(torch.tensor(ids), shape, text_sc, lm), rp)
                        mem = rag.open(DictStore({k: x.cpu() for k, x in made.items()}), rp, shape, a.device)
                    ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=pq.max_new_tokens, stop_ids=stop_ids, question=pq.question)
                    answer = tok.decode(ans, skip_special_tokens=True).strip()
                    row["cells"][v] = {"answer": answer, "correct": bool(scoring.score(answer, pq)[0])}
                else:
                    v_, _, how = v.partition(":")  # the ask's options (module docstring)
                    kind, _, rest = v_.partition("@")
                    carry = int(rest.split("/c")[1]) if "/c" in rest else windows.CARRY_TOKENS
                    key = "one" if kind == "one" else f"win/c{carry}"
                    p_v, cb = params, 0.0
                    for opt in filter(None, how.split("+")):
                        k_, eq, val = opt.partition("=")
                        if not eq:
                            p_v = p_v.replace(reposition=k_)
                        elif k_ == "cb":
                            cb = float(val)
                        else:
                            p_v = p_v.replace(**{k_: type(getattr(p_v, k_))(json.loads(val) if val[:1].isdigit() or val[:1] == "-" or val in ("true", "false") else val)})
                    mem = sekv.open(DictStore(dict(packs[key])), p_v, shape, a.device)
                    row["cells"][v] = sekv_cell(lm, mem, q_ids, pq, needle, rest.startswith("rp"), stop_ids, pq.max_new_tokens, a.batched, cb)
                c = row["cells"][v]
                print(f"{a.length} d{depth:g} s{seed} {v:12s} {'Y' if c['correct'] else 'n'} {c['answer'][:28]!r:32s}"
                      + (f" ranks {c['ranks']} zoomed {c['zoomed_layers']}/{shape.n_layers} prof {c['profile_at_needle']} q {c['question_z_at_needle']}"
                         if "ranks" in c else ""), flush=True)
            row["seconds"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            if out:
                out.write_text(json.dumps({"command": "python -m benchmarks.studies.past_window " + " ".join(sys.argv[1:]),
                                           "model": a.model, "dtype": str(shape.dtype).removeprefix("torch."), "device": a.device,
                                           "budget": a.budget, "params": a.param, "rows": rows}, indent=1))
    for v in variants:
        print(f"{v:12s} found {sum(r['cells'][v]['correct'] for r in rows)}/{len(rows)}")


def recon(method, pack: dict, pres: list, plan: list, params, shape: ModelShape, device, bucket: int = 4096) -> dict:
    """What a windowed pack holds against the KV its windows' prefills made, by each token's position in its window
    (``bucket`` positions a row): the mean relative error |rebuilt - prefill| / |prefill| (per token and KV head, then
    averaged over heads and layers) of the span tokens' keys (pre-RoPE: the prefill's keys de-rotated at their document
    position in float64) and values rebuilt from the decoded factors, their mean rank, and the worst relative error of
    the full-resolution tokens' keys (as stored, post-RoPE).  Any window whose late tokens the pack holds worse than its
    early ones shows as a row that grows."""
    from sekv_core.sekv import factorize as fz

    res = method.open(DictStore(dict(pack)), params, shape, device).res
    d, hkv, L = shape.head_dim, shape.n_kv_heads, shape.n_layers
    start, length = res.span_start.long(), res.span_len.long()
    tok = torch.repeat_interleave(start, length) + (torch.arange(int(length.sum())) - torch.repeat_interleave(torch.cumsum(length, 0) - length, length))
    w_start = torch.tensor([w.start for w in plan])
    w_off = torch.tensor([w.offset for w in plan])
    local = tok - w_off[torch.searchsorted(w_start, tok, right=True) - 1]
    b = local // bucket
    nb = int(b.max()) + 1 if b.numel() else 0
    span_b = (res.span_start.long() - w_off[torch.searchsorted(w_start, res.span_start.long(), right=True) - 1]) // bucket
    ang = tok.double().view(-1, 1) * res.inv_freq.double().cpu().view(1, -1)
    cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
    err = {"k": torch.zeros(nb, dtype=torch.float64), "v": torch.zeros(nb, dtype=torch.float64)}
    count = torch.bincount(b, minlength=nb).double().clamp_min(1)
    rank = torch.zeros(nb, dtype=torch.float64)
    full_k = 0.0
    for li in range(L):
        f, _ = res.factors[li]
        rebuilt = fz.reconstruct_all(f, length, d).double()  # [2 Hkv, T, d]: K heads, then V heads
        k = torch.cat([p.keys[li].cpu() for p in pres], 1).double()[:, tok]  # the windows' own parts, in document order
        v = torch.cat([p.values[li].cpu() for p in pres], 1).double()[:, tok]
        k_pre = k * cos + torch.cat([k[..., d // 2 :], -k[..., : d // 2]], -1) * sin  # RoPE undone at the document position
        for kind, ref, got in (("k", k_pre, rebuilt[:hkv]), ("v", v, rebuilt[hkv:])):
            e = ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).mean(0)  # [T]
            err[kind] += torch.zeros(nb, dtype=torch.float64).index_add_(0, b, e) / count / L
        r = f.rank.double()[:hkv].mean(0)  # key ranks per span
        rank += torch.zeros(nb, dtype=torch.float64).index_add_(0, span_b, r) / torch.bincount(span_b, minlength=nb).double().clamp_min(1) / L
        fk = pack[f"sekv.full.k.{li}"].double()
        kf = torch.cat([p.keys[li].cpu() for p in pres], 1).double()[:, res.full_pos]
        full_k = max(full_k, float(((fk - kf).norm(dim=-1) / kf.norm(dim=-1).clamp_min(1e-6)).max()))
    return {"bucket": bucket, "k_err": [round(float(x), 4) for x in err["k"]], "v_err": [round(float(x), 4) for x in err["v"]],
            "k_rank": [round(float(x), 2) for x in rank], "tokens": torch.bincount(b, minlength=nb).tolist(), "full_k_err_max": round(full_k, 4)}


def check_prefill(lm, ids: list[int], header: int, plan: list, pres: list, bucket: int = 4096) -> dict:
    """Each window's KV as sekv's prefill made it (chunks over a growing cache; on CUDA the fused kernels' lower-right
    causal mask) against one plain transformers forward of the window's tokens (SDPA, its own causal mask), moved to
    the window's document positions as prefill_window moves them: the mean relative error |sekv - plain| / |plain|
    (per token and KV head, averaged over heads and layers) of keys and values by position in the window
    (``bucket`` positions a row)."""
    from sekv_core.sekv import rope

    model = lm.model
    dev = next(model.parameters()).device
    old = model.config._attn_implementation
    inv = rope.inv_freq_of(pres[0].shape)
    L = pres[0].shape.n_layers
    sums = {"k": {}, "v": {}}
    counts: dict[int, int] = {}
    try:
        model.set_attn_implementation("sdpa")
        for w, p in zip(plan, pres):
            local = torch.tensor(w.local_ids(ids, header), device=dev).view(1, -1)
            drop = local.shape[1] - w.n
            with torch.inference_mode():
                cache = model.get_decoder()(input_ids=local, use_cache=True).past_key_values
            b = (torch.arange(w.n) + drop) // bucket
            for i in b.unique().tolist():
                counts[i] = counts.get(i, 0) + int((b == i).sum())
            for li in range(L):
                layer = cache.layers[li] if hasattr(cache, "layers") else None
                hk = (layer.keys if layer is not None else cache.key_cache[li])[0, :, drop:]
                hv = (layer.values if layer is not None else cache.value_cache[li])[0, :, drop:]
                hk = windows.shift(hk, w.offset, inv) if w.offset else hk
                for kind, ref, got in (("k", hk, p.keys[li]), ("v", hv, p.values[li])):
                    ref, got = ref.double().cpu(), got.double().cpu()
                    e = ((got - ref).norm(dim=-1) / ref.norm(dim=-1).clamp_min(1e-6)).mean(0)
                    tot = torch.zeros(int(b.max()) + 1, dtype=torch.float64).index_add_(0, b, e)
                    for i in b.unique().tolist():
                        sums[kind][i] = sums[kind].get(i, 0.0) + float(tot[i]) / L
            del cache
    finally:
        model.set_attn_implementation(old)
    rows = sorted(counts)
    return {"bucket": bucket, "k_err": [round(sums["k"][i] / counts[i], 4) for i in rows],
            "v_err": [round(sums["v"][i] / counts[i], 4) for i in rows], "tokens": [counts[i] for i in rows]}


def _cache_path(a, params, seed: int, depth: float) -> Path | None:
    if not a.cache:
        return None
    tag = f"{a.model}-{a.dtype or 'default'}-{a.length}-w{a.window}-b{params.budget:g}-d{depth:g}-s{seed}"
    return Path(a.cache) / f"{tag}.safetensors"


def _load(path: Path | None) -> dict:
    """Packs kept by an earlier run: {"one": {...}, "win/c256": {...}}."""
    if path is None or not path.exists():
        return {}
    from safetensors.torch import load_file

    packs: dict = {}
    for name, t in load_file(str(path)).items():
        key, _, tensor = name.partition("|")
        packs.setdefault(key, {})[tensor] = t
    return packs


def _save(path: Path | None, packs: dict) -> None:
    if path is None or not packs:
        return
    from safetensors.torch import save_file

    path.parent.mkdir(parents=True, exist_ok=True)
    save_file({f"{key}|{n}": t.contiguous() for key, p in packs.items() for n, t in p.items()}, str(path))


def _header_len(tok, document: str) -> int:
    """Tokens of the prompt before the document's text (every window's opening), as ingest computes it."""
    from sekv_core.documents import Document, PageSpan
    from sekv_core.ingest import _tokenize

    class _LM:  # _tokenize reads only the tokenizer
        tokenizer = tok

    doc = Document(None, "niah", "txt", document, "", (PageSpan(1, 0, len(document)),))
    return _tokenize(_LM, doc)[2]


if __name__ == "__main__":
    main()
