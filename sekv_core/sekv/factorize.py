"""Per-span truncated SVD of keys and values (SPEC §1.5), batched, in a ragged packed layout.

For every (KV head g, span i) the span's matrix X (n_i x d) is factorised as
X ~= (U * sigma)[:, :r] @ Vt[:r], keeping the smallest rank r whose retained
energy sum_{j<r} sigma_j^2 / sum sigma^2 reaches ``energy`` (the untrained rank
rule; r <= rank_max).  Spans are bucketed by length and zero-padded to the
bucket length (zero rows change neither sigma nor Vt), so one batched
decomposition runs per bucket: no Python loop per span or head.

Packed layout (one per layer and K/V), all 1-D so that any set of spans can be
gathered with one index_select:

* ``us``  -- the n_i x r_gi blocks of U*sigma, row-major, concatenated in
  (g, i) order; int8 (per-row absmax, ``us_scale`` one scale per token row:
  [Hkv * T]) or ``dtype`` (float16 by default);
* ``vt``  -- the r_gi x d blocks of Vt, concatenated likewise; int8 with one
  scale per row (``vt_scale`` [sum r]) or ``dtype``;
* ``rank`` -- [Hkv, S] int16.  Offsets are cumulative sums of n_i * r_gi and
  r_gi * d, recomputed at load time (:func:`offsets`).

``method="gram"`` (default) takes the eigendecomposition of X^T X (d x d) and
U*sigma = X @ V (float64): it is 1.5x faster than ``torch.linalg.svd`` on CPU and,
since the reconstruction is the projection X V_r V_r^T, exact at full rank up
to the orthogonality of V.  ``method="svd"`` is kept for comparison
(benchmarks/studies/rope_factors.py).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable

import torch

from .linalg import _decompose

INT8_MAX = 127.0


@dataclass
class Factors:
    """One layer's factors of one matrix kind (K or V), packed."""

    us: torch.Tensor  # [sum_gi n_i * r_gi] int8 | float16
    vt: torch.Tensor  # [sum_gi r_gi * d] int8 | float16
    rank: torch.Tensor  # [Hkv, S] int16
    us_scale: torch.Tensor | None = None  # [Hkv * T] float16 (per token row)
    vt_scale: torch.Tensor | None = None  # [sum_gi r_gi] float16 (per component row)

    def tensors(self, prefix: str) -> dict[str, torch.Tensor]:
        out = {f"{prefix}.us": self.us, f"{prefix}.vt": self.vt, f"{prefix}.rank": self.rank}
        if self.us_scale is not None:
            out[f"{prefix}.us_scale"] = self.us_scale
            out[f"{prefix}.vt_scale"] = self.vt_scale
        return out

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors("").values())


def _bucket_len(n: torch.Tensor) -> torch.Tensor:
    """Bucket length of each span: n rounded up to a multiple of 16 (few buckets, little padding)."""
    return (n + 15) // 16 * 16


def choose_rank(sigma: torch.Tensor, energy: float, rank_max: int) -> torch.Tensor:
    """Smallest r with sum_{j<r} sigma_j^2 >= energy * sum sigma^2, capped at rank_max ([B] int64)."""
    e = sigma.double() ** 2
    total = e.sum(-1, keepdim=True)
    k = sigma.shape[-1]
    if energy >= 1.0:
        r = (e > 0).sum(-1) if k else torch.zeros(sigma.shape[0], dtype=torch.long, device=sigma.device)
    else:
        frac = torch.cumsum(e, -1) / total.clamp_min(1e-300)
        r = (frac < energy).sum(-1) + 1
        r = torch.where(total.squeeze(-1) > 0, r, torch.zeros_like(r))
    return r.clamp(max=min(rank_max, k)).long()


@contextlib.contextmanager
def single_thread():
    """Batched LAPACK on many small matrices: one thread is several times faster than two on our CPU
    (and ~10x faster when the cores are shared); the thread count is restored afterwards."""
    old = torch.get_num_threads()
    if old != 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if old != 1:
            torch.set_num_threads(old)


def offsets(rank: torch.Tensor, span_len: torch.Tensor, d: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(us_off, vt_off, row_off) [Hkv, S] int64: where block (g, i) starts in us / vt, and its first token row."""
    r = rank.long()
    n = span_len.view(1, -1).long().expand_as(r)
    us_sz, vt_sz = (n * r).flatten(), (r * d).flatten()
    us_off = (torch.cumsum(us_sz, 0) - us_sz).view_as(r)
    vt_off = (torch.cumsum(vt_sz, 0) - vt_sz).view_as(r)
    rows = n.flatten()
    row_off = (torch.cumsum(rows, 0) - rows).view_as(r)
    return us_off, vt_off, row_off


def decompose_spans(x: torch.Tensor, span_len: torch.Tensor, rank_max: int = 32, method: str = "gram") -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every span's leading singular triplets, zero-padded.

    x [Hkv, T, d] (span order) -> U*sigma [Hkv, S, n_max, R], sigma [Hkv, S, R], Vt [Hkv, S, R, d]
    (float32, R = min(rank_max, d, n_max); components past a span's own min(n_i, d) are zero).
    One batched decomposition per length bucket: no loop per span or head.
    """
    hkv, t, d = x.shape
    n_host = span_len.long().cpu()  # sizes and buckets are decided on the host: no device sync for them
    n = n_host.to(x.device)
    s = n.numel()
    x = x.float()
    first = torch.cumsum(n, 0) - n
    n_max = int(n_host.max()) if s else 0
    n_min = int(n_host.min()) if s else 0
    r_cap = max(0, min(rank_max, d, n_max))
    us_pad = x.new_zeros(hkv, s, n_max, r_cap)
    sig_pad = x.new_zeros(hkv, s, r_cap)
    vt_pad = x.new_zeros(hkv, s, r_cap, d)
    bl = _bucket_len(n_host)
    if x.is_cuda:  # one batched call per stage beats a few smaller ones on a GPU (launches, not FLOPs, dominate)
        bl = torch.full_like(bl, int(bl.max()) if s else 0)
    for nb in torch.unique(bl).tolist():  # a handful of buckets, not spans
        ids = torch.nonzero(bl == nb).flatten().to(x.device)
        j = torch.arange(nb, device=x.device)
        valid = j.view(1, -1) < n[ids].view(-1, 1)
        src = torch.where(valid, first[ids].view(-1, 1) + j.view(1, -1), torch.zeros_like(valid, dtype=torch.long))
        a = x[:, src].masked_fill_(~valid.view(1, *valid.shape, 1), 0.0)  # [hkv, Sb, nb, d], padding rows zero
        with single_thread():
            us, sigma, vt = _decompose(a.reshape(-1, nb, d), method, want=r_cap, rows_at_least_want=n_min >= r_cap, own=True)  # a: scaled in place
        del a
        k = min(r_cap, us.shape[-1])
        m = min(nb, n_max)
        us_pad[:, ids, :m, :k] = us.reshape(hkv, -1, nb, us.shape[-1])[:, :, :m, :k]
        sig_pad[:, ids, :k] = sigma.reshape(hkv, -1, sigma.shape[-1])[:, :, :k]
        vt_pad[:, ids, :k] = vt.reshape(hkv, -1, vt.shape[-2], d)[:, :, :k]
    # a span of n_i rows has at most n_i nonzero components: clear numerical noise past that
    live = torch.arange(r_cap, device=x.device).view(1, 1, -1) < n.view(1, -1, 1)
    return us_pad * live.unsqueeze(2), sig_pad * live, vt_pad * live.unsqueeze(-1)


def factorize(
    x: torch.Tensor,
    span_len: torch.Tensor,
    *,
    energy: float,
    rank_max: int = 32,
    int8: bool = False,
    dtype: torch.dtype = torch.float16,
    method: str = "gram",
    keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
) -> Factors:
    """x [Hkv, T, d]: the compressed tokens of one layer in span order (span i has span_len[i] rows).

    Rank rule: the energy rule (:func:`choose_rank`), further narrowed, where given, by
    ``keep(sigma [Hkv, S, R]) -> bool [Hkv, S, R]``, a per-component decision (the trained rank gate,
    sekv/rank_gate.py); kept components need not be a prefix: they are moved to the front before packing.
    """
    return factorize_many([x], span_len, energies=[energy], keeps=[keep], rank_max=rank_max, int8=int8, dtype=dtype, method=method)[0]


def factorize_many(
    xs: list[torch.Tensor],
    span_len: torch.Tensor,
    *,
    energies: list[float],
    keeps: list[Callable[[torch.Tensor], torch.Tensor] | None],
    rank_max: int = 32,
    int8: bool = False,
    dtype: torch.dtype = torch.float16,
    method: str = "gram",
) -> list[Factors]:
    """:func:`factorize` of several matrices of the same spans (a layer's keys and values: xs [Hkv_j, T, d]), each
    with its own energy and gate, from **one** batched decomposition of all of them (each (matrix, head, span)
    block is decomposed on its own, so the factors are those of separate calls; the launches and host syncs of
    the decomposition are paid once)."""
    n = span_len.long().to(xs[0].device)
    us_all, sig_all, vt_all = decompose_spans(torch.cat([x.float() for x in xs]) if len(xs) > 1 else xs[0], span_len, rank_max, method)
    out, o = [], 0
    for x, energy, keep in zip(xs, energies, keeps):
        h = x.shape[0]
        us_pad, sig_pad, vt_pad = us_all[o : o + h], sig_all[o : o + h], vt_all[o : o + h]
        o += h
        hkv, s, _, r_cap = us_pad.shape
        rank = torch.minimum(choose_rank(sig_pad.reshape(hkv * s, r_cap), energy, rank_max).view(hkv, s), n.view(1, -1))
        if keep is not None:  # the gate may only drop components the energy rule keeps (the rule bounds the pack size)
            within = torch.arange(r_cap, device=sig_pad.device).view(1, 1, -1) < rank.to(sig_pad.device).unsqueeze(-1)
            mask = keep(sig_pad) & (sig_pad > 0) & within
            order = torch.argsort((~mask).to(torch.int8), dim=-1, stable=True)  # kept components first, in order
            us_pad = us_pad.gather(3, order.unsqueeze(2).expand_as(us_pad))
            vt_pad = vt_pad.gather(2, order.unsqueeze(-1).expand_as(vt_pad))
            rank = mask.sum(-1)
        out.append(pack(us_pad, vt_pad, rank, n, int8=int8, dtype=dtype))
    return out


def pack(us_pad: torch.Tensor, vt_pad: torch.Tensor, rank: torch.Tensor, n: torch.Tensor, *, int8: bool, dtype: torch.dtype) -> Factors:
    """Padded factors (leading ``rank`` components valid) -> the ragged packed layout."""
    hkv, s, n_max, r_cap = us_pad.shape
    d = vt_pad.shape[-1]
    dev = us_pad.device
    if s == 0 or n_max == 0 or r_cap == 0:  # no spans (a very short document): empty factors, zero ranks
        empty = lambda dt: torch.zeros(0, dtype=dt, device=dev)  # noqa: E731
        rank16 = torch.zeros(hkv, s, dtype=torch.int16, device=dev)
        if not int8:
            return Factors(empty(dtype), empty(dtype), rank16)
        return Factors(empty(torch.int8), empty(torch.int8), rank16, torch.zeros(int(n.sum()) * hkv, dtype=torch.float16, device=dev), empty(torch.float16))
    # the packed layout walks (g, i, row, col) in row-major order over the valid rows and columns; its index is built
    # from the block sizes, which cost one device -> host copy of the ranks (boolean selection would sync per tensor)
    n = n.to(dev).long()
    rank = rank.to(dev).long()
    rank_host = rank.cpu()
    n_host = n.cpu()
    t = int(n_host.sum())
    sid = torch.repeat_interleave(torch.arange(s, device=dev), n, output_size=t)  # token row -> span
    j = torch.arange(t, device=dev) - torch.repeat_interleave(_excl_cumsum(n), n, output_size=t)  # row in its span
    g = torch.arange(hkv, device=dev).view(-1, 1)
    row_lens = rank[:, sid]  # [Hkv, T]: each valid row keeps its block's rank columns
    row_starts = ((g * s + sid) * n_max + j) * r_cap
    us_idx = _ragged(row_starts.flatten(), row_lens.flatten(), int((rank_host * n_host.view(1, -1)).sum()))
    gi = torch.arange(hkv * s, device=dev)
    comp = _ragged(gi * r_cap, rank.flatten(), int(rank_host.sum()))  # flat (g, i, c) of the kept components
    vt_idx = (comp.view(-1, 1) * d + torch.arange(d, device=dev)).flatten()
    rank16 = rank.to(torch.int16)
    if not int8:
        return Factors(us_pad.flatten()[us_idx].to(dtype), vt_pad.flatten()[vt_idx].to(dtype), rank16)
    cols_ok = torch.arange(r_cap, device=dev).view(1, 1, -1) < rank.unsqueeze(-1)  # [Hkv, S, r_cap]
    us_scale = (torch.where(cols_ok.unsqueeze(2), us_pad.abs(), 0.0).amax(-1) / INT8_MAX).clamp_min(1e-8).to(torch.float16)  # [Hkv, S, n_max]
    us_q = torch.round(us_pad / us_scale.float().unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    vt_scale = (vt_pad.abs().amax(-1) / INT8_MAX).clamp_min(1e-8).to(torch.float16)  # [Hkv, S, r_cap]
    vt_q = torch.round(vt_pad / vt_scale.float().unsqueeze(-1)).clamp(-INT8_MAX, INT8_MAX).to(torch.int8)
    return Factors(us_q.flatten()[us_idx], vt_q.flatten()[vt_idx], rank16, us_scale[:, sid, j].flatten(), vt_scale.flatten()[comp])


def _ragged(starts: torch.Tensor, lens: torch.Tensor, total: int) -> torch.Tensor:
    """Concatenation of arange(starts[e], starts[e] + lens[e]) over e (lens may be 0), given its length: no sync."""
    if total == 0:
        return torch.empty(0, dtype=torch.long, device=starts.device)
    first = torch.repeat_interleave(starts - _excl_cumsum(lens), lens, output_size=total)
    return first + torch.arange(total, device=starts.device)


def _excl_cumsum(x: torch.Tensor) -> torch.Tensor:
    return torch.cumsum(x, 0) - x


def ranges(starts: torch.Tensor, lens: torch.Tensor) -> torch.Tensor:
    """Concatenation of arange(starts[e], starts[e] + lens[e]) over e, without a loop.

    A cumulative sum of steps: +1 inside a range, a jump to the next start where one begins.
    """
    keep = lens > 0
    starts, lens = starts[keep], lens[keep]
    total = int(lens.sum())
    if total == 0:
        return torch.empty(0, dtype=torch.long, device=starts.device)
    step = torch.ones(total, dtype=torch.long, device=starts.device)
    first = _excl_cumsum(lens)
    step[first[1:]] = starts[1:] - (starts[:-1] + lens[:-1] - 1)
    step[0] = starts[0]
    return torch.cumsum(step, 0)


@dataclass
class Layout:
    """Load-time offsets into one layer's packed factors (see :func:`offsets`)."""

    rank: torch.Tensor  # [Hkv, S] int64
    us_off: torch.Tensor
    vt_off: torch.Tensor
    row_off: torch.Tensor

    @classmethod
    def of(cls, f: Factors, span_len: torch.Tensor, d: int) -> "Layout":
        rank = f.rank.long()
        return cls(rank, *offsets(rank, span_len, d))


def stack_kv(fk: Factors, fv: Factors) -> Factors:
    """One factor set holding K (heads 0..Hkv-1) then V (heads Hkv..2Hkv-1), so that one gather and
    one batched product reconstruct both (the packed layout is head-major, so this is concatenation)."""
    sc = fk.us_scale is not None
    return Factors(
        torch.cat([fk.us, fv.us]),
        torch.cat([fk.vt, fv.vt]),
        torch.cat([fk.rank, fv.rank]),
        torch.cat([fk.us_scale, fv.us_scale]) if sc else None,
        torch.cat([fk.vt_scale, fv.vt_scale]) if sc else None,
    )


@dataclass
class Fetch:
    """The compact factor blocks of a set of (KV head, span) pairs: what moves to the compute device."""

    us: torch.Tensor
    vt: torch.Tensor
    us_scale: torch.Tensor | None
    vt_scale: torch.Tensor | None
    n: torch.Tensor  # [E] int64, rows per block
    r: torch.Tensor  # [E] int64, rank per block
    n_max: int
    r_max: int

    def nbytes(self) -> int:
        ts = [self.us, self.vt, self.us_scale, self.vt_scale]
        return sum(t.numel() * t.element_size() for t in ts if t is not None)

    def to(self, device, non_blocking: bool = False) -> "Fetch":
        mv = lambda t: None if t is None else t.to(device, non_blocking=non_blocking)  # noqa: E731
        return Fetch(mv(self.us), mv(self.vt), mv(self.us_scale), mv(self.vt_scale), mv(self.n), mv(self.r), self.n_max, self.r_max)


def gather(
    f: Factors,
    lay: Layout,
    span_len: torch.Tensor,
    g: torch.Tensor,
    i: torch.Tensor,
    d: int,
    out: dict | None = None,
    row0: torch.Tensor | None = None,
    rows: torch.Tensor | None = None,
) -> Fetch:
    """Select the blocks of pairs (g[e], i[e]) from the packed (CPU) factors, compactly.

    ``row0`` / ``rows`` [E]: only the token rows row0[e] .. row0[e] + rows[e] - 1 of span i[e] (a zoom block,
    sekv/segment.py ``zoom_blocks``): those rows of U*sigma and the span's whole Vt.  Default: every row.
    ``out`` may hold preallocated (pinned) 1-D buffers named like the fields; they are
    used (and grown) in place so a CUDA copy can be asynchronous.
    """
    r = lay.rank[g, i]
    if row0 is None:
        n = span_len[i].long()
        row0 = torch.zeros_like(n)
    else:
        n = rows.long()
        row0 = row0.long()
    parts = {
        "us": (f.us, ranges(lay.us_off[g, i] + row0 * r, n * r)),
        "vt": (f.vt, ranges(lay.vt_off[g, i], r * d)),
    }
    if f.us_scale is not None:
        parts["us_scale"] = (f.us_scale, ranges(lay.row_off[g, i] + row0, n))
        parts["vt_scale"] = (f.vt_scale, ranges(torch.div(lay.vt_off[g, i], d, rounding_mode="floor"), r))
    got: dict[str, torch.Tensor | None] = {"us_scale": None, "vt_scale": None}
    for name, (src, idx) in parts.items():
        if out is None:
            got[name] = src.index_select(0, idx)
            continue
        buf = out.get(name)
        if buf is None or buf.dtype != src.dtype or buf.numel() < idx.numel():
            buf = torch.empty(max(idx.numel(), 2 * (buf.numel() if buf is not None else 0)), dtype=src.dtype, pin_memory=bool(out.get("_pin")))
            out[name] = buf
        got[name] = torch.index_select(src, 0, idx, out=buf[: idx.numel()])
    return Fetch(got["us"], got["vt"], got["us_scale"], got["vt_scale"], n, r, int(n.max()) if n.numel() else 0, int(r.max()) if r.numel() else 0)


def expand(fe: Fetch, d: int, dtype=torch.float32) -> torch.Tensor:
    """Reconstruct the fetched blocks on their device: [E, n_max, d] (rows past n[e] are zero)."""
    dev = fe.us.device
    e = fe.n.numel()
    if e == 0 or fe.n_max == 0:
        return torch.zeros(e, fe.n_max, d, dtype=dtype, device=dev)
    if fe.r_max == 0:
        return torch.zeros(e, fe.n_max, d, dtype=dtype, device=dev)
    n, r = fe.n.view(-1, 1, 1), fe.r.view(-1, 1, 1)
    j = torch.arange(fe.n_max, device=dev).view(1, -1, 1)
    c = torch.arange(fe.r_max, device=dev).view(1, 1, -1)
    cu = _excl_cumsum(fe.n * fe.r).view(-1, 1, 1)
    ok = (j < n) & (c < r)
    idx = torch.where(ok, cu + j * r + c, torch.zeros((), dtype=torch.long, device=dev))
    us = fe.us[idx].to(dtype) * ok
    c2 = torch.arange(fe.r_max, device=dev).view(1, -1, 1)
    ee = torch.arange(d, device=dev).view(1, 1, -1)
    cv = _excl_cumsum(fe.r * d).view(-1, 1, 1)
    okv = (c2 < r).expand(-1, -1, d)
    vidx = torch.where(okv, cv + c2 * d + ee, torch.zeros((), dtype=torch.long, device=dev))
    vt = fe.vt[vidx].to(dtype) * okv
    if fe.us_scale is not None:
        rows = torch.where(j < n, _excl_cumsum(fe.n).view(-1, 1, 1) + j, torch.zeros((), dtype=torch.long, device=dev))
        us = us * fe.us_scale[rows].to(dtype)
        comp = torch.where(c2 < r, _excl_cumsum(fe.r).view(-1, 1, 1) + c2, torch.zeros((), dtype=torch.long, device=dev))
        vt = vt * fe.vt_scale[comp].to(dtype)
    return torch.bmm(us, vt)


def reconstruct_all(f: Factors, span_len: torch.Tensor, d: int) -> torch.Tensor:
    """Every span's reconstruction [Hkv, T, d] float32 (reference / tests; the runtime gathers subsets)."""
    hkv, s = f.rank.shape
    lay = Layout.of(f, span_len, d)
    dev = span_len.device
    g = torch.arange(hkv, device=dev).repeat_interleave(s)
    i = torch.arange(s, device=dev).repeat(hkv)
    rows = expand(gather(f, lay, span_len, g, i, d), d)
    valid = torch.arange(rows.shape[1], device=dev).view(1, -1) < span_len.long()[i].view(-1, 1)
    return rows[valid].view(hkv, -1, d)
