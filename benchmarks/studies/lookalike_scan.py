"""Where the scout's look-alike rule (sekv/lexical.py ``Lexicon.lookalikes``) fires, and what it marks: the lexical
side only, no model (seconds to a minute).

The document's words as ingest computes them (``lexical.token_terms`` over the tokenizer's offsets), cut into
16-token blocks (the default ``zoom_unit``; a pack's blocks are parts of its spans, so this is close, not exact), the
last 512 tokens full resolution (the end window).

* ``--doc FILE``: qa_long's questions of its manual; per question the blocks marked, how many of the evidence's
  blocks are among them, and the evidence's best block rank by lexical score alone.
* ``--task niah|mn_niah --lengths --depths``: the bench's contexts (seed ``--seed``); per question which needles
  have a marked block within 32 tokens (the asked one first).

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


END_WINDOW = 512


def _cut(tok, text: str, unit: int):
    """(lexicon, block starts, block lengths, token character starts) of a text."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    terms = lexical.token_terms(text, enc["offset_mapping"])
    n = terms.numel()
    end = max(0, n - END_WINDOW)
    starts = torch.arange(0, end, unit)
    lens = torch.clamp(end - starts, max=unit)
    lex = lexical.Lexicon(terms, starts, lens, torch.arange(end, n))
    return lex, starts, lens, torch.tensor([s for s, _ in enc["offset_mapping"]])


def scan_task(tok, a) -> None:
    from sekv_core import prompt

    essays = tasks.load_haystack(a.haystack)
    for length in (int(x) for x in a.lengths.split(",")):
        for depth in (float(x) for x in a.depths.split(",")):
            ctx = tasks.GRID_TASKS[a.task](tok, length, depth, a.seed, essays)
            text = prompt.document_prefix(tok, ctx.document)
            lex, starts, _, offs = _cut(tok, text, a.unit)
            at = [int(torch.searchsorted(offs, torch.tensor(text.index(nd)))) for nd in ctx.meta["needles"]]
            for qi, pq in enumerate(ctx.probes):
                look = lex.lookalikes(pq.question, starts)
                marked = starts[look] if look is not None else starts[:0]
                order = [qi] + [j for j in range(len(at)) if j != qi]
                hit = [bool(((marked - at[j]).abs() <= lexical.REACH).any()) for j in order]
                print(f"{a.task} {length} d{depth:g} {pq.item or '-':12s} marked blocks {int(marked.numel()):3d}  "
                      f"needles marked (asked first) {hit}")


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", default=None, help="qa_long's document (python -m benchmarks.long_doc fetch)")
    ap.add_argument("--task", default=None, choices=["niah", "mn_niah"])
    ap.add_argument("--lengths", default="65536,131072")
    ap.add_argument("--depths", default="0,50,100")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--haystack", default="/work/shared/data/haystack/pg_essays")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="whose tokenizer cuts the document")
    ap.add_argument("--unit", type=int, default=16)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models.model_dir(a.model)))
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
        t0 = int(torch.searchsorted(offs, torch.tensor(q.offset)))
        t1 = int(torch.searchsorted(offs, torch.tensor(q.offset + len(q.evidence))))
        ev = (starts < t1) & (starts + lens > t0)
        sc = lex.scores(q.question)
        rank = int((sc > sc[ev].max()).sum())
        n_look = 0 if look is None else int(look.sum())
        n_ev = 0 if look is None else int(look[ev].sum())
        fired += n_look > 0
        demoted += n_ev > 0
        print(f"Q{q.number:2d}  look-alike blocks {n_look:4d}  evidence blocks marked {n_ev}/{int(ev.sum())}  "
              f"evidence's lexical rank {rank:3d}  | {q.question[:64]}")
    print(f"{n} blocks: the rule fires on {fired} of {len(questions)} questions and marks the evidence of {demoted}")


if __name__ == "__main__":
    main()
