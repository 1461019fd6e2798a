"""At-rest 4- / 3-bit codec of the int8 SVD factors (sekv/factorize.py): smaller packs, the same memory.

Only the pack file changes: a memory decodes the tensors back to the int8 factors (+ the float16
row scales factorize.pack wrote) when it opens the pack, so everything that reads factors (the CPU
reference step, sekv/blocks.py, sekv/decode.py) is unchanged.

**Group code.**  A flat int8 tensor q is cut into groups of ``group`` consecutive elements (the
last one zero-padded).  Each group stores its absolute maximum a = max |q| as one **uint8** (q is
int8, so a is an integer 0..127, stored exactly; a float16 multiplier would cost twice as much) and
one B-bit code per element (B = 4 for a table of 16 levels on [-1, 1], 3 for 8 levels): the index of the
level nearest to q / a, packed as a little-endian bit stream (bit j of element k is stream bit k B + j;
for B = 4, element 2k in the low nibble of byte k, 2k+1 in the high one).  Decoding: q^ = round(level * a).
Error per element: |q - q^| <= a * gap / 2 + 1/2, gap the distance between the two levels around
q / a (the 1/2: rounding back to int8); uniform ``int4`` levels k / 7: a / 14 + 1/2.

Level tables (``LEVELS``): ``int4``, k / 7 for k = -8..7 (-8 / 7 is never chosen since |q / a| <= 1);
``nf4``, the NormalFloat levels of QLoRA (Dettmers et al. 2023): standard-normal quantiles scaled to
[-1, 1], denser near zero; ``int3`` (k / 3, k = -4..3) and ``nf3`` (the same construction with 8 levels)
for 3 bits.  The value factors of default packs use ``VALUES_3BIT`` (values tolerate it, keys do not).

**Row scales** (``scales="log8"``, :func:`encode_scales`): the float16 ``us_scale`` / ``vt_scale`` as one
byte each on a per-tensor log2 grid of 255 steps between the smallest and largest positive scale.

**Which elements, in which order** (benchmarks/studies/factor_codec.py measured the choices, docs/design.md):

* ``us`` (n_i x r blocks, row-major; factorize scaled every row to |max| = 127) is encoded
  **column-major within each block** (``order="col"``): a column holds one singular direction, so its
  values are alike and the trailing, small components get their own small multiplier;
* ``vt`` (r x d blocks, one unit vector per row): the first ``lead`` rows of every block stay int8
  (tensor ``vt.lead``), the rest is group-coded in row order.  The leading component of pre-RoPE keys
  carries most of a span's energy and is nearly the same for every token of it; a 4-bit error in its
  direction shifts every key of the span alike, i.e. the span's attention mass (key error 0.099 ->
  0.146 with every row coded; 0.111 with the first one kept).

Pack tensors for a prefix ``sekv.fk.{l}`` / ``sekv.fv.{l}`` (instead of ``us`` / ``vt``):
``us.qB`` / ``vt.qB`` uint8 codes, ``us.qBm`` / ``vt.qBm`` uint8 group maxima (B = 4 or 3), ``vt.lead`` int8;
``us_scale``, ``vt_scale`` as before or ``us_scale.l8`` / ``vt_scale.l8`` uint8 + ``*.l8p`` float32 [2];
``rank`` as before.  ``sekv.factor_codec`` int64 [4] = (group, levels id, us order id, lead), or [5] with
the scales id, makes a pack self-describing; ``sekv.factor_codec.fv`` where the values' code differs.
"""

from __future__ import annotations

import torch

from . import factorize as fz

#: 16 levels on [-1, 1], ascending; the position in this dict is the id stored in ``sekv.factor_codec``
LEVELS: dict[str, torch.Tensor] = {
    "int4": torch.arange(-8, 8, dtype=torch.float32) / 7.0,
    "nf4": torch.tensor(
        [
            -1.0, -0.6961928009986877, -0.5250730514526367, -0.39491748809814453,
            -0.28444138169288635, -0.18477343022823334, -0.09105003625154495, 0.0,
            0.07958029955625534, 0.16093020141124725, 0.24611230194568634, 0.33791524171829224,
            0.44070982933044434, 0.5626170039176941, 0.7229568362236023, 1.0,
        ],
        dtype=torch.float32,
    ),
    # 3 bits: k / 3 for k = -4..3 (-4 / 3 is never chosen); the NormalFloat construction with 8 levels
    # (4 positive standard-normal quantiles, 3 negative, 0; the positive ones are nf4's 9th, 11th, 13th, 15th)
    "int3": torch.arange(-4, 4, dtype=torch.float32) / 3.0,
    "nf3": torch.tensor(
        [-1.0, -0.478629160115911, -0.21714181782574415, 0.0, 0.16093017270493618, 0.33791519352165506, 0.5626169700752371, 1.0],
        dtype=torch.float32,
    ),
}
ORDERS = ("row", "col")
#: row scales (``us_scale`` / ``vt_scale``) at rest: ``fp16`` as factorize wrote them, or ``log8`` (:func:`encode_scales`)
SCALES = ("fp16", "log8")
CONFIG = "sekv.factor_codec"
#: the 4-bit codec of ``factor_bits=4`` packs, chosen (docs/design.md, factors) among the variants benchmarks/studies/factor_codec.py measured
DEFAULT = {"group": 32, "levels": "nf4", "order": "col", "lead": 1}
#: the value factors' code with ``value_bits=3`` (docs/design.md, factors): nf3 levels in groups
#: of 128 (values barely notice the group size: attention-output error 0.2285 at 32, 0.2303 at 128)
VALUES_3BIT = {"group": 128, "levels": "nf3", "order": "col", "lead": 1}


def bits_of(levels: str) -> int:
    """Bits per element of a level table (16 levels: 4, 8 levels: 3)."""
    return int(LEVELS[levels].numel()).bit_length() - 1


def code_names(levels: str) -> tuple[str, str, str, str]:
    """Tensor names (relative to the prefix) of the codes and group maxima: ``us.q4``, ``us.q4m``, ``vt.q4``, ``vt.q4m``
    for 4-bit levels, ``us.q3`` ... for 3-bit ones."""
    b = bits_of(levels)
    return f"us.q{b}", f"us.q{b}m", f"vt.q{b}", f"vt.q{b}m"


def n_groups(n: int, group: int) -> int:
    return (n + group - 1) // group


def check(group: int, levels: str, order: str = "col", lead: int = 0, scales: str = "fp16") -> None:
    if group < 2 or group % 2 or group > 4096:
        raise ValueError(f"factor codec: group must be an even number in 2..4096, not {group}")
    if levels not in LEVELS:
        raise ValueError(f"factor codec: levels must be one of {', '.join(LEVELS)}, not {levels!r}")
    if order not in ORDERS:
        raise ValueError(f"factor codec: order must be one of {', '.join(ORDERS)}, not {order!r}")
    if lead < 0:
        raise ValueError(f"factor codec: lead must be >= 0, not {lead}")
    if scales not in SCALES:
        raise ValueError(f"factor codec: scales must be one of {', '.join(SCALES)}, not {scales!r}")


def _pack_bits(idx: torch.Tensor, bits: int) -> torch.Tensor:
    """Level indices [n] (< 2^bits) -> a little-endian bit stream, uint8 [ceil(n * bits / 8)]: bit j of element k
    is bit (k * bits + j) of the stream; for 4 bits, element 2k in the low nibble of byte k."""
    n = idx.numel()
    if bits == 4:
        if n % 2:
            idx = torch.cat([idx, idx.new_zeros(1)])
        pairs = idx.view(-1, 2)
        return (pairs[:, 0] | (pairs[:, 1] << 4)).contiguous()
    sh = torch.arange(8, device=idx.device, dtype=torch.uint8)
    b = ((idx.view(-1, 1) >> sh[:bits]) & 1).flatten()
    nb = (n * bits + 7) // 8
    b = torch.cat([b, b.new_zeros(nb * 8 - b.numel())]).view(nb, 8)
    return (b << sh).sum(1, dtype=torch.int32).to(torch.uint8)


def _unpack_bits(codes: torch.Tensor, n: int, bits: int) -> torch.Tensor:
    """Inverse of :func:`_pack_bits`: level indices [n] int64."""
    sh = torch.arange(8, device=codes.device, dtype=torch.uint8)
    b = ((codes.view(-1, 1) >> sh) & 1).flatten()[: n * bits].view(n, bits).long()
    return (b << sh[:bits].long()).sum(1)


#: elements encoded at a time, in groups of `group` (a multiple of 8, so every chunk's codes are whole bytes): the
#: float / index temporaries stay ~20 bytes x this, not x the document's factor count
_ENCODE_CHUNK = 1 << 20
#: the same on a GPU, where each chunk is ~10-20 kernel launches: 4x fewer chunks (an 8B model's layer at 128K tokens
#: codes ~33 M us elements), ~160 MB of temporaries (what compress's device bound leaves, sekv/compress.py MARGIN_BYTES)
_ENCODE_CHUNK_CUDA = 1 << 22


def _encode_chunk(t: torch.Tensor) -> int:
    return _ENCODE_CHUNK_CUDA if t.is_cuda else _ENCODE_CHUNK


def encode(q: torch.Tensor, group: int, levels: str = "nf4") -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [n] -> (codes uint8 [ceil(n * bits / 8)], group maxima uint8 [ceil(n / group)]); bits = bits_of(levels)."""
    if q.dtype != torch.int8 or q.dim() != 1:
        raise ValueError("codec.encode takes a 1-D int8 tensor")
    check(group, levels)
    step = max(1, _encode_chunk(q) // (8 * group)) * 8 * group  # groups and bytes never straddle two chunks
    if q.numel() <= step:
        return _encode(q, group, levels)
    parts = [_encode(q[a : a + step], group, levels) for a in range(0, q.numel(), step)]
    return torch.cat([c for c, _ in parts]), torch.cat([m for _, m in parts])


def _encode(q: torch.Tensor, group: int, levels: str) -> tuple[torch.Tensor, torch.Tensor]:
    lv = LEVELS[levels].to(q.device, non_blocking=True)  # pageable: staged at once, no stream sync on CUDA
    n = q.numel()
    g = n_groups(n, group)
    x = torch.zeros(g * group, dtype=torch.float32, device=q.device)
    x[:n] = q.float().clamp(-127, 127)
    x = x.view(g, group)
    a = x.abs().amax(1)  # integers 0..127
    y = x / torch.where(a > 0, a, torch.ones_like(a)).unsqueeze(1)  # in [-1, 1]; a zero group stays 0
    mids = (lv[1:] + lv[:-1]) / 2
    idx = torch.bucketize(y, mids).to(torch.uint8).flatten()[:n]  # the nearest level
    return _pack_bits(idx, bits_of(levels)), a.to(torch.uint8)


def decode(codes: torch.Tensor, maxima: torch.Tensor, n: int, group: int, levels: str = "nf4") -> torch.Tensor:
    """Inverse of :func:`encode`: int8 [n].  Decoded a chunk of elements at a time (as encode codes them: groups and
    bytes never straddle two chunks), so the float and index temporaries stay ~16 bytes x the chunk, not x n (an 8B
    model's layer at 128K tokens: tens of millions of elements, decoded on the device while a first question waits)."""
    bits = bits_of(levels)
    if codes.numel() != (n * bits + 7) // 8 or maxima.numel() != n_groups(n, group):
        raise ValueError(f"factor codec: {codes.numel()} codes / {maxima.numel()} group maxima do not hold {n} elements in groups of {group}")
    step = max(1, _encode_chunk(codes) // (8 * group)) * 8 * group
    if n <= step:
        return _decode(codes, maxima, n, group, levels, bits)
    out = torch.empty(n, dtype=torch.int8, device=codes.device)
    for a in range(0, n, step):
        m = min(step, n - a)
        out[a : a + m] = _decode(codes[a * bits // 8 : (a * bits + m * bits + 7) // 8], maxima[a // group : a // group + n_groups(m, group)], m, group, levels, bits)
    return out


def _decode(codes: torch.Tensor, maxima: torch.Tensor, n: int, group: int, levels: str, bits: int) -> torch.Tensor:
    lv = LEVELS[levels].to(codes.device, non_blocking=True)  # pageable: staged at once, no stream sync on CUDA
    g = maxima.numel()
    x = torch.zeros(g * group, dtype=torch.float32, device=codes.device)
    if bits == 4:
        byte = torch.arange(256, device=codes.device)
        pair = torch.stack([lv[byte & 0x0F], lv[byte >> 4]], 1)  # [256, 2]: the two levels of every byte
        x[: 2 * codes.numel()] = pair[codes.long()].flatten()[: g * group]
    else:
        x[:n] = lv[_unpack_bits(codes, n, bits)]
    x = x.view(g, group) * maxima.float().unsqueeze(1)
    return torch.round(x.flatten()[:n]).clamp(-127, 127).to(torch.int8)


def column_order(rows: torch.Tensor, cols: torch.Tensor, total: int | None = None) -> torch.Tensor:
    """Ragged blocks rows[b] x cols[b], row-major and concatenated: where each element goes in the
    column-major layout (every block keeps its offset o; element (j, c) moves from o + j * cols + c to
    o + c * rows + j).  Encode ``x[p] = flat``, decode ``flat = x[p]``.  [sum rows * cols] int64.
    ``total``: sum(rows * cols) when the caller knows it (no read of the device's sum: no host sync on CUDA)."""
    rows, cols = rows.long().flatten(), cols.long().flatten()
    size = rows * cols
    total = int(size.sum()) if total is None else total
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=rows.device)
    off = torch.repeat_interleave(torch.cumsum(size, 0) - size, size, output_size=total)
    # (j, c) of each element from its index t within the block, in float32: t < rows * cols is exact there and
    # t / cols is at least 1 / cols away from the next integer, so floor() is exact (and faster than integer division)
    t = (torch.arange(total, device=rows.device) - off).float()
    c = torch.repeat_interleave(cols.float(), size, output_size=total)
    j = torch.floor(t / c)
    return off + ((t - j * c) * torch.repeat_interleave(rows.float(), size, output_size=total) + j).long()


def _us_order(rank: torch.Tensor, span_len: torch.Tensor, total: int | None = None) -> torch.Tensor:
    return column_order(span_len.long().view(1, -1).expand_as(rank), rank, total)


def _column_runs(x: torch.Tensor, rank: torch.Tensor, span_len: torch.Tensor):
    """The runs of whole blocks :func:`_from_columns` and :func:`_to_columns` reorder one at a time (a block keeps
    its offset, so runs reorder independently): (o0, o1, order) with ``order`` the run's :func:`_us_order`, its
    index temporaries ~_ENCODE_CHUNK elements.  The runs are cut where ``rank`` and ``span_len`` are (the host's:
    nothing is read back from ``x``'s device)."""
    rows = span_len.long().view(1, -1).expand_as(rank).flatten()
    cols = rank.long().flatten()
    end = torch.cumsum(rows * cols, 0)
    dev = x.device
    b0, o0, chunk = 0, 0, _encode_chunk(x)
    while b0 < rows.numel():
        b1 = max(b0 + 1, int(torch.searchsorted(end, o0 + chunk, right=True)))
        o1 = int(end[b1 - 1])
        yield o0, o1, column_order(rows[b0:b1].to(dev, non_blocking=True), cols[b0:b1].to(dev, non_blocking=True), o1 - o0)
        b0, o0 = b1, o1


def _from_columns(x: torch.Tensor, rank: torch.Tensor, span_len: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`_to_columns`, ``x[_us_order(rank, span_len)]``, a run of whole blocks at a time (rank and
    span_len on the host)."""
    out = torch.empty_like(x)
    for o0, o1, order in _column_runs(x, rank, span_len):
        out[o0:o1] = x[o0:o1][order]
    return out


def _to_columns(us: torch.Tensor, rank: torch.Tensor, span_len: torch.Tensor) -> torch.Tensor:
    """``x[_us_order(rank, span_len)] = us``, a run of whole blocks at a time (rank and span_len the host's, from
    encode_factors)."""
    x = torch.empty_like(us)
    for o0, o1, order in _column_runs(us, rank, span_len):
        x[o0:o1][order] = us[o0:o1]
    return x


def _vt_rows(rank: torch.Tensor, lead: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Rows of a packed ``vt`` ([sum r, d]) in the first ``lead`` of their block, and the others, ascending: the
    rows :func:`_lead_mask` marks and leaves, as indices (made where ``rank`` is)."""
    r = rank.long().flatten()
    first = torch.cumsum(r, 0) - r
    n_lead = r.clamp_max(lead)
    return _runs(first, n_lead), _runs(first + n_lead, r - n_lead)


def _runs(start: torch.Tensor, n: torch.Tensor) -> torch.Tensor:
    """start[b], start[b] + 1, ..., start[b] + n[b] - 1 for every b, concatenated: int64 [sum n]."""
    k = int(n.sum())
    return torch.repeat_interleave(start, n, output_size=k) + torch.arange(k, device=n.device) - torch.repeat_interleave(torch.cumsum(n, 0) - n, n, output_size=k)


def _lead_mask(rank: torch.Tensor, d: int, lead: int, total: int | None = None) -> torch.Tensor:
    """Elements of a packed ``vt`` in the first ``lead`` rows of their block: bool [sum r * d].  ``total``: sum(r),
    when the caller knows it (no host sync on CUDA)."""
    r = rank.long().flatten()
    total = int(r.sum()) if total is None else total
    if total == 0:
        return torch.zeros(0, dtype=torch.bool, device=r.device)
    first = torch.cumsum(r, 0) - r
    comp = torch.arange(total, device=r.device) - torch.repeat_interleave(first, r, output_size=total)  # each vt row's component index
    return (comp < lead).repeat_interleave(d)


def factor_sizes(rank: torch.Tensor, span_len: torch.Tensor, lead: int) -> tuple[int, int, int]:
    """(us elements, vt rows, vt rows in the first ``lead`` of their block) of factors with these ranks [Hkv, S] and
    span lengths [S]: the sizes a decode needs, read where the ranks are (the host: the pack's tensors)."""
    r = rank.long()
    return int((r * span_len.long().view(1, -1)).sum()), int(r.sum()), int(r.clamp_max(lead).sum())


def encode_scales(s: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log8``: positive float16 row scales [m] -> (codes uint8 [m], (lo, step) float32 [2]).

    Code 0 is an exact 0 (factorize's zero rows); code c >= 1 stands for 2^(lo + (c - 1) step), with lo / hi the
    log2 of the tensor's smallest / largest positive scale and step = (hi - lo) / 254, so every positive scale is
    within a relative 2^(step / 2) - 1 (+ float16 rounding) of its decoded value."""
    x = s.float()
    if not x.numel():
        return torch.zeros(0, dtype=torch.uint8, device=x.device), torch.zeros(2, dtype=torch.float32, device=x.device)
    pos = x > 0
    lg = torch.log2(torch.where(pos, x, torch.ones_like(x)))
    inf = torch.tensor(float("inf"), device=x.device)
    lo, hi = torch.where(pos, lg, inf).min(), torch.where(pos, lg, -inf).max()  # over the positive ones: no selection
    if not bool(torch.isfinite(lo)):  # none positive
        return torch.zeros(x.numel(), dtype=torch.uint8, device=x.device), torch.zeros(2, dtype=torch.float32, device=x.device)
    step = torch.clamp((hi - lo) / 254, min=1e-6)
    c = torch.where(pos, torch.round((lg - lo) / step).clamp(0, 254) + 1, torch.zeros_like(x))
    return c.to(torch.uint8), torch.stack([lo, step]).float()


def decode_scales(codes: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """Inverse of :func:`encode_scales`: float16 [m]."""
    c = codes.float()
    x = torch.exp2(p[0].float() + (c - 1) * p[1].float())
    return torch.where(c > 0, x, torch.zeros_like(x)).to(torch.float16)


def encode_factors(f: fz.Factors, span_len: torch.Tensor, d: int, *, group: int, levels: str, order: str, lead: int, scales: str = "fp16") -> dict[str, torch.Tensor]:
    """int8 factors -> the at-rest tensors (names relative to the prefix, e.g. ``us.q4``)."""
    check(group, levels, order, lead, scales)
    if f.us_scale is None:
        raise ValueError("factor codec: the factors must be int8 (factors_8bit)")
    dev = f.us.device
    # what indexes the factors is made from the ranks and span lengths on the host (merge keeps its ranks there when
    # the factors are on an accelerator): no size or boolean selection is read back from the device
    rank, span_len = f.rank.cpu(), span_len.cpu()
    us = f.us
    if order == "col":
        us = _to_columns(us, rank, span_len)
    lead_rows, rest_rows = (i.to(dev, non_blocking=True) for i in _vt_rows(rank, lead))
    vt = f.vt.reshape(-1, d)
    cu, mu = encode(us, group, levels)
    cv, mv = encode(vt.index_select(0, rest_rows).flatten(), group, levels)
    out = dict(zip(code_names(levels), (cu, mu, cv, mv)))
    out.update({"vt.lead": vt.index_select(0, lead_rows).flatten(), "rank": f.rank})
    out.update(code_scales({"us_scale": f.us_scale, "vt_scale": f.vt_scale}, scales))
    return out


def code_scales(t: dict[str, torch.Tensor], scales: str) -> dict[str, torch.Tensor]:
    """The float16 row scales ``us_scale`` / ``vt_scale`` at rest: as they are (``fp16``), or ``log8``
    (:func:`encode_scales`: ``us_scale.l8`` / ``us_scale.l8p`` ...)."""
    if scales != "log8":
        return dict(t)
    out = {}
    for k, s in t.items():
        out[f"{k}.l8"], out[f"{k}.l8p"] = encode_scales(s)
    return out


def scale_names(scales: str) -> tuple[str, ...]:
    return ("us_scale", "vt_scale") if scales == "fp16" else ("us_scale.l8", "us_scale.l8p", "vt_scale.l8", "vt_scale.l8p")


def decode_factors(t: dict[str, torch.Tensor], span_len: torch.Tensor, d: int, *, group: int, levels: str, order: str, lead: int, scales: str = "fp16",
                   sizes: tuple[int, int, int] | None = None, rank_host: torch.Tensor | None = None, span_host: torch.Tensor | None = None) -> fz.Factors:
    """Inverse of :func:`encode_factors` (tensors on one device): the int8 factors factorize.pack wrote, up to
    the code's error.  ``sizes``: :func:`factor_sizes` of the ranks, read on the host by the caller; with them a
    decode on an accelerator reads nothing back from it (no host sync): the vt rows are placed by their running
    counts instead of boolean indexing.  ``rank_host`` / ``span_host``: the ranks and span lengths on the host (the
    pack's): the us columns are re-ordered a run of blocks at a time and the vt rows placed by row indices made
    there, so the decode's temporaries stay bounded (a chunk, or a row index) instead of int64 tensors of every
    element (the same int8 factors, bit for bit)."""
    rank = t["rank"]
    if rank_host is None and rank.device.type == "cpu":
        rank_host = rank
    if rank_host is not None and span_host is None:
        span_host = span_len.cpu()
    n_us, n_rows, n_lead = sizes if sizes is not None else factor_sizes(rank, span_len, lead)
    cus, mus, cvt, mvt = code_names(levels)
    us = decode(t[cus], t[mus], n_us, group, levels)
    if order == "col":
        us = _from_columns(us, rank_host, span_host) if rank_host is not None else us[_us_order(rank, span_len.to(rank.device), n_us)]
    n_other = (n_rows - n_lead) * d
    rest = decode(t[cvt], t[mvt], n_other, group, levels)
    lead_vals = t["vt.lead"]
    if lead_vals.numel() != n_lead * d:
        raise ValueError(f"factor codec: {lead_vals.numel()} leading vt elements where the ranks give {n_lead * d}")
    if rank_host is not None and n_lead and n_other:  # rows placed by their indices from the host's ranks (encode's
        # _vt_rows): two row copies, not an int64 running count and two gathers of every element
        lead_rows, rest_rows = (i.to(rest.device, non_blocking=True) for i in _vt_rows(rank_host, lead))
        vt = torch.empty(n_rows, d, dtype=torch.int8, device=rest.device)
        vt.index_copy_(0, lead_rows, lead_vals.view(-1, d))
        vt.index_copy_(0, rest_rows, rest.view(-1, d))
        vt = vt.view(-1)
    elif n_lead == 0:
        vt = rest
    elif n_other == 0:
        vt = lead_vals.clone()
    else:  # element i is the c_i-th leading one or the (i - c_i)-th other one, c_i the leading ones up to i
        lm = _lead_mask(rank, d, lead, n_rows)
        c = torch.cumsum(lm, 0)
        i = torch.arange(lm.numel(), device=lm.device)
        vt = torch.where(lm, lead_vals[(c - 1).clamp_min(0)], rest[(i - c).clamp(0, n_other - 1)])
    if scales == "log8":
        us_s, vt_s = decode_scales(t["us_scale.l8"], t["us_scale.l8p"]), decode_scales(t["vt_scale.l8"], t["vt_scale.l8p"])
    else:
        us_s, vt_s = t["us_scale"], t["vt_scale"]
    return fz.Factors(us, vt, rank, us_s, vt_s)


def config_tensor(group: int, levels: str, order: str, lead: int, scales: str = "fp16") -> torch.Tensor:
    """[group, levels id, us order id, lead] (+ scales id where not fp16: packs before it have 4 entries)."""
    check(group, levels, order, lead, scales)
    c = [group, list(LEVELS).index(levels), ORDERS.index(order), lead] + ([SCALES.index(scales)] if scales != "fp16" else [])
    return torch.tensor(c, dtype=torch.long)


def parse_config(c: torch.Tensor) -> dict:
    v = [int(x) for x in c.tolist()]
    group, lv, order, lead = v[:4]
    return {"group": group, "levels": list(LEVELS)[lv], "order": ORDERS[order], "lead": lead, "scales": SCALES[v[4]] if len(v) > 4 else "fp16"}


def config_name(kind: str) -> str:
    """The config tensor of ``kind`` ("fk" / "fv"): ``sekv.factor_codec`` for both, unless the value factors have
    their own, ``sekv.factor_codec.fv``."""
    return f"{CONFIG}.{kind}" if kind == "fv" else CONFIG


def kind_config(store, names: set[str], kind: str) -> dict | None:
    """The codec of ``kind``'s factors in a pack, or None (factor_bits=8 / float packs)."""
    name = config_name(kind)
    if name in names:
        return parse_config(store.get(name))
    return parse_config(store.get(CONFIG)) if CONFIG in names else None


def read_factors(store, names: set[str], prefix: str, device=None, to_host: bool = True) -> fz.Factors | None:
    """A pack's coded factors under ``prefix`` decoded to int8 (CPU tensors), or None where they are stored
    plainly.  device: a CUDA device decodes there (the CPU decodes ~40 M elements/s on one thread: minutes
    for a 128K-token pack of an 8B model) and copies the int8 factors back (``to_host`` False: leaves them there)."""
    cfg = kind_config(store, names, prefix.split(".")[1])
    if cfg is None or f"{prefix}.{code_names(cfg['levels'])[0]}" not in names:
        return None
    head_dim = int(store.get("sekv.config")[3])
    span_len = (store.get("sekv.span_end") - store.get("sekv.span_start")).long()
    parts = code_names(cfg["levels"]) + ("vt.lead", "rank") + scale_names(cfg["scales"])
    segs = segments(store, names)
    if segs is not None:  # a pack `sekv add` extended: each segment decoded on its own, then in (head, span) order
        return _read_segments(store, prefix, parts, segs, span_len, head_dim, cfg, device, to_host)
    if device is not None and torch.device(device).type == "cuda":
        host = {k: store.get(f"{prefix}.{k}") for k in parts}
        sizes = factor_sizes(host["rank"], span_len, cfg["lead"])  # on the host: the decode there reads nothing back
        t = {k: v.to(device, non_blocking=True) for k, v in host.items()}  # pageable: staged at once, no stream sync
        f = decode_factors(t, span_len.to(device, non_blocking=True), head_dim, **cfg, sizes=sizes, rank_host=host["rank"], span_host=span_len)
        return fz.Factors(*(x.cpu() for x in (f.us, f.vt, f.rank, f.us_scale, f.vt_scale))) if to_host else f
    with fz.single_thread():  # element-wise passes over ~1M elements: two threads were 5x slower on our 2-core CPU
        return decode_factors({k: store.get(f"{prefix}.{k}") for k in parts}, span_len, head_dim, **cfg)


# -- segments: the coded factors of a pack `sekv add` extended ------------------------------------------------
#
# A group code and a log8 scale grid span a whole tensor, and a layer's factors are packed (KV head, span) ordered:
# appended spans cannot join the coded tensors without coding the old ones again (a second rounding).  So an
# extended pack keeps each ingest's or add's factors coded as they were, a *segment* of consecutive spans:
# ``sekv.factor_segments`` int64 [K+1] (span boundaries, 0 .. S), segment 0 under the usual names, segment j >= 1
# under ``{prefix}.s{j}.*``; ``{prefix}.rank`` holds every span's ranks.

SEGMENTS = "sekv.factor_segments"


def segments(store, names: set[str]) -> list[int] | None:
    """The span boundaries of a pack's factor segments, or None (one segment: every pack `sekv add` did not extend)."""
    return [int(x) for x in store.get(SEGMENTS).tolist()] if SEGMENTS in names else None


def segment_name(prefix: str, j: int, part: str) -> str:
    return f"{prefix}.{part}" if j == 0 or part == "rank" else f"{prefix}.s{j}.{part}"


def _read_segments(store, prefix, parts, segs, span_len, head_dim, cfg, device, to_host) -> fz.Factors:
    from .merge import merge_factors

    cuda = device is not None and torch.device(device).type == "cuda"
    dev = torch.device(device) if cuda else torch.device("cpu")
    rank = store.get(f"{prefix}.rank")
    pieces = []
    with fz.single_thread():
        for j, (a, b) in enumerate(zip(segs, segs[1:])):
            t = {k: store.get(segment_name(prefix, j, k)).to(dev) for k in parts if k != "rank"}
            t["rank"] = rank[:, a:b].contiguous().to(dev)
            sizes = factor_sizes(rank[:, a:b], span_len[a:b], cfg["lead"])  # the host's ranks: no sync on CUDA
            f = decode_factors(t, span_len[a:b].to(dev), head_dim, **cfg, sizes=sizes, rank_host=rank[:, a:b], span_host=span_len[a:b])
            pieces.append(({"us": f.us, "vt": f.vt, "rank": f.rank, "us_scale": f.us_scale, "vt_scale": f.vt_scale}, span_len[a:b].to(dev)))
        f = merge_factors(pieces, head_dim)
    return fz.Factors(*(x.cpu() for x in (f.us, f.vt, f.rank, f.us_scale, f.vt_scale))) if cuda and to_host else f
