"""Why `sekv` loses the sample documents' questions at a 10 % budget: ranking, or room?

For each document of `sekv bench qa` (sample_docs/QUESTIONS.md) the document is prefilled once and
compressed as `sekv ingest --method sekv --budget B` does.  Per question, on the CPU reference step:

* ``scout``      the normal ask (scout routing, the default);
* ``forced``     the same, with the span(s) holding the expected answer put first in the scout's
                 ranking (an oracle: is the ranking what fails?);
* ``zoom_all``   every span rebuilt, no budget: is the SVD memory good enough?

and where the answer's span stood in the scout's ranking, and how many spans each KV group could
keep under the cap.

    python -m benchmarks.studies.qa_diagnosis --budget 0.1 --out docs/bench/qa-diagnosis-qwen2.5-0.5b.json
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
from sekv_core.documents import load_document
from sekv_core.generate import generate
from sekv_core.methods.base import DictStore, ModelShape
from sekv_core.methods import scores
from sekv_core.prefill import prefill

from benchmarks.studies.needles import needle_tokens


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--param", action="append", default=[], help="sekv parameter override KEY=VALUE (e.g. factor_bits=8), repeatable")
    ap.add_argument("--out", default=None)
    ap.add_argument("--modes", default="scout,forced,zoom_all", help="comma-separated subset of scout,forced,zoom_all")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device="cpu")
    model, tok = lm.model, lm.tokenizer
    shape = ModelShape.of(lm.config, next(model.parameters()).dtype)
    stop = prompt.stop_token_ids(tok, model.generation_config)
    sekv = methods.get("sekv")
    d = tasks.sample_docs_dir()
    by_doc: dict[str, list] = {}
    for doc, n, q, answers in tasks.parse_questions((d / "QUESTIONS.md").read_text(encoding="utf-8")):
        by_doc.setdefault(doc, []).append((n, q, answers))
    rows = []
    for doc, qs in by_doc.items():
        t0 = time.perf_counter()
        text = prompt.document_prefix(tok, load_document(d / doc).text)
        ids = torch.tensor(prompt.encode(tok, text))
        extra = {k: json.loads(v) if v[:1].isdigit() or v in ("true", "false") else v for k, v in (x.split("=", 1) for x in a.param)}
        params = sekv.resolve_params({"budget": a.budget, **extra})
        # as `sekv ingest` prefills (sekv_core/ingest.py): the document end's queries give the scout's profile
        pre = prefill(model, ids, with_surprisal=True, capture=scores.capture_kinds(sekv.needs_scores), obs_window=sekv.obs_window(params))
        pre.scores.update(scores.text_scores(tok, text, ids.tolist(), sekv.needs_scores))
        tensors = {k: v.cpu() for k, v in sekv.compress(pre, params).items()}
        pack_ratio = sum(v.numel() * v.element_size() for v in tensors.values()) / (ids.numel() * shape.kv_bytes_per_token())
        mem = sekv.open(DictStore(tensors), params, shape, "cpu")
        all_mem = sekv.open(DictStore(tensors), sekv.resolve_params({"budget": a.budget, **extra, "zoom": "all"}), shape, "cpu")
        base = mem.n_tokens()
        print(f"{doc}: {ids.numel()} tokens, {mem.res.n_spans} spans, prefill+compress {time.perf_counter() - t0:.0f} s, pack tensors / raw KV {pack_ratio:.4f}", flush=True)
        for n, q, answers in qs:
            hit = next((x for x in answers if re.search(re.escape(x), text, re.IGNORECASE)), None)
            spans, blocks = [], []
            if hit is not None:
                c0 = re.search(re.escape(hit), text, re.IGNORECASE).start()
                n0, n1 = needle_tokens(tok, text, text[c0 : c0 + len(hit)])
                spans = ((mem.res.span_start < n1) & (mem.res.span_end > n0)).nonzero().flatten().tolist()
                # the zoom blocks holding the answer (= its spans when zoom_unit is 0)
                blocks = ((mem.res.block_start < n1) & (mem.res.block_start + mem.res.block_len > n0)).nonzero().flatten().tolist()
            qids = prompt.encode(tok, prompt.question_suffix(tok, q))
            ranks, kept = {}, {}
            orig = mem.prepare_question

            def ask(memory, force: bool = False) -> str:
                def prep(forward, question=None):
                    orig(forward, question)
                    ranks["rank"] = [int((memory.ranking.prio > memory.ranking.prio[i]).sum()) for i in blocks]
                    if force and blocks:
                        memory.ranking.prio[blocks] = 1e4

                if memory is mem:
                    memory.prepare_question = prep
                out, _ = generate(model, memory, qids, max_new_tokens=32, stop_ids=stop, question=q)
                if memory is mem:
                    held = [h for h in memory.step.held if h is not None]
                    kept["per_group"] = round(sum(int(h[0].sum()) for h in held) / max(1, len(held) * shape.n_kv_heads), 2)  # zoom blocks
                    kept["tokens_per_group"] = round(sum(int((h[0].long() * memory.res.block_len).sum()) for h in held) / max(1, len(held) * shape.n_kv_heads), 1)
                    kept["answer_kept"] = bool(blocks) and all(bool(h[0][:, blocks].all()) for h in held) if held else False
                    memory.prepare_question = orig
                memory.truncate(base)
                return tok.decode(out, skip_special_tokens=True).strip()

            modes = a.modes.split(",")
            ans = {}
            if "scout" in modes:
                ans["scout"] = ask(mem)
            scout_rank, scout_kept = ranks.get("rank"), dict(kept)
            if "forced" in modes:
                ans["forced"] = ask(mem, force=True)
            if "zoom_all" in modes:
                ans["zoom_all"] = ask(all_mem)

            def ok(s: str) -> bool:
                return any(re.search(r"\b" + re.escape(x) + r"\b", s, re.IGNORECASE) for x in answers)

            row = {"doc": doc, "q": n, "question": q, "expected": answers, "answer_spans": spans, "answer_blocks": blocks,
                   "answer_span_tokens": [int(mem.res.span_len[i]) for i in spans], "scout_rank": scout_rank,
                   "spans_kept_per_group": scout_kept.get("per_group"), "tokens_kept_per_group": scout_kept.get("tokens_per_group"), "answer_kept_every_layer": scout_kept.get("answer_kept"),
                   "answers": ans, "correct": {k: ok(v) for k, v in ans.items()}}
            rows.append(row)
            print(json.dumps(row, ensure_ascii=False), flush=True)
            print(f"  -> {doc[:10]} Q{n}: " + " | ".join(f"{k}: {'OK' if row['correct'][k] else 'x'} {v!r}" for k, v in ans.items()), flush=True)
    print("\ncorrect: " + ", ".join(f"{k} {sum(r['correct'][k] for r in rows)}/{len(rows)}" for k in ("scout", "forced", "zoom_all") if k in rows[0]["correct"]))
    if a.out:
        Path(a.out).write_text(json.dumps({"budget": a.budget, "model": a.model, "params": a.param, "rows": rows}, indent=1, ensure_ascii=False))


if __name__ == "__main__":
    main()
