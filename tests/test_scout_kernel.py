"""The scout's fused block scoring (sekv_core/sekv/scout_kernel.py) against a float64 reference written out block by
block, and wired into the batched step (gpu_step.SCOUT_FUSED) against the PyTorch path and full-KV attention.

On the CPU these run the kernel under Triton's interpreter (TRITON_INTERPRET=1, numpy), where triton is importable;
else they are skipped.  The CUDA test runs the compiled kernel."""

from __future__ import annotations

import os

import pytest
import torch

from sekv_core.sekv import rope

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:  # not installed, or not usable here
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
on_cpu = pytest.mark.skipif(not (HAVE_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1 on the CPU")
on_cuda = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available() and not INTERPRET), reason="needs CUDA and triton")


def _case(hkv=2, ns=5, n_max=23, r=7, d=32, m=9, whole=False, seed=0, device="cpu"):
    """Random factors, queries and rotations for ns ragged spans cut into ragged blocks (one span with a single
    block, gaps of no block between some): (us, vt, q, phase, row_block, per_span)."""
    g = torch.Generator().manual_seed(seed)
    P = hkv * ns
    lens = torch.randint(n_max // 2, n_max + 1, (ns,), generator=g)
    lens[0] = n_max
    row_block = torch.full((ns, n_max), -1, dtype=torch.long)
    for s in range(ns):
        n = int(lens[s])
        if whole or s == 1:
            row_block[s, :n] = 0
            continue
        cuts = sorted(torch.randperm(n - 1, generator=g)[: int(torch.randint(1, 5, (1,), generator=g))].add(1).tolist())
        for k, (a, b) in enumerate(zip([0] + cuts, cuts + [n])):
            row_block[s, a:b] = k
            if s == 2 and b - a > 2:  # a row of no block inside the span
                row_block[s, b - 1] = -1
    per_span = int(row_block.max()) + 1
    us = torch.randn(P, n_max, r, generator=g)
    vt = torch.randn(P, r, d, generator=g) / r**0.5
    q = torch.randn(hkv, m, d, generator=g) / d**0.5
    pos = torch.randint(0, 4000, (ns, n_max), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    phase = rope.pairs_phase(*rope.cos_sin_half(pos.flatten(), inv_freq, dtype=torch.bfloat16)).view(ns, n_max, d // 2, 2).to(torch.bfloat16)
    to = lambda x: x.to(device)  # noqa: E731
    return to(us), to(vt), to(q), to(phase), to(row_block), per_span


def _reference(us, vt, q, phase, row_block, per_span):
    """out [Hkv, ns, per_span, M]: each block's logsumexp over its rows of the rotated keys' logits, in float64."""
    hkv, m, d = q.shape
    ns = row_block.shape[0]
    out = torch.full((hkv, ns, per_span, m), float("-inf"), dtype=torch.float64)
    for gi in range(hkv):
        for s in range(ns):
            p = gi * ns + s
            keys = us[p].double().cpu() @ vt[p].double().cpu()  # [n_max, d], pairs order
            if phase is not None:
                c, sn = phase[s, ..., 0].double().cpu(), phase[s, ..., 1].double().cpu()
                x1, x2 = keys[:, 0::2], keys[:, 1::2]
                keys = torch.stack([x1 * c - x2 * sn, x1 * sn + x2 * c], -1).view(keys.shape)
            logits = keys @ q[gi].double().cpu().T  # [n_max, M]
            for k in range(per_span):
                rows = (row_block[s].cpu() == k).nonzero().flatten()
                if len(rows):
                    out[gi, s, k] = torch.logsumexp(logits[rows], 0)
    return out


def _run(us, vt, q, phase, row_block, per_span, **kw):
    from sekv_core.sekv import scout_kernel as sk

    hkv, m, _ = q.shape
    ns = row_block.shape[0]
    start, length = sk.block_tables(row_block, per_span)
    out = torch.full((hkv, ns, per_span, m), 7.0, device=q.device)
    return sk.block_lse(us, vt, q, start, length, out, phase=phase, **kw)


def _check(got, ref):
    got = got.double().cpu()
    assert torch.equal(torch.isinf(got), torch.isinf(ref))  # the blocks a span lacks, and only those
    fin = torch.isfinite(ref)
    assert fin.any() and torch.allclose(got[fin], ref[fin], atol=1e-4, rtol=1e-5), (got[fin] - ref[fin]).abs().max()


@on_cpu
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("whole", [False, True])
def test_block_lse_equals_blockwise_reference(rotate, whole):
    """Ragged spans and blocks, more query columns than a tile, more rows than a row tile (whole spans of up to 23
    rows): the kernel's logsumexps are the float64 reference's; blocks a span lacks are -inf."""
    us, vt, q, phase, rb, per = _case(whole=whole, m=70, seed=3 + whole)
    ph = phase if rotate else None
    _check(_run(us, vt, q, ph, rb, per), _reference(us, vt, q, ph, rb, per))


@on_cpu
def test_block_lse_strided_output_and_factors():
    """The output is a slice of the layer's [Hkv, S, blocks, M] table (chunk of spans) and the factors views with
    strides of their own (as blocks.unpack may give): the same values, written only inside the slice."""
    from sekv_core.sekv import scout_kernel as sk

    us, vt, q, phase, rb, per = _case(d=64, r=5)
    hkv, m = q.shape[0], q.shape[1]
    ns = rb.shape[0]
    full = torch.zeros(hkv, ns + 3, per, m)
    us_t = us.transpose(1, 2).contiguous().transpose(1, 2)  # same values, other strides
    start, length = sk.block_tables(rb, per)
    sk.block_lse(us_t, vt, q, start, length, full[:, 2 : 2 + ns], phase=phase)
    _check(full[:, 2 : 2 + ns], _reference(us, vt, q, phase, rb, per))
    assert not full[:, :2].any() and not full[:, 2 + ns :].any()


# -- the kernel reading the factor-block rows themselves (block_lse_rows) -------------------------------------------

_LENS = [23, 9, 17, 1, 20, 3, 14, 23]  # ragged spans: a one-token span, two of the longest


def _blocks_case(fmt: str, d: int = 32, hkv: int = 2, seed: int = 0):
    """One layer's K and V factor blocks (blocks.build of factorize.factorize's output: int8 codes with float16 scales,
    or float16 / bfloat16 factors) of ragged spans whose keys' ranks differ by (group, span) and from the values' (the
    blocks' r_max, the V side's, pads the K side): (blocks, span lengths, the keys the K factors give [Hkv, T, d])."""
    from sekv_core.sekv import blocks
    from sekv_core.sekv import factorize as fz

    g = torch.Generator().manual_seed(seed)
    lens = torch.tensor(_LENS)
    t = int(lens.sum())
    x = torch.randn(hkv, t, d, generator=g) * torch.linspace(1.0, 0.05, d)  # a decaying spectrum: the energy rule cuts
    x[1] = x[1, :, : d // 4] @ torch.randn(d // 4, d, generator=g) + 0.01 * x[1]  # group 1 nearly of rank d/4
    int8, dt = fmt == "int8", {"int8": torch.float16, "float16": torch.float16, "bfloat16": torch.bfloat16}[fmt]
    fk = fz.factorize(x, lens, energy=0.9, rank_max=16, int8=int8, dtype=dt)
    fv = fz.factorize(torch.randn(hkv, t, d, generator=g), lens, energy=0.99, rank_max=20, int8=int8, dtype=dt)
    b = blocks.build(fz.stack_kv(fk, fv), lens, d, "cpu", pin=False)
    rk = fk.rank.long()
    assert b.int8 == int8 and len(set(rk.flatten().tolist())) > 2 and not torch.equal(rk[0], rk[1]) and b.r_max > rk.max()
    return b, lens, fz.reconstruct_all(fk, lens, d)


def _rows_tables(lens, n_max, whole, seed=1):
    """Each row's block within its span [S, n_max] (-1: none): whole spans, or runs of 1-6 rows with a row of no block
    inside some spans; the most blocks a span has."""
    g = torch.Generator().manual_seed(seed)
    rb = torch.full((len(lens), n_max), -1, dtype=torch.long)
    for s, n in enumerate(lens.tolist()):
        at, k = 0, 0
        while at < n:
            w = n if whole else min(n - at, int(torch.randint(1, 7, (1,), generator=g)))
            rb[s, at : at + w] = k
            if not whole and w > 2 and s % 3 == 0:
                rb[s, at + w - 1] = -1
            at, k = at + w, k + 1
    return rb, int(rb.max()) + 1


def _natural_reference(keys, lens, q, phase, rb, per):
    """out [Hkv, S, per, M] in float64 from the keys in their own column order (factorize.reconstruct_all, not the
    blocks), rotated as the model does (rotate-half: x1 = the first half's column j, x2 = the second's) by phase
    [S, n_max, d/2, 2], against the queries q [Hkv, M, d] in that order."""
    hkv, m, d = q.shape
    h = d // 2
    first = torch.cumsum(lens, 0) - lens
    out = torch.full((hkv, len(lens), per, m), float("-inf"), dtype=torch.float64)
    for gi in range(hkv):
        for s, n in enumerate(lens.tolist()):
            k = keys[gi, first[s] : first[s] + n].double()
            if phase is not None:
                c, sn = phase[s, :n, :, 0].double(), phase[s, :n, :, 1].double()
                k = torch.cat([k[:, :h] * c - k[:, h:] * sn, k[:, h:] * c + k[:, :h] * sn], 1)
            logits = k @ q[gi].double().T
            for b in range(per):
                rows = (rb[s, :n] == b).nonzero().flatten()
                if len(rows):
                    out[gi, s, b] = torch.logsumexp(logits[rows], 0)
    return out


def _pytorch_path(b, rows, q, phase, rb, per, whole, fused=None, staged=True):
    """gpu_step.BatchedStep._scout_lse on one layer of these blocks (rows [Hkv, ns, stride] of spans 0..ns-1): the
    PyTorch path (fused None) or the wired kernel (the rows staged, or read where the blocks are)."""
    from types import SimpleNamespace

    from sekv_core import methods  # noqa: F401 - first: gpu_step alone does not import (a cycle through sekv.memory)
    from sekv_core.sekv import gpu_step

    hkv, m, d = q.shape
    ns = rows.shape[1]
    st = gpu_step.BatchedStep.__new__(gpu_step.BatchedStep)
    st.blocks, st.hkv, st.d = [b], hkv, d
    r = SimpleNamespace(pre_rope=phase is not None, whole_spans=whole, device=q.device)
    t = {"row_block": rb, "past": rb < 0, "row_block0": rb.clamp_min(0), "per_span": per}
    if phase is not None:
        t["phase"] = phase
    if fused is not None:
        t["start"], t["length"] = fused.block_tables(rb, per)
    out = torch.full((1, hkv, ns, per, m), 7.0)
    st._scout_lse(r, [0], q[None], 0, ns, t, {0: rows.reshape(hkv * ns, -1)} if staged else {}, out, fused)
    return out[0]


def _phase(n_spans, n_max, d, seed=2):
    g = torch.Generator().manual_seed(seed)
    pos = torch.randint(0, 4000, (n_spans, n_max), generator=g)
    inv_freq = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    return rope.pairs_phase(*rope.cos_sin_half(pos.flatten(), inv_freq, dtype=torch.bfloat16)).view(n_spans, n_max, d // 2, 2)


@on_cpu
@pytest.mark.parametrize("fmt", ["int8", "float16", "bfloat16"])
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("whole", [False, True])
def test_block_lse_rows_equals_unpacked_kernel_pytorch_path_and_float64(fmt, rotate, whole):
    """The kernel reading the block rows (int8 or 16-bit factors, ragged spans, ranks differing by pair and padded
    to the V side's, pre-RoPE keys rotated in the kernel or keys stored rotated, zoom blocks or whole spans) gives
    the float32-input kernel's logsumexps from blocks.unpack's factors (the same dequantised values: bit for bit in
    the interpreter), the PyTorch path's (BatchedStep._scout_lse), and the float64 reference from the factors' own
    keys (factorize.reconstruct_all, rotate-half RoPE in the model's column order)."""
    from sekv_core.sekv import blocks
    from sekv_core.sekv import scout_kernel as sk

    b, lens, keys = _blocks_case(fmt)
    hkv, d, S = keys.shape[0], keys.shape[2], len(_LENS)
    rb, per = _rows_tables(lens, b.n_max, whole)
    q_nat = torch.randn(hkv, 20, d, generator=torch.Generator().manual_seed(3)) / d**0.5
    phase = _phase(S, b.n_max, d) if rotate else None
    q = q_nat[..., rope.pairs_order(d)] if rotate else q_nat  # the keys' column order the scout makes them in
    rows = b.words.view(hkv, S, b.stride)  # every span, read where the blocks are
    start, length = sk.block_tables(rb, per)
    got = sk.block_lse_rows(b, rows, q, start, length, torch.full((hkv, S, per, 20), 7.0), phase=phase, pairs=rotate)
    us, vt = blocks.unpack(b, rows.reshape(hkv * S, -1), torch.float32, side=0, pairs=rotate)
    ref32 = sk.block_lse(us, vt, q, start, length, torch.full((hkv, S, per, 20), 7.0), phase=phase)
    assert torch.equal(got, ref32)
    torch_path = _pytorch_path(b, rows, q, phase, rb, per, whole)
    assert torch.equal(torch.isinf(got), torch.isinf(torch_path))
    assert torch.allclose(got, torch_path, atol=1e-5, rtol=1e-4), (got - torch_path).nan_to_num().abs().max()
    _check(got, _natural_reference(keys, lens, q_nat, phase, rb, per))


@on_cpu
@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
def test_block_lse_rows_in_place_staged_or_fetched(fmt):
    """The rows of a run of spans as the scout meets them: a strided view of the blocks where they lie (every
    group's run), a staged copy ([Hkv * ns, stride]), fetched rows (blocks.fetch: the words past a block's used part
    repeat its last), and through the wired BatchedStep._scout_lse (staged or in place): the same logsumexps,
    written only into the chunk's slice of the output."""
    from sekv_core.sekv import blocks
    from sekv_core.sekv import scout_kernel as sk

    b, lens, keys = _blocks_case(fmt, seed=5)
    hkv, d, S = keys.shape[0], keys.shape[2], len(_LENS)
    rb, per = _rows_tables(lens, b.n_max, False, seed=6)
    q_nat = torch.randn(hkv, 9, d, generator=torch.Generator().manual_seed(7)) / d**0.5
    q, phase = q_nat[..., rope.pairs_order(d)], _phase(S, b.n_max, d)
    i0, i1 = 2, 7
    ns = i1 - i0
    start, length = sk.block_tables(rb[i0:i1], per)
    ph = phase[i0:i1]
    view = b.words.view(hkv, S, b.stride)[:, i0:i1]
    assert not view.is_contiguous()
    pair = (torch.arange(hkv).view(-1, 1) * S + torch.arange(i0, i1).view(1, -1)).flatten()
    fetched, _ = blocks.fetch(b, pair, torch.ones_like(pair, dtype=torch.bool))
    ref = _natural_reference(keys, lens, q_nat, phase, rb, per)[:, i0:i1]
    outs = []
    for rows in (view, view.contiguous().view(hkv * ns, b.stride), fetched):
        full = torch.zeros(hkv, S, per, 9)
        sk.block_lse_rows(b, rows, q, start, length, full[:, i0:i1], phase=ph)
        assert not full[:, :i0].any() and not full[:, i1:].any()
        outs.append(full[:, i0:i1])
        _check(outs[-1], ref)
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    for staged in (True, False):  # the wired call: spans 0..ns-1 of a chunk of the blocks' first spans
        got = _pytorch_path(b, b.words.view(hkv, S, b.stride)[:, :ns], q, phase[:ns], rb[:ns], per, False, fused=sk, staged=staged)
        _check(got, _natural_reference(keys, lens, q_nat, phase, rb, per)[:, :ns])



@on_cuda
@pytest.mark.parametrize("fmt", ["int8", "bfloat16"])
@pytest.mark.parametrize("rotate", [True, False])
def test_block_lse_rows_on_cuda(fmt, rotate):
    """The compiled row-reading kernel at head_dim 128 (the 8B shape's): the float64 reference's values (ieee), and
    within TF32's rounding (tf32); a view of the blocks' rows in device memory, read in place."""
    from sekv_core.sekv import scout_kernel as sk

    b, lens, keys = _blocks_case(fmt, d=128, hkv=4, seed=8)
    hkv, d, S = keys.shape[0], keys.shape[2], len(_LENS)
    rb, per = _rows_tables(lens, b.n_max, False, seed=9)
    q_nat = torch.randn(hkv, 100, d, generator=torch.Generator().manual_seed(10)) / d**0.5
    phase = _phase(S, b.n_max, d) if rotate else None
    q = q_nat[..., rope.pairs_order(d)] if rotate else q_nat
    ref = _natural_reference(keys, lens, q_nat, phase, rb, per)
    rows = b.words.cuda().view(hkv, S, b.stride)
    start, length = sk.block_tables(rb.cuda(), per)
    ph = None if phase is None else phase.cuda()
    # TF32 rounds each product's inputs to 10 mantissa bits (2^-11 relative), so a logit's error is bounded by about
    # 2^-10 * sum |q| |k| (the keys' own reconstruction and their rotation add as much again): the tolerance is 2^-8 times the block's
    # logsumexp of |q| . |k| (>= its largest such sum), not a fixed atol (int8 keys reach |q| . |k| ~ 45 here)
    bound = _natural_reference(keys.abs(), lens, q_nat.abs(), None, rb, per)
    for prec in ("ieee", "tf32"):
        got = sk.block_lse_rows(b, rows, q.cuda(), start, length, torch.full((hkv, S, per, 100), 7.0, device="cuda"), phase=ph, pairs=rotate, precision=prec)
        if prec == "ieee":
            _check(got, ref)
        else:
            got, fin = got.double().cpu(), torch.isfinite(ref)
            err = (got[fin] - ref[fin]).abs()
            assert torch.equal(torch.isinf(got), ~fin) and (err <= 2.0**-8 * bound[fin] + 1e-4).all(), err.max()

def test_fused_scout_chunks_budgeted_by_their_staged_rows(monkeypatch):
    """With the fused kernel a chunk's memory is its staged block rows: the scout's chunks hold about
    SCOUT_CHUNK_BYTES of them each (never more), more spans a chunk than the PyTorch path's keys and logits allow,
    and cover every span of every layer once."""
    from sekv_core import methods  # noqa: F401 - first: gpu_step alone does not import (a cycle through sekv.memory)
    from sekv_core.sekv import blocks
    from sekv_core.sekv import factorize as fz
    from sekv_core.sekv import gpu_step

    g = torch.Generator().manual_seed(0)
    lens = torch.randint(8, 40, (300,), generator=g)
    x = torch.randn(2, int(lens.sum()), 64, generator=g)
    f = fz.factorize(x, lens, energy=0.8, rank_max=16, int8=True)
    b = blocks.build(fz.stack_kv(f, f), lens, 64, "cpu", pin=False)
    st = gpu_step.BatchedStep.__new__(gpu_step.BatchedStep)
    st.blocks, st.hkv, st.d, st.P = [b, b, b], 2, 64, 0
    budget = 100 * 8 * b.stride  # 100 pairs' rows: a layer (600 pairs) in chunks
    monkeypatch.setattr(gpu_step, "SCOUT_CHUNK_BYTES", budget)
    jobs = st._scout_jobs([0, 1, 2], 300, 20, b.n_max, fused=True)
    staged = [len(layers) * 2 * (i1 - i0) * 8 * b.stride for layers, i0, i1 in jobs]
    assert max(staged) <= budget and min(staged) > budget // 2
    assert sorted((layers[0], i) for layers, i0, i1 in jobs for i in range(i0, i1)) == [(l, i) for l in range(3) for i in range(300)]
    assert len(jobs) < len(st._scout_jobs([0, 1, 2], 300, 20, b.n_max, fused=False))


def _tiny32(kind):
    """test_sekv_method.tiny with head_dim 32 (the kernel's smallest): 2 layers, 4 query heads, 2 KV groups."""
    import transformers

    common = dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=300, max_position_embeddings=4096)
    cfg = transformers.Qwen2Config(**common) if kind == "qwen2" else transformers.LlamaConfig(**common, rope_theta=50000.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()


def _scout_masses(fused: bool, monkeypatch, **params):
    """The batched step's scout pass on the tiny model: (memory, its per-layer block masses [L, n_blocks])."""
    import test_sekv_scout
    from test_sekv_method import EXACT
    from test_sekv_scout import QUESTION, _memory

    from sekv_core import runtime
    from sekv_core.sekv import gpu_step

    monkeypatch.setattr(test_sekv_scout, "tiny", _tiny32)
    monkeypatch.setattr(gpu_step, "SCOUT_FUSED", fused)
    calls, unpacked = [], []
    if fused:
        from sekv_core.sekv import scout_kernel as sk

        inner = sk.block_lse_rows
        monkeypatch.setattr(sk, "block_lse_rows", lambda *a, **k: calls.append(1) or inner(*a, **k))
    inner_factors = gpu_step.BatchedStep._scout_factors
    monkeypatch.setattr(gpu_step.BatchedStep, "_scout_factors", lambda *a, **k: unpacked.append(1) or inner_factors(*a, **k))
    model, res, store, p, mem = _memory("qwen2", capture=False, **{**EXACT, "zoom": "router", "budget": 0.5, **params})
    assert mem.shape.head_dim == 32
    mem.batched = True
    masses = []
    inner_masses = gpu_step.BatchedStep._scout_masses

    def spy(self, *a, **k):
        out = inner_masses(self, *a, **k)
        masses.append(out.clone())
        return out

    monkeypatch.setattr(gpu_step.BatchedStep, "_scout_masses", spy)
    q = torch.tensor([QUESTION])
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    assert bool(calls) == fused and len(masses) == 1  # the kernel ran where it was asked for, and only there
    assert bool(unpacked) != fused  # the fused pass reads the block rows: no float32 factors unpacked
    return mem, masses[0]


@on_cpu
@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
@pytest.mark.parametrize("unit", [3, 16])
def test_fused_scout_masses_equal_the_pytorch_path(unit, key_space, monkeypatch):
    """gpu_step.SCOUT_FUSED: the batched step's per-layer block masses are the PyTorch path's, keys factorised before
    RoPE (rotated in the kernel) or after, zoom blocks of 3 tokens (several a span) or of 16 (whole spans); and so
    its ranking."""
    params = {"zoom_unit": unit, "key_space": key_space}
    mem0, ref = _scout_masses(False, monkeypatch, **params)
    mem1, got = _scout_masses(True, monkeypatch, **params)
    assert mem0.res.pre_rope == (key_space == "pre_rope") and mem0.res.whole_spans == (unit == 16)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()
    assert torch.allclose(mem1.ranking.prio, mem0.ranking.prio, atol=1e-4)


@on_cpu
def test_fused_scout_in_chunks_of_spans(monkeypatch):
    """A layer's spans scored a few at a time (long contexts; the rotation made a chunk at a time): the same masses."""
    from sekv_core.sekv import gpu_step

    mem0, ref = _scout_masses(False, monkeypatch, zoom_unit=3)
    monkeypatch.setattr(gpu_step.BatchedStep, "_scout_chunk", lambda self, n_pairs, per_pair: (5, 1))
    monkeypatch.setattr(gpu_step, "SCOUT_CHUNK_BYTES", 1)
    mem1, got = _scout_masses(True, monkeypatch, zoom_unit=3)
    assert torch.allclose(got, ref, atol=1e-4), (got - ref).abs().max()


@on_cuda
@pytest.mark.parametrize("rotate", [True, False])
@pytest.mark.parametrize("whole", [False, True])
def test_block_lse_on_cuda(rotate, whole):
    """The compiled kernel on the device: the float64 reference's values (ieee), and within TF32's rounding (tf32)."""
    us, vt, q, phase, rb, per = _case(d=128, r=40, n_max=150, ns=40, hkv=4, m=100, whole=whole, device="cuda")
    ph = phase if rotate else None
    ref = _reference(us, vt, q, ph, rb, per)
    _check(_run(us, vt, q, ph, rb, per, precision="ieee"), ref)
    got = _run(us, vt, q, ph, rb, per, precision="tf32").double().cpu()
    fin = torch.isfinite(ref)
    assert torch.equal(torch.isinf(got), ~fin) and torch.allclose(got[fin], ref[fin], atol=2e-2)


def _fused_chunks_against_float64(device, monkeypatch):
    """test_ttft's scout arguments and float64 block masses (every block from its own factors, one at a time) on the
    head_dim-32 tiny model, the pass scored with the kernel in chunks of every size."""
    import test_sekv_scout
    from test_ttft import _block_masses_reference, _scout_args

    from sekv_core.sekv import gpu_step
    from sekv_core.sekv import scout_kernel as sk

    monkeypatch.setattr(test_sekv_scout, "tiny", _tiny32)
    mem, args = _scout_args(device)
    st, S = mem.step, mem.res.n_spans
    assert S > 8 and st.hkv > 1 and mem.res.n_blocks > 2 * S and mem.res.pre_rope
    ref = _block_masses_reference(mem, *args)
    monkeypatch.setattr(gpu_step, "SCOUT_FUSED", True)
    calls = []
    inner = sk.block_lse_rows
    monkeypatch.setattr(sk, "block_lse_rows", lambda *a, **k: calls.append(1) or inner(*a, **k))
    cases = [((10**6, 2), None), ((st.hkv * S, 1), True), ((3 * st.hkv, 1), True), ((3 * st.hkv, 1), False), ((st.hkv, 1), True)]
    for (pairs, layers), staging in cases:
        monkeypatch.setattr(gpu_step.BatchedStep, "_scout_chunk", lambda self, n_pairs, per_pair, _c=(pairs, layers): _c)
        monkeypatch.setattr(gpu_step, "SCOUT_STAGING", staging)
        n = len(calls)
        got = st.scout_masses(*args)
        runs = 1 if pairs >= st.hkv * S else -(-S // (pairs // st.hkv))  # a layer's chunks
        assert len(calls) - n == mem.shape.n_layers * runs  # one launch a layer and chunk
        assert torch.allclose(got.double().cpu(), ref, atol=1e-5, rtol=1e-4), (pairs, staging, (got.double().cpu() - ref).abs().max())


@on_cpu
def test_fused_scout_chunks_give_the_blocks_own_masses(monkeypatch):
    """The scout's chunks (both layers in one, a layer in one, runs of 3 spans (the last shorter), one span;
    streamed or read in place) scored by the kernel give every block's mass computed from its own factors in float64."""
    _fused_chunks_against_float64("cpu", monkeypatch)


@on_cuda
def test_fused_scout_chunks_give_the_blocks_own_masses_on_cuda(monkeypatch):
    """The same on the device: the compiled kernel inside the batched step's scout pass (TF32 off: a float32 model)."""
    _fused_chunks_against_float64("cuda", monkeypatch)
