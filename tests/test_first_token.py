"""Host syncs between a question's tokens and its first answer token on the batched (CUDA) step.

Every host sync on the way (a scalar read, a data-dependent shape, a blocking copy from the host) stalls the host
until the device has run everything queued, so the next kernels' launches stop overlapping the device's work.
The scout pass, the fixed sets' fill and the answer's first forward make none: on the CPU, every call that would
wait on CUDA is listed by benchmarks/ttft_ops.py's SyncTrace; on CUDA, torch's sync debug mode counts them.
"""

from __future__ import annotations

import traceback
import warnings

import pytest
import torch

from benchmarks.ttft_ops import SyncTrace
from sekv_core import methods, runtime
from sekv_core.methods.base import GrowingKV
from sekv_core.methods.full import FullMemory

from test_sekv_method import _setup, tiny

QUESTION = [5, 17, 42, 99, 7, 250, 31, 8]


def test_sync_trace_names_what_waits_and_nothing_else():
    """The tracer's own property: each kind of call that waits for the device is listed once per call, by the line
    that made it; the sync-free forms of the same operations are not."""
    x = torch.arange(12.0).view(3, 4)
    m = x > 5
    with SyncTrace() as t:
        x.sum().item()  # a scalar read
        bool((x > 0).all())
        torch.nonzero(m)  # data-dependent shapes
        x[m]
        torch.repeat_interleave(torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2]))
        x.tolist()
        x.to("cpu")  # a blocking copy where x is on the host and the target the device (a "maybe")
        torch.tensor([1.0], device="cpu")
    kinds = sorted(s.split(" @ ")[0] for s in t.sites.elements())
    assert kinds == sorted(["_local_scalar_dense", "is_nonzero", "nonzero", "index (boolean mask)", "repeat_interleave (no output_size)",
                            "tolist", "maybe: to(device), blocking", "torch.tensor(device=)", "_local_scalar_dense"]) or kinds == sorted(
        ["_local_scalar_dense", "_local_scalar_dense", "nonzero", "index (boolean mask)", "repeat_interleave (no output_size)", "tolist",
         "maybe: to(device), blocking", "torch.tensor(device=)"]), kinds  # bool() of a one-element tensor: is_nonzero or a scalar read
    with SyncTrace() as t:
        x.index_select(0, torch.tensor([0, 2]))
        torch.where(m, x, 0.0)
        x.repeat_interleave(2, 0)  # int repeats: the size is known
        torch.repeat_interleave(torch.tensor([1, 2, 3]), torch.tensor([1, 1, 2]), output_size=4)
        x.to("cpu", non_blocking=True)
        torch.topk(x.flatten(), 3)
    assert not t.sites, t.sites


def _scout_and_first_logits(model, mem, q) -> torch.Tensor:
    """A question's scout pass and its answer's first forward, to the first token's id on the device."""
    mem.truncate(mem.res.n_doc)
    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
    hidden = runtime.forward_hidden(model, q, mem.n_tokens(), mem)
    with torch.inference_mode():
        return model.get_output_embeddings()(hidden[:, -1]).argmax(-1)


@pytest.mark.parametrize("tier", ["factors", "int8"])
def test_scout_and_first_forward_make_no_sync_on_the_batched_step(tier, monkeypatch):
    """The batched step run on the CPU: the second question's scout pass and first forward make no call that would
    wait on CUDA (the transformers mask code's packed-sequence check included: sekv registers no mask function); the
    first question only reads the host's span tables once (made on the host, sent without a sync).  With a zoom
    tier, its rows staged as on CUDA (the plan's row ids copied to the host without a sync, sekv/zoom_tier.py)."""
    from sekv_core.sekv import zoom_tier

    monkeypatch.setattr(zoom_tier, "STAGED_ON", {"cpu", "cuda"})
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.3, min_span=10, window=16, zoom_tier=tier)
    mem.batched = True
    q = torch.tensor([QUESTION])
    mem._step()  # the factor blocks (CUDA: built on a second thread from the open)
    with SyncTrace() as first:
        a = _scout_and_first_logits(model, mem, q)
    with SyncTrace() as second:
        b = _scout_and_first_logits(model, mem, q)
    assert torch.equal(a, b)
    # ".to(device)" of tensors that are on the device there (the rotary tables) are no copies: the CUDA test counts
    assert not second.definite(), second.sites
    assert all("_span_blocks" in s for s in first.definite()), first.sites  # host tensors: the tables of the pack's spans


def _cuda_syncs(fn) -> list[str]:
    """Run fn under torch's sync debug mode ("warn"): the stack of each host sync it made."""
    seen: list[str] = []
    show = warnings.showwarning

    def record(message, category, filename, lineno, file=None, line=None):
        if "synchroniz" in str(message).lower() and "prototype" not in str(message):  # not the mode's own notice
            frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
            here = [f for f in frames if "sekv_core" in f.filename] or frames
            seen.append(" <- ".join(f"{f.filename.split('/')[-1]}:{f.lineno} {f.name}" for f in here[-3:][::-1]))

    torch.cuda.synchronize()
    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = record
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
            warnings.showwarning = show
    return seen


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("routing,tier", [("scout", "factors"), ("per_layer", "factors"), ("scout", "int8"), ("scout", "exact")])
def test_cuda_scout_and_first_forward_read_nothing_back(routing, tier):
    """On CUDA, a question's scout pass, the fixed sets' fill (or the per-layer routing) and the answer's first forward
    to its first token's logits make no host sync, on the first question of an opened pack (its factor blocks built)
    and on the next; the answer's first token is the CPU's batched step's.  With a zoom tier the fill's rows are
    gathered on the host: the plan's row ids reach it by a non-blocking copy that the staging thread waits for
    (sekv/zoom_tier.py StagedRows), so the question's thread makes no sync there either.  (Per-layer routing outside
    a scout pass reads a tier with one sync a layer, ZoomTier.rows: not tested here.)"""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.3, min_span=10, window=16, routing=routing, zoom_tier=tier)
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)
    mem.batched = True
    want = _scout_and_first_logits(model, mem, torch.tensor([QUESTION]))
    m = methods.get("sekv").open(store, p, res.shape, "cuda")
    m._step()  # joins the factor blocks' build (its own syncs are counted in tests/test_sekv_decode.py)
    if getattr(m, "_warming", None) is not None:  # the kernels' warm-up after the build, on its thread: not the question's
        m._warming.join()
    q = torch.tensor([QUESTION], device="cuda")
    got = {}
    for ask in ("first", "second"):
        syncs = _cuda_syncs(lambda: got.__setitem__(ask, _scout_and_first_logits(gmodel, m, q)))
        assert not syncs, f"{ask} question: {len(syncs)} host syncs:\n" + "\n".join(syncs)
    assert got["first"].item() == got["second"].item() == want.item()


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"))])
def test_ttft_parts_add_up(device):
    """DecodeStats splits the TTFT into the scout pass and the first forward (CUDA: events on the stream): both
    ran, and together they fit in the TTFT (the rest is the first token's read and the marks themselves); a memory
    with no scout pass (full) has next to nothing in it."""
    from sekv_core.generate import generate

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.3, min_span=10, window=16)
    if device == "cuda":
        model = model.cuda()
        runtime.install(model)
        mem = methods.get("sekv").open(store, p, res.shape, "cuda")
        full = FullMemory(GrowingKV.from_tensors([k.cuda() for k in res.keys], [v.cuda() for v in res.values], "cuda"), res.shape)
    mem.batched = True
    for m, scouted in ((mem, True), (full, False)):
        _, st = generate(model, m, QUESTION, max_new_tokens=3, stop_ids=set())
        assert st.first_forward_s > 0 and st.scout_s >= 0
        assert st.scout_s + st.first_forward_s <= st.ttft_s * 1.01 + 1e-3, st
        if scouted:
            assert st.scout_s > 0.1 * st.first_forward_s  # a second forward of the question, and its scoring
        else:
            assert st.scout_s < 0.1 * st.first_forward_s


# -- the factor blocks started before the model loads (sekv/gpu_step.py start_blocks) ----------------------------


def _batched(store, p, res, device="cpu"):
    m = methods.get("sekv").open(store, p, res.shape, device)
    m.batched = True
    return m


def _first_logits(model, m, q):
    return runtime.forward_logits(model, q, m.n_tokens(), m, last_only=False)


def test_blocks_built_from_the_pack_alone_are_the_opened_packs():
    """The build start_blocks runs (the pack's checks, then its factors read from the store with the manifest's shape)
    gives the blocks, and so the logits, of the opened pack's own build; an early build that failed is made again
    in the first forward, from the opened pack."""
    from sekv_core.errors import PackError
    from sekv_core.sekv import gpu_step, layout

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    plain, early, failed = (_batched(store, p, res) for _ in range(3))
    n = plain.res.n_doc

    def source():
        layout.validate(store, res.shape, n)
        return gpu_step._Source(store, res.shape, torch.device("cpu"))

    early._blocks, early._early = gpu_step.BlockBuild(source), True
    took = early._blocks

    def broken():
        raise PackError("checksum mismatch")

    failed._blocks, failed._early = gpu_step.BlockBuild(broken), True
    q = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
    want = _first_logits(model, q=q, m=plain)
    for m in (early, failed):
        assert torch.equal(_first_logits(model, q=q, m=m), want)
    # the early build itself succeeded and its blocks are the ones the step uses (not a silent rebuild after a failure)
    assert took.result_or_none() is not None, took._error
    assert early.step.blocks is took.result()
    for a, b in zip(plain.step.blocks, early.step.blocks):
        assert torch.equal(a.words, b.words) and torch.equal(a.used, b.used) and (a.stride, a.n_max, a.r_max) == (b.stride, b.n_max, b.r_max)


def test_start_blocks_only_for_an_accelerator_and_taken_once_by_its_store():
    from sekv_core.sekv import gpu_step

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=300, budget=0.5, min_span=10)
    gpu_step.start_blocks(store, res.shape, 300, "cpu")  # the CPU opens its factors itself
    assert gpu_step.take_blocks(store, "cpu") is None
    build = gpu_step.BlockBuild(lambda: gpu_step._Source(store, res.shape, torch.device("cpu")))
    gpu_step._EARLY[id(store)] = (store, torch.device("cpu"), build)
    assert gpu_step.take_blocks(object(), "cpu") is None and gpu_step.take_blocks(store, "cpu") is build
    assert gpu_step.take_blocks(store, "cpu") is None  # once


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_memory_takes_up_the_blocks_started_before_it_opened():
    """start_blocks on CUDA, then the open: the memory takes that build up (no second build) and answers as a memory
    that built its own."""
    from sekv_core.sekv import gpu_step

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)
    own = _batched(store, p, res, "cuda")
    assert not own._early
    gpu_step.start_blocks(store, res.shape, own.res.n_doc, "cuda")
    early = _batched(store, p, res, "cuda")
    assert early._early and id(store) not in gpu_step._EARLY
    q = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3)).cuda()
    a, b = _first_logits(gmodel, early, q), _first_logits(gmodel, own, q)
    assert torch.allclose(a, b, atol=1e-5, rtol=1e-5), (a - b).abs().max()
    for a, b in zip(own.step.blocks, early.step.blocks):
        assert torch.equal(a.words, b.words)


# -- fewer ops before the first token: the same values (sekv/rope.py, residents.py, fixed_set.py) ---------------


@pytest.mark.parametrize("d", [8, 64])
def test_swapped_rotation_is_the_models_rotation_exactly(d):
    """rotate_half(x) * sin as x with its halves swapped times a half-negated sin: bit for bit the model's rotation."""
    from sekv_core.sekv import rope

    g = torch.Generator().manual_seed(3)
    x = torch.randn(37, d, generator=g) * 10
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    pos = torch.randint(0, 40000, (37,), generator=g)
    for dtype in (torch.float32, torch.bfloat16):
        cos, sin = rope.cos_sin(pos, inv, dtype=dtype)
        assert torch.equal(rope.apply_swapped(x, *rope.swapped(cos, sin)), rope.apply(x, cos, sin))


def test_rotation_table_gives_the_computed_rotation(monkeypatch):
    """Residents.rotate_doc (a table of every document position) equals Residents.rotate (computed at each call)
    exactly, with or without the table (a document past ROPE_TABLE_BYTES); rows past the document do not fail."""
    from sekv_core.sekv import residents

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=300, budget=0.3, min_span=10, window=16)
    r = mem.res
    assert r.pre_rope
    rows = torch.randn(50, r.shape.head_dim, generator=torch.Generator().manual_seed(4))
    pos = torch.randint(0, r.n_doc, (50,), generator=torch.Generator().manual_seed(5))
    want = r.rotate(rows, pos)
    assert torch.equal(r.rotate_doc(rows, pos), want)
    assert r.rotate_doc(rows, pos + r.n_doc).shape == rows.shape  # positions past the document: read the last one's
    r._rope_tables.clear()
    monkeypatch.setattr(residents, "ROPE_TABLE_BYTES", 0)
    assert torch.equal(r.rotate_doc(rows, pos), want) and r._rope_tables[r.device] is None


def test_one_device_fill_counts_each_layers_zoom():
    """A fixed set filled on one device records its stats once for all layers: the ask's span counts and zoom rate
    per layer are what each layer's kept blocks give (computed here from fixed.keep), and the bytes fetched what a
    fetch a layer counts (the stacked block tables removed: each layer counts its own fetch)."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.3, min_span=10, window=16)
    q = torch.tensor([QUESTION])
    stats, h2d = [], []
    for stacked in (True, False):
        m = _batched(store, p, res)
        m._step()
        assert (m.step.fixed.last_all is not None) and all(b.last.data_ptr() == m.step.fixed.last_all[i].data_ptr() for i, b in enumerate(m.step.blocks))
        if not stacked:
            m.step.fixed.last_all = None
        _scout_and_first_logits(model, m, q)
        x = m.step_stats().extra
        stats.append((x["span_zoom_counts"], x["zoom_rate_per_layer"]))
        h2d.append(x["h2d_bytes_step"])
    assert stats[0] == stats[1] and h2d[0] == h2d[1] > 0
    r, f = m.res, m.step.fixed
    g = r.shape.n_heads // r.shape.n_kv_heads
    counts, rates = torch.zeros(r.n_spans, dtype=torch.long), []
    for layer in range(r.shape.n_layers):
        keep = f.keep[layer].cpu()
        assert keep.any()
        seen = (torch.zeros(keep.shape[0], r.n_spans).index_add_(1, r.block_span, keep.float()) > 0).repeat_interleave(g, 0)  # [H, S]
        counts += seen.long().sum(0)
        rates.append(float(seen.double().mean()))
    assert stats[0][0] == {i: int(c) for i, c in enumerate(counts.tolist()) if c}
    assert stats[0][1] == pytest.approx(rates)


def test_warm_kernels_runs_the_question_path_on_made_up_inputs():
    """The warm-up (run on CUDA on the blocks' thread) runs on a memory's real blocks and the model's shape, leaves the
    global random state alone, and changes no block (the answers then are those of a memory without it)."""
    from sekv_core.sekv import gpu_step

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=300, budget=0.3, min_span=10, window=16)
    mem.batched = True
    mem._step()
    words = [b.words.clone() for b in mem.step.blocks]
    state = torch.get_rng_state()
    with torch.inference_mode():
        gpu_step.warm_kernels(mem.step.blocks, mem.res.shape, "cpu", mem.res.n_spans)
    assert torch.equal(torch.get_rng_state(), state)
    assert all(torch.equal(w, b.words) for w, b in zip(words, mem.step.blocks))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_block_build_warms_the_kernels_without_error():
    """On CUDA the blocks' thread runs the warm-up after the build: it raises nothing, and the build's result does not
    wait for it."""
    from sekv_core.sekv import gpu_step

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.5, min_span=10)
    build = gpu_step.BlockBuild(lambda: gpu_step._Source(store, res.shape, torch.device("cuda", torch.cuda.current_device())))
    blocks = build.result()
    build.join()
    assert build.warm_error is None, repr(build.warm_error)
    assert blocks and all(b.last.is_cuda for b in blocks)


def test_single_token_steps_wait_for_the_blocks_thread():
    """The blocks' thread (its warm-up after the build) has ended before the first single-token step, which CUDA may
    capture (another thread's allocations or copies during a capture would break it)."""
    from sekv_core.generate import generate
    from sekv_core.sekv import gpu_step

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=300, budget=0.3, min_span=10, window=16)
    mem.batched = True
    mem._blocks = build = gpu_step.BlockBuild(mem.res)
    generate(model, mem, QUESTION, max_new_tokens=3, stop_ids=set(), graphs=True)
    assert mem._warming is None and not build._thread.is_alive()


@pytest.mark.parametrize("how", ["gqa", "math"])
def test_the_question_forwards_sdpa_layouts_are_one_attention(how, monkeypatch):
    """fixed_set.FILL_SDPA_LAYOUT (the question's forward only, default packed: cuDNN builds a plan per question
    length) gives the logits of the other layouts; a single-token step keeps SDPA_LAYOUT."""
    from sekv_core.sekv import fixed_set

    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.3, min_span=10, window=16)
    mem.batched = True
    q = torch.tensor([QUESTION])
    packed = []
    grouped = fixed_set.grouped_attention
    monkeypatch.setattr(fixed_set, "grouped_attention", lambda *a: packed.append(a[0].shape[2]) or grouped(*a))

    def question():
        mem.truncate(mem.res.n_doc)
        mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
        return runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)

    a = question()
    assert packed and set(packed) == {q.shape[1]}  # the question's forward, every layer
    packed.clear()
    runtime.forward_logits(model, a[:, -1:].argmax(-1), mem.n_tokens(), mem)
    assert not packed  # a single-token step: SDPA_LAYOUT
    monkeypatch.setattr(fixed_set, "FILL_SDPA_LAYOUT", how)
    b = question()
    assert not packed
    assert torch.allclose(a, b, atol=1e-4, rtol=1e-4), (a - b).abs().max()
