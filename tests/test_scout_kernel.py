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
    calls = []
    if fused:
        from sekv_core.sekv import scout_kernel as sk

        inner = sk.block_lse
        monkeypatch.setattr(sk, "block_lse", lambda *a, **k: calls.append(1) or inner(*a, **k))
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
    inner = sk.block_lse
    monkeypatch.setattr(sk, "block_lse", lambda *a, **k: calls.append(1) or inner(*a, **k))
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
