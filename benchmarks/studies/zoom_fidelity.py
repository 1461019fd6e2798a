"""Why sekv misses needles that full KV finds: retrieval, fidelity and layout, one variable at a time.

On a gpu_cli document (``python -m benchmarks.gpu_cli docs``: docs.json with the magic-number questions), prefilled
once (``--cache``: the prefill's KV, surprisal and profile queries kept as safetensors and read back by a later run),
then compressed per variant (``NAME:key=value,...``, sekv parameters, as mk_fidelity's variants) and each question
asked per budget.  Per ask: the answer, whether it holds the expected number as a whole word (gpu_cli's score), the
rank of the asked needle's best block under the scout's final ranking (0 = first), in how many layers a block of it
is zoomed at the answer's first forward, and the relative error of what a zoomed block holds of the number's tokens
(the factors' rebuild, or the pack's zoom tier where it has one; all layers and KV heads, pre-RoPE keys) against the
prefill's.

The oracles are parameter settings, not code paths of their own:

* fidelity: ``exact:rank_max=64,energy_k=1.0,energy_v=1.0,factors_8bit=false,factor_dtype=float32,svd=svd`` --
  every span's factors at full rank in float32, so a zoomed block is the prefill's K / V up to float32 rounding;
  everything else (segmentation, coarse entries, ranking inputs) as the default pack.
* retrieval: ``budget=1.0`` (ask time) -- every block zoomed, through the variant's factors.
* ``full`` -- the full-KV reference.

    python -m benchmarks.gpu_cli docs --out /tmp/d8 --lengths 8192
    python -m benchmarks.studies.zoom_fidelity --docs /tmp/d8 --doc niah_8192 --variant full --variant base: \\
        --variant exact:rank_max=64,energy_k=1.0,energy_v=1.0,factors_8bit=false,factor_dtype=float32,svd=svd \\
        --budgets 0.1 --cache /tmp/zf --out X.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from sekv_core import ingest, methods, models, prompt
from sekv_core.bench.scoring import contains
from sekv_core.documents import load_document
from sekv_core.generate import generate
from sekv_core.methods import scores as prefill_scores
from sekv_core.methods.base import DictStore, ModelShape, PrefillResult
from sekv_core.prefill import prefill
from sekv_core.sekv import factorize as fz
from sekv_core.sekv import scout

from benchmarks.studies.mk_fidelity import parse_variant
from benchmarks.studies.past_window import Probe, rank_of


def cached_prefill(lm, ids: list[int], kinds, obs_window: int, path: Path | None) -> PrefillResult:
    shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
    if path is not None and path.exists():
        t = load_file(str(path))
        L = shape.n_layers
        r = PrefillResult(torch.tensor(ids), [t[f"k{i}"] for i in range(L)], [t[f"v{i}"] for i in range(L)], t["surprisal"], shape,
                          model_fingerprint=lm.fingerprint, model_id=lm.model_id, model=lm.model)
        if "obs_queries" in kinds:
            r.scores["obs_queries"] = [t[f"q{i}"] for i in range(L)]
        return r
    r = prefill(lm.model, torch.tensor(ids), with_surprisal=True, capture=kinds, obs_window=obs_window)
    if path is not None:
        path.parent.mkdir(parents=True, exist_ok=True)
        out = {"surprisal": r.surprisal.cpu().contiguous()}
        for i, (k, v) in enumerate(zip(r.keys, r.values)):
            out[f"k{i}"], out[f"v{i}"] = k.cpu().contiguous(), v.cpu().contiguous()
        for i, q in enumerate(r.scores.get("obs_queries") or []):
            out[f"q{i}"] = q.cpu().contiguous()
        save_file(out, str(path))
    return r


def needle_error(mem, pre: PrefillResult, n0: int, n1: int) -> tuple[float, float] | None:
    """Relative Frobenius error of the pack's rebuilt K (pre-RoPE) / V of tokens [n0, n1) that sit in spans (all layers
    and KV heads) against the prefill's; None when none of them is in a span (full resolution)."""
    r = mem.res
    ss, sl = r.span_start.cpu().long(), r.span_len.cpu().long()
    toks = [t for t in range(n0, n1) if bool(((ss <= t) & (t < ss + sl)).any())]
    if not toks:
        return None
    d, hkv = r.shape.head_dim, r.shape.n_kv_heads
    ek = nk = ev = nv = 0.0
    for layer in range(r.shape.n_layers):
        f, lay = r.factors[layer]
        for t in toks:
            s = int(((ss <= t) & (t < ss + sl)).nonzero()[0])
            g = torch.arange(2 * hkv)
            if r.zoom_tier is not None:  # what a zoomed block holds: the tier's rows
                _, tk, tv = r.zoom_tier.lookup(layer, torch.arange(hkv), torch.full((hkv,), t), torch.ones(hkv, dtype=torch.bool))
                got = torch.cat([tk.float(), tv.float()])
            else:
                got = fz.expand(fz.gather(f, lay, r.span_len, g, torch.full((2 * hkv,), s), d, row0=torch.full((2 * hkv,), t - int(ss[s])),
                                          rows=torch.ones(2 * hkv, dtype=torch.long)), d, torch.float32)[:, 0]  # [2Hkv, d]
            k_pre = _unrotate(r, pre.keys[layer][:, t].float(), t)
            v = pre.values[layer][:, t].float()
            ek += float((got[:hkv] - k_pre).pow(2).sum()); nk += float(k_pre.pow(2).sum())
            ev += float((got[hkv:] - v).pow(2).sum()); nv += float(v.pow(2).sum())
    return round((ek / nk) ** 0.5, 4), round((ev / nv) ** 0.5, 4)


def _unrotate(r, k: torch.Tensor, t: int) -> torch.Tensor:
    """Post-RoPE key rows [Hkv, d] at position t -> pre-RoPE (RoPE at -t)."""
    rows = k.view(k.shape[0], 1, -1)
    pos = torch.full((k.shape[0], 1), -t, dtype=torch.long)
    return r.rotate(rows, pos).view(k.shape)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", required=True, help="a folder written by `python -m benchmarks.gpu_cli docs`")
    ap.add_argument("--doc", required=True, help="the document's name in docs.json")
    ap.add_argument("--variant", action="append", default=[], help="full, or NAME:key=value,... (sekv parameters)")
    ap.add_argument("--budgets", default="0.1")
    ap.add_argument("--questions", default="", help="indices of the questions to ask (default all)")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cpu", help="cpu or cuda (the model, the prefill, the opened memories: on cuda the "
                    "batched step, whose zoomed layers and number errors are not probed)")
    ap.add_argument("--dtype", default=None, help="model dtype (default models.default_dtype: bfloat16 on this CPU)")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--max-new-tokens", type=int, default=12)
    ap.add_argument("--cache", default=None)
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device=a.device, dtype=getattr(torch, a.dtype) if a.dtype else None)
    tok = lm.tokenizer
    shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
    stop_ids = prompt.stop_token_ids(tok, getattr(lm.model, "generation_config", None))
    docs_dir = Path(a.docs)
    doc = [d for d in json.loads((docs_dir / "docs.json").read_text())["docs"] if d["name"] == a.doc][0]
    qs = doc["questions"] if not a.questions else [doc["questions"][int(i)] for i in a.questions.split(",")]
    sekv, full = methods.get("sekv"), methods.get("full")
    ids, _runs, _header, _parts, text, offsets = ingest._encode(lm, load_document(docs_dir / doc["file"]))
    ids = list(ids)
    kinds = prefill_scores.capture_kinds(sekv.needs_scores)
    t0 = time.perf_counter()
    cache = Path(a.cache) / f"{a.doc}.{a.model}.{str(shape.dtype).removeprefix('torch.')}.safetensors" if a.cache else None
    pre = cached_prefill(lm, ids, kinds, sekv.obs_window(sekv.resolve_params({})), cache)
    print(f"prefill {len(ids)} tokens: {time.perf_counter() - t0:.1f} s ({'cached' if cache and cache.exists() else 'run'})", flush=True)
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    rows = []
    out = Path(a.out) if a.out else None
    for v in a.variant or ["base:"]:
        name, over = ("full", None) if v == "full" else parse_variant(v)
        tc = time.perf_counter()
        if name == "full":
            fp = full.resolve_params({})
            tensors, m = full.compress(pre, fp), full
        else:
            sp = sekv.resolve_params(dict(over or {}))
            needs = sekv.needs(sp)
            pre.scores.update(prefill_scores.text_scores(tok, text, ids, needs, offsets=offsets))
            tensors, m = sekv.compress(pre, sp), sekv
        pack_bytes = sum(x.numel() * x.element_size() for x in tensors.values())
        comp_s = time.perf_counter() - tc
        for b in [float(x) for x in a.budgets.split(",")] if name != "full" else [1.0]:
            for q in qs:
                key = re.search(r"number for (.+?) mentioned", q["question"]).group(1)
                needle = f"The special magic number for {key} is: {q['expected']}"
                c0 = text.index(needle) + needle.index(q["expected"])  # the number's tokens
                c1 = c0 + len(q["expected"])
                hit = [i for i, (x, y) in enumerate(enc) if x < c1 and y > c0]
                s0 = text.index(needle)
                sent = [i for i, (x, y) in enumerate(enc) if x < s0 + len(needle) and y > s0]
                q_ids = prompt.encode(tok, prompt.question_suffix(tok, q["question"]))
                row = {"doc": a.doc, "variant": name, "params": over, "budget": b, "expected": q["expected"], "pack_bytes": pack_bytes,
                       "compress_s": round(comp_s, 1), "needle_tokens": [sent[0], sent[-1] + 1], "number_tokens": [hit[0], hit[-1] + 1]}
                ta = time.perf_counter()
                if name == "full":
                    mem = m.open(DictStore(dict(tensors)), fp, shape, a.device)
                    ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=a.max_new_tokens, stop_ids=stop_ids, question=q["question"])
                else:
                    mem = m.open(DictStore(dict(tensors)), sp.replace(budget=b), shape, a.device)
                    res = mem.res
                    bs, bl = res.block_start.cpu(), res.block_len.cpu()
                    blocks = ((bs < sent[-1] + 1) & (bs + bl > sent[0])).nonzero().flatten()
                    with Probe() as p:
                        ans, _ = generate(lm.model, mem, q_ids, max_new_tokens=a.max_new_tokens, stop_ids=stop_ids, question=q["question"])
                    parts = p.parts or {"question": torch.zeros(res.n_blocks), "profile": torch.zeros(res.n_blocks), "pw": 0.0,
                                        "lexical": None, "lw": 0.0}  # no scout pass seen: ranks read as ties
                    final = parts["question"].float().cpu() - parts["pw"] * parts["profile"].float().cpu()
                    if parts["lexical"] is not None and parts["lw"] > 0 and float(parts["lexical"].max()) > 0:
                        final = scout.zscore(final) + parts["lw"] * scout.zscore(parts["lexical"].float().cpu())
                    row["rank"] = rank_of(final, blocks)
                    row["rank_attention"] = rank_of(parts["question"].float().cpu() - parts["pw"] * parts["profile"].float().cpu(), blocks)
                    row["zoomed_layers"] = sum(bool(k[:, blocks].any()) for k in p.keeps)
                    row["all_needle_blocks_layers"] = sum(bool(k[:, blocks].all()) for k in p.keeps)
                    row["number_full_res"] = sum(int(t) in set(res.full_pos.cpu().tolist()) for t in range(hit[0], hit[-1] + 1))
                    row["number_err_kv"] = needle_error(mem, pre, hit[0], hit[-1] + 1) if a.device == "cpu" else None
                    if a.device != "cpu":
                        row["zoomed_layers"] = row["all_needle_blocks_layers"] = None  # the probe watches the CPU step
                answer = tok.decode(ans, skip_special_tokens=True).strip()
                row.update(answer=answer, correct=contains(answer, q["expected"], whole_word=True), ask_s=round(time.perf_counter() - ta, 1))
                rows.append(row)
                print(json.dumps(row), flush=True)
                if out:
                    out.write_text(json.dumps({"command": "python -m benchmarks.studies.zoom_fidelity " + " ".join(sys.argv[1:]),
                                               "model": a.model, "dtype": str(shape.dtype).removeprefix("torch."), "rows": rows}, indent=1))
        del tensors


if __name__ == "__main__":
    main()
