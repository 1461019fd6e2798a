"""How should the scout rank zoom blocks?  Ranks of the answer's block under alternative scout rules.

For each context (the sample documents' questions, NIAH needles) the document is prefilled and
compressed as `sekv ingest --method sekv` does, with the given parameters (e.g. zoom_unit=16).  The
question's scout pass runs once over the memory (CPU reference step); at each layer it records the
attention mass of every zoom block for every (query head, question token), from the factors (what the
product sees) and from the exact keys of the prefill (a teacher), and reduces them several ways:

* ``max``        max over query heads and question tokens (the scout's rule, sekv/scout.py)
* ``content``    the same over the question's own tokens only (not the chat template's)
* ``mean_head``  mean over query heads of the max over question tokens
* ``last``       max over query heads at the last question token (the one that writes the answer's first token)

Per rule, per-layer z-scores are summed over layers, and the document profile (the pack's, for its
zoom unit) is subtracted with weights 0 / 0.25 / 0.5 / 0.75.  Printed: the rank (0 = first) of the best
answer block under each, and how many contexts put it within the blocks the cap keeps.

    python -m benchmarks.studies.rank_study --param zoom_unit=16 --out docs/bench/rank-study-u16-qwen2.5-0.5b.json
"""

from __future__ import annotations

import argparse
import json
import re
import time
from pathlib import Path

import torch

from sekv_core import methods, models, prompt
from sekv_core.bench import tasks
from sekv_core.methods.base import DictStore, ModelShape
from sekv_core.methods import scores
from sekv_core.prefill import prefill
from sekv_core.sekv import lexical, scout
from sekv_core import runtime

from benchmarks.studies.needles import needle_tokens

RULES = ("max", "content", "mean_head", "last")
WEIGHTS = (0.0, 0.25, 0.5, 0.75)
LAMBDAS = (1.0, 2.0, 4.0)


def contexts(tok, a):
    out = []
    if "qa" in a.tasks:
        for c in tasks.gen_qa(tok, 0):
            text = prompt.document_prefix(tok, c.document)
            for p in c.probes:
                hit = next((x for x in p.expected if re.search(re.escape(x), text, re.IGNORECASE)), None)
                c0 = re.search(re.escape(hit), text, re.IGNORECASE).start()
                out.append((f"qa:{p.item}", text, p.question, needle_tokens(tok, text, text[c0 : c0 + len(hit)])))
    essays = tasks.load_haystack(None)
    for spec in a.niah:
        length, seed = (int(x) for x in spec.split(":"))
        for depth in (0, 25, 50, 75, 100):
            c = tasks.gen_niah(tok, length, depth, seed, essays)
            text = prompt.document_prefix(tok, c.document)
            out.append((f"niah:{length}:{seed}:{depth}", text, c.probes[0].question, needle_tokens(tok, text, c.meta["needles"][0])))
    return out


def reduce_rules(p: torch.Tensor, content: torch.Tensor) -> dict[str, torch.Tensor]:
    """p [Hkv, B, G, T] masses -> per rule [B]."""
    hkv, b, g, t = p.shape
    heads = p.permute(1, 0, 2, 3).reshape(b, hkv * g, t)  # [B, H, T]
    return {
        "max": heads.amax(dim=(1, 2)),
        "content": heads[:, :, content].amax(dim=(1, 2)),
        "mean_head": heads.amax(dim=2).mean(dim=1),
        "last": heads[:, :, -1].amax(dim=1),
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--param", action="append", default=[])
    ap.add_argument("--tasks", default="qa")
    ap.add_argument("--niah", default="4096:0", help="comma-separated LENGTH:SEED NIAH grids (5 depths each); '' for none")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    a.niah = [x for x in a.niah.split(",") if x]
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device="cpu")
    model, tok = lm.model, lm.tokenizer
    shape = ModelShape.of(lm.config, next(model.parameters()).dtype)
    sekv = methods.get("sekv")
    extra = {k: json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v for k, v in (x.split("=", 1) for x in a.param)}
    params = sekv.resolve_params({"budget": a.budget, **extra})
    rows = []
    for name, text, question, (n0, n1) in contexts(tok, a):
        t0 = time.perf_counter()
        ids = torch.tensor(prompt.encode(tok, text))
        pre = prefill(model, ids, with_surprisal=True, capture=scores.capture_kinds(sekv.needs_scores), obs_window=sekv.obs_window(params))
        pre.scores.update(scores.text_scores(tok, text, ids.tolist(), sekv.needs_scores))
        tensors = {k: v.cpu() for k, v in sekv.compress(pre, params).items()}
        mem = sekv.open(DictStore(tensors), params, shape, "cpu")
        B = mem.res.n_blocks
        blocks = ((mem.res.block_start < n1) & (mem.res.block_start + mem.res.block_len > n0)).nonzero().flatten()
        block_of = torch.full((ids.numel(),), -1, dtype=torch.long)
        for b in range(B):
            block_of[mem.res.block_start[b] : mem.res.block_start[b] + mem.res.block_len[b]] = b
        suffix = prompt.question_suffix(tok, question)
        enc = tok(suffix, add_special_tokens=False, return_offsets_mapping=True)
        q0 = suffix.index(question)
        content = torch.tensor([a_ < q0 + len(question) and b_ > q0 for a_, b_ in enc["offset_mapping"]])
        qids = enc["input_ids"]
        T = len(qids)
        per = {("fac", r): [] for r in RULES} | {("exact", r): [] for r in RULES}
        orig_mass = scout.layer_mass
        cap = {}

        def layer_mass(span_lse, span_group, span_id, other_lse, n):
            hkv, m = other_lse.shape
            pg = torch.full((hkv, n, m), float("-inf"), dtype=span_lse.dtype)
            pg[span_group, span_id] = span_lse
            total = torch.logsumexp(torch.cat([pg, other_lse.unsqueeze(1)], 1), 1)
            cap["p"] = torch.exp(pg - total.unsqueeze(1)).view(hkv, n, -1, T)
            return orig_mass(span_lse, span_group, span_id, other_lse, n)

        inner = mem._scout_layer

        def spy(layer, query, scaling):
            inner(layer, query, scaling)
            for r, v in reduce_rules(cap["p"], content).items():
                per[("fac", r)].append(v)
            # the teacher: exact post-RoPE keys of the document, the softmax over the document's tokens
            k = pre.keys[layer].float()  # [Hkv, N, d]
            hkv, d = k.shape[0], k.shape[-1]
            q = query[0].float().reshape(hkv, -1, d)
            pr = torch.softmax(torch.bmm(q, k.transpose(1, 2)) * scaling, -1)  # [Hkv, G*T, N]
            inside = block_of >= 0
            m = torch.zeros(hkv, q.shape[1], B).index_add_(2, block_of[inside], pr[:, :, inside])
            for r, v in reduce_rules(m.permute(0, 2, 1).reshape(hkv, B, -1, T), content).items():
                per[("exact", r)].append(v)

        scout.layer_mass, mem._scout_layer = layer_mass, spy
        try:
            mem._begin_forward(T)  # sizes the scout's chunks like an ask
            mem.prepare_question(lambda: runtime.forward_hidden(model, torch.tensor([qids]), mem.n_tokens(), mem))
        finally:
            scout.layer_mass = orig_mass
        prof = mem.res.scout_profile if mem.res.scout_profile is not None else torch.zeros(B)
        lex = lexical.Lexicon(lexical.document_terms(tok, text), mem.res.block_start, mem.res.block_len)
        lz = scout.zscore(lex.scores(question))
        kept = int(mem.step.cap // (shape.n_kv_heads * mem.res.entry_bytes)) if mem.step.cap else 0  # tokens per group and layer
        ranks = {}
        variants = {}
        for (src, r), vs in per.items():
            zsum = sum(scout.zscore(v) for v in vs)
            for w in WEIGHTS:
                variants[f"{src}/{r}/w{w}"] = zsum - w * prof
                if r == "max":
                    for lam in LAMBDAS:
                        variants[f"{src}/{r}/w{w}+lex{lam}"] = scout.zscore(zsum - w * prof) + lam * lz
        variants["lex"] = lz
        for key, score in variants.items():
            order = torch.argsort(score, descending=True)
            pos = torch.empty(B, dtype=torch.long)
            pos[order] = torch.arange(B)
            best = int(pos[blocks].min()) if blocks.numel() else -1
            # tokens of the blocks ranked before the best answer block: does it fit the cap's tokens?
            before = int(mem.res.block_len[order[:best]].sum()) if best >= 0 else -1
            ranks[key] = (best, before)
        row = {"context": name, "blocks": B, "answer_blocks": blocks.tolist(), "cap_tokens": kept, "ranks": ranks}
        rows.append(row)
        print(f"{name}: {B} blocks, cap {kept} tok, {time.perf_counter() - t0:.0f} s  "
              + " ".join(f"{k}={v[0]}" for k, v in ranks.items() if k in ("fac/max/w0.75", "lex", "fac/max/w0.75+lex1.0", "fac/max/w0.0+lex1.0")), flush=True)
    print("\nanswer block within the cap (tokens ranked before it + its own < cap):")
    for key in rows[0]["ranks"]:
        ok = [r["ranks"][key][1] >= 0 and r["ranks"][key][1] + 16 <= r["cap_tokens"] for r in rows]
        qa = sum(o for o, r in zip(ok, rows) if r["context"].startswith("qa"))
        nh = sum(o for o, r in zip(ok, rows) if r["context"].startswith("niah"))
        print(f"  {key:28s} qa {qa}/{sum(r['context'].startswith('qa') for r in rows)}  niah {nh}/{sum(r['context'].startswith('niah') for r in rows)}")
    if a.out:
        Path(a.out).write_text(json.dumps({"budget": a.budget, "params": a.param, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
