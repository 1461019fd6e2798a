"""Scout routing: one span ranking per question, shared by every layer (docs/design.md, scout; docs/experiments/sekv-notebook.md §7b, §7c).

A needle is answered when its span is zoomed in nearly every layer, yet at the question's tokens no single
layer's attention, not even full KV's, reliably puts that span first (route diagnosis, docs/experiments/sekv-notebook.md §7b).
Summed over layers, it stands out.  So before a question is answered its tokens are run once over the
memory (the *scout pass*, with the per-layer router).  At each layer the keys of every span are rebuilt
from the factors a chunk at a time, and the question's attention mass on each span is what the
full-resolution softmax over the whole document would give it:

    mass_i = max over (query head, question token) of  sum_{t in span i} softmax(q . k / sqrt(d))_t

(the softmax runs over every span token, anchor, window and question token).  It is z-scored over spans
and summed over layers.  Some spans (the document's head, the last ones) draw attention from any query;
so the same sum is taken at ingest for the queries of the document's last PROFILE_QUERIES tokens (the
*document profile*, stored in the pack, exact keys) and subtracted.  The answer's forwards then keep spans
in order of (question sum - profile), in every layer, within the same budget cap.  The logsumexp per span
is built chunk by chunk, so only one chunk of reconstructed keys exists at a time.  The batched step (sekv/gpu_step.py)
keeps each layer's queries during the forward and scores every layer after it, several layers a chunk
(:func:`block_masses`, :meth:`Ranking.add_masses`); the reference step scores each layer as it goes (:meth:`Ranking.add_layer`).
"""

from __future__ import annotations

import torch

#: document tokens at the end whose queries give the question-independent profile
PROFILE_QUERIES = 32


def span_logsumexp(q: torch.Tensor, rows: torch.Tensor, n: torch.Tensor, group: torch.Tensor, scaling: float) -> torch.Tensor:
    """log sum_t exp(q . k_t * scaling) over each block's rows.

    q [Hkv, M, d] (M = query heads of a group x question tokens), rows [E, n_max, d] (block e's first n[e]
    rows are its keys), group [E] (KV group of block e) -> [E, M].
    """
    if rows.shape[0] == 0:
        return q.new_zeros(0, q.shape[1])
    logits = torch.bmm(q[group], rows.transpose(1, 2)) * scaling  # [E, M, n_max]
    pad = torch.arange(rows.shape[1], device=rows.device).view(1, 1, -1) >= n.view(-1, 1, 1)
    return torch.logsumexp(logits.masked_fill(pad, float("-inf")), dim=-1)


def layer_mass(span_lse: torch.Tensor, span_group: torch.Tensor, span_id: torch.Tensor, other_lse: torch.Tensor, n_spans: int) -> torch.Tensor:
    """Attention mass of each span, max over (group, query head, question token).

    span_lse [E, M] (one row per (group, span) block), span_group / span_id [E], other_lse [Hkv, M] (the
    logsumexp over every full-resolution key: anchors, window, question) -> [n_spans].  A row whose span_id is
    n_spans stands for no span and is dropped (a step keeps its rows at a fixed count: no host sync to drop them).
    """
    hkv, m = other_lse.shape
    per_group = torch.full((hkv, n_spans + 1, m), float("-inf"), dtype=span_lse.dtype, device=span_lse.device)
    per_group[span_group, span_id] = span_lse
    per_group = per_group[:, :n_spans]
    total = torch.logsumexp(torch.cat([per_group, other_lse.unsqueeze(1)], dim=1), dim=1)  # [Hkv, M]
    mass = torch.exp(per_group - total.unsqueeze(1))  # [Hkv, S, M]
    return mass.amax(dim=-1).amax(dim=0)


def block_masses(block_lse: torch.Tensor, other_lse: torch.Tensor) -> torch.Tensor:
    """:func:`layer_mass` for several layers at once, every (group, block) pair scored: block_lse [L, Hkv, B, M]
    (-inf for a row of no block), other_lse [L, Hkv, M] -> [L, B]."""
    total = torch.logsumexp(torch.cat([block_lse, other_lse.unsqueeze(2)], dim=2), dim=2)  # [L, Hkv, M]
    return torch.exp(block_lse - total.unsqueeze(2)).amax(dim=-1).amax(dim=1)


def zscore(v: torch.Tensor) -> torch.Tensor:
    """(v - mean) / std over spans (the last dimension: each row of a [L, S] on its own); zeros where every span
    has the same value (decided on the device: no sync)."""
    if v.shape[-1] < 2:
        return torch.zeros_like(v)
    sd = v.std(dim=-1, keepdim=True)
    pos = sd > 0
    return torch.where(pos, (v - v.mean(dim=-1, keepdim=True)) / torch.where(pos, sd, torch.ones_like(sd)), torch.zeros_like(v))


def document_profile(prefill, span_start: torch.Tensor, span_end: torch.Tensor, rows: int | None = None) -> torch.Tensor:
    """Sum over layers of the z-scored span masses seen by the document end's queries (exact keys): [S] float32.

    prefill.scores["obs_queries"]: per layer [H, w, d] (post-RoPE).  Zeros when they were not recorded.  ``rows``:
    the query rows scored at once ([rows, N] attention, a KV head at a time; sekv/compress.py's memory bound), the
    same masses; None: every head's rows together.
    """
    s = int(span_start.numel())
    queries = prefill.scores.get("obs_queries") if prefill.scores else None
    if not queries or s == 0:
        return torch.zeros(s, dtype=torch.float32)
    n = prefill.n_tokens
    span_of = torch.full((n,), -1, dtype=torch.long)
    lens = span_end - span_start
    span_of[torch.repeat_interleave(span_start, lens) + _ranks(lens)] = torch.repeat_interleave(torch.arange(s), lens)
    keys = prefill.keys
    dev = keys.devices[0] if hasattr(keys, "devices") else keys[0].device
    span_of, inside = span_of.to(dev), (span_of >= 0).to(dev)
    idx = span_of[inside]
    total = torch.zeros(s, dtype=torch.float32, device=dev)
    for q, k in zip(queries, keys):
        hkv, d = k.shape[0], k.shape[-1]
        qf = q.to(dev).reshape(hkv, -1, d)  # [Hkv, G*w, d]
        if rows is None:
            p = torch.softmax(torch.bmm(qf.float(), k.float().transpose(1, 2)) * d**-0.5, dim=-1)  # [Hkv, G*w, N]
            mass = torch.zeros(hkv, qf.shape[1], s, device=dev).index_add_(2, idx, p[:, :, inside])
            top = mass.amax(dim=1).amax(dim=0)
        else:
            top = torch.zeros(s, device=dev)  # masses are >= 0: the running max starts at 0
            for h in range(hkv):
                kh = k[h].float().t()
                for r0 in range(0, qf.shape[1], rows):
                    p = torch.softmax((qf[h, r0 : r0 + rows].float() @ kh) * d**-0.5, dim=-1)  # [rows, N]
                    mass = torch.zeros(p.shape[0], s, device=dev).index_add_(1, idx, p[:, inside])
                    top = torch.maximum(top, mass.amax(dim=0))
                    del p, mass
        total += zscore(top)
    return total.cpu()


def _ranks(lens: torch.Tensor) -> torch.Tensor:
    """0..len-1 for each run: [sum(lens)]."""
    starts = torch.cumsum(lens, 0) - lens
    return torch.arange(int(lens.sum())) - torch.repeat_interleave(starts, lens)


class Ranking:
    """The question's ranking of zoom blocks, shared by every layer: a fixed device buffer (a captured CUDA graph
    reads it), filled by a scout pass (``kind="scout"``); or every block alike, always (``kind="all"``: the
    exactness check, every block expanded).

    A ranking holds for the ask that follows its scout pass; a forward of an ask without one (a caller that
    bypasses generate()) routes per layer."""

    def __init__(self, kind: str, n_blocks: int, device):
        self.kind = kind
        self.prio = torch.zeros(n_blocks, device=device)
        self.version = 0  # bumped with every new ranking: the batched step's fixed sets are keyed on it
        self.scouting = False
        self.ready = self.pending = kind == "all"
        self._sum = None
        self.allowed: torch.Tensor | None = None  # restrict(): the blocks that may be ranked (--doc)

    def restrict(self, allowed: torch.Tensor | None) -> None:
        """Rank only the blocks where ``allowed`` [n_blocks] bool holds (None: every block): the others get priority
        -inf, which no selection keeps."""
        self.allowed = allowed
        if self.kind == "all":
            self.prio.copy_(torch.zeros_like(self.prio) if allowed is None else torch.where(allowed, 0.0, float("-inf")))
            self.version += 1

    def on(self, device) -> torch.Tensor:
        """The priorities on ``device`` (a layer's, on a model placed across devices): a copy made once per ranking."""
        device, p = torch.device(device), self.prio
        if device.type == p.device.type and device.index in (None, p.device.index):
            return p
        copies = self.__dict__.setdefault("_copies", {})
        held = copies.get(device)
        if held is None or held[0] != self.version:
            held = copies[device] = (self.version, p.to(device))
        return held[1]

    def ranks(self) -> bool:
        """Whether this forward keeps blocks in the ranking's order."""
        return self.ready and not self.scouting

    def new_ask(self) -> None:
        if self.kind == "scout":
            self.ready, self.pending = self.pending, False

    def begin_pass(self) -> None:
        self.scouting, self._sum = True, torch.zeros_like(self.prio)

    def add_layer(self, q: torch.Tensor, exact_keys: torch.Tensor, scaling: float, block_lse) -> None:
        """Add a layer's z-scored block masses for the question's queries q [Hkv, M, d] (float32); exact_keys
        [Hkv, F+A, d]: the layer's full-resolution keys; block_lse: the step's (lse [E, M], group [E], block [E])
        of the rebuilt blocks."""
        other = torch.logsumexp(torch.bmm(q, exact_keys.float().transpose(1, 2)) * scaling, dim=-1)  # [Hkv, M]
        lse, grp, sid = block_lse
        mass = zscore(layer_mass(lse, grp, sid, other, self.prio.numel()))
        self._sum += mass if mass.device == self._sum.device else mass.to(self._sum.device)

    def add_masses(self, masses: torch.Tensor) -> None:
        """Add the z-scored masses of several layers at once: masses [L, n_blocks] (:func:`block_masses`)."""
        self._sum += zscore(masses).sum(0)

    def finish_pass(self, profile: torch.Tensor, profile_weight: float, lexical: torch.Tensor | None, lexical_weight: float) -> None:
        """rank = the question's sum - profile_weight x the document profile, plus lexical_weight x the z-scored
        lexical scores of the question's words (sekv/lexical.py) where any of them is in the document."""
        rank = self._sum - profile_weight * profile
        if lexical_weight > 0 and lexical is not None and lexical.numel():
            rank = torch.where(lexical.max() > 0, zscore(rank) + lexical_weight * zscore(lexical), rank)
        if self.allowed is not None:
            rank = torch.where(self.allowed, rank, float("-inf"))
        self.prio.copy_(rank)
        self.version += 1
        self.pending = True

    def end_pass(self) -> None:
        self.scouting, self._sum = False, None

    def span_order(self, block_span: torch.Tensor, n_spans: int, limit: int = 32) -> list[int]:
        """The spans in the order of their best-ranked zoom block (the first `limit`): the evidence order where
        every layer expanded the same spans; computed once per ranking (step_stats runs every step)."""
        cached = getattr(self, "_order", None)
        if cached is None or cached[0] != self.version:
            best = torch.full((n_spans,), float("-inf")).scatter_reduce(0, block_span, self.prio.float().cpu(), "amax")
            self._order = cached = (self.version, torch.argsort(best, descending=True, stable=True)[:limit].tolist())
        return list(cached[1])
