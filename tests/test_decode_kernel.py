"""The static decode step's split-KV attention (sekv_core/sekv/decode_kernel.py) against a float64 reference of masked
attention, and wired into the fixed sets' single-token step (fixed_set.DECODE_KERNEL) against SDPA's path.

On the CPU these run the kernels under Triton's interpreter (TRITON_INTERPRET=1, numpy), where triton is importable;
else they are skipped.  The CUDA tests run the compiled kernels."""

from __future__ import annotations

import os

import pytest
import torch

try:
    import triton  # noqa: F401

    HAVE_TRITON = True
except Exception:  # not installed, or not usable here
    HAVE_TRITON = False

INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"
on_cpu = pytest.mark.skipif(not (HAVE_TRITON and INTERPRET), reason="needs triton and TRITON_INTERPRET=1 on the CPU")
on_cuda = pytest.mark.skipif(not (HAVE_TRITON and torch.cuda.is_available() and not INTERPRET), reason="needs CUDA and triton")


def _reference(q, k, v, m, scaling):
    """Masked GQA attention in float64, written out: head h on group h // (H / Hkv)."""
    g = q.shape[1] // k.shape[1]
    kk, vv = k.double().repeat_interleave(g, 1), v.double().repeat_interleave(g, 1)
    s = (q.double() @ kk.transpose(-1, -2)) * scaling + m.double()
    return torch.softmax(s, -1) @ vv


def _case(h, hkv, t, d, dtype, device, seed=0, hide_split=False):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(1, n, r, d, generator=gen).to(device, dtype) for n, r in ((h, 1), (hkv, t), (hkv, t)))
    m = torch.zeros(1, h, 1, t)
    m[..., int(0.8 * t) :] = float("-inf")  # the capacity past the length
    m[..., : t // 8] = torch.rand(1, h, 1, t // 8, generator=gen) * 3  # coarse entries' +log n
    m[:, ::2, :, t // 8 : t // 4] = float("-inf")  # hidden for some heads only
    if hide_split:  # a whole split of keys hidden for every head (it must add nothing)
        m[..., 300:600] = float("-inf")
    return q, k, v, m.to(device, dtype)


def _check(device):
    from sekv_core.sekv import decode_kernel as dk

    for dtype, tol in ((torch.float32, 1e-5), (torch.bfloat16, 1.6e-2)):
        for h, hkv, t, d in ((8, 2, 1500, 32), (14, 2, 700, 64), (4, 4, 70, 16)):
            q, k, v, m = _case(h, hkv, t, d, dtype, device, hide_split=t > 1000)
            n, chunk = dk.splits(t, hkv)
            assert n * chunk >= t and (n - 1) * chunk < t and chunk % dk.BLOCK_N == 0
            out = dk.decode_attention(q, k, v, m, d**-0.5)
            ref = _reference(q.cpu(), k.cpu(), v.cpu(), m.cpu(), d**-0.5)
            assert out.shape == (1, h, 1, d) and out.dtype == dtype
            err = (out.cpu().double() - ref).abs().max().item()
            assert err < tol, (dtype, h, hkv, t, d, err)


@on_cpu
def test_decode_attention_equals_float64_reference():
    """Several splits (one wholly hidden), a single split, GQA groups of 4 and 7 heads, float32 and bfloat16."""
    _check("cpu")


@on_cuda
def test_decode_attention_equals_float64_reference_on_cuda():
    _check("cuda")


@on_cpu
def test_decode_attention_strided_inputs_and_a_broadcast_mask():
    """Keys and values as views of a wider buffer (the joint buffer's resident part and annex), a mask of one row
    for every head (head stride 0), the output into a given tensor."""
    from sekv_core.sekv import decode_kernel as dk

    h, hkv, t, d = 8, 2, 500, 32
    gen = torch.Generator().manual_seed(1)
    buf = torch.randn(1, hkv, t + 40, d, generator=gen)
    k, v = buf[:, :, 20 : 20 + t], torch.randn(1, hkv, t + 40, d, generator=gen)[:, :, :t]
    q = torch.randn(1, h, 1, d, generator=gen)
    row = torch.zeros(1, 1, 1, t)
    row[..., 400:] = float("-inf")
    out = torch.empty(1, h, 1, d)
    got = dk.decode_attention(q, k, v, row.expand(1, h, 1, t), 0.2, out=out)
    assert got is out
    assert torch.allclose(out.double(), _reference(q, k, v, row.expand(1, h, 1, t), 0.2), atol=1e-5)


@on_cpu
@pytest.mark.parametrize("routing", ["scout"])
def test_static_sekv_steps_with_the_kernel_equal_sdpas(monkeypatch, routing):
    """A sekv memory's static single-token steps (what a CUDA graph captures) give the same logits with the kernel as
    with the SDPA call, and the ordinary step's (tests/test_graphed_step.py's comparison)."""
    from sekv_core import methods, runtime
    from sekv_core.sekv import fixed_set

    from test_graphed_step import QUESTION, _steps
    from test_sekv_method import _setup

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10, window=16, routing=routing)
    calls = []
    real = fixed_set.decode_kernel

    def counted(device, d):
        dk = real(device, d)
        calls.append(dk is not None)
        return dk

    out = []
    for on in (False, True):
        monkeypatch.setattr(fixed_set, "DECODE_KERNEL", on)
        monkeypatch.setattr(fixed_set, "decode_kernel", counted)
        m = methods.get("sekv").open(store, p, res.shape, "cpu")
        m.batched = True
        q = torch.tensor([QUESTION])
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m))
        out.append(_steps(model, m, True, 6, q)[0])
        if on:
            assert calls and all(calls)
        calls.clear()
    assert torch.allclose(out[0], out[1], atol=1e-4, rtol=1e-4), (out[0] - out[1]).abs().max()


def test_a_kernel_that_fails_to_build_leaves_the_sdpa_step(monkeypatch):
    """Where triton imports but cannot build the kernel (the step's first, eager run meets it), the step takes the SDPA
    call from then on and gives its logits."""
    from sekv_core import methods, runtime
    from sekv_core.sekv import fixed_set

    from test_graphed_step import QUESTION, _steps
    from test_sekv_method import _setup

    class Broken:
        calls = 0

        @staticmethod
        def supported(d):
            return True

        @classmethod
        def decode_attention(cls, *a, **k):
            cls.calls += 1
            raise RuntimeError("PTX assembly failed")

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10, window=16, routing="scout")
    out = []
    for broken in (False, True):
        monkeypatch.setattr(fixed_set, "DECODE_KERNEL", broken)
        monkeypatch.setattr(fixed_set, "_DECODE", [Broken] if broken else [])
        m = methods.get("sekv").open(store, p, res.shape, "cpu")
        m.batched = True
        q = torch.tensor([QUESTION])
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m))
        if broken:
            monkeypatch.setenv("TRITON_INTERPRET", "1")  # the loader's CPU condition
        out.append(_steps(model, m, True, 4, q)[0])
    assert Broken.calls == 1 and fixed_set._DECODE == [None]
    assert torch.allclose(out[0], out[1], atol=1e-6, rtol=1e-6), (out[0] - out[1]).abs().max()
