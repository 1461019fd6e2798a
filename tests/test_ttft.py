"""Time to first token: the rehearsal (Session.rehearse) changes no answer and leaves every first use of a kernel
behind it (CUDA); the scout's scoring is the same masses with fewer launches."""

from __future__ import annotations

import os
import sys

import pytest
import torch
from torch.overrides import TorchFunctionMode
from torch.profiler import record_function

from conftest import SAMPLE_MD
from sekv_core import api as sekv
from sekv_core import methods
from sekv_core import session as session_mod
from sekv_core.session import Session

QUESTIONS = ["How many steps does the tower have?", "Who kept the log?"]


@pytest.fixture(scope="module")
def packs(lm, tmp_path_factory):
    d = tmp_path_factory.mktemp("ttft")
    return {m: sekv.ingest(SAMPLE_MD, d / f"{m}.sekv", model=lm, method=m).pack_path for m in ("sekv", "full")}


def _answers(s: Session) -> list[tuple]:
    out = []
    for q in QUESTIONS:
        a = s.ask(q, max_new_tokens=6)
        out.append((a.token_ids, a.stats.extra.get("span_order")))
    return out


def _open(pack, lm, batched: bool) -> Session:
    s = Session.open(pack, lm=lm)
    if batched:
        s.memory.batched = True  # the accelerators' step (sekv/gpu_step.py), on the CPU
    return s


def lazy_loads(prof) -> list[str]:
    """Each lazy CUDA function load of a profile (``record_shapes``; the code run under :class:`Lines`), named by what
    ran it."""
    events = list(prof.events())
    return [around(events, e) for e in events if e.name == "Lazy Function Loading"]


def around(events, target) -> str:
    """What ran ``target``: its profiler parents and the host events whose time holds it (on its thread, else on any),
    outermost first (:class:`Lines`' source lines among them), and the innermost op's input shapes and kernels."""
    t0, t1 = target.time_range.start, target.time_range.end
    held = [e for e in events if e is not target and e.device_type == target.device_type and e.time_range.start <= t0 and t1 <= e.time_range.end]
    held = [e for e in held if e.thread == target.thread] or held
    held.sort(key=lambda e: (e.time_range.start, -e.time_range.end))
    parents, p = [], target.cpu_parent
    while p is not None:
        parents.insert(0, p.name)
        p = p.cpu_parent
    out = [f"{target.name} at {t0:.0f} us", "parents: " + " > ".join(parents[-24:]), "held by: " + " > ".join(e.name for e in held[-24:])]
    for e in reversed(held):  # the innermost op with shapes or kernels
        if e.input_shapes or e.kernels:
            out.append(f"innermost {e.name}: shapes {e.input_shapes}; kernels {[k.name[:160] for k in e.kernels]}")
            break
    return "\n  ".join(out)


class Lines(TorchFunctionMode):
    """Each torch call of sekv's or transformers' code inside a profiler range named by its source line ("path:line"),
    so that a profile's events say where they were called from (the profiler's own ``with_stack`` is not used: its
    parse failed now and then in tests, decoding a frame's name)."""

    MINE = (f"{os.sep}sekv_core{os.sep}", f"{os.sep}transformers{os.sep}models{os.sep}")

    def __torch_function__(self, func, types, args=(), kwargs=None):
        f = sys._getframe(1)
        while f is not None and not any(m in f.f_code.co_filename for m in self.MINE):
            f = f.f_back
        if f is None:
            return func(*args, **(kwargs or {}))
        name = f.f_code.co_filename
        for m in self.MINE:
            name = name.split(m, 1)[-1] if m in name else name
        with record_function(f"{name}:{f.f_lineno}"):
            return func(*args, **(kwargs or {}))


def test_around_names_what_ran_an_event():
    """The failure message of the no-lazy-load tests names a load by what ran it (here: a product's kernel call, inside
    the op and sekv's source line that called it), so that a CUDA run says which kernel of which part loaded."""
    import inspect

    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from sekv_core.sekv import gpu_step

    q, keys = torch.ones(2, 3, 4), torch.ones(2, 5, 4)
    with profile(activities=[ProfilerActivity.CPU], record_shapes=True) as prof, Lines():
        gpu_step.BatchedStep.scout_exact(q, keys, 0.5)
    events = list(prof.events())
    bmm = next(e for e in events if e.name == "aten::bmm" and e.device_type == DeviceType.CPU)
    text = around(events, bmm)
    lines, first = inspect.getsourcelines(gpu_step.BatchedStep.scout_exact)
    line = first + next(i for i, t in enumerate(lines) if "torch.matmul" in t)
    assert f"sekv/gpu_step.py:{line} > aten::matmul" in text.split("held by: ")[1]  # the line, then the op
    assert "innermost aten::matmul: shapes [[2, 3, 4], [2, 4, 5]]" in text


@pytest.mark.parametrize("method,batched", [("sekv", False), ("sekv", True), ("full", False)])
def test_rehearsal_changes_no_answer(packs, lm, method, batched):
    """Questions asked after a rehearsal (run to its end on its thread, here on the CPU) give the tokens and the
    evidence order of the same questions in a session that had none; its wait is counted in the first answer's TTFT."""
    plain = _answers(_open(packs[method], lm, batched))
    s = _open(packs[method], lm, batched)
    assert s.rehearse(force=True)
    assert not s.rehearse(force=True)  # one at a time
    first = s.ask(QUESTIONS[0], max_new_tokens=6)
    assert s.rehearsal_error is None and s.rehearsal_s is not None
    waited = first.stats.extra.get("rehearsal_wait_s", 0.0)
    assert 0.0 <= waited <= first.stats.ttft_s
    rest = s.ask(QUESTIONS[1], max_new_tokens=6)
    assert "rehearsal_wait_s" not in rest.stats.extra
    assert [(first.token_ids, first.stats.extra.get("span_order")), (rest.token_ids, rest.stats.extra.get("span_order"))] == plain
    assert not s.rehearse(force=True)  # once per session


def test_rehearsal_only_on_cuda_and_its_error_is_left_to_the_question(packs, lm, monkeypatch):
    s = Session.open(packs["sekv"], lm=lm)
    assert not s.rehearse()  # the CPU: nothing to load
    assert s.settle() == 0.0
    monkeypatch.setattr(session_mod, "REHEARSAL_QUESTION", "")  # an empty question: SekvError inside the rehearsal
    assert s.rehearse(force=True)
    s.settle()
    assert s.rehearsal_error is not None and s.rehearsal_s is None
    assert s.ask(QUESTIONS[0], max_new_tokens=4).token_ids == Session.open(packs["sekv"], lm=lm).ask(QUESTIONS[0], max_new_tokens=4).token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_first_question_after_the_rehearsal_loads_no_kernel(packs, tiny_qwen):
    """On CUDA, after the rehearsal, the first real question (another length, another text) makes no lazy CUDA
    function load: every kernel of its way (scout pass, fills, first forward, decode steps) ran in the rehearsal."""
    from torch.profiler import ProfilerActivity, profile

    from sekv_core import models

    lm = models.load(str(tiny_qwen), device="cuda")
    for method in ("sekv", "full"):
        s = Session.open(packs[method], lm=lm)
        assert s.rehearse()
        s.settle()
        assert s.rehearsal_error is None, s.rehearsal_error
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof, Lines():
            s.ask("Which lamp was lit last, and by whom, in the keeper's own words?", max_new_tokens=6)
        loads = lazy_loads(prof)
        assert not loads, f"{method}: {len(loads)} lazy loads\n" + "\n".join(loads)


def _scout_args(device: str):
    """A batched sekv memory (tiny model, many spans) on ``device`` and the arguments its scout pass gave
    scout_masses (each layer's question queries and their logsumexp over the exact keys)."""
    from test_sekv_scout import QUESTION as SCOUT_Q, _memory
    from sekv_core import runtime

    model, res, store, p, mem = _memory("qwen2", n=600, capture=False, budget=0.3, min_span=10, window=16, zoom_unit=3)
    if device != "cpu":
        model = model.to(device)
        mem = methods.get("sekv").open(store, p, res.shape, device)
    mem.batched = True
    mem._step()
    got = {}
    inner = mem.step.scout_masses

    def grab(qs, others, scaling):
        got["args"] = (qs, others, scaling)
        return inner(qs, others, scaling)

    mem.step.scout_masses = grab
    q = torch.tensor([SCOUT_Q], device=device)
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    del mem.step.scout_masses
    return mem, got["args"]


def _block_masses_reference(mem, qs, others, scaling) -> torch.Tensor:
    """Every layer's zoom-block masses from its factor blocks, one block at a time in float64: the keys rebuilt from
    both sides' factors (blocks.unpack), rotated to their document positions (rope.cos_sin), the block's logsumexp
    over its own rows, its mass the max over groups and queries of exp(lse - the logsumexp over every block and the
    exact keys) -> [L, n_blocks]."""
    from sekv_core.sekv import blocks as fb
    from sekv_core.sekv import rope

    r, st = mem.res, mem.step
    S = r.n_spans
    out = []
    for layer, b in enumerate(st.blocks):
        us, vt = fb.unpack(b, b.words.view(-1, b.stride).cpu(), torch.float64)
        keys = torch.matmul(us[:, 0], vt[:, 0])  # [Hkv * S, n_max, d]
        q, other = qs[layer].double().cpu(), others[layer].double().cpu()
        lse = torch.empty(st.hkv, r.n_blocks, q.shape[1], dtype=torch.float64)
        for e in range(r.n_blocks):
            i, j0, n = int(r.block_span[e]), int(r.block_off[e]), int(r.block_len[e])
            pos = int(r.span_start[i]) + j0 + torch.arange(n)
            cos, sin = rope.cos_sin(pos, r.inv_freq.cpu(), r.rope_scaling)
            for g in range(st.hkv):
                k = rope.apply(keys[g * S + i, j0 : j0 + n], cos.double(), sin.double()) if r.pre_rope else keys[g * S + i, j0 : j0 + n]
                lse[g, e] = torch.logsumexp(q[g] @ k.t() * scaling, dim=-1)
        total = torch.logsumexp(torch.cat([lse, other.unsqueeze(1)], 1), 1)  # [Hkv, M]
        out.append(torch.exp(lse - total.unsqueeze(1)).amax(-1).amax(0))
    return torch.stack(out)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_scout_chunks_of_every_group_give_the_blocks_own_masses(device, monkeypatch):
    """The scout's scoring in chunks of spans of every KV group (both layers in one; a layer in one; runs of a few
    spans, the last one shorter; one span), its blocks streamed (group runs copied one by one, or through the
    blocks' mapped view in one strided copy: on the CPU, emulated) or read in place, gives each zoom block's mass
    computed from the blocks' own factors one block at a time (float64)."""
    from sekv_core.sekv import gpu_step

    mem, args = _scout_args(device)
    st, S = mem.step, mem.res.n_spans
    ref = _block_masses_reference(mem, *args)
    assert S % 4 and S > 8 and st.hkv > 1  # runs of 4 spans: the last one shorter
    seen = []
    real_jobs = gpu_step.BatchedStep._scout_jobs
    monkeypatch.setattr(gpu_step.BatchedStep, "_scout_jobs", lambda self, *a: seen.append(real_jobs(self, *a)) or seen[-1])
    cases = [((10**6, 2), None, False), ((st.hkv * S, 1), True, False), ((4 * st.hkv, 1), True, False), ((4 * st.hkv, 1), False, False),
             ((st.hkv, 1), True, False)]
    if device == "cpu":
        cases.append(((4 * st.hkv, 1), True, True))
    uva = [b.uva for b in st.blocks]
    for (pairs, layers), staging, mapped in cases:
        monkeypatch.setattr(gpu_step.BatchedStep, "_scout_chunk", lambda self, n_pairs, per_pair, _c=(pairs, layers): _c)
        monkeypatch.setattr(gpu_step, "SCOUT_STAGING", staging)
        for b, u in zip(st.blocks, uva):
            b.uva = mapped or u
        got = st.scout_masses(*args)
        assert torch.allclose(got.double().cpu(), ref, atol=1e-5, rtol=1e-4), (pairs, staging, mapped, (got.double().cpu() - ref).abs().max())
    for b, u in zip(st.blocks, uva):
        b.uva = u
    assert [len(j) for j in seen] == [1, 2, 2 * -(-S // 4), 2 * -(-S // 4), 2 * S] + ([2 * -(-S // 4)] if device == "cpu" else [])
    assert seen[2][-1][1:] == (S - S % 4, S) and all(j[0] == [0, 1] for j in seen[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_scout_rotation_table_in_16_bits_holds_the_rotation_exactly(dtype):
    """The scout's pass-wide rotation table is held in a 16-bit model's dtype (half the bytes, so it fits its chunk
    bound at twice the context): rope.cos_sin_half's values for that dtype are that dtype's, so nothing changes."""
    from sekv_core.sekv import rope

    pos = torch.randint(0, 200_000, (4096,))
    inv = 1.0 / (1e6 ** (torch.arange(0, 128, 2).float() / 128))
    cos, sin = rope.cos_sin_half(pos, inv, 1.0, dtype=dtype)
    assert torch.equal(cos.to(dtype).float(), cos) and torch.equal(sin.to(dtype).float(), sin)
    assert not torch.equal(rope.cos_sin_half(pos, inv, 1.0)[0].to(dtype).float(), rope.cos_sin_half(pos, inv, 1.0)[0])  # float32's are not


@pytest.mark.parametrize("tier", ["factors", "int8"])
def test_rehearsal_on_the_first_layer_runs_the_question_way_and_keeps_nothing(tier, monkeypatch):
    """rehearse_layer (what the factor blocks' thread runs on CUDA while the model loads) takes the question's way on
    the pack's first layers, for each of its question lengths: the scout pass (its scoring in several chunks), the
    fixed sets' fill, the first forward; then a single-token step, eager and static, on the accelerators' step; the
    pack's own memory, opened after it with the same blocks, answers as one opened without it."""
    from sekv_core.sekv import gpu_step, memory, zoom_tier
    from test_sekv_method import _setup

    monkeypatch.setattr(zoom_tier, "STAGED_ON", {"cpu", "cuda"})
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.3, min_span=10, window=16, zoom_tier=tier)
    blocks = gpu_step.build_blocks(mem.res)
    calls = {}
    for name in ("prepare_question", "_step", "static_begin"):
        real = getattr(memory.ZoomMemory, name)

        def spy(self, *a, _real=real, _name=name, **k):
            calls.setdefault(_name, []).append(self.shape.n_layers)
            return _real(self, *a, **k)

        monkeypatch.setattr(memory.ZoomMemory, name, spy)
    from sekv_core.sekv import fixed_set

    fills = []
    real_fill = fixed_set.FixedSets._fill
    monkeypatch.setattr(fixed_set.FixedSets, "_fill", lambda self, r, layer, plan: fills.append(layer) or real_fill(self, r, layer, plan))
    monkeypatch.setattr(gpu_step.BatchedStep, "_scout_chunk", lambda self, n_pairs, per_pair: (7, 1))  # several chunks
    s = memory.rehearse_layer(store, p, res.shape, "cpu", blocks, batched=True)
    n, k = min(memory.REHEARSAL_LAYERS, res.shape.n_layers), len(memory.REHEARSAL_TOKENS)
    assert n >= 2 and k >= 2  # several layers' stacks and views; a second length
    assert s > 0 and calls["prepare_question"] == [n] * k and set(calls["_step"]) == {n} and calls["static_begin"] == [n]
    assert fills == list(range(n)) * k
    monkeypatch.undo()
    q = torch.tensor([[5, 17, 42, 99, 7, 250, 31, 8]])
    from sekv_core import runtime

    def first_logits(blocks_given):
        m = memory.ZoomMemory(store, p, res.shape, "cpu", blocks=blocks_given)
        m.batched = True
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m))
        return runtime.forward_logits(model, q, m.n_tokens(), m), m.ranking.prio.clone()

    a, pa = first_logits(blocks)  # the blocks the rehearsal used
    b, pb = first_logits(gpu_step.build_blocks(mem.res))
    assert torch.equal(a, b) and torch.equal(pa, pb)


def test_rehearsals_draw_nothing_from_the_default_generator_and_take_the_lexical_branches(packs, lm, monkeypatch):
    """No rehearsal (rehearse_layer, Session.rehearse) nor question draws from the default generator: on CUDA a draw
    from it beside a CUDA graph's capture (on any thread), or after a capture that failed, raises.  rehearse_layer's
    made-up question takes the lexical evidence's way, the look-alikes' demotion included (demoting nothing); the
    session's rehearsal asks two lengths (one token apart), each to its last token whatever the stop tokens, and
    leaves the memory as it was."""
    from sekv_core.pack import read_pack
    from sekv_core.sekv import gpu_step, lexical, memory, scout

    s = Session.open(packs["sekv"], lm=lm)
    s.memory.batched = True
    demoted, evidence = [], []
    real_demote, real_finish = lexical.demote, scout.Ranking.finish_pass
    monkeypatch.setattr(lexical, "demote", lambda prio, mask: demoted.append(mask) or real_demote(prio, mask))
    monkeypatch.setattr(scout.Ranking, "finish_pass", lambda self, pr, pw, lex, lw: evidence.append(lex) or real_finish(self, pr, pw, lex, lw))
    state = torch.random.get_rng_state()
    memory.rehearse_layer(read_pack(packs["sekv"]), s.memory.params, s.memory.shape, "cpu", gpu_step.build_blocks(s.memory.res), batched=True)
    assert torch.equal(torch.random.get_rng_state(), state)
    assert len(evidence) == len(memory.REHEARSAL_TOKENS) and all(e is not None for e in evidence)
    assert len(demoted) == len(memory.REHEARSAL_TOKENS) and all(m is not None and not m.any() for m in demoted)
    seen = []
    real_generate = session_mod.generate

    def spy(model, mem, q_ids, **kw):
        ids, stats = real_generate(model, mem, q_ids, **kw)
        seen.append((len(q_ids), kw["max_new_tokens"], len(ids), mem.rehearsing))
        return ids, stats

    monkeypatch.setattr(session_mod, "generate", spy)
    s.stop_ids = set(range(len(lm.tokenizer)))  # every token ends an answer
    assert s.rehearse(force=True)
    s.settle()
    assert s.rehearsal_error is None, s.rehearsal_error
    (n0, t0, m0, r0), (n1, t1, m1, r1) = seen
    assert (t0, m0, t1, m1) == (session_mod.REHEARSAL_TOKENS, session_mod.REHEARSAL_TOKENS, 1, 1) and n1 == n0 - 1 and r0 and r1
    assert not s.memory.rehearsing
    assert s.ask(QUESTIONS[0], max_new_tokens=4).token_ids == [] and seen[-1][3] is False  # a question stops at its stop tokens
    assert torch.equal(torch.random.get_rng_state(), state)


def test_tf32_stays_on_while_a_step_on_another_thread_is_inside():
    """The batched step's TF32 products (gpu_step._tf32, a process-wide setting): a question and the blocks'
    rehearsal run steps on two threads at once; one leaving leaves the other's products in TF32, and the setting is
    set back once both have left."""
    from sekv_core.sekv.gpu_step import _tf32

    before = torch.backends.cuda.matmul.allow_tf32
    a, b = _tf32(True), _tf32(True)
    try:
        a.__enter__()
        b.__enter__()
        a.__exit__(None, None, None)
        assert torch.backends.cuda.matmul.allow_tf32
        b.__exit__(None, None, None)
        assert torch.backends.cuda.matmul.allow_tf32 == before
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("tier", ["factors", "int8"])
def test_cuda_blocks_thread_rehearses_the_first_layer(tier):
    """On CUDA, a build started before the model loads with the ask's params (start_blocks) rehearses the question's
    way on the pack's first layer after the build, without error; the memory that takes the build up answers as a
    memory that built its own blocks."""
    from sekv_core import runtime
    from sekv_core.sekv import gpu_step, memory
    from test_sekv_method import _setup

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.3, min_span=10, window=16, zoom_tier=tier)
    dev = torch.device("cuda", torch.cuda.current_device())
    state = torch.cuda.get_rng_state(dev)
    gpu_step.start_blocks(store, res.shape, res.n_tokens, dev, p)
    early = gpu_step._EARLY[id(store)][2]
    early.join()
    assert early.warm_error is None and early.rehearsal_s is not None, repr(early.warm_error)
    assert torch.equal(torch.cuda.get_rng_state(dev), state)  # no draw from the device's default generator
    model = model.to(dev)
    q = torch.tensor([[5, 17, 42, 99, 7, 250, 31, 8]], device=dev)
    out = []
    for m in (memory.ZoomMemory(store, p, res.shape, dev), memory.ZoomMemory(store, p, res.shape, dev, blocks=gpu_step.build_blocks(memory.ZoomMemory(store, p, res.shape, dev).res))):
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m))
        out.append((runtime.forward_logits(model, q, m.n_tokens(), m), m.ranking.prio.clone()))
    # the scoring's chunks follow where the blocks are (kept on the device by the early build, or streamed): the
    # same masses up to float32 summation order (tests/test_ttft.py test_scout_chunks_of_every_group...)
    (la, pa), (lb, pb) = out
    assert torch.equal(pa.isnan(), pb.isnan()) and torch.allclose(pa, pb, atol=1e-5, rtol=1e-4, equal_nan=True), (pa - pb).nan_to_num(0).abs().max()
    assert torch.allclose(la, lb, atol=1e-5), (la - lb).abs().max()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_first_sekv_question_after_the_first_layer_rehearsal_loads_no_kernel(packs, tiny_qwen):
    """On CUDA, with the model's own kernels loaded by the same question asked of full (what full's first question
    pays too; the same length, so the model's products pick the same kernels), a sekv session opened after it builds
    its blocks and rehearses its first layers before the model is loaded: its first question, to its first token,
    then makes no lazy CUDA function load (every sekv kernel of its way ran in the rehearsal)."""
    from torch.profiler import ProfilerActivity, profile

    from sekv_core import models

    lm = models.load(str(tiny_qwen), device="cuda")
    Session.open(packs["full"], lm=lm).ask(QUESTIONS[0], max_new_tokens=6)
    s = Session.open(packs["sekv"], model=str(tiny_qwen), device="cuda")  # the build and rehearsal start before the load
    build = s.memory._blocks
    build.join()  # as when the model load outlasts them (a question asked before the build's end skips the rehearsal)
    assert build.warm_error is None and build.rehearsal_s is not None
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as prof, Lines():
        s.ask(QUESTIONS[0], max_new_tokens=1)  # to the first token (the decode steps' graphs come after it)
    loads = lazy_loads(prof)
    assert not loads, f"{len(loads)} lazy loads\n" + "\n".join(loads)


def test_the_scouts_triton_kernel_waits_for_a_rehearsal(packs, lm, monkeypatch):
    """The fused scout kernel (gpu_step.SCOUT_FUSED) is compiled by Triton at its first use in a process (seconds a
    specialization): a session's question takes it only once a rehearsal has run it; a question without one (a single
    `sekv ask`) takes the PyTorch path, with the same answer."""
    from sekv_core.sekv import gpu_step

    asked = []
    monkeypatch.setattr(gpu_step, "scout_kernel", lambda device, d: asked.append(d))  # None: the PyTorch path all the same
    s = _open(packs["sekv"], lm, True)
    cold = s.ask(QUESTIONS[0], max_new_tokens=4)
    assert asked == [] and s.memory.fused_scout is False
    from sekv_core.pack import read_pack
    from sekv_core.sekv import memory

    # the blocks' thread's rehearsal of the first layers (while `sekv ask` loads its model) takes the first question's way
    memory.rehearse_layer(read_pack(packs["sekv"]), s.memory.params, s.memory.shape, "cpu", gpu_step.build_blocks(s.memory.res), batched=True)
    assert asked == []
    assert s.rehearse(force=True)
    warm = s.ask(QUESTIONS[0], max_new_tokens=4)
    assert asked and s.memory.fused_scout is True  # the rehearsal's questions and this one
    assert warm.token_ids == cold.token_ids
