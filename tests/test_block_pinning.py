"""The batched step's factor blocks before the first question (sekv/gpu_step.py BlockBuild) and after it
(sekv/blocks.py HostPinning): the first question reads only blocks that are built, whatever the build's pace; blocks
moved to host memory in pauses between questions never change an answer, and no half-made copy is ever read."""

from __future__ import annotations

import time

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.sekv import blocks as fb
from sekv_core.sekv import gpu_step

from test_sekv_method import _setup, tiny

QUESTIONS = [[5, 17, 42, 99, 7, 250, 31, 8], [3, 14, 15, 92, 65, 35], [271, 82, 81, 82, 8]]


def _batched(store, p, res, device="cpu"):
    m = methods.get("sekv").open(store, p, res.shape, device)
    m.batched = True
    return m


def _question(model, mem, q) -> torch.Tensor:
    """A question's scout pass (every layer's blocks read) and its answer's first forward (the kept blocks fetched):
    the first forward's logits."""
    mem.truncate(mem.res.n_doc)
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    return runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)


def _readers(monkeypatch) -> list[float]:
    """The times of every read of factor blocks (the scout's rebuild, the fixed sets' and routed steps' fetches)."""
    reads: list[float] = []
    for name in ("fetch", "unpack"):
        real = getattr(fb, name)

        def spy(*a, _real=real, **k):
            reads.append(time.monotonic())
            return _real(*a, **k)

        monkeypatch.setattr(fb, name, spy)
    return reads


def test_first_question_reads_only_blocks_already_built_by_a_slow_build(monkeypatch):
    """A deliberately slow build (each layer's blocks come 40 ms apart, on the build's thread): the first question
    starts at once, its first read of a block comes after the last layer was built, and its logits are those of a
    memory that built its blocks in its first forward."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    plain = _batched(store, p, res)
    q = torch.tensor([QUESTIONS[0]])
    want = _question(model, plain, q)
    built: list[float] = []
    real = fb.build

    def slow(*a, **k):
        time.sleep(0.04)
        b = real(*a, **k)
        built.append(time.monotonic())
        return b

    monkeypatch.setattr(fb, "build", slow)
    m = _batched(store, p, res)
    m._blocks = gpu_step.BlockBuild(m.res)
    reads = _readers(monkeypatch)
    t0 = time.monotonic()
    got = _question(model, m, q)
    assert torch.equal(got, want)
    assert len(built) == res.shape.n_layers and reads and min(reads) > max(built) > t0


def test_blocks_moved_in_pauses_never_change_an_answer(monkeypatch):
    """Layers moved to other host memory by HostPinning between questions (a slow copy that holds -1 until it is done,
    as a half-made copy would): every question's logits equal those of a memory whose blocks never move, whether a
    layer moved before, during or after a question; no layer moves while the memory is in use."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    still, m = _batched(store, p, res), _batched(store, p, res)
    assert m.ranking is not None and m.ranking.kind == "scout"
    q0 = torch.tensor([QUESTIONS[0]])
    assert torch.equal(_question(model, m, q0), _question(model, still, q0))
    L = res.shape.n_layers
    old = [b.words for b in m.step.blocks]
    copies = []

    def slow_copy(words, pin, non_blocking=False):
        host = torch.full_like(words, -1)
        time.sleep(0.05)
        host.copy_(words)
        copies.append(time.monotonic())
        return host

    monkeypatch.setattr(fb, "to_host", slow_copy)
    want = [_question(model, still, torch.tensor([q])) for q in QUESTIONS]
    m.pinning = fb.HostPinning(m.step.blocks, list(range(L)), "cpu", pin=False, idle_s=1.0)
    m.pinning.touch()
    # in use: questions back to back for longer than the pause -> nothing moves
    t_end = time.monotonic() + 2.5
    while time.monotonic() < t_end:
        for q, w in zip(QUESTIONS, want):
            assert torch.equal(_question(model, m, torch.tensor([q])), w)
    assert m.pinning.pending() == L and not copies
    # pauses: layers move (one at a time, each taking 50 ms), installed by the next question's first forward
    m.pinning.idle_s = 0.02
    for k in range(6):
        time.sleep(0.03 + 0.04 * k)
        j = k % len(QUESTIONS)
        assert torch.equal(_question(model, m, torch.tensor([QUESTIONS[j]])), want[j]), k
    assert m.pinning.installed > 0  # layers moved between the questions above, and were read moved
    m.pinning.finish()
    assert m.pinning.pending() == 0 and m.pinning.installed == L and len(copies) == L
    assert all(b.words.data_ptr() != w.data_ptr() and torch.equal(b.words, w) for b, w in zip(m.step.blocks, old))
    qt = torch.tensor([QUESTIONS[1]])
    assert torch.equal(_question(model, m, qt), _question(model, still, qt))


def test_pinning_thread_ends_with_its_memory():
    """The copying thread holds no reference to its blocks while it waits: dropping the memory ends it."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=300, budget=0.5, min_span=10)
    m = _batched(store, p, res)
    _question(model, m, torch.tensor([QUESTIONS[0]]))
    pin = fb.HostPinning(m.step.blocks, [0], "cpu", pin=False, idle_s=30.0)
    pin.touch()
    th = pin.thread
    assert th.is_alive()
    del pin
    th.join(timeout=2.0)
    assert not th.is_alive()


# -- CUDA: the build keeps the layers on the device, the pinning moves them to pinned host memory -------------------


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_blocks_kept_on_the_device_then_pinned_answer_the_same(monkeypatch):
    """On CUDA the build started before the open keeps its layers in device memory (the first question gathers from
    there: no page-locking before it) and the memory's pinning moves them to pinned host memory, read through their
    mapped (UVA) view; the first question's logits, later questions' and graphed decoding steps' all equal those of a
    memory whose blocks were pinned from the start (KEEP_SHARE 0, the default)."""
    from sekv_core.generate import generate

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)
    monkeypatch.setattr(gpu_step, "KEEP_SHARE", 0.0)
    pinned = _batched(store, p, res, "cuda")
    pinned._step()  # its build (a thread) read the share
    monkeypatch.setattr(gpu_step, "KEEP_SHARE", 100.0)  # of the document's full KV: every layer
    gpu_step.start_blocks(store, res.shape, pinned.res.n_doc, "cuda")
    kept = _batched(store, p, res, "cuda")
    assert kept._early
    q = torch.tensor([QUESTIONS[0]], device="cuda")
    a, b = _question(gmodel, pinned, q), _question(gmodel, kept, q)
    assert torch.equal(a, b), (a - b).abs().max()
    assert all(x.uva and x.words.is_pinned() for x in pinned.step.blocks)
    assert kept.pinning is not None and all(x.words.is_cuda and not x.uva for x in kept.step.blocks)
    assert kept.pinning.pending() == res.shape.n_layers and kept.pinning.device_bytes() > 0
    key = kept.pinning.key()
    kept.pinning.finish()
    assert kept.pinning.key() != key and kept.pinning.device_bytes() == 0
    assert all(x.uva and x.words.is_pinned() for x in kept.step.blocks)
    for x, y in zip(pinned.step.blocks, kept.step.blocks):
        assert torch.equal(x.words, y.words)
    for qq in QUESTIONS[1:]:
        q = torch.tensor([qq], device="cuda")
        assert torch.equal(_question(gmodel, pinned, q), _question(gmodel, kept, q))
    outs = []
    for m in (pinned, kept):
        m.truncate(m.res.n_doc)
        outs.append(generate(gmodel, m, QUESTIONS[2], max_new_tokens=6, stop_ids=set(), graphs=True)[0])
    assert outs[0] == outs[1]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_kept_blocks_stay_within_their_share(monkeypatch):
    """The build keeps layers on the device only while they fit KEEP_SHARE of the document's full KV; the rest are
    page-locked by the build (a share smaller than one layer's blocks: none kept, no pinning object)."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    monkeypatch.setattr(gpu_step, "KEEP_SHARE", 1e-12)
    gpu_step.start_blocks(store, res.shape, len(ids), "cuda")
    m = _batched(store, p, res, "cuda")
    m._step()
    assert m.pinning is None and all(x.uva for x in m.step.blocks)


def test_factor_checks_of_the_early_build_catch_damaged_factors_only():
    """start_blocks checks only what the build reads (layout.validate factors_only): damaged factors or spans fail
    there as in the open's full check; a NaN in a coarse entry (not read by the build) fails only the full check."""
    from sekv_core.errors import PackError
    from sekv_core.methods.base import DictStore
    from sekv_core.sekv import layout

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=300, budget=0.5, min_span=10)
    t = {k: store.get(k) for k in store.keys()}
    layout.validate(DictStore(t), res.shape, len(ids), factors_only=True)
    names = [k for k in t if k.startswith("sekv.fk.1.") and k != "sekv.fk.1.rank"]
    short = dict(t, **{names[0]: t[names[0]][:-1]})
    rank = dict(t, **{"sekv.fv.0.rank": t["sekv.fv.0.rank"] + 1000})
    for bad in (short, rank):
        for fo in (True, False):
            with pytest.raises(PackError):
                layout.validate(DictStore(bad), res.shape, len(ids), factors_only=fo)
    nan = dict(t, **{"sekv.coarse.k.0": torch.full_like(t["sekv.coarse.k.0"], float("nan"))})
    layout.validate(DictStore(nan), res.shape, len(ids), factors_only=True)
    with pytest.raises(PackError):
        layout.validate(DictStore(nan), res.shape, len(ids))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_page_locked_memory_is_mapped_at_its_own_size():
    """blocks.page_locked: page-locked (registered, not torch's power-of-two pinned allocation) host memory of exactly
    the size asked, read by the device through its mapped view; registered again after it went (unregistered)."""
    for _ in range(2):
        t = fb.page_locked(1000 * 1000 + 3)
        assert t.is_pinned() and t.numel() == 1000 * 1000 + 3 and t.dtype == torch.int64
        t.copy_(torch.arange(t.numel()))
        v = fb.device_view(t, torch.device("cuda"))
        assert v is not None and torch.equal(v.index_select(0, torch.tensor([0, 5, t.numel() - 1], device="cuda")).cpu(),
                                             torch.tensor([0, 5, t.numel() - 1]))
        del v, t
