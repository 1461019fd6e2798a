"""Where the scout's look-alike rule (sekv/lexical.py ``Lexicon.lookalikes``) fires, and what it marks: the lexical
side only, no model (seconds to a minute).

The document's words as ingest computes them (``lexical.token_terms`` over the tokenizer's offsets), cut into
16-token blocks (the default ``zoom_unit``; a pack's blocks are parts of its spans, so this is close, not exact), the
last tokens full resolution as a pack's end window (``min(512, 0.1 x budget x N)``; 512 from 20,480 tokens at 10 %).

* ``--doc FILE``: qa_long's questions of its manual; per question the blocks marked, how many of the evidence's
  blocks are among them, and the evidence's best block rank by lexical score alone.
* ``--task niah|mn_niah --lengths --depths``: the bench's contexts (seed ``--seed``); per question which needles
  have a marked block within 32 tokens (the asked one first), which lie in the end window (resident at full
  resolution: no ranking reaches them), which of those ``Lexicon.resident_lookalikes`` marks, and the z-scored
  lexical score (the scout's, before x ``lexical_weight``) of the asked needle's best block against the best block
  of no needle.
* ``--task qa|qa_heldout``: the sample documents' questions; per question what either rule marks.
* ``--cached FILE...``: the multi-needle study's cached packs (``--cache`` of benchmarks/studies/multi_needle.py: the
  real model's spans and end window); per question the full-resolution pieces ``Lexicon.resident_lookalikes`` marks.

    python -m benchmarks.studies.lookalike_scan --doc long_doc/bash_reference_manual.txt
    python -m benchmarks.studies.lookalike_scan --task mn_niah --lengths 65536,131072 --depths 0,50,100
"""

from __future__ import annotations

import argparse

import torch

from sekv_core import models
from sekv_core.bench import tasks
from sekv_core.documents import load_document
from sekv_core.sekv import lexical


def end_window(n: int, budget: float) -> int:
    """The full-resolution tokens at the document's end a pack of n tokens keeps (sekv/compress.py lengths)."""
    from sekv_core.sekv.compress import lengths
    from sekv_core.sekv.params import SekvParams

    return lengths(n, SekvParams(budget=budget))[2]


def _cut(tok, text: str, unit: int, budget: float = 0.1):
    """(lexicon, block starts, block lengths, token character starts) of a text."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    terms = lexical.token_terms(text, enc["offset_mapping"])
    n = terms.numel()
    end = max(0, n - end_window(n, budget))
    starts = torch.arange(0, end, unit)
    lens = torch.clamp(end - starts, max=unit)
    lex = lexical.Lexicon(terms, starts, lens, torch.arange(end, n))
    return lex, starts, lens, torch.tensor([s for s, _ in enc["offset_mapping"]])


def _z(x: torch.Tensor) -> torch.Tensor:
    """The z-scores the scout ranks by (sekv/scout.py zscore)."""
    from sekv_core.sekv.scout import zscore

    return zscore(x.float())


def scan_task(tok, a) -> None:
    from sekv_core import prompt

    essays = tasks.load_haystack(a.haystack)
    for length in (int(x) for x in a.lengths.split(",")):
        for depth in (float(x) for x in a.depths.split(",")):
            ctx = tasks.GRID_TASKS[a.task](tok, length, depth, a.seed, essays)
            text = prompt.document_prefix(tok, ctx.document)
            lex, starts, _, offs = _cut(tok, text, a.unit, a.budget)
            at = [int(torch.searchsorted(offs, torch.tensor(text.index(nd)))) for nd in ctx.meta["needles"]]
            n = int(offs.numel())
            for qi, pq in enumerate(ctx.probes):
                look = lex.lookalikes(pq.question, starts)
                marked = starts[look] if look is not None else starts[:0]
                res = lex.resident_lookalikes(pq.question, starts)
                pieces = lex.run_start[res] if res is not None else lex.run_start[:0]
                order = [qi] + [j for j in range(len(at)) if j != qi]
                hit = [bool(((marked - at[j]).abs() <= lexical.REACH).any()) for j in order]
                # a needle in the end window: resident at full resolution, out of the ranking's reach
                end = [at[j] >= n - end_window(n, a.budget) for j in order]
                held = [bool(((pieces - at[j]).abs() <= lexical.REACH).any()) for j in order]
                z = _z(lex.scores(pq.question))
                mine = (starts - at[qi]).abs() <= a.unit  # the asked needle's blocks
                other = torch.ones_like(mine)
                for j in range(len(at)):
                    other &= (starts - at[j]).abs() > 2 * a.unit
                zq = f"{float(z[mine].max()):6.1f}" if mine.any() else "   end"
                print(f"{a.task} {length} d{depth:g} {pq.item or '-':12s} marked blocks {int(marked.numel()):3d}  "
                      f"needles marked (asked first) {hit}  in the end window {end}  marked there {held}  "
                      f"lexical z: asked {zq}, best non-needle block {float(z[other].max()):5.1f}")


def scan_qa(tok, a) -> None:
    """The sample documents' questions (within the window): where either rule marks anything."""
    from sekv_core import prompt

    for ctx in tasks.gen_qa(tok, a.seed, tasks.QA_TASKS[a.task], a.task):
        text = prompt.document_prefix(tok, ctx.document)
        lex, starts, _, _ = _cut(tok, text, a.unit, a.budget)
        for pq in ctx.probes:
            look = lex.lookalikes(pq.question, starts)
            res = lex.resident_lookalikes(pq.question, starts)
            print(f"{pq.item:34s} look-alike blocks {0 if look is None else int(look.sum()):3d}  "
                  f"full-resolution pieces {0 if res is None else int(res.sum()):2d}  | {pq.question[:60]}")


def scan_cached(tok, a) -> None:
    """The multi-needle study's cached packs (benchmarks/studies/multi_needle.py --cache: a real model's spans and end
    window, not 16-token cuts): per question the full-resolution pieces ``Lexicon.resident_lookalikes`` marks, their
    tokens, and which needles (the context's order) they cover."""
    from pathlib import Path

    from sekv_core import prompt
    from sekv_core.sekv.segment import zoom_blocks

    from benchmarks.studies.needles import needle_tokens
    from benchmarks.studies.past_window import _load

    essays = tasks.load_haystack(a.haystack)
    for path in a.cached:
        # mn_niah-MODEL-LENGTH-wWINDOW-bBUDGET-dDEPTH-sSEED.safetensors
        parts = Path(path).name.removesuffix(".safetensors").split("-")
        length, depth, seed = int(parts[-5]), float(parts[-2][1:]), int(parts[-1][1:])
        pack = _load(Path(path))["win"]
        _, b0, b1 = zoom_blocks(pack["sekv.span_start"].long(), pack["sekv.span_end"].long(), a.unit)
        starts = b0.long()
        lex = lexical.Lexicon(pack["sekv.lex.terms"], starts, (b1 - b0).long(), pack["sekv.full_idx"].long())
        ctx = tasks.GRID_TASKS["mn_niah"](tok, length, depth, seed, essays)
        text = prompt.document_prefix(tok, ctx.document)
        at = [needle_tokens(tok, text, nd) for nd in ctx.meta["needles"]]
        for pq in ctx.probes:
            res = lex.resident_lookalikes(pq.question, starts)
            pieces = [] if res is None else [(s, s + n) for s, n in zip(lex.run_start[res].tolist(), lex.run_len[res].tolist())]
            cover = [any(n0 < e and s < n1 for s, e in pieces) for n0, n1 in at]
            print(f"mn_niah {length} d{depth:g} s{seed} {pq.item:12s} full-resolution pieces marked {len(pieces)} "
                  f"({sum(e - s for s, e in pieces)} tokens)  needles in them {cover}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", default=None, help="qa_long's document (python -m benchmarks.long_doc fetch)")
    ap.add_argument("--task", default=None, choices=["niah", "mn_niah", *tasks.QA_TASKS])
    ap.add_argument("--lengths", default="65536,131072")
    ap.add_argument("--depths", default="0,50,100")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--haystack", default="/work/shared/data/haystack/pg_essays")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="whose tokenizer cuts the document")
    ap.add_argument("--unit", type=int, default=16)
    ap.add_argument("--cached", nargs="*", default=None, help="the multi-needle study's cached packs (its --cache files)")
    ap.add_argument("--budget", type=float, default=0.1, help="sizes the end window as a pack's (sekv/compress.py lengths)")
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models.model_dir(a.model)))
    if a.cached:
        scan_cached(tok, a)
        return
    if a.task in tasks.QA_TASKS:
        scan_qa(tok, a)
        return
    if a.task:
        scan_task(tok, a)
        return
    if not a.doc:
        ap.error("give --doc FILE (qa_long's manual) or --task")
    lex, starts, lens, offs = _cut(tok, load_document(a.doc).text, a.unit)
    n = int(starts.numel())
    fired = demoted = 0
    questions = tasks.parse_long_questions(tasks.long_questions_file().read_text(encoding="utf-8"))
    for q in questions:
        look = lex.lookalikes(q.question, starts)
        res = lex.resident_lookalikes(q.question, starts)
        t0 = int(torch.searchsorted(offs, torch.tensor(q.offset)))
        t1 = int(torch.searchsorted(offs, torch.tensor(q.offset + len(q.evidence))))
        ev = (starts < t1) & (starts + lens > t0)
        sc = lex.scores(q.question)
        rank = int((sc > sc[ev].max()).sum())
        n_look = 0 if look is None else int(look.sum())
        n_ev = 0 if look is None else int(look[ev].sum())
        fired += n_look > 0
        demoted += n_ev > 0
        n_res = 0 if res is None else int(res.sum())
        print(f"Q{q.number:2d}  look-alike blocks {n_look:4d}  full-resolution pieces {n_res}  evidence blocks marked {n_ev}/{int(ev.sum())}  "
              f"evidence's lexical rank {rank:3d}  | {q.question[:64]}")
    print(f"{n} blocks: the rule fires on {fired} of {len(questions)} questions and marks the evidence of {demoted}")


if __name__ == "__main__":
    main()
