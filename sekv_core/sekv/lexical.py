"""Lexical evidence for the scout: which zoom blocks share the question's words (docs/design.md, scout).

The scout ranks zoom blocks by the question's attention mass summed over layers (sekv/scout.py).  On the
sample documents that signal, even with exact keys, puts the answer's block 4th-200th of 100-220 blocks,
so the cap (5-12 blocks per KV group at 10 %) misses it; the question's words point at it directly.  So the
ranking adds a BM25-style score of each block: the inverse block frequency of every distinct question term
found in the block or within WINDOW tokens of it (a key phrase and its answer may lie across a cut).

Terms are words (runs of letters and digits), lower-cased, with a light suffix stripping so that
"descaled" meets "descale"; stop words and one-character words have none.  The document's side is computed
at ingest from the text the tokenizer saw and stored in the pack as ``sekv.lex.terms`` [N] int32, the term
of the word each token belongs to (-1: none); the question's side from the question's text at ask time.
"""

from __future__ import annotations

import math
import re
import zlib

import torch

#: tokens on either side of a block that count as its own
WINDOW = 8

STOP_WORDS = frozenset(
    """a an the and or but if then else of to in on at by for with from as is are was were be been being am do does
    did done have has had having it its this that these those there here what which who whom whose when where why
    how all any both each few more most other some such no nor not only own same so than too very can will just
    should would could may might must shall i me my we our you your he him his she her they them their us about
    into over under again further once also per up down out off""".split()
)
_WORD = re.compile(r"[^\W_]+")
_SUFFIXES = ("ing", "ed", "es", "s", "e")


def stem(word: str) -> str:
    """A light suffix stripping (not a full stemmer): one of -ing -ed -es -s -e, leaving at least 3 letters."""
    if len(word) > 4:
        for suf in _SUFFIXES:
            if word.endswith(suf) and len(word) - len(suf) >= 3:
                return word[: -len(suf)]
    return word


def term_id(word: str) -> int | None:
    """A word's stable 31-bit term id (the same in every process and on every machine), None for no term."""
    w = word.lower()
    if len(w) < 2 or w in STOP_WORDS:
        return None
    return zlib.crc32(stem(w).encode("utf-8")) & 0x7FFFFFFF


def text_terms(text: str) -> set[int]:
    """The distinct terms of a text (the question)."""
    return {t for t in (term_id(m.group()) for m in _WORD.finditer(text)) if t is not None}


def token_terms(text: str, offsets) -> torch.Tensor:
    """[N] int32: the term of the word each token (character range ``offsets``: pairs, or an [N, 2] tensor) of
    ``text`` overlaps first; -1.  The words' terms are computed once per distinct word; the tokens are matched to
    words all at once (the first word ending after a token starts, if it starts before the token ends)."""
    starts, ends, ids = [], [], []
    memo: dict[str, int | None] = {}
    for m in _WORD.finditer(text):
        w = m.group()
        t = memo[w] if w in memo else memo.setdefault(w, term_id(w))
        if t is not None:
            starts.append(m.start())
            ends.append(m.end())
            ids.append(t)
    off = torch.as_tensor(offsets, dtype=torch.long).view(-1, 2)
    out = torch.full((off.shape[0],), -1, dtype=torch.int32)
    if not ids or not off.shape[0]:
        return out
    e = torch.tensor(ends, dtype=torch.long)
    j = torch.searchsorted(e, off[:, 0].contiguous(), right=True)  # the first word ending after the token starts
    jc = j.clamp_max(len(ids) - 1)
    hit = (j < len(ids)) & (torch.tensor(starts, dtype=torch.long)[jc] < off[:, 1])
    return torch.where(hit, torch.tensor(ids, dtype=torch.int32)[jc], out)


class Lexicon:
    """A document's token terms (``sekv.lex.terms``), indexed by zoom block, to score blocks against a question."""

    def __init__(self, terms: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor):
        terms = terms.long()
        n = terms.numel()
        lo = (block_start - WINDOW).clamp_min(0)
        hi = (block_start + block_len + WINDOW).clamp_max(n)
        self.n_blocks = int(block_start.numel())
        self.block_terms: list[set[int]] = []
        for s, e in zip(lo.tolist(), hi.tolist()):
            t = terms[s:e]
            self.block_terms.append(set(t[t >= 0].tolist()))
        df: dict[int, int] = {}
        for ts in self.block_terms:
            for t in ts:
                df[t] = df.get(t, 0) + 1
        b = self.n_blocks
        self.idf = {t: math.log(1.0 + (b - c + 0.5) / (c + 0.5)) for t, c in df.items()}

    def scores(self, question: str) -> torch.Tensor:
        """[B] float32: the sum of the idf of the distinct question terms in each block's window."""
        q = text_terms(question)
        if not q:
            return torch.zeros(self.n_blocks, dtype=torch.float32)
        # summed in Python, made a tensor once (an item write per block is a tensor op each)
        return torch.tensor([sum(self.idf[t] for t in hit) if (hit := q & ts) else 0.0 for ts in self.block_terms], dtype=torch.float32)


def document_terms(tokenizer, text: str, offsets=None) -> torch.Tensor:
    """``sekv.lex.terms`` of a document prefix as ingest tokenizes it: [N] int32.  ``offsets``: the tokens'
    character ranges when the caller has them already (ingest's own tokenization of ``text``)."""
    if offsets is None:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return token_terms(text, offsets)
