"""The scout pass's block scoring as one Triton kernel: factor-block rows -> keys -> RoPE -> logits -> each zoom block's
logsumexp.

What it replaces (gpu_step.BatchedStep._scout_lse, the PyTorch path): for a chunk of (KV group, span) pairs, the key
factors are unpacked from the block rows into float32 U*sigma [.., n_max, r] and Vt [.., r, d] (blocks.unpack side 0),
the keys U*sigma @ Vt materialised as float32 [.., n_max, d], rotated in place, multiplied by the question's queries
into float32 logits [.., n_max, M], masked past each span, and reduced by a segmented logsumexp per zoom block (amax,
sub, exp, scatter_add, log, add).  On the H200 at 128K tokens (the 8B shape: 32 layers, 8 KV heads, d = 128, ~1100
spans of 80-160 tokens, blocks of ~14-16 tokens, M = 4 query heads x ~25 question tokens) that was 416 chunks of ~19
kernels each, ~0.3-0.35 s, the chunks' size bounded by the keys and logits they materialise.

Here one program takes one (pair, tile of BLOCK_M query columns) and reads the pair's block row itself
(:func:`block_lse_rows`: the int64 words of sekv/blocks.py, ``Vt [2, r, d] | vt_scale [2, r] | us_scale [n, 2] |
U*sigma [n, 2, r]``, viewed as the factors' element type and, for int8, as float16 for the scales), dequantising its key
side (side 0) in registers: int8 codes times their float16 scales as float32 products, or float16 / bfloat16 factors
as float32 (the values blocks.unpack(..., torch.float32, side=0) gives, bit for bit).  It loads the pair's Vt once as
each RoPE pair's x1 and x2 columns [r, d/2]: for a pre-RoPE pack the first and second halves of Vt's own columns
(the model's rotate-half pairs; the queries come in rope.pairs_order, column 2j x1_j and 2j + 1 x2_j), else its even
and odd columns; then for each zoom block of the span, its rows of U*sigma BLOCK_N at a time [BLOCK_N, r] (each row
times its scale): the keys' two halves are formed in registers, rotated by the rows' (cos, sin) (rope.pairs_phase's
table: x1 c - x2 s, x1 s + x2 c), scored against the queries and folded into an online logsumexp over the block's
rows.  Nothing but the [blocks, M] results is written; a block with no rows (a span with fewer blocks than the most)
gives -inf, as the PyTorch path's log 0.  The blocks are given as (first row, rows) per (span, block) of the chunk
(:func:`block_tables`); a pack of whole spans is one block per span: its rows 0..span_len - 1, so rows past a span
(padding, or a fetch's repeated last word) are never read.  One program a pair (not a block) reads its Vt and queries
once, not once a block (~11 blocks a span at 128K).

The rows are read as the scout has them (gpu_step.BatchedStep._scout_rows): a chunk's rows staged in a device buffer
(gpu_step.ScoutRows), or a strided view of the blocks where they lie (device memory, or page-locked host memory
through its mapped view: the kernel reads host memory), so a chunk's memory is only its staged rows and its output:
no float32 factors, keys or logits.  The scout budgets its fused chunks on the staged rows alone
(gpu_step._scout_jobs: a pair's row, K and V, as stored): at 128K on the 8B shape (n_max 160, d 128, int8, r ~ 64)
about 37 KB a pair, ~1800 pairs a 64 MiB chunk against ~900 when the unpacked float32 factors (4 r (n_max + d) bytes
a pair) bounded them, so a layer is ~5 chunks, not ~10.  :func:`block_lse` is the same kernel on unpacked float32
factors (any strides).  Used behind gpu_step.SCOUT_FUSED on CUDA with triton (and on the CPU under
TRITON_INTERPRET=1, which runs it with numpy: the tests).  Its products take TF32 where the step allows TF32
(gpu_step._tf32), else full float32.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _block_lse_kernel(
    U, V, USC, VSC, Q, PH, START, LEN, OUT,
    NS, PER, M, R,
    o_u, o_v, o_us, o_vs,
    u_g, u_s, u_n, u_r, v_g, v_s, v_r, v_d, us_g, us_s, us_n, vs_g, vs_s, vs_r,
    s_qg, s_qm, s_qd, s_ps, s_pn, s_og, s_os, s_ok,
    D2: tl.constexpr, RP: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_M: tl.constexpr, ROPE: tl.constexpr,
    HALVES: tl.constexpr, SCALED: tl.constexpr, PREC: tl.constexpr,
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
    u_p = U + o_u + g * u_g + s * u_s  # the pair's U*sigma (its side 0 where the rows hold both)
    us_p = USC + o_us + g * us_g + s * us_s  # its rows' scales (SCALED)

    # the pair's Vt as the keys' x1 and x2 columns of each RoPE pair [RP, D2] (rows past the rank: 0): the first and
    # second halves of a pre-RoPE block's own columns (HALVES), else the even and odd columns (as given: in the pairs
    # order for a pre-RoPE pack's unpacked factors, any order of the queries' for keys stored rotated)
    if HALVES:
        c_e = offs_j
        c_o = offs_j + D2
    else:
        c_e = 2 * offs_j
        c_o = 2 * offs_j + 1
    v_p = V + o_v + g * v_g + s * v_s + offs_r[:, None] * v_r
    v_e = tl.load(v_p + c_e[None, :] * v_d, mask=rmask[:, None], other=0).to(tl.float32)
    v_o = tl.load(v_p + c_o[None, :] * v_d, mask=rmask[:, None], other=0).to(tl.float32)
    if SCALED:  # int8 codes times their component's scale: float32 products, as blocks.unpack's
        vsc = tl.load(VSC + o_vs + g * vs_g + s * vs_s + offs_r * vs_r, mask=rmask, other=0).to(tl.float32)
        v_e = v_e * vsc[:, None]
        v_o = v_o * vsc[:, None]
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
            u = tl.load(u_p + row[:, None] * u_n + offs_r[None, :] * u_r, mask=nmask[:, None] & rmask[None, :], other=0).to(tl.float32)
            if SCALED:  # each row's codes times its scale
                usc = tl.load(us_p + row * us_n, mask=nmask, other=0).to(tl.float32)
                u = u * usc[:, None]
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
#: device: triton.compile to a cubin, cuobjdump -res-usage) reading int8, bfloat16 and float32 factors, at d = 64 and
#: 128, ranks up to 32 / 64 / 128 and 64 query columns, with the launch's warps: no register spills, but for full
#: float32 (ieee) at d = 128 and rank 128 (176-216 bytes of stack, as the float32-input kernel before); TF32 at d = 128
#: takes 64-192 registers (int8 at rank 128: 192).  Shared memory: 56-112 KiB a program at d = 128
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
    """The logsumexps of one layer's zoom blocks for a chunk of ns spans of every KV group, written into ``out``, from
    unpacked factors (:func:`block_lse_rows` reads the blocks' rows themselves; this is its float32 counterpart).

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
    if P != hkv * ns or vt.shape != (P, r, d):
        raise ValueError("block_lse: inconsistent shapes")
    if us.dtype != torch.float32 or vt.dtype != torch.float32:
        raise ValueError("block_lse: float32 factors")
    su, sv = us.stride(), vt.stride()
    return _launch(us, vt, us, us, (0, 0, 0, 0), (ns * su[0], su[0], su[1], su[2]), (ns * sv[0], sv[0], sv[1], sv[2]),
                   (0, 0, 0), (0, 0, 0), r, False, False, q, start, length, out, phase, precision)


def block_lse_rows(b, rows: torch.Tensor, q: torch.Tensor, start: torch.Tensor, length: torch.Tensor, out: torch.Tensor,
                   phase: torch.Tensor | None = None, pairs: bool | None = None, precision: str | None = None) -> torch.Tensor:
    """:func:`block_lse` read from the layer's factor-block rows themselves (b: its blocks.Blocks), their key side
    dequantised in registers: int8 codes times their float16 scales, or float16 / bfloat16 factors, as float32 (the
    values blocks.unpack(b, rows, torch.float32, side=0) gives, each code's product the same float32 multiply).

    rows [Hkv, ns, b.stride] int64 (or [Hkv * ns, b.stride]), group-major: the blocks of the chunk's spans of every KV
    group, as fetched or staged (gpu_step.ScoutRows) or a view of the blocks where they lie (any strides but the
    words'); nothing is unpacked into a tensor.  ``pairs`` (None: where ``phase`` is given): the keys are made in
    RoPE's pairs order, Vt's columns j and d/2 + j read as each pair's x1 and x2 (q in rope.pairs_order, as for
    blocks.unpack(pairs=True)); else Vt's columns as stored (q in the same order).  The rest as :func:`block_lse`."""
    hkv, m, d = q.shape
    ns = start.shape[0]
    if rows.dim() == 2 and rows.shape[0] == hkv * ns:
        rows = rows.view(hkv, ns, rows.shape[1])
    if rows.dtype != torch.int64 or rows.shape != (hkv, ns, b.stride) or (rows.numel() and rows.stride(-1) != 1) or d != b.d:
        raise ValueError("block_lse_rows: rows [Hkv, ns, stride] int64 of the blocks, words contiguous, queries of their head_dim")
    if rows.numel() == 0:
        return _launch(None, None, None, None, None, None, None, None, None, 0, False, False, q, start, length, out, phase, precision)
    es = b.dtype.itemsize
    oa, ob, oc, od = b.sections
    rm = b.r_max
    f = rows.view(b.dtype)  # [Hkv, ns, stride * 8 / es]: the factors (and in int8, the scales' bytes among them)
    sc = rows.view(torch.float16) if b.int8 else f  # the scales (not read without int8)
    pairs = phase is not None if pairs is None else pairs
    # U*sigma [n, 2, r] at od (side 0: each row's first r), Vt [2, r, d] at oa (side 0 first), us_scale [n, 2] at oc,
    # vt_scale [2, r] at ob: element offsets into each view
    return _launch(f, f, sc, sc, (od // es, oa // es, oc // 2 if b.int8 else 0, ob // 2 if b.int8 else 0),
                   (f.stride(0), f.stride(1), 2 * rm, 1), (f.stride(0), f.stride(1), d, 1),
                   (sc.stride(0), sc.stride(1), 2), (sc.stride(0), sc.stride(1), 1), rm, bool(pairs), b.int8,
                   q, start, length, out, phase, precision)


def _launch(u, v, usc, vsc, offs, su, sv, sus, svs, r, halves, scaled, q, start, length, out, phase, precision):
    """The kernel's launch for P = Hkv * ns pairs: u / v / usc / vsc what U*sigma, Vt and their scales are read from,
    offs their element offsets, su (group, span, row, rank), sv (group, span, rank, column), sus (group, span, row),
    svs (group, span, rank) their strides in elements; r the rank (rows past it are not read)."""
    hkv, m, d = q.shape
    ns, per = start.shape
    if not supported(d):
        raise ValueError(f"the scout kernel needs an even head_dim whose half is a power of two >= 16, not {d}")
    if out.shape != (hkv, ns, per, m) or length.shape != start.shape:
        raise ValueError("block_lse: inconsistent shapes")
    if out.stride(-1) != 1 or q.dtype != torch.float32:
        raise ValueError("block_lse: float32 queries, an output with a contiguous last dimension")
    if hkv * ns == 0 or per == 0 or m == 0:
        return out
    if precision is None:
        precision = "tf32" if q.is_cuda and torch.backends.cuda.matmul.allow_tf32 else "ieee"
    rope = phase is not None
    if rope and (phase.shape[0] != ns or phase.shape[2:] != (d // 2, 2) or phase.stride(-1) != 1 or phase.stride(-2) != 2):
        raise ValueError("block_lse: phase [ns, n_max, d/2, 2] with its last two dimensions contiguous")
    ph = phase if rope else q  # not read without RoPE
    block_m = min(64, _pow2(m))
    start, length = start.to(torch.int32).contiguous(), length.to(torch.int32).contiguous()
    _block_lse_kernel[(hkv * ns, triton.cdiv(m, block_m))](
        u, v, usc, vsc, q, ph, start, length, out,
        ns, per, m, r,
        *offs, *su, *sv, *sus, *svs,
        q.stride(0), q.stride(1), q.stride(2),
        ph.stride(0) if rope else 0, ph.stride(1) if rope else 0,
        out.stride(0), out.stride(1), out.stride(2),
        D2=d // 2, RP=_pow2(r), BLOCK_N=BLOCK_N, BLOCK_M=block_m, ROPE=rope, HALVES=halves, SCALED=scaled, PREC=precision,
        num_warps=8 if d >= 128 or precision == "ieee" else 4, num_stages=2,
    )
    return out
