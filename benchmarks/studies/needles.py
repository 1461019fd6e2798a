"""Where a needle sits in a tokenised text (shared by the studies)."""

from __future__ import annotations


def needle_tokens(tok, text: str, needle: str) -> tuple[int, int]:
    """The token range [first, last + 1) that covers the needle's characters."""
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    c0 = text.index(needle)
    c1 = c0 + len(needle)
    hit = [i for i, (a, b) in enumerate(enc["offset_mapping"]) if a < c1 and b > c0]
    return hit[0], hit[-1] + 1
