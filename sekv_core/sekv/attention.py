"""One attention over the mixed-resolution memory (SPEC §2.4-2.6), batched.

Per layer the keys a query sees are laid out as

    [ full-res document tokens (F) | coarse span entries (S) | appended tokens (A) | reconstructed tokens (U) ]

where the first three live in one growing buffer and the U reconstructed
tokens are the tokens of the spans each KV group expanded at this step, padded
to the longest group.  One additive mask per (query head, query token) makes
each head see, for every span, either its coarse entry (score + log n_i) or the
span's reconstructed tokens, never both; padding and other groups' spans are
hidden.  Everything is tensor ops: no loop over spans or heads.

``select`` is the budget cap: (KV group, span) candidates in decreasing gate
logit, kept while the cumulative reconstruction bytes fit the cap.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

NEG_INF = float("-inf")


def select(priority: torch.Tensor, cost: torch.Tensor, cap: float | None) -> torch.Tensor:
    """Budget cap.  priority [Hkv, S] (-inf: not a candidate), cost [S] bytes per (group, span) -> keep [Hkv, S] bool.

    Candidates are taken in decreasing priority while the running total of their
    costs stays <= cap (the first one that does not fit ends the selection:
    "keep spans in decreasing p_i until the budget is full").  cap None: no cap.
    """
    cand = priority > NEG_INF
    if cap is None:
        return cand
    hkv, s = priority.shape
    flat = priority.flatten()
    order = torch.argsort(flat, descending=True, stable=True)
    c = cost.to(torch.float64).repeat(hkv)[order]
    fits = (torch.cumsum(c, 0) <= float(cap)) & cand.flatten()[order]
    fits = torch.cumprod(fits.to(torch.int8), 0).bool()  # a prefix
    keep = torch.zeros(hkv * s, dtype=torch.bool, device=priority.device)
    keep[order] = fits
    return keep.view(hkv, s)


def route(logits: torch.Tensor, logit_tau: torch.Tensor, n_kv: int) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [H, q, S], logit_tau [H] -> (head candidates [H, S] bool, group priority [Hkv, S]).

    Several query tokens (the question's forward) take the max gate over tokens:
    a span any of them wants is a candidate, and once reconstructed every token
    of the forward may use it.  The group priority is the max over the group's
    candidate heads.
    """
    h, _, s = logits.shape
    lg = logits.amax(1)
    cand = lg > logit_tau.view(h, 1)
    prio = torch.where(cand, lg, NEG_INF).view(n_kv, h // n_kv, s).amax(1)
    return cand, prio


def place(rows: torch.Tensor, g: torch.Tensor, n: torch.Tensor, n_kv: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Arrange reconstructed blocks per KV group.

    rows [E, n_max, d] (pairs sorted by group), g [E], n [E] ->
    (per-group rows [Hkv, U, d] zero-padded, block index of each slot [Hkv, U] (-1 = padding),
    row-within-block of each slot [Hkv, U]).
    """
    e, n_max, d = rows.shape
    dev = rows.device
    per_group = torch.zeros(n_kv, dtype=torch.long, device=dev).index_add_(0, g, n)
    u = int(per_group.max()) if e else 0
    start_in_group = torch.cumsum(n, 0) - n - (torch.cumsum(per_group, 0) - per_group)[g]
    j = torch.arange(n_max, device=dev).view(1, -1)
    valid = j < n.view(-1, 1)
    dest = (g.view(-1, 1) * u + start_in_group.view(-1, 1) + j)[valid]
    out = rows.new_zeros(n_kv * u, d)
    out[dest] = rows[valid]
    blk = torch.full((n_kv * u,), -1, dtype=torch.long, device=dev)
    blk[dest] = torch.arange(e, device=dev).view(-1, 1).expand(-1, n_max)[valid]
    row = torch.zeros(n_kv * u, dtype=torch.long, device=dev)
    row[dest] = j.expand(e, -1)[valid]
    return out.view(n_kv, u, d), blk.view(n_kv, u), row.view(n_kv, u)


def build_mask(
    *,
    n_heads: int,
    n_q: int,
    n_full: int,
    log_n: torch.Tensor,
    expanded: torch.Tensor,
    n_tail: int,
    slot_span: torch.Tensor | None,
    dtype,
    coarse: torch.Tensor | None = None,
    hidden: torch.Tensor | None = None,
) -> torch.Tensor:
    """Additive mask [1, H, q, F + S + A + U].

    expanded [H, S] bool: the head sees the span's tokens (coarse hidden), else the
    coarse entry with + log n_i.  slot_span [Hkv, U] (-1 = padding): which span each
    reconstructed slot belongs to.  The appended tail is causal among the q new tokens.
    Zoom blocks (parts of spans): ``expanded`` [H, B] and ``slot_span`` index blocks, and
    ``coarse`` [H, S] gives the coarse entries' scores (:func:`coarse_scores`).  ``hidden`` [F] (0 or -inf): the
    full-resolution columns hidden for the question (sekv/residents.py HiddenColumns); None: every one seen.
    """
    h = expanded.shape[0]
    dev = expanded.device
    ninf = NEG_INF  # a Python scalar: a tensor made from it on the device would be a blocking copy (a host sync)
    if coarse is None:
        coarse = torch.where(expanded, ninf, log_n.float().view(1, -1))  # [H, S]
    s = coarse.shape[1]
    full = torch.zeros(h, n_full, device=dev) if hidden is None else hidden.view(1, -1).expand(h, n_full)
    head = torch.cat([full, coarse], 1).unsqueeze(1).expand(h, n_q, n_full + s)
    t = torch.arange(n_tail, device=dev).view(1, -1)
    qi = torch.arange(n_q, device=dev).view(-1, 1)
    tail = torch.where(t <= n_tail - n_q + qi, 0.0, ninf).unsqueeze(0).expand(h, n_q, n_tail)
    parts = [head, tail]
    if slot_span is not None and slot_span.shape[1] > 0:
        n_kv = slot_span.shape[0]
        sp = slot_span.unsqueeze(1).expand(n_kv, h // n_kv, -1).reshape(h, -1)  # [H, U]
        sees = (sp >= 0) & expanded.gather(1, sp.clamp_min(0))
        parts.append(torch.where(sees, 0.0, ninf).unsqueeze(1).expand(h, n_q, sp.shape[1]))
    return torch.cat(parts, -1).to(dtype).unsqueeze(0)


def coarse_scores(expanded: torch.Tensor, block_span: torch.Tensor, block_len: torch.Tensor, span_len: torch.Tensor) -> torch.Tensor:
    """Additive scores of the coarse entries when zoom blocks (parts of spans) are expanded.

    expanded [H, B] bool (blocks a head sees at full resolution), block_span / block_len [B], span_len [S] ->
    [H, S]: + log(n_i - m_i) for the m_i tokens of span i the head sees expanded (the coarse entry stands for the
    rest of the span), -inf once the whole span is.  With one block per span this is the SPEC's rule: + log n_i or
    hidden.
    """
    h = expanded.shape[0]
    m = torch.zeros(h, span_len.numel(), dtype=torch.float32, device=expanded.device)
    m.index_add_(1, block_span, expanded.float() * block_len.float().view(1, -1))
    rest = span_len.float().view(1, -1) - m
    return torch.where(rest > 0.5, rest.clamp_min(1).log(), NEG_INF)


def mixed_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """query [1, H, q, d], keys/values [1, Hkv, T, d], mask [1, H, q, T] -> [1, H, q, d]."""
    return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask, scale=scaling, enable_gqa=keys.shape[1] != query.shape[1])


# -- the batched decode path (sync-free, fixed shapes): sekv/blocks.py fetches, these select and attend ---------


def select_topk(priority: torch.Tensor, cost: torch.Tensor, cap: float | None, p_max: int) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`select` with a fixed-size result: (pair [P] flat g * S + i in decreasing priority, ok [P] bool).

    P = min(p_max, Hkv * S); with p_max at least the number of pairs the cap can hold, the kept pairs
    (``ok``) are exactly :func:`select`'s (up to the order of equal priorities).  No host sync.

    ``ok`` is a prefix without a running product: the priorities come sorted (``> -inf`` holds for a prefix) and the
    costs are >= 0 (their running sum stays within the cap for a prefix).  Integer costs are summed as integers
    against the cap's floor (what a float64 sum of integers below 2^53 compares to the cap).
    """
    hkv, s = priority.shape
    flat = priority.flatten()
    k = min(int(p_max), flat.numel())
    top, pair = torch.topk(flat, k, sorted=True)
    ok = top > NEG_INF
    if cap is not None:
        c = cost[pair % s]
        if c.is_floating_point():
            c, cap = c.to(torch.float64), float(cap)
        else:
            cap = math.floor(cap)
        ok = ok & (torch.cumsum(c, 0) <= cap)
    return pair, ok


def flat_attention(
    query: torch.Tensor,
    keys: torch.Tensor,
    values: torch.Tensor,
    resident_mask: torch.Tensor,
    rk: torch.Tensor,
    rv: torch.Tensor,
    visible: torch.Tensor,
    scaling: float,
    q_chunk: int = 16,
    coarse_hidden: tuple[int, int, torch.Tensor] | None = None,
) -> torch.Tensor:
    """One softmax over the resident memory and a flat list of reconstructed tokens.

    query [1, H, q, d]; keys / values [1, Hkv, T, d] (full-res | coarse | tail) with the additive
    resident_mask [1, H, q, T]; rk / rv [U, d]: reconstructed tokens of every KV group, one flat list;
    visible [H, U] bool: which of them each query head sees (its group's tokens of spans it expanded).
    Equal to ``mixed_attention`` over the per-group layout of ``place`` (tests), in float32.
    coarse_hidden (a, b, hidden [H, b - a] bool): resident columns a..b-1 are also hidden where ``hidden`` holds (the coarse
    entries of the spans a head expanded, over a mask made once for every layer: no copy of it a layer).
    """
    _, h, q, d = query.shape
    hkv, t = keys.shape[1], keys.shape[2]
    g = h // hkv
    kf, vf = keys[0].float(), values[0].float()
    rkf, rvf = rk.float(), rv.float()
    hide = (~visible).unsqueeze(1)  # [H, 1, U]
    outs = []
    for a in range(0, q, q_chunk):
        qf = query[0, :, a : a + q_chunk].float()  # [H, qc, d]
        qc = qf.shape[1]
        # the scores worked in place (the same operations and layouts, so the same values, with one score tensor of
        # each kind alive instead of three: at 128K tokens of an 8B model sb is ~150 MiB a chunk)
        sa = torch.matmul(qf.reshape(hkv, g * qc, d), kf.transpose(1, 2)).view(h, qc, t).mul_(scaling).add_(resident_mask[0, :, a : a + qc].float())
        if coarse_hidden is not None:
            c0, c1, hidden = coarse_hidden
            sa[:, :, c0:c1].masked_fill_(hidden.unsqueeze(1), NEG_INF)
        # [U, d] x [d, H q], transposed: a tall product that cuBLAS runs on tensor cores (TF32 where enabled)
        # (masked into a new tensor as before: the contiguous layout the sums and the product below read)
        sb = (torch.matmul(rkf, qf.reshape(h * qc, d).t()).t().view(h, qc, -1) * scaling).masked_fill(hide, NEG_INF)
        m = sa.amax(-1, keepdim=True)
        if sb.shape[-1]:
            m = torch.maximum(m, sb.amax(-1, keepdim=True))
        pa, pb = sa.sub_(m).exp_(), sb.sub_(m).exp_()
        del sa, sb
        z = pa.sum(-1, keepdim=True) + pb.sum(-1, keepdim=True)
        o = torch.matmul(pa.view(hkv, g * qc, t), vf).view(h, qc, d) + torch.matmul(pb.view(h * qc, -1), rvf).view(h, qc, d)
        outs.append(o / z)
    return (outs[0] if len(outs) == 1 else torch.cat(outs, 1)).to(query.dtype).unsqueeze(0)
