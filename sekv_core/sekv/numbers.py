"""Number tokens kept exact: which document tokens ingest keeps at full resolution because they carry digits.

A model reading a number copies it digit by digit from the keys and values of the number's tokens, and a near-miss
of one of them is a wrong answer ('6570127' for 6560127).  When several near-identical numbered sentences are zoomed
together (four "The special magic number for KEY is: NNNNNNN." needles), the lossy factors leave the model almost no
margin between them (docs/benchmarks.md, "Why sekv misreads multi-key numbers").  So segmentation takes the number
tokens out of their spans and keeps their K/V exact, like the anchors (sekv/segment.py keep_exact).

The rule, at the tokenizer's level: a token is a *number token* when its decoded text contains a decimal digit
(``str.isdecimal`` of any character, so not "²"; Qwen2.5 and SmolLM2 split numbers into one token a digit).  A *number* is a run
of consecutive number tokens.  They count against the budget as every full-resolution token does (the ledger's
persistent part, sekv/budget.py), and at most ``number_share`` of the budget's tokens (``number_share x b x N``)
go to them: the longest numbers first (codes and long numbers, where one wrong digit is a wrong answer; a
document's years and small counts after them), whole numbers only, ties in document order.
"""

from __future__ import annotations

import math

import torch


def number_flags(token_text: list[str]) -> torch.Tensor:
    """[N] bool: the tokens whose text contains a decimal digit."""
    return torch.tensor([any(c.isdecimal() for c in t) for t in token_text], dtype=torch.bool)


def number_runs(flags: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(start, end) of every run of consecutive flagged positions, in document order."""
    f = flags.to(torch.int8)
    edge = torch.diff(torch.cat([torch.zeros(1, dtype=torch.int8), f, torch.zeros(1, dtype=torch.int8)]))
    return torch.nonzero(edge == 1).flatten(), torch.nonzero(edge == -1).flatten()


def exact_positions(flags: torch.Tensor, cap: int, lo: int = 0, hi: int | None = None) -> torch.Tensor:
    """Sorted positions of the numbers kept exact within [lo, hi): whole runs of ``flags``, the longest first (ties
    in document order), while their tokens total at most ``cap``.  A run crossing lo or hi counts its part inside."""
    hi = flags.numel() if hi is None else hi
    inside = torch.zeros_like(flags)
    inside[lo:hi] = flags[lo:hi]
    start, end = number_runs(inside)
    if cap <= 0 or start.numel() == 0:
        return torch.empty(0, dtype=torch.long)
    n = end - start
    order = sorted(range(n.numel()), key=lambda i: (-int(n[i]), int(start[i])))
    kept, total = [], 0
    for i in order:
        if total + int(n[i]) <= cap:
            kept.append(torch.arange(int(start[i]), int(end[i])))
            total += int(n[i])
    return torch.sort(torch.cat(kept)).values if kept else torch.empty(0, dtype=torch.long)


def number_cap(share: float, budget: float, n_tokens: int) -> int:
    """Tokens the numbers of an n_tokens document (or window) may take at budget fraction b: share x b x N."""
    return int(math.floor(max(0.0, share) * budget * n_tokens))
