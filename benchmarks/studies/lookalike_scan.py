"""Where the scout's look-alike rule (sekv/lexical.py ``Lexicon.lookalikes``) fires on qa_long's questions, and whether
it would demote a question's evidence: the lexical side only, no model (seconds).

The document's words as ingest computes them (``lexical.token_terms`` over the tokenizer's offsets), cut into
16-token blocks (the default ``zoom_unit``; a pack's blocks are parts of its spans, so this is close, not exact).
Per question: the blocks marked as look-alikes, how many of the evidence's blocks are among them, and the
evidence's best block rank by lexical score alone.

    python -m benchmarks.studies.lookalike_scan --doc long_doc/bash_reference_manual.txt
"""

from __future__ import annotations

import argparse

import torch

from sekv_core import models
from sekv_core.bench import tasks
from sekv_core.documents import load_document
from sekv_core.sekv import lexical


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--doc", required=True, help="qa_long's document (python -m benchmarks.long_doc fetch)")
    ap.add_argument("--model", default="qwen2.5-0.5b", help="whose tokenizer cuts the document")
    ap.add_argument("--unit", type=int, default=16)
    a = ap.parse_args()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(models.model_dir(a.model)))
    text = load_document(a.doc).text
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    terms = lexical.token_terms(text, enc["offset_mapping"])
    n = terms.numel()
    starts = torch.arange(0, n, a.unit)
    lens = torch.clamp(n - starts, max=a.unit)
    lex = lexical.Lexicon(terms, starts, lens)
    offs = torch.tensor([s for s, _ in enc["offset_mapping"]])
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
    print(f"{n} tokens, {starts.numel()} blocks: the rule fires on {fired} of {len(questions)} questions and marks the "
          f"evidence of {demoted}")


if __name__ == "__main__":
    main()
