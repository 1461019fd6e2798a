"""Whole-step static decoding (sekv_core/graphed_step.py): the static path equals the ordinary step.

On the CPU the static path runs eagerly (exactly the code a CUDA graph captures); on CUDA the captured and
replayed step is compared with eager decoding.
"""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.generate import generate
from sekv_core.graphed_step import GraphedStep
from sekv_core.methods.base import GrowingKV
from sekv_core.methods.full import FullMemory

from test_sekv_method import EXACT, _setup, tiny

QUESTION = [5, 17, 42, 99, 7, 250]


def _steps(model, mem, static: bool, n: int, start: torch.Tensor, compile_layers: bool = False) -> torch.Tensor:
    """Logits of n greedy single-token steps after a question forward (ordinary), by either path."""
    head = model.get_output_embeddings()
    logits = [runtime.forward_logits(model, start, mem.n_tokens(), mem)]
    step = GraphedStep(model, mem, compile_layers=compile_layers) if static else None
    for _ in range(n):
        nxt = logits[-1].argmax(-1)
        if static:
            with torch.inference_mode():
                logits.append(head(step(nxt)[:, -1:]).float())
        else:
            logits.append(runtime.forward_logits(model, nxt, mem.n_tokens(), mem))
    return torch.cat(logits, 1), step


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_static_full_steps_equal_ordinary_steps_through_growth(kind):
    model, ref, ids, res, store, p, mem, full = _setup(kind, n=300)
    q = torch.tensor([QUESTION])
    a, _ = _steps(model, full, False, 8, q)
    # a memory whose capacity runs out twice during the steps (buffers reallocated: the key changes)
    small = FullMemory(GrowingKV.from_tensors(res.keys, res.values, "cpu", extra=len(QUESTION) + 2), res.shape)
    cap = small.kv.k[0].shape[-2]
    b, _ = _steps(model, small, True, 8, q)
    assert small.kv.k[0].shape[-2] > cap
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    assert small.n_tokens() == full.n_tokens()
    # with plain transformers over document + question + answer
    toks = torch.cat([ids.view(1, -1), q, b[:, :-1].argmax(-1)], 1)
    with torch.inference_mode():
        c = ref(toks).logits[:, -b.shape[1] :].float()
    assert torch.allclose(b, c, atol=2e-4, rtol=1e-4), (b - c).abs().max()


@pytest.mark.parametrize("routing", ["scout", "per_layer"])
def test_static_sekv_steps_equal_ordinary_batched_steps(routing):
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10, window=16, routing=routing)

    def batched():
        m = methods.get("sekv").open(store, p, res.shape, "cpu")
        m.batched = True
        return m

    out, stats = [], []
    for static in (False, True):
        m = batched()
        q = torch.tensor([QUESTION])
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m))
        out.append(_steps(model, m, static, 6, q)[0])
        stats.append(m.step_stats())
    assert torch.allclose(out[0], out[1], atol=1e-5, rtol=1e-5), (out[0] - out[1]).abs().max()
    x, y = (s.extra for s in stats)
    for k in ("zoom_spans_total", "span_zoom_counts", "budget_bytes", "h2d_bytes_total"):
        assert x[k] == y[k], k
    assert x["zoom_rate_per_layer"] == pytest.approx(y["zoom_rate_per_layer"])
    assert stats[0].resident_bytes == stats[1].resident_bytes <= x["budget_bytes"] + x["appended_bytes"]
    assert 0 < x["zoom_spans_total"]


def test_generate_with_static_steps_equals_generate():
    model, ref, ids, res, store, p, mem, full = _setup("llama", n=400, **EXACT)
    a, _ = generate(model, mem, QUESTION, max_new_tokens=5, stop_ids=set(), graphs=False)
    mem.truncate(400)
    mem.batched = True
    b, _ = generate(model, mem, QUESTION, max_new_tokens=5, stop_ids=set(), graphs=True)
    c, _ = generate(model, full, QUESTION, max_new_tokens=5, stop_ids=set(), graphs=True)
    assert a == b == c


@pytest.mark.parametrize("method", ["full", "sekv"])
def test_greedy_step_gives_the_argmax_of_the_plain_steps_logits(method):
    """GraphedStep(greedy=True), the head and the argmax inside the step: each token is the argmax of the head over a
    plain static step's hidden state, its own token fed back without a copy and its position moved on inside the
    step, and a truncation between steps (the position written again from the host) followed as the plain step does."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=400, budget=0.5, min_span=10, window=16)
    head = model.get_output_embeddings()

    def memory():
        if method == "full":
            return FullMemory(GrowingKV.from_tensors(res.keys, res.values, "cpu", extra=len(QUESTION) + 12), res.shape)
        m = methods.get("sekv").open(store, p, res.shape, "cpu")
        m.batched = True
        return m

    runs = []
    for greedy in (False, True):
        m = memory()
        q = torch.tensor([QUESTION])
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m))
        tok = runtime.forward_logits(model, q, m.n_tokens(), m)[:, -1].argmax(-1)
        step = GraphedStep(model, m, greedy=greedy)
        toks, fed = [], []
        with torch.inference_mode():
            for i in range(7):
                if i == 4:  # the last two tokens dropped: go on from the one fed two steps ago
                    m.truncate(m.n_tokens() - 2)
                    tok = fed[-2].clone()
                fed.append(tok)
                out = step(tok.view(1, 1))
                tok = out if greedy else head(out[:, -1]).argmax(-1)
                toks.append(int(tok))
                if greedy:  # the next step's input and position, left on the device by this one
                    assert int(step.tok) == toks[-1] and int(step.pos) == m.n_tokens()
        runs.append(toks)
        if greedy:
            assert out.shape == (1,) and out.dtype == torch.long
    assert runs[0] == runs[1]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_compiled_layer_steps_equal_ordinary_steps(device):
    """Static steps whose decoder layers run torch.compile'd (one compilation shared by the layers, the memory's
    attention a graph break; captured on CUDA) give the ordinary steps' logits, for full and sekv; the layers are
    left as they were."""
    import torch._dynamo

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=400, budget=0.5, min_span=10, window=16)
    if device == "cuda":
        model = model.cuda()
    dev = torch.device(device)

    def memories():
        yield FullMemory(GrowingKV.from_tensors([k.to(dev) for k in res.keys], [v.to(dev) for v in res.values], device, extra=len(QUESTION) + 3), res.shape)
        m = methods.get("sekv").open(store, p, res.shape, device)
        m.batched = True
        yield m

    def run(compiled: bool) -> list[torch.Tensor]:
        out = []
        for m in memories():
            q = torch.tensor([QUESTION], device=dev)
            m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m))
            out.append(_steps(model, m, True, 5, q, compile_layers=compiled)[0].cpu())
        return out

    plain = run(False)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    for a, b in zip(plain, run(True)):
        assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
    # compiled once for all layers (the graph break splits a layer in two), and nothing left patched
    assert 2 <= torch._dynamo.utils.counters["stats"]["unique_graphs"] <= 4
    assert all("forward" not in vars(layer) for layer in model.get_decoder().layers)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["full", "sekv-scout", "sekv-per-layer"])
def test_cuda_graphed_steps_equal_eager_steps(method):
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10, window=16,
                                                      routing="per_layer" if method == "sekv-per-layer" else "scout")
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)

    def memory():
        if method == "full":
            return FullMemory(GrowingKV.from_tensors([k.cuda() for k in res.keys], [v.cuda() for v in res.values], "cuda", extra=len(QUESTION) + 3), res.shape)
        return methods.get("sekv").open(store, p, res.shape, "cuda")

    if method == "sekv-per-layer":
        # per-layer routing reads the zoom tier's rows through the host at every step: no static step (eager steps)
        assert memory().res.zoom_tier is not None and not GraphedStep.supported(gmodel, memory())
    outs = []
    for graphs in (False, True) if method != "sekv-per-layer" else ():
        m = memory()
        q = torch.tensor([QUESTION], device="cuda")
        if method != "full":
            m.prepare_question(lambda: runtime.forward_hidden(gmodel, q, m.n_tokens(), m))
        lg, step = _steps(gmodel, m, graphs, 8, q)
        outs.append(lg.cpu())
    if outs:
        assert 1 <= step.captures <= 3  # replayed, not recaptured at every step (full: once more after growth)
        assert torch.allclose(outs[0], outs[1], atol=2e-3, rtol=1e-3), (outs[0] - outs[1]).abs().max()
    # generate() on CUDA takes the graphed path and gives the eager answer
    m = memory()
    a, _ = generate(gmodel, m, QUESTION, max_new_tokens=8, stop_ids=set(), graphs=False)
    m = memory()
    b, _ = generate(gmodel, m, QUESTION, max_new_tokens=8, stop_ids=set())
    assert a == b


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_capture_survives_page_locking_on_another_thread():
    """Another thread page-locks host memory and copies to the device while a step is captured (as the zoom tier's and
    the factor blocks' threads do): the capture holds and the graphed steps give the eager steps' logits."""
    import threading

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10, window=16, routing="scout")
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)
    stop = threading.Event()

    def pinning():
        s = torch.cuda.Stream()
        while not stop.is_set():
            h = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
            with torch.cuda.stream(s):
                h.to("cuda", non_blocking=True)
            s.synchronize()

    outs = []
    for graphs in (False, True):
        m = methods.get("sekv").open(store, p, res.shape, "cuda")
        q = torch.tensor([QUESTION], device="cuda")
        m.prepare_question(lambda: runtime.forward_hidden(gmodel, q, m.n_tokens(), m))
        th = threading.Thread(target=pinning, daemon=True)
        th.start()
        try:
            lg, step = _steps(gmodel, m, graphs, 8, q)
        finally:
            stop.set()
            th.join()
            stop.clear()
        outs.append(lg.cpu())
    assert step.captures >= 1
    assert torch.allclose(outs[0], outs[1], atol=2e-3, rtol=1e-3), (outs[0] - outs[1]).abs().max()


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_static_step_calls_per_layer_are_bounded(kind):
    """A static step's non-view aten calls (about one CUDA kernel each; benchmarks/step_ops.py counts them) grow per
    layer by at most the model's fused layer (7 projections, 2 norms, rotary of q and k together as cat, mul, roll,
    addcmul, 2 residual adds, the activation and its product: 17) plus the memory's (the new token's K and V written, one attention: 3 for
    sekv over a reused fixed set; 5 for full, whose mask is remade a layer); and sekv's memory code moves no more
    than a few rows a layer besides the attention (no copy of the resident set or its mask a step)."""
    from benchmarks.step_ops import count_steps, memories

    geometry = {"heads": 8, "kv_heads": 2, "head_dim": 32, "hidden": 64, "kind": kind}
    counts = {}
    for layers in (2, 3):
        model, mems = memories(400, layers, torch.float32, budget=0.2, **geometry)
        for name, mem in mems.items():
            counts[name, layers] = count_steps(model, mem, QUESTION)[-1]
    for name, memory_calls in (("sekv", 3), ("full", 5)):
        a, b = counts[name, 2], counts[name, 3]
        assert b.calls - a.calls <= 17 + memory_calls, (name, b.calls - a.calls, b.by_site - a.by_site)
        mine = lambda c: sum(n for s, n in c.by_site.items() if s[0] != "model")  # noqa: E731
        assert mine(b) - mine(a) <= memory_calls, (name, b.by_site - a.by_site)
    sekv = counts["sekv", 3]
    moved = sum(v for (site, op), v in sekv.bytes_by_site.items() if site != "model" and op != "sdpa")
    row = geometry["kv_heads"] * geometry["head_dim"] * 4  # one token's K or V, float32
    assert moved <= 3 * 8 * row, moved  # 3 layers: K and V rows, an index, a mask column


def test_fused_norm_and_rotary_are_the_models_within_bf16_rounding():
    """The static step's fused RMSNorm and rotary (graphed_step.fused_ops) give transformers' results within one bf16
    rounding, exactly in float32 arithmetic up to float32 rounding, and leave the model's code as it was."""
    import transformers.models.llama.modeling_llama as ml

    from sekv_core.graphed_step import fused_ops

    model = tiny("llama")
    norm, plain = model.model.layers[0].input_layernorm, ml.apply_rotary_pos_emb
    g = torch.Generator().manual_seed(0)
    for dtype, tol in ((torch.float32, 1e-6), (torch.bfloat16, 2.0**-7)):
        norm.weight.data = (1 + torch.randn(64, generator=g)).to(dtype)
        x = (3 * torch.randn(1, 1, 64, generator=g)).to(dtype)
        q, k = (torch.randn(1, n, 1, 16, generator=g).to(dtype) for n in (4, 2))
        ang = torch.rand(1, 1, 8, generator=g) * 6
        cos, sin = (f(torch.cat([ang, ang], -1)).to(dtype) for f in (torch.cos, torch.sin))
        ref = norm(x), *ml.apply_rotary_pos_emb(q, k, cos, sin)
        with fused_ops(model):
            assert "forward" in vars(norm) and ml.apply_rotary_pos_emb is not plain
            got = norm(x), *ml.apply_rotary_pos_emb(q, k, cos, sin)
        for a, b in zip(ref, got):
            assert a.dtype == b.dtype
            assert torch.allclose(a.float(), b.float(), atol=tol * 4, rtol=tol), (dtype, (a.float() - b.float()).abs().max())
    assert "forward" not in vars(norm) and ml.apply_rotary_pos_emb is plain


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_rotary_of_q_and_k_together_equals_each_on_its_own(dtype):
    """The static step rotates q's and k's heads as one tensor: bit for bit the rotation of each on its own (the
    previous code: addcmul(x * cos, roll(x, d / 2), sin') per tensor)."""
    from sekv_core.graphed_step import _rotary

    g = torch.Generator().manual_seed(1)
    q, k = (torch.randn(1, n, 1, 16, generator=g).to(dtype) for n in (8, 2))
    ang = torch.rand(1, 1, 8, generator=g) * 6
    cos, sin = (f(torch.cat([ang, ang], -1)).to(dtype) for f in (torch.cos, torch.sin))
    gq, gk = _rotary(None, {})(q, k, cos, sin)
    s = torch.cat([-sin[..., :8], sin[..., 8:]], -1).unsqueeze(1)
    for x, got in ((q, gq), (k, gk)):
        assert got.shape == x.shape and torch.equal(got, torch.addcmul(x * cos.unsqueeze(1), x.roll(8, -1), s))
