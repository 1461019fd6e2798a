"""Scoring answers against expected strings: case-insensitive substring matches.

``score(answer, probe)`` returns ``(correct, fraction)``: the fraction of expected
strings found (for "any" probes 1.0 or 0.0), and whether the probe counts as
answered (any one found, or all found).
"""

from __future__ import annotations

import re
import unicodedata

from .tasks import Probe


def normalize(text: str) -> str:
    """Case-folded, NFKC, whitespace collapsed (so "Marta\\nSofie" matches "Marta Sofie")."""
    return re.sub(r"\s+", " ", unicodedata.normalize("NFKC", text)).strip().casefold()


def contains(answer: str, expected: str, whole_word: bool = False) -> bool:
    """Is `expected` in `answer` (case-insensitive)?  whole_word: not inside a longer word or number."""
    a, e = normalize(answer), normalize(expected)
    if not e:
        return False
    if not whole_word:
        return e in a
    return re.search(r"(?<!\w)" + re.escape(e) + r"(?!\w)", a) is not None


def fraction_found(answer: str, expected: list[str], whole_word: bool = False) -> float:
    if not expected:
        return 0.0
    return sum(contains(answer, e, whole_word) for e in expected) / len(expected)


def score(answer: str, probe: Probe) -> tuple[bool, float]:
    if probe.match == "all":
        f = fraction_found(answer, probe.expected, probe.whole_word)
        return f == 1.0, f
    ok = any(contains(answer, e, probe.whole_word) for e in probe.expected)
    return ok, float(ok)
