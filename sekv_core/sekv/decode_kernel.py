"""One new token's attention over a long masked memory, split along the keys (flash decoding) as two Triton kernels.

What it replaces: sekv's static single-token step attends, a layer at a time, over the resident buffer and the fixed
set's annex under an additive mask (sekv/fixed_set.py ``_joint_attention``) by one SDPA call.  A masked GQA call has
neither flash attention nor the memory-efficient kernel on CUDA, and whichever kernel takes it gives one thread block
to a query head (or a KV group) and its query tile: for one token that is H thread blocks, each streaming all T rows of
its group, where an unmasked call gets flash attention's split-KV decoding over every multiprocessor.

Here the first kernel gives each (KV group, split) a program: its G query heads (padded to a tile of 16 rows for the
tensor cores) against ``CHUNK`` key rows of its group, BLOCK_N at a time: logits in float32 (the products of the model
dtype read as float32 and multiplied on TF32 tensor cores, which hold a 16-bit value exactly; float32 models' in full
float32), times the scale, plus the mask's row (any additive mask: -inf hides), an online softmax, the probabilities
(float32, TF32 in the product) times the values, accumulated in float32.  It writes
each split's running max, sum and unnormalised output.  The second kernel, a program a query head, folds the splits:
out = sum_s e^(m_s - m) acc_s / sum_s e^(m_s - m) l_s, rounded to the model dtype once.  A split whose every column is
hidden leaves m = -inf and adds nothing; a head with every column hidden gets zeros (SDPA's gives NaN: the step never
has one, the token itself is always visible).

The keys and values are read once a group (G heads share them), the mask once a head.  The grid depends only on T
(fixed per captured graph).  Used by the static step on CUDA where triton imports (fixed_set.DECODE_KERNEL), and on
the CPU under TRITON_INTERPRET=1 (the tests).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: key rows a program's tile (a power of two)
BLOCK_N = 64
#: programs wanted along the keys for all groups together: a few a multiprocessor (132 on an H200)
TARGET_PROGRAMS = 512
#: fewest key rows a split (below it the folding costs more than it spreads)
MIN_CHUNK = 256
#: most splits (the fold holds a head's [splits, d] partial outputs in registers)
MAX_SPLITS = 64


@triton.jit
def _split_kernel(Q, K, V, MASK, ACC, ML, T, CHUNK, scaling,
                  s_qh, s_qd, s_kg, s_kt, s_kd, s_vg, s_vt, s_vd, s_mh, s_mt,
                  G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr, BLOCK_N: tl.constexpr, NSPLIT: tl.constexpr, PREC: tl.constexpr):
    g = tl.program_id(0).to(tl.int64)
    sp = tl.program_id(1)
    heads = tl.arange(0, GP)
    hok = heads < G
    hh = (g * G + heads).to(tl.int64)
    dd = tl.arange(0, D)
    q = tl.load(Q + hh[:, None] * s_qh + dd[None, :] * s_qd, mask=hok[:, None], other=0.0).to(tl.float32)
    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    start = sp * CHUNK
    end = tl.minimum(start + CHUNK, T)
    for n0 in range(start, end, BLOCK_N):
        cols = n0 + tl.arange(0, BLOCK_N)
        cok = cols < end
        c64 = cols.to(tl.int64)
        k = tl.load(K + g * s_kg + c64[:, None] * s_kt + dd[None, :] * s_kd, mask=cok[:, None], other=0.0).to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision=PREC) * scaling
        b = tl.load(MASK + hh[:, None] * s_mh + c64[None, :] * s_mt, mask=hok[:, None] & cok[None, :], other=float("-inf"))
        s = s + b.to(tl.float32)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        live = m_new > float("-inf")
        m_safe = tl.where(live, m_new, 0.0)
        alpha = tl.where(live, tl.exp(m_i - m_safe), 1.0)
        p = tl.exp(s - m_safe[:, None])  # hidden columns: exp(-inf) = 0
        v = tl.load(V + g * s_vg + c64[:, None] * s_vt + dd[None, :] * s_vd, mask=cok[:, None], other=0.0).to(tl.float32)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision=PREC)
        m_i = m_new
    row = (hh * NSPLIT + sp)[:, None]
    tl.store(ACC + row * D + dd[None, :], acc, mask=hok[:, None])
    tl.store(ML + (hh * NSPLIT + sp) * 2, m_i, mask=hok)
    tl.store(ML + (hh * NSPLIT + sp) * 2 + 1, l_i, mask=hok)


@triton.jit
def _fold_kernel(ACC, ML, OUT, s_oh, s_od, NSPLIT: tl.constexpr, SP: tl.constexpr, D: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    ss = tl.arange(0, SP)
    sok = ss < NSPLIT
    m = tl.load(ML + (h * NSPLIT + ss) * 2, mask=sok, other=float("-inf"))
    l = tl.load(ML + (h * NSPLIT + ss) * 2 + 1, mask=sok, other=0.0)
    top = tl.max(m, 0)
    top = tl.where(top > float("-inf"), top, 0.0)
    w = tl.where(m > float("-inf"), tl.exp(m - top), 0.0)
    dd = tl.arange(0, D)
    acc = tl.load(ACC + (h * NSPLIT + ss)[:, None] * D + dd[None, :], mask=sok[:, None], other=0.0)
    num = tl.sum(acc * w[:, None], 0)
    den = tl.sum(l * w, 0)
    out = tl.where(den > 0, num / den, 0.0)
    tl.store(OUT + h * s_oh + dd * s_od, out.to(OUT.dtype.element_ty))


def supported(d: int) -> bool:
    """head_dim d the kernel takes (a power of two, 16..256: one tile of d columns)."""
    return 16 <= d <= 256 and d & (d - 1) == 0


def splits(t: int, hkv: int) -> tuple[int, int]:
    """(splits, rows a split) for T = t key rows and hkv groups: about TARGET_PROGRAMS programs, splits of at least
    MIN_CHUNK rows and at most MAX_SPLITS, a split a whole number of BLOCK_N tiles."""
    n = max(1, min(MAX_SPLITS, TARGET_PROGRAMS // max(1, hkv), -(-t // MIN_CHUNK)))
    chunk = -(-t // n)
    chunk = -(-chunk // BLOCK_N) * BLOCK_N
    return -(-t // chunk), chunk


def decode_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, scaling: float,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one token, query [1, H, 1, d], over keys / values [1, Hkv, T, d] (head h on group h // (H / Hkv))
    under the additive mask [1, H, 1, T] (any dtype; broadcast over heads where its head stride is 0) -> [1, H, 1, d]
    in the query's dtype.  Any strides with a unit last-dimension stride for q, keys, values."""
    _, h, nq, d = query.shape
    _, hkv, t, _ = keys.shape
    assert nq == 1 and h % hkv == 0 and supported(d), (query.shape, keys.shape)
    g = h // hkv
    n, chunk = splits(t, hkv)
    dev = query.device
    acc = torch.empty(h, n, d, device=dev, dtype=torch.float32)
    ml = torch.empty(h, n, 2, device=dev, dtype=torch.float32)
    if out is None:
        out = torch.empty(1, h, 1, d, device=dev, dtype=query.dtype)
    m = mask.expand(1, h, 1, t)
    _split_kernel[(hkv, n)](
        query, keys, values, m, acc, ml, t, chunk, float(scaling),
        query.stride(1), query.stride(3), keys.stride(1), keys.stride(2), keys.stride(3),
        values.stride(1), values.stride(2), values.stride(3), m.stride(1), m.stride(3),
        G=g, GP=max(16, triton.next_power_of_2(g)), D=d, BLOCK_N=BLOCK_N, NSPLIT=n, PREC="tf32" if query.dtype in (torch.bfloat16, torch.float16) else "ieee",
    )
    _fold_kernel[(h,)](acc, ml, out, out.stride(1), out.stride(3), NSPLIT=n, SP=max(2, triton.next_power_of_2(n)), D=d)
    return out
