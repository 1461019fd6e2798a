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

Look-alikes (:meth:`Lexicon.lookalikes`): passages that share most of the question's words with its best match but
lack its most specific one (another archive's passphrase sentence when one archive is asked).  With ``lookalikes="demote"``
(sekv/params.py) the scout ranks them after every other block (:func:`demote`), so at a small budget they keep their
coarse entries and anchors but are not zoomed, and the model does not read the look-alike's value at full
resolution next to the asked one (docs/long-documents.md, "Four needles").  A look-alike held at full resolution
(the document's last sentence, in the end window) is out of any ranking's reach: :meth:`Lexicon.resident_lookalikes`
finds those, by the same test; :meth:`Lexicon.resident_columns` gives their columns, which every step hides from
attention for that question (sekv/residents.py HiddenColumns).
"""

from __future__ import annotations

import math
import re
import zlib
from dataclasses import dataclass
from typing import Callable

import torch

#: tokens on either side of a block that count as its own
WINDOW = 8
#: look-alikes (:meth:`Lexicon.lookalikes`): a block within this many tokens of a block matching every term of the
#: best match is part of that passage, not a look-alike
NEAR = 64
#: look-alikes: the least share of the best block's idf mass a partial match must carry to count as one
LOOKALIKE_SHARE = 0.5
#: look-alikes: the blocks within this many tokens of one are its passage (the rest of its sentence, its value)
REACH = 32
#: look-alikes: runs of at least this many consecutive full-resolution tokens (the end window, the sinks) are
#: passages too, cut into pieces of this length
RUN = 16

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

    def __init__(self, terms: torch.Tensor, block_start: torch.Tensor, block_len: torch.Tensor, full_pos: torch.Tensor | None = None):
        """``full_pos``: the full-resolution tokens' positions; their runs of at least RUN tokens (the end window,
        the sinks) are passages too, for :meth:`lookalikes` only (a question's best match may be held there)."""
        terms = terms.long()
        self.full_pos = full_pos.long().cpu() if full_pos is not None else None
        self._last: tuple | None = None  # the last question's best match (asked for its blocks and its runs)
        self.n_blocks = int(block_start.numel())
        self.block_terms = _window_terms(terms, block_start, block_len)
        self.run_start, self.run_len, self.run_terms = torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long), []
        if full_pos is not None and full_pos.numel():
            rs, rl = _runs(full_pos.long().cpu(), RUN)
            self.run_start, self.run_len, self.run_terms = rs, rl, _window_terms(terms, rs, rl)
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

    def lookalikes(self, question: str, block_start: torch.Tensor, near: int = NEAR, share: float = LOOKALIKE_SHARE,
                   reach: int = REACH) -> torch.Tensor | None:
        """[B] bool: the blocks of passages that look like the question's best match but lack its most specific word --
        the "secret passphrase for the ... archive" sentences of the other archives when one archive is asked.

        The best match is the block (or run of full-resolution tokens: the end window) whose window holds the largest
        idf mass of the question's terms; T its terms and
        the key term the rarest of T (highest idf: the archive's name).  A look-alike holds at least two terms of T
        carrying at least ``share`` of T's idf mass, but not the key term, and lies more than ``near`` tokens from
        every block or run that holds all of T (the best passage's own neighbours share its words without being another
        passage).  The blocks within ``reach`` tokens of a look-alike (its sentence's other words, its value) are
        marked with it, unless they are that near a block holding all of T.  None when there is none: no question
        term in the document, a best match of one term, no look-alike."""
        m = self._best_match(question, block_start)
        return None if m is None else m.mark(m.hits, block_start.long().cpu(), near, share, reach)

    def resident_lookalikes(self, question: str, block_start: torch.Tensor, near: int = NEAR, share: float = LOOKALIKE_SHARE,
                            reach: int = REACH) -> torch.Tensor | None:
        """[R] bool over the pieces of the full-resolution runs (``run_start`` / ``run_len``: the end window, the
        sinks): the look-alikes :meth:`lookalikes` finds there, by the same test.  No ranking reaches them (they are
        resident at full resolution whatever the budget), so :func:`demote` cannot; the document's last sentence
        being another archive's passphrase is such a case (docs/long-documents.md, "Four needles")."""
        m = self._best_match(question, block_start)
        return None if m is None or not self.run_terms else m.mark(m.run_hits, self.run_start, near, share, reach)

    def resident_columns(self, question: str, block_start: torch.Tensor) -> torch.Tensor | None:
        """[K] long: the full-resolution tokens (indices into ``full_pos``, the pack's full-resolution columns) of the
        pieces :meth:`resident_lookalikes` marks, which the steps hide from attention for the question; None: none."""
        marked = self.resident_lookalikes(question, block_start)
        if marked is None or self.full_pos is None:
            return None
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(self.run_start[marked].tolist(), self.run_len[marked].tolist())])
        return torch.isin(self.full_pos, pos).nonzero().flatten()

    def _best_match(self, question: str, block_start: torch.Tensor) -> "_Match | None":
        last = self._last  # asked for the blocks' look-alikes and the runs' in turn: found once
        if last is not None and last[0] == question and last[1] is block_start:
            return last[2]
        m = self._find_match(question, block_start)
        self._last = (question, block_start, m)
        return m

    def _find_match(self, question: str, block_start: torch.Tensor) -> "_Match | None":
        q = text_terms(question)
        if not q or not self.block_terms:
            return None
        hits = [q & ts for ts in self.block_terms]
        top_idf = max(self.idf.values(), default=0.0)
        idf = lambda t: self.idf.get(t, top_idf)  # noqa: E731  (a word only full-resolution tokens hold: the rarest)
        run_hits = [q & ts for ts in self.run_terms]
        mass = [sum(idf(t) for t in h) for h in hits + run_hits]
        best = max(range(len(mass)), key=mass.__getitem__)
        top = (hits + run_hits)[best]
        if len(top) < 2:
            return None
        key = max(top, key=lambda t: (idf(t), t))
        starts = block_start.long().cpu()
        whole = torch.cat([starts[torch.tensor([h >= top for h in hits], dtype=torch.bool)],
                           self.run_start[torch.tensor([h >= top for h in run_hits], dtype=torch.bool)]])
        return _Match(top, key, mass[best], idf, hits, run_hits, whole)


@dataclass
class _Match:
    """A question's best match (its terms ``top``, the ``key`` term, their idf ``mass``), the question's terms in every
    block (``hits``) and run piece (``run_hits``), and the starts of the blocks and pieces holding all of ``top``."""

    top: set[int]
    key: int
    mass: float
    idf: Callable[[int], float]
    hits: list[set[int]]
    run_hits: list[set[int]]
    whole: torch.Tensor

    def mark(self, hits: list[set[int]], starts: torch.Tensor, near: int, share: float, reach: int) -> torch.Tensor | None:
        """[len(hits)] bool: the look-alikes among passages starting at ``starts`` with question terms ``hits``, and
        the passages within ``reach`` of one (Lexicon.lookalikes); None: none."""
        cand = []
        for h in hits:
            part = h & self.top
            cand.append(self.key not in h and len(part) >= 2 and sum(self.idf(t) for t in part) >= share * self.mass)
        cand = torch.tensor(cand, dtype=torch.bool)
        if not bool(cand.any()):
            return None
        far = (starts.view(-1, 1) - self.whole.view(1, -1)).abs().amin(1) > near
        core = starts[cand & far]
        if not core.numel():
            return None
        return far & ((starts.view(-1, 1) - core.view(1, -1)).abs().amin(1) <= reach)


def _window_terms(terms: torch.Tensor, start: torch.Tensor, length: torch.Tensor) -> list[set[int]]:
    """The distinct terms of each passage [start, start + length) and WINDOW tokens on either side."""
    n = terms.numel()
    lo = (start - WINDOW).clamp_min(0)
    hi = (start + length + WINDOW).clamp_max(n)
    out = []
    for s, e in zip(lo.tolist(), hi.tolist()):
        t = terms[s:e]
        out.append(set(t[t >= 0].tolist()))
    return out


def _runs(pos: torch.Tensor, piece: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Runs of at least ``piece`` consecutive positions in sorted ``pos``, cut into pieces of at most ``piece``:
    (starts, lengths)."""
    if not pos.numel():
        return torch.zeros(0, dtype=torch.long), torch.zeros(0, dtype=torch.long)
    brk = torch.nonzero(pos[1:] != pos[:-1] + 1).flatten() + 1
    first = torch.cat([torch.zeros(1, dtype=torch.long), brk])
    last = torch.cat([brk, torch.tensor([pos.numel()])])
    starts, lens = [], []
    for a, b in zip(first.tolist(), last.tolist()):
        if b - a >= piece:
            for c in range(a, b, piece):
                starts.append(int(pos[c]))
                lens.append(min(piece, b - c))
    return torch.tensor(starts, dtype=torch.long), torch.tensor(lens, dtype=torch.long)


def document_terms(tokenizer, text: str, offsets=None) -> torch.Tensor:
    """``sekv.lex.terms`` of a document prefix as ingest tokenizes it: [N] int32.  ``offsets``: the tokens'
    character ranges when the caller has them already (ingest's own tokenization of ``text``)."""
    if offsets is None:
        offsets = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    return token_terms(text, offsets)


def demote(prio: torch.Tensor, mask: torch.Tensor | None) -> None:
    """The ranking ``prio`` [B] (in place): the blocks of ``mask`` moved after every other finite-priority block,
    their order among themselves kept (finite: a budget that keeps every block still zooms them; a block at -inf,
    outside ``--doc``, stays there)."""
    if mask is None or prio.numel() == 0:
        return
    m = mask.to(prio.device, non_blocking=True)
    finite = torch.isfinite(prio)
    inf = torch.tensor(float("inf"), device=prio.device, dtype=prio.dtype)
    lo = torch.where(finite & ~m, prio, inf).min()  # the lowest of the others (no host sync: decided on the device)
    hi = torch.where(finite & m, prio, -inf).max()
    shift = hi - lo + 1.0
    shift = torch.where(torch.isfinite(shift), shift.clamp_min(0.0), torch.zeros_like(shift))
    prio.copy_(torch.where(m & finite, prio - shift, prio))
