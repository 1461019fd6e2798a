"""Fused DepthWeave-KV decode attention (Triton): basis lookup + dequantisation + RoPE + scores + softmax.V.

One program per (KV head, token split).  For a block of BLOCK_N compressed tokens it
loads the int8 coefficients and their block scales and the routed 4-bit residual bytes
(gathered through the token's group offset - the block's stored offset plus an in-block
cumulative sum - and masked past the token's level) with their group scales, and forms
the pre-RoPE key kp = a @ B + c_lo @ C_lo + c_hi @ C_hi and the value likewise.  RoPE is
folded into the scores instead of the key: with rot = rotate_half (rot^T = -rot, and cos
and sin equal on both halves),

    (kp * cos + rot(kp) * sin) . q  =  (kp * cos) . q - (kp * sin) . rot(q)

so the G query heads of the group are scored with two small dots against q and rot(q),
cos/sin computed from the positions (rounded to the model dtype, as the model does).  The
block is folded into an online softmax with the reconstructed values.  Reconstructed keys
and values live in registers / shared memory only - never written to global memory.  The
splits' partials (acc, max, sum) are merged on the host side (``doc_attention``), then
with the exact part (sink, question, answer tokens) by the caller.

Only imported on CUDA devices (memory.fused_available); benchmarks/studies/depthweave_gpu_check.py
compares it with the PyTorch path (attention.py) and times it.  TRITON_INTERPRET=1 runs it
on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from .codec import OFF_BLOCK

AVAILABLE = True
#: operands of the reconstruction dots: "tf32" (tensor cores), "ieee" (exact float32), "fp16" (half the shared memory;
#: int8 x float16-scale products rounded to float16, ~5e-4 relative); None = tf32, fp16 for head_dim > 64
PRECISION: str | None = None


@triton.jit
def _dw_decode_kernel(
    Q, COEF_K, CSC_K, COEF_V, CSC_V, B_K, B_V, C_K, C_V, POOL_K, PSC_K, POOL_V, PSC_V, NG, BOFF, INV_FREQ,
    ACC, MAX, SUM,
    NC, NB, SPLIT, POS0, ROPE_SCALE,
    G: tl.constexpr, GP: tl.constexpr, D: tl.constexpr,
    RK: tl.constexpr, RV: tl.constexpr, RPK: tl.constexpr, RPV: tl.constexpr, CBK: tl.constexpr, CBV: tl.constexpr,
    GK: tl.constexpr, GV: tl.constexpr, NBK: tl.constexpr, NBV: tl.constexpr, NBPK: tl.constexpr, NBPV: tl.constexpr,
    CK_ROWS: tl.constexpr, CV_ROWS: tl.constexpr,
    HAS_RES: tl.constexpr, ROPE: tl.constexpr, ROUND: tl.constexpr, BLOCK_N: tl.constexpr, PREC: tl.constexpr, F16: tl.constexpr,
):
    h = tl.program_id(0)
    sp = tl.program_id(1)
    n_splits = tl.num_programs(1)
    HALF: tl.constexpr = D // 2
    hk: tl.constexpr = GK // 2
    hv: tl.constexpr = GV // 2
    offs_d = tl.arange(0, D)
    offs_g = tl.arange(0, GP)
    offs_rk = tl.arange(0, RPK)
    offs_rv = tl.arange(0, RPV)
    offs_bk = tl.arange(0, NBPK)
    offs_bv = tl.arange(0, NBPV)

    qmask = offs_g[:, None] < G
    q_ptr = Q + (h * G + offs_g[:, None]) * D
    q = tl.load(q_ptr + offs_d[None, :], mask=qmask, other=0.0)  # [GP, D]
    if ROPE:
        # rot(q) = rotate_half(q): -q[j + D/2] for j < D/2, q[j - D/2] otherwise
        rq = tl.load(q_ptr + ((offs_d + HALF) % D)[None, :], mask=qmask, other=0.0) * tl.where(offs_d < HALF, -1.0, 1.0)[None, :]
        inv = tl.load(INV_FREQ + offs_d % HALF)  # [D]: both halves share the frequencies

    # bases (zero rows past the rank); residual basis rows of the low / high nibble of byte b: group b // (g/2),
    # channel b % (g/2) (+ g/2).  The tiles are loaded inside the loop (L1/L2 hits) to keep register pressure down.
    bk_ptr = B_K + h * RK * D + offs_rk[:, None] * D + offs_d[None, :]
    bv_ptr = B_V + h * RV * D + offs_rv[:, None] * D + offs_d[None, :]
    ck_lo_ptr = C_K + h * CK_ROWS * D + ((offs_bk // hk) * GK + offs_bk % hk)[:, None] * D + offs_d[None, :]
    cv_lo_ptr = C_V + h * CV_ROWS * D + ((offs_bv // hv) * GV + offs_bv % hv)[:, None] * D + offs_d[None, :]

    m_i = tl.full([GP], float("-inf"), tl.float32)
    l_i = tl.zeros([GP], tl.float32)
    acc = tl.zeros([GP, D], tl.float32)
    start = sp * SPLIT
    for n0 in range(0, SPLIT, BLOCK_N):  # SPLIT is a multiple of BLOCK_N; blocks past NC are fully masked
        offs_n = start + n0 + tl.arange(0, BLOCK_N)
        nmask = offs_n < NC
        row = h * NC + offs_n  # token row in [Hkv, Nc]
        # coefficients: int8 x block scale, then the shared bases
        mk = nmask[:, None] & (offs_rk[None, :] < RK)
        ak = tl.load(COEF_K + row[:, None] * RK + offs_rk[None, :], mask=mk, other=0).to(tl.float32)
        ak = ak * tl.load(CSC_K + row[:, None] * (RK // CBK) + offs_rk[None, :] // CBK, mask=mk, other=0.0).to(tl.float32)
        mv = nmask[:, None] & (offs_rv[None, :] < RV)
        av = tl.load(COEF_V + row[:, None] * RV + offs_rv[None, :], mask=mv, other=0).to(tl.float32)
        av = av * tl.load(CSC_V + row[:, None] * (RV // CBV) + offs_rv[None, :] // CBV, mask=mv, other=0.0).to(tl.float32)
        bk = tl.load(bk_ptr, mask=offs_rk[:, None] < RK, other=0.0)
        bv = tl.load(bv_ptr, mask=offs_rv[:, None] < RV, other=0.0)
        if F16:
            kp = tl.dot(ak.to(tl.float16), bk.to(tl.float16))
            vv = tl.dot(av.to(tl.float16), bv.to(tl.float16))
        else:
            kp = tl.dot(ak, bk, input_precision=PREC)
            vv = tl.dot(av, bv, input_precision=PREC)
        if HAS_RES:
            ng = tl.load(NG + row, mask=nmask, other=0).to(tl.int32)
            # token offsets: the block's stored offset + an exclusive in-block cumulative sum (BLOCK_N == OFF_BLOCK)
            goff = tl.load(BOFF + h * NB + (start + n0) // BLOCK_N) + tl.cumsum(ng, 0) - ng
            vk = nmask[:, None] & (offs_bk[None, :] < (ng * hk)[:, None])
            byte = tl.load(POOL_K + (goff * hk)[:, None] + offs_bk[None, :], mask=vk, other=136).to(tl.int32)
            sc = tl.load(PSC_K + goff[:, None] + offs_bk[None, :] // hk, mask=vk, other=0.0).to(tl.float32)
            lo = ((byte & 15) - 8).to(tl.float32) * sc
            hi = ((byte >> 4) - 8).to(tl.float32) * sc
            rmask = offs_bk[:, None] < NBK
            c_lo = tl.load(ck_lo_ptr, mask=rmask, other=0.0)
            c_hi = tl.load(ck_lo_ptr + hk * D, mask=rmask, other=0.0)
            if F16:
                kp += tl.dot(lo.to(tl.float16), c_lo.to(tl.float16)) + tl.dot(hi.to(tl.float16), c_hi.to(tl.float16))
            else:
                kp += tl.dot(lo, c_lo, input_precision=PREC) + tl.dot(hi, c_hi, input_precision=PREC)
            vvm = nmask[:, None] & (offs_bv[None, :] < (ng * hv)[:, None])
            byte = tl.load(POOL_V + (goff * hv)[:, None] + offs_bv[None, :], mask=vvm, other=136).to(tl.int32)
            sc = tl.load(PSC_V + goff[:, None] + offs_bv[None, :] // hv, mask=vvm, other=0.0).to(tl.float32)
            lo = ((byte & 15) - 8).to(tl.float32) * sc
            hi = ((byte >> 4) - 8).to(tl.float32) * sc
            rmask = offs_bv[:, None] < NBV
            c_lo = tl.load(cv_lo_ptr, mask=rmask, other=0.0)
            c_hi = tl.load(cv_lo_ptr + hv * D, mask=rmask, other=0.0)
            if F16:
                vv += tl.dot(lo.to(tl.float16), c_lo.to(tl.float16)) + tl.dot(hi.to(tl.float16), c_hi.to(tl.float16))
            else:
                vv += tl.dot(lo, c_lo, input_precision=PREC) + tl.dot(hi, c_hi, input_precision=PREC)
        if ROPE:  # cos/sin of the absolute positions, rounded to the model dtype as the model does
            ang = (POS0 + offs_n).to(tl.float32)[:, None] * inv[None, :]
            cs = tl.cos(ang) * ROPE_SCALE
            sn = tl.sin(ang) * ROPE_SCALE
            if ROUND == 1:
                cs = cs.to(tl.bfloat16).to(tl.float32)
                sn = sn.to(tl.bfloat16).to(tl.float32)
            if ROUND == 2:
                cs = cs.to(tl.float16).to(tl.float32)
                sn = sn.to(tl.float16).to(tl.float32)
            s = tl.dot(kp * cs, tl.trans(q), input_precision=PREC) - tl.dot(kp * sn, tl.trans(rq), input_precision=PREC)
        else:
            s = tl.dot(kp, tl.trans(q), input_precision=PREC)  # [BLOCK_N, GP]
        s = tl.where(nmask[:, None], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 0))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[None, :])
        l_i = l_i * alpha + tl.sum(p, 0)
        acc = acc * alpha[:, None] + tl.dot(tl.trans(p), vv, input_precision=PREC)
        m_i = m_new
    out = (h * n_splits + sp) * GP + offs_g
    tl.store(ACC + out[:, None] * D + offs_d[None, :], acc)
    tl.store(MAX + out, m_i)
    tl.store(SUM + out, l_i)


def _pow2(x: int, lo: int = 16) -> int:
    return max(lo, triton.next_power_of_2(max(1, int(x))))


_DUMMIES: dict = {}


def _dummy(device, dtype) -> torch.Tensor:
    key = (str(device), dtype)
    if key not in _DUMMIES:
        _DUMMIES[key] = torch.zeros(1, dtype=dtype, device=device)
    return _DUMMIES[key]


def doc_attention(qf: torch.Tensor, zk, zv, ng: torch.Tensor, boff: torch.Tensor, max_groups: int, rot,
                  split: int | None = None, precision: str | None = None):
    """Softmax partial of qf [Hkv, G, D] (float32, pre-scaled; one query per head) over the compressed tokens.

    Returns (o [Hkv, G, D] unnormalised, m [Hkv, G], l [Hkv, G]) like attention.partial.
    zk / zv: attention.ZCodes with 8-bit coefficients and 4-bit residual pools; ng [Hkv, Nc] uint8 groups per
    token, boff [Hkv, ceil(Nc/64)] int32 block offsets (codec.group_offsets); rot: attention.Rotary or None.
    """
    hkv, G, D = qf.shape
    nc = zk.coef.shape[1]
    dev = qf.device
    block_n = OFF_BLOCK  # a kernel block is one offset block
    if D & (D - 1) or D < 16:
        raise ValueError("the fused kernel needs a power-of-two head_dim >= 16")
    if zk.coef_scale is None or zv.coef_scale is None:
        raise ValueError("the fused kernel needs quantised coefficients")
    precision = precision or PRECISION or ("tf32" if D <= 64 else "fp16")
    has_res = max_groups > 0 and zk.resbasis.shape[1] > 0 and zv.resbasis.shape[1] > 0 and zk.pool_scale is not None
    nbk = max_groups * zk.group // 2 if has_res else 0
    nbv = max_groups * zv.group // 2 if has_res else 0
    if split is None:  # enough programs to fill the GPU: ~4 per SM over the KV heads
        sms = torch.cuda.get_device_properties(dev).multi_processor_count if qf.is_cuda else 8
        split = triton.cdiv(nc, max(1, 4 * sms // hkv))
    split = max(1, triton.cdiv(split, block_n)) * block_n  # splits start on offset blocks
    n_splits = max(1, triton.cdiv(nc, split))
    GP = _pow2(G)
    acc = torch.empty(hkv, n_splits, GP, D, device=dev, dtype=torch.float32)
    mx = torch.empty(hkv, n_splits, GP, device=dev, dtype=torch.float32)
    sm = torch.empty_like(mx)
    f32, u8, f16 = _dummy(dev, torch.float32), _dummy(dev, torch.uint8), _dummy(dev, torch.float16)
    use = lambda t, d: t if has_res and t is not None and t.numel() else d  # noqa: E731
    round_ = {torch.bfloat16: 1, torch.float16: 2}.get(rot.dtype, 0) if rot is not None else 0
    _dw_decode_kernel[(hkv, n_splits)](
        qf.contiguous(), zk.coef, zk.coef_scale, zv.coef, zv.coef_scale, zk.basis, zv.basis,
        use(zk.resbasis, f32), use(zv.resbasis, f32), use(zk.pool, u8), use(zk.pool_scale, f16), use(zv.pool, u8),
        use(zv.pool_scale, f16), use(ng, u8), use(boff, f32), rot.inv_freq if rot is not None else f32,
        acc, mx, sm, nc, boff.shape[-1], split, rot.offset if rot is not None else 0, float(rot.scaling) if rot is not None else 1.0,
        G=G, GP=GP, D=D, RK=zk.rank, RV=zv.rank, RPK=_pow2(zk.rank), RPV=_pow2(zv.rank),
        CBK=zk.rank // zk.coef_scale.shape[-1], CBV=zv.rank // zv.coef_scale.shape[-1],
        GK=max(2, zk.group), GV=max(2, zv.group), NBK=nbk, NBV=nbv, NBPK=_pow2(nbk), NBPV=_pow2(nbv),
        CK_ROWS=zk.resbasis.shape[1], CV_ROWS=zv.resbasis.shape[1],
        HAS_RES=has_res, ROPE=rot is not None, ROUND=round_, BLOCK_N=block_n,
        PREC="tf32" if precision == "fp16" else precision, F16=precision == "fp16",
        num_warps=4 if D <= 64 else 8, num_stages=1,
    )
    if n_splits == 1:
        return acc[:, 0, :G], mx[:, 0, :G], sm[:, 0, :G]
    acc, mx, sm = acc[:, :, :G], mx[:, :, :G], sm[:, :, :G]
    m = mx.amax(1)
    w = torch.exp(mx - m.unsqueeze(1))
    return (acc * w.unsqueeze(-1)).sum(1), m, (sm * w).sum(1)
