"""The scout pass's block scoring as one Triton kernel: factors -> keys -> RoPE -> logits -> each zoom block's logsumexp.

What it replaces (gpu_step.BatchedStep._scout_lse, the PyTorch path): for a chunk of (KV group, span) pairs, the keys
U*sigma @ Vt are materialised as float32 [.., n_max, d], rotated in place, multiplied by the question's queries into
float32 logits [.., n_max, M], masked past each span, and reduced by a segmented logsumexp per zoom block (amax, sub,
exp, scatter_add, log, add).  On the H200 at 128K tokens (the 8B shape: 32 layers, 8 KV heads, d = 128, ~1100 spans of
80-160 tokens, blocks of ~14-16 tokens, M = 4 query heads x ~25 question tokens) that was 416 chunks of ~19 kernels
each, ~0.3-0.35 s, the chunks' size bounded by the keys and logits they materialise.

Here one program takes one (pair, tile of BLOCK_M query columns).  It loads the pair's Vt [r, d] as its even and
odd columns (a pre-RoPE pack's keys are made in RoPE's pairs order, rope.pairs_order: column 2j is x1_j, 2j + 1 is
x2_j) and the group's queries (scaled, in the keys' column order) once; then for each zoom block of the span, its
rows of U*sigma BLOCK_N at a time [BLOCK_N, r]: the keys' two halves are formed in registers, rotated by the rows'
(cos, sin) (rope.pairs_phase's table: x1 c - x2 s, x1 s + x2 c), scored against the queries and folded into an online
logsumexp over the block's rows.  Nothing but the [blocks, M] results is written; a block with no rows (a span with
fewer blocks than the most) gives -inf, as the PyTorch path's log 0.  The blocks are given as (first row, rows) per
(span, block) of the chunk (:func:`block_tables`); a pack of whole spans is one block per span: its rows
0..span_len - 1.  One program a pair (not a block) reads its Vt and queries once, not once a block (~11 blocks a
span at 128K).

It reads the factors as unpacked (float32 U*sigma [P, n_max, r], Vt [P, r, d], blocks.unpack side 0), so a chunk's
only work tensors are those two: the scout's chunks are budgeted on them together (gpu_step._scout_jobs), 4 r (n_max +
d) bytes a pair against the PyTorch path's 4 n_max max(d, M, 2 r) per work tensor.  At 128K on the 8B shape (n_max
160, d 128) that is about as many pairs a chunk for r ~ 64 and twice as many for r ~ 32: what it saves is mostly the
launches (one a layer and chunk, beside the unpack's few, against ~19 a chunk) and the keys' and logits' round trips
through device memory, less the number of chunks (the staged host rows, ScoutRows, bound those anyway).  Used behind
gpu_step.SCOUT_FUSED on CUDA with triton (and on the CPU under TRITON_INTERPRET=1, which runs it with numpy: the
tests).  Its products take TF32 where the step allows TF32 (gpu_step._tf32), else full float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_lse_kernel(
    US, VT, Q, PH, START, LEN, OUT,
    NS, PER, M, R,
    s_up, s_un, s_ur, s_vp, s_vr, s_vd, s_qg, s_qm, s_qd, s_ps, s_pn, s_og, s_os, s_ok,
    D2: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ROPE: tl.constexpr,
    PREC: tl.constexpr,
):
    p = tl.program_id(0).to(tl.int64)  # the pair: its Vt and its group's queries loaded once for all its blocks
    mt = tl.program_id(1)
    g = p // NS
    s = p % NS
    offs_r = tl.arange(0, RP)
    offs_j = tl.arange(0, D2)
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    rmask = offs_r < R
    mmask = offs_m < M

    # the pair's Vt as its even and odd columns [RP, D2] (rows past the rank: 0)
    v_ptr = VT + p * s_vp + offs_r[:, None] * s_vr + (2 * offs_j)[None, :] * s_vd
    v_e = tl.load(v_ptr, mask=rmask[:, None], other=0.0)
    v_o = tl.load(v_ptr + s_vd, mask=rmask[:, None], other=0.0)
    # the group's queries, transposed, their even and odd columns [D2, BLOCK_M]
    q_ptr = Q + g * s_qg + offs_m[None, :] * s_qm + (2 * offs_j)[:, None] * s_qd
    q_e = tl.load(q_ptr, mask=mmask[None, :], other=0.0)
    q_o = tl.load(q_ptr + s_qd, mask=mmask[None, :], other=0.0)

    for k in range(0, PER):  # the span's blocks, each a run of its rows
        start = tl.load(START + s * PER + k)
        ln = tl.load(LEN + s * PER + k)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        for n0 in range(0, ln, BLOCK_N):
            rows = n0 + tl.arange(0, BLOCK_N)
            nmask = rows < ln
            row = start + rows  # within the span
            u = tl.load(US + p * s_up + row[:, None] * s_un + offs_r[None, :] * s_ur, mask=nmask[:, None] & rmask[None, :], other=0.0)
            k_e = tl.dot(u, v_e, input_precision=PREC)  # [BLOCK_N, D2]: x1 of each RoPE pair
            k_o = tl.dot(u, v_o, input_precision=PREC)  # x2
            if ROPE:
                ph = PH + s * s_ps + row[:, None] * s_pn + (2 * offs_j)[None, :]
                c = tl.load(ph, mask=nmask[:, None], other=0.0).to(tl.float32)
                sn = tl.load(ph + 1, mask=nmask[:, None], other=0.0).to(tl.float32)
                r_e = k_e * c - k_o * sn
                r_o = k_e * sn + k_o * c
                k_e = r_e
                k_o = r_o
            x = tl.dot(k_e, q_e, input_precision=PREC) + tl.dot(k_o, q_o, input_precision=PREC)  # [BLOCK_N, BLOCK_M]
            x = tl.where(nmask[:, None], x, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(x, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            l_i = l_i * tl.exp(m_i - m_safe) + tl.sum(tl.exp(x - m_safe[None, :]), 0)
            m_i = m_new
        res = tl.where(l_i > 0, m_i + tl.log(tl.where(l_i > 0, l_i, 1.0)), float("-inf"))  # no rows: -inf
        tl.store(OUT + g * s_og + s * s_os + k * s_ok + offs_m, res, mask=mmask)


#: rows of a block scored at once: a zoom block's (~14-16 tokens; a whole span in several).  Compiled for sm_90 (no
#: device: triton.compile to a cubin, cuobjdump -res-usage) at d = 64 and 128, ranks up to 32 / 64 / 128 and 64 query
#: columns, with the launch's warps: no register spills, but for full float32 at d = 128 and rank 128 (216 bytes);
#: 32 rows spill in full float32.  Shared memory: 60-115 KiB a program at d = 128
BLOCK_N = 16


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, int(x))))


def supported(d: int) -> bool:
    """Head dimensions the kernel takes: each half a power of two of at least 16 (d = 32, 64, 128, 256)."""
    h = d // 2
    return d % 2 == 0 and h >= 16 and h & (h - 1) == 0


def block_tables(row_block: torch.Tensor, per_span: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Each (span, block)'s first row and number of rows ([S, per_span] int32 each) from the scout's table of each row's
    block within its span (row_block [S, n_max], -1 for rows of no block).  A block's rows are one run (a zoom block
    is a run of its span's tokens; a whole span, rows 0..span_len - 1); a block a span lacks has 0 rows."""
    hit = row_block.unsqueeze(-1) == torch.arange(per_span, device=row_block.device).view(1, 1, -1)  # [S, n_max, per_span]
    n = hit.sum(1)
    first = torch.where(n > 0, hit.int().argmax(1), 0)
    return first.to(torch.int32).contiguous(), n.to(torch.int32).contiguous()


def block_lse(us: torch.Tensor, vt: torch.Tensor, q: torch.Tensor, start: torch.Tensor, length: torch.Tensor,
              out: torch.Tensor, phase: torch.Tensor | None = None, precision: str | None = None) -> torch.Tensor:
    """The logsumexps of one layer's zoom blocks for a chunk of ns spans of every KV group, written into ``out``.

    us [P, n_max, r], vt [P, r, d]: float32 factors of the keys of the P = Hkv * ns (group, span) pairs, group-major
    (blocks.unpack side 0; for a pre-RoPE pack with ``pairs``: the keys' columns in rope.pairs_order).  q [Hkv, M, d]
    float32: the group's queries, scaled, in the keys' column order.  start / length [ns, per_span] int32: each
    block's first row within its span and its rows (:func:`block_tables`; 0 rows: -inf).  phase [ns, n_max', d/2, 2]
    (rope.pairs_phase, any float dtype) or None: each row's rotation, None for keys stored with their rotation.
    out [Hkv, ns, per_span, M] float32 (any strides with a contiguous last dimension): out[g, s, b, m] = logsumexp over
    the rows i of block b of span s of (rotate(us[p, i] @ vt[p])) . q[g, m], p = g * ns + s.  ``precision``: "ieee" or
    "tf32" (None: tf32 on CUDA where torch's float32 matmuls allow it)."""
    P, _, r = us.shape
    hkv, m, d = q.shape
    ns, per = start.shape
    if not supported(d):
        raise ValueError(f"the scout kernel needs an even head_dim whose half is a power of two >= 16, not {d}")
    if P != hkv * ns or vt.shape != (P, r, d) or out.shape != (hkv, ns, per, m) or length.shape != start.shape:
        raise ValueError("block_lse: inconsistent shapes")
    if out.stride(-1) != 1 or q.dtype != torch.float32 or us.dtype != torch.float32 or vt.dtype != torch.float32:
        raise ValueError("block_lse: float32 factors and queries, an output with a contiguous last dimension")
    if P == 0 or per == 0 or m == 0:
        return out
    if precision is None:
        precision = "tf32" if us.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    rope = phase is not None
    if rope and (phase.shape[0] != ns or phase.shape[2:] != (d // 2, 2) or phase.stride(-1) != 1 or phase.stride(-2) != 2):
        raise ValueError("block_lse: phase [ns, n_max, d/2, 2] with its last two dimensions contiguous")
    ph = phase if rope else us  # not read without RoPE
    block_m = min(64, _pow2(m))
    start, length = start.to(torch.int32).contiguous(), length.to(torch.int32).contiguous()
    _block_lse_kernel[(P, triton.cdiv(m, block_m))](
        us, vt, q, ph, start, length, out,
        ns, per, m, r,
        us.stride(0), us.stride(1), us.stride(2), vt.stride(0), vt.stride(1), vt.stride(2),
        q.stride(0), q.stride(1), q.stride(2),
        ph.stride(0) if rope else 0, ph.stride(1) if rope else 0,
        out.stride(0), out.stride(1), out.stride(2),
        D2=d // 2, RP=_pow2(r), BLOCK_N=BLOCK_N, BLOCK_M=block_m, ROPE=rope, PREC=precision,
        num_warps=8 if d >= 128 or precision == "ieee" else 4, num_stages=2,
    )
    return out
