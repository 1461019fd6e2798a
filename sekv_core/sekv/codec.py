"""At-rest 4-bit codec of the int8 SVD factors (sekv/factorize.py): smaller packs, the same memory.

Only the pack file changes: a memory decodes the tensors back to the int8 factors (+ the float16
row scales factorize.pack wrote) when it opens the pack, so everything that reads factors (the CPU
reference step, sekv/blocks.py, sekv/decode.py) is unchanged.

**Group code.**  A flat int8 tensor q is cut into groups of ``group`` consecutive elements (the
last one zero-padded).  Each group stores its absolute maximum a = max |q| as one **uint8** (q is
int8, so a is an integer 0..127, stored exactly; a float16 multiplier would cost twice as much) and
one 4-bit code per element, two per byte (element 2k in the low nibble, 2k+1 in the high): the index
of the level nearest to q / a in a table of 16 levels on [-1, 1].  Decoding: q^ = round(level * a).
Error per element: |q - q^| <= a * gap / 2 + 1/2, gap the distance between the two levels around
q / a (the 1/2: rounding back to int8); uniform ``int4`` levels k / 7: a / 14 + 1/2.

Level tables (``LEVELS``): ``int4``, k / 7 for k = -8..7 (-8 / 7 is never chosen since |q / a| <= 1);
``nf4``, the NormalFloat levels of QLoRA (Dettmers et al. 2023): standard-normal quantiles scaled to
[-1, 1], denser near zero.

**Which elements, in which order** (benchmarks/factor_codec.py measured the choices, docs/sekv.md §3):

* ``us`` (n_i x r blocks, row-major; factorize scaled every row to |max| = 127) is encoded
  **column-major within each block** (``order="col"``): a column holds one singular direction, so its
  values are alike and the trailing, small components get their own small multiplier;
* ``vt`` (r x d blocks, one unit vector per row): the first ``lead`` rows of every block stay int8
  (tensor ``vt.lead``), the rest is group-coded in row order.  The leading component of pre-RoPE keys
  carries most of a span's energy and is nearly the same for every token of it; a 4-bit error in its
  direction shifts every key of the span alike, i.e. the span's attention mass (key error 0.099 ->
  0.146 with every row coded; 0.111 with the first one kept).

Pack tensors for a prefix ``sekv.fk.{l}`` / ``sekv.fv.{l}`` (instead of ``us`` / ``vt``):
``us.q4`` / ``vt.q4`` uint8 codes, ``us.q4m`` / ``vt.q4m`` uint8 group maxima, ``vt.lead`` int8;
``us_scale``, ``vt_scale``, ``rank`` as before.  ``sekv.factor_codec`` int64 [4] = (group, levels id,
us order id, lead) makes a pack self-describing.
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
}
ORDERS = ("row", "col")
CONFIG = "sekv.factor_codec"
#: the codec of ``factor_bits=4`` packs, chosen in docs/sekv.md §3 among the variants benchmarks/factor_codec.py measured
DEFAULT = {"group": 32, "levels": "nf4", "order": "col", "lead": 1}


def n_groups(n: int, group: int) -> int:
    return (n + group - 1) // group


def check(group: int, levels: str, order: str = "col", lead: int = 0) -> None:
    if group < 2 or group % 2 or group > 4096:
        raise ValueError(f"factor codec: group must be an even number in 2..4096, not {group}")
    if levels not in LEVELS:
        raise ValueError(f"factor codec: levels must be one of {', '.join(LEVELS)}, not {levels!r}")
    if order not in ORDERS:
        raise ValueError(f"factor codec: order must be one of {', '.join(ORDERS)}, not {order!r}")
    if lead < 0:
        raise ValueError(f"factor codec: lead must be >= 0, not {lead}")


def encode(q: torch.Tensor, group: int, levels: str = "nf4") -> tuple[torch.Tensor, torch.Tensor]:
    """int8 [n] -> (codes uint8 [ceil(n / 2)], group maxima uint8 [ceil(n / group)])."""
    if q.dtype != torch.int8 or q.dim() != 1:
        raise ValueError("codec.encode takes a 1-D int8 tensor")
    check(group, levels)
    lv = LEVELS[levels].to(q.device)
    n = q.numel()
    g = n_groups(n, group)
    x = torch.zeros(g * group, dtype=torch.float32, device=q.device)
    x[:n] = q.float().clamp(-127, 127)
    x = x.view(g, group)
    a = x.abs().amax(1)  # integers 0..127
    y = x / torch.where(a > 0, a, torch.ones_like(a)).unsqueeze(1)  # in [-1, 1]; a zero group stays 0
    mids = (lv[1:] + lv[:-1]) / 2
    idx = torch.bucketize(y, mids).to(torch.uint8).flatten()  # the nearest level
    if idx.numel() % 2:
        idx = torch.cat([idx, idx.new_zeros(1)])
    pairs = idx.view(-1, 2)
    codes = pairs[:, 0] | (pairs[:, 1] << 4)
    return codes[: (n + 1) // 2].contiguous(), a.to(torch.uint8)


def decode(codes: torch.Tensor, maxima: torch.Tensor, n: int, group: int, levels: str = "nf4") -> torch.Tensor:
    """Inverse of :func:`encode`: int8 [n]."""
    if codes.numel() != (n + 1) // 2 or maxima.numel() != n_groups(n, group):
        raise ValueError(f"factor codec: {codes.numel()} codes / {maxima.numel()} group maxima do not hold {n} elements in groups of {group}")
    lv = LEVELS[levels].to(codes.device)
    byte = torch.arange(256, device=codes.device)
    pair = torch.stack([lv[byte & 0x0F], lv[byte >> 4]], 1)  # [256, 2]: the two levels of every byte
    g = maxima.numel()
    x = torch.zeros(g * group, dtype=torch.float32, device=codes.device)
    x[: 2 * codes.numel()] = pair[codes.long()].flatten()[: g * group]
    x = x.view(g, group) * maxima.float().unsqueeze(1)
    return torch.round(x.flatten()[:n]).clamp(-127, 127).to(torch.int8)


def column_order(rows: torch.Tensor, cols: torch.Tensor) -> torch.Tensor:
    """Ragged blocks rows[b] x cols[b], row-major and concatenated: where each element goes in the
    column-major layout (every block keeps its offset o; element (j, c) moves from o + j * cols + c to
    o + c * rows + j).  Encode ``x[p] = flat``, decode ``flat = x[p]``.  [sum rows * cols] int64."""
    rows, cols = rows.long().flatten(), cols.long().flatten()
    size = rows * cols
    total = int(size.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.long, device=rows.device)
    off = torch.repeat_interleave(torch.cumsum(size, 0) - size, size)
    # (j, c) of each element from its index t within the block, in float32: t < rows * cols is exact there and
    # t / cols is at least 1 / cols away from the next integer, so floor() is exact (and faster than integer division)
    t = (torch.arange(total, device=rows.device) - off).float()
    c = torch.repeat_interleave(cols.float(), size)
    j = torch.floor(t / c)
    return off + ((t - j * c) * torch.repeat_interleave(rows.float(), size) + j).long()


def _us_order(rank: torch.Tensor, span_len: torch.Tensor) -> torch.Tensor:
    return column_order(span_len.long().view(1, -1).expand_as(rank), rank)


def _lead_mask(rank: torch.Tensor, d: int, lead: int) -> torch.Tensor:
    """Elements of a packed ``vt`` in the first ``lead`` rows of their block: bool [sum r * d]."""
    r = rank.long().flatten()
    total = int(r.sum())
    if total == 0:
        return torch.zeros(0, dtype=torch.bool, device=r.device)
    first = torch.cumsum(r, 0) - r
    comp = torch.arange(total, device=r.device) - torch.repeat_interleave(first, r)  # each vt row's component index
    return (comp < lead).repeat_interleave(d)


def encode_factors(f: fz.Factors, span_len: torch.Tensor, d: int, *, group: int, levels: str, order: str, lead: int) -> dict[str, torch.Tensor]:
    """int8 factors -> the at-rest tensors (names relative to the prefix, e.g. ``us.q4``)."""
    check(group, levels, order, lead)
    if f.us_scale is None:
        raise ValueError("factor codec: the factors must be int8 (factors_8bit)")
    dev = f.us.device
    us = f.us
    if order == "col":
        x = torch.empty_like(us)
        x[_us_order(f.rank.to(dev), span_len.to(dev))] = us
        us = x
    lm = _lead_mask(f.rank.to(dev), d, lead)
    cu, mu = encode(us, group, levels)
    cv, mv = encode(f.vt[~lm], group, levels)
    return {"us.q4": cu, "us.q4m": mu, "vt.q4": cv, "vt.q4m": mv, "vt.lead": f.vt[lm].contiguous(), "rank": f.rank, "us_scale": f.us_scale, "vt_scale": f.vt_scale}


def decode_factors(t: dict[str, torch.Tensor], span_len: torch.Tensor, d: int, *, group: int, levels: str, order: str, lead: int) -> fz.Factors:
    """Inverse of :func:`encode_factors` (tensors on one device): the int8 factors factorize.pack wrote, up to
    the code's error."""
    rank = t["rank"]
    n_us = int((rank.long() * span_len.long().view(1, -1)).sum())
    us = decode(t["us.q4"], t["us.q4m"], n_us, group, levels)
    if order == "col":
        us = us[_us_order(rank, span_len.to(rank.device))]
    lm = _lead_mask(rank, d, lead)
    vt = torch.empty(lm.numel(), dtype=torch.int8, device=rank.device)
    vt[lm] = t["vt.lead"]
    vt[~lm] = decode(t["vt.q4"], t["vt.q4m"], int((~lm).sum()), group, levels)
    return fz.Factors(us, vt, rank, t["us_scale"], t["vt_scale"])


def config_tensor(group: int, levels: str, order: str, lead: int) -> torch.Tensor:
    check(group, levels, order, lead)
    return torch.tensor([group, list(LEVELS).index(levels), ORDERS.index(order), lead], dtype=torch.long)


def parse_config(c: torch.Tensor) -> dict:
    group, lv, order, lead = (int(x) for x in c.tolist())
    return {"group": group, "levels": list(LEVELS)[lv], "order": ORDERS[order], "lead": lead}


def read_factors(store, names: set[str], prefix: str, device=None) -> fz.Factors | None:
    """A pack's coded factors under ``prefix`` decoded to int8 (CPU tensors), or None where they are stored
    plainly.  device: a CUDA device decodes there (the CPU decodes ~40 M elements/s on one thread: minutes
    for a 128K-token pack of an 8B model) and copies the int8 factors back."""
    if f"{prefix}.us.q4" not in names:
        return None
    cfg = parse_config(store.get(CONFIG))
    head_dim = int(store.get("sekv.config")[3])
    span_len = (store.get("sekv.span_end") - store.get("sekv.span_start")).long()
    parts = ("us.q4", "us.q4m", "vt.q4", "vt.q4m", "vt.lead", "rank", "us_scale", "vt_scale")
    if device is not None and torch.device(device).type == "cuda":
        t = {k: store.get(f"{prefix}.{k}").to(device) for k in parts}
        f = decode_factors(t, span_len.to(device), head_dim, **cfg)
        return fz.Factors(*(x.cpu() for x in (f.us, f.vt, f.rank, f.us_scale, f.vt_scale)))
    with fz.single_thread():  # element-wise passes over ~1M elements: two threads were 5x slower on our 2-core CPU
        return decode_factors({k: store.get(f"{prefix}.{k}") for k in parts}, span_len, head_dim, **cfg)
