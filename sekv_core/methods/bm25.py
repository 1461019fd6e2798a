"""Okapi BM25 over a document's chunks, as tensors (rag's index; its terms are sekv's lexical terms, sekv/lexical.py).

The index is a posting list sorted by chunk then term: (chunk, term, tf) triples, tf the occurrences of the term in
the chunk (a word split into several tokens counts once).  A chunk's length is the sum of its tfs.  The score of a
chunk for a query's distinct terms is

    sum_t idf(t) * tf (k1 + 1) / (tf + k1 (1 - b + b len / avg_len)),    idf(t) = ln(1 + (C - df + 0.5) / (df + 0.5))

(Lucene's idf, never negative), with k1 = 1.2, b = 0.75 and C the number of chunks.  Small enough to keep here
rather than take a dependency: rank_bm25 and friends work on Python lists of strings, not on the term ids and
tensors a pack stores.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

K1 = 1.2
B = 0.75


def postings(bounds: list[int], terms: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(chunk [P], term [P], tf [P]) int32 of chunks [bounds[i], bounds[i+1]) over token terms [N] (-1: none); a term
    occurs where a token carries it and the previous token does not carry the same one."""
    terms = terms.long()
    prev = torch.cat([terms.new_full((1,), -1), terms[:-1]])
    starts = torch.tensor(bounds[:-1], dtype=torch.long)
    first = torch.zeros_like(terms, dtype=torch.bool)
    if len(bounds) > 1 and terms.numel():
        first[starts] = True
    occ = (terms >= 0) & ((terms != prev) | first)  # a chunk's first token starts an occurrence whatever precedes it
    pos = occ.nonzero().flatten()
    if len(bounds) < 2 or pos.numel() == 0:
        e = torch.zeros(0, dtype=torch.int32)
        return e, e.clone(), e.clone()
    chunk = torch.bucketize(pos, torch.tensor(bounds[1:], dtype=torch.long), right=True)
    keep = (pos >= bounds[0]) & (chunk < len(bounds) - 1)
    chunk, term = chunk[keep], terms[pos[keep]]
    pair = torch.stack([chunk, term], 1)
    uniq, counts = torch.unique(pair, dim=0, return_counts=True)  # sorted by chunk, then term
    return uniq[:, 0].int(), uniq[:, 1].int(), counts.int()


@dataclass
class Index:
    chunk: torch.Tensor  # [P] long
    term: torch.Tensor  # [P] long
    tf: torch.Tensor  # [P] float32
    n_chunks: int

    @classmethod
    def of(cls, chunk: torch.Tensor, term: torch.Tensor, tf: torch.Tensor, n_chunks: int) -> "Index":
        return cls(chunk.long(), term.long(), tf.float(), int(n_chunks))

    def scores(self, query_terms: set[int] | list[int]) -> torch.Tensor:
        """[C] float32: every chunk's BM25 score for the query's distinct terms."""
        out = torch.zeros(self.n_chunks, dtype=torch.float32)
        q = torch.tensor(sorted(set(query_terms)), dtype=torch.long)
        if self.n_chunks == 0 or q.numel() == 0 or self.term.numel() == 0:
            return out
        length = torch.zeros(self.n_chunks, dtype=torch.float32).index_add_(0, self.chunk, self.tf)
        avg = float(length.mean()) or 1.0
        hit = torch.isin(self.term, q)
        if not bool(hit.any()):
            return out
        terms, chunks, tf = self.term[hit], self.chunk[hit], self.tf[hit]
        uniq, inv = torch.unique(terms, return_inverse=True)
        df = torch.zeros(uniq.numel(), dtype=torch.float32).index_add_(0, inv, torch.ones_like(tf))
        idf = torch.log1p((self.n_chunks - df + 0.5) / (df + 0.5))[inv]
        part = idf * tf * (K1 + 1) / (tf + K1 * (1 - B + B * length[chunks] / avg))
        return out.index_add_(0, chunks, part)
