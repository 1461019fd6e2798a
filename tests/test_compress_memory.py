"""sekv's compress under a device-memory bound (sekv/compress.py plan / free_bytes): the same pack, and a measured
peak under the bound.

The bound is what compress reads from ``compress.free_bytes`` (on CUDA: the free memory less a margin; on the CPU:
none).  Here it is replaced by a small figure on the CPU path, so the grouping and the span chunks a GPU would take
run on the CPU.  Reference: the same prefill compressed without a bound (every layer at once, as before).  The peak is
counted by a dispatch-mode hook: the bytes of every tensor storage compress makes and has alive at once (what it
returns excluded: on a GPU it goes to the host)."""

from __future__ import annotations

import itertools
import types
import weakref

import pytest
import torch
import transformers
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from sekv_core import methods, runtime
from sekv_core.prefill import prefill
from sekv_core.sekv import compress as C
from sekv_core.sekv.rank_gate import RankGate

N_TOKENS = 3000


class LiveBytes(TorchDispatchMode):
    """Storage bytes made under the mode, as a log of (storage id, +bytes when made / -bytes when its last tensor
    dies); :meth:`peak` the most alive at once."""

    def __init__(self):
        super().__init__()
        self.refs, self.ids, self.size, self.log, self.seq = {}, {}, {}, [], itertools.count()

    def _drop(self, key):
        self.refs[key] -= 1
        if self.refs[key] == 0:
            i = self.ids.pop(key)
            del self.refs[key]
            self.log.append((i, -self.size[i]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        strided = lambda t: isinstance(t, torch.Tensor) and t.layout == torch.strided  # noqa: E731
        ins = {t.untyped_storage().data_ptr() for t in tree_flatten((args, kwargs))[0] if strided(t)}
        for t in tree_flatten(out)[0]:
            if not strided(t):
                continue
            st = t.untyped_storage()
            key = st.data_ptr()
            if key == 0:
                continue
            if key not in self.refs:
                if key in ins:  # a view, or an in-place result, of a tensor made before
                    continue
                i = next(self.seq)
                self.ids[key], self.size[i], self.refs[key] = i, st.nbytes(), 0
                self.log.append((i, st.nbytes()))
            self.refs[key] += 1
            weakref.finalize(t, self._drop, key)
        return out

    def peak(self, exclude=()) -> int:
        skip = {self.ids[k] for k in exclude if k in self.ids}
        cur = top = 0
        for i, b in self.log:
            if i not in skip:
                cur += b
                top = max(top, cur)
        return top


@pytest.fixture(scope="module")
def setup():
    cfg = transformers.LlamaConfig(hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                                   vocab_size=300, max_position_embeddings=8192, rope_theta=50000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    runtime.install(model)
    ids = torch.randint(0, 300, (N_TOKENS,), generator=torch.Generator().manual_seed(1))
    res = prefill(model, ids, with_surprisal=True, chunk=512, capture=("obs_queries",))
    offloaded = prefill(model, ids, with_surprisal=True, chunk=512, capture=("obs_queries",), offload_kv=True)
    m = methods.get("sekv")
    return m, res, offloaded, m.resolve_params({"budget": 0.1, "router": "untrained"})


def _measured(fn):
    with LiveBytes() as acct:
        piece = fn()
    return piece, acct.peak({t.untyped_storage().data_ptr() for t in piece.tensors.values()})


def _close(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        x, y = a[k], b[k]
        assert x.shape == y.shape and x.dtype == y.dtype, k
        if x.is_floating_point():
            assert torch.allclose(x.float(), y.float(), rtol=1e-4, atol=1e-4), (k, (x.float() - y.float()).abs().max())
        else:  # ranks, int8 / 4-bit codes: a float32 rounding apart at most, on a few elements
            diff = (x.long() - y.long()).abs()
            assert int(diff.max()) <= 1 and float((diff > 0).float().mean()) < 1e-3, k


def test_a_bound_gives_the_same_pack(setup, monkeypatch):
    m, res, offloaded, p = setup
    ref = m.compress(res, p)  # the CPU: no bound, a layer at a time
    seg = C.segmentation(res, p)
    monkeypatch.setattr(C, "GROUP_ON_CPU", True)  # the grouping a GPU does
    cpu = torch.device("cpu")
    for bound in (1 << 40, 2_000_000, 900_000):  # every layer in one group; one layer a group in span chunks; smaller chunks
        monkeypatch.setattr(C, "free_bytes", lambda device, b=bound: b)
        todo = C.plan(res, seg, bound, cpu)
        got = m.compress(offloaded, p)  # the KV on the host (kv_offload.LayersOn), read a layer at a time
        _close(got, ref)
        if bound == 1 << 40:
            assert todo.group == 3 and len(todo.chunks) == 1
        else:
            assert todo.group == 1 and len(todo.chunks) > 3 and todo.profile_rows < _query_rows(res)
    assert len(C.plan(res, seg, 900_000, cpu).chunks) > len(C.plan(res, seg, 2_000_000, cpu).chunks)


def _query_rows(res) -> int:
    q = res.scores["obs_queries"][0]
    return q.shape[0] * q.shape[1]


def test_a_trained_rank_gate_in_span_chunks(setup, monkeypatch):
    """The gate reads each block's span summary: chunked, each chunk's spans get their own (and it drops components)."""
    m, res, offloaded, p = setup
    torch.manual_seed(3)
    gate = RankGate(p.rank_max, res.shape.head_dim)
    with torch.no_grad():
        gate.net[2].bias.normal_(0.0, 3.0)  # some components dropped, some kept
    trained = types.SimpleNamespace(gate=gate)
    ref = C.compress_window(res, p, trained)
    monkeypatch.setattr(C, "free_bytes", lambda device: 900_000)
    got = C.compress_window(res, p, trained)
    _close(got.tensors, ref.tensors)
    full = C.compress_window(res, p, None).tensors
    assert int(ref.tensors["fk.0.rank"].long().sum()) < int(full["fk.0.rank"].long().sum())  # the gate did drop some


@pytest.mark.parametrize("bound", [2_000_000, 900_000])
def test_the_peak_stays_under_the_bound(setup, monkeypatch, bound):
    m, res, offloaded, p = setup
    _, unbounded = _measured(lambda: C.compress_window(res, p))
    assert unbounded > 2 * bound  # without the bound, compress holds more: this test can fail
    monkeypatch.setattr(C, "free_bytes", lambda device: bound)
    monkeypatch.setattr(C, "GROUP_ON_CPU", True)
    piece, peak = _measured(lambda: C.compress_window(res, p))
    assert peak <= bound, (peak, bound)
    assert piece.tensors["fk.0.rank"].shape[1] == C.segmentation(res, p).n_spans


def test_out_of_memory_all_the_same_runs_the_step_again_in_smaller_chunks(setup, monkeypatch):
    """The plan's counts are estimates: a device that cannot hold what they allowed (here: a decomposition of more
    than 600 rows raises torch.OutOfMemoryError) gets the failed step again under half the bound, until it fits; the
    same tensors.  Errors other than running out of memory are not retried."""
    from sekv_core.sekv import factorize as fz

    m, res, offloaded, p = setup
    ref = C.compress_window(res, p)
    real, seen = fz.factorize_many, []

    def small_device(xs, span_len, **kw):
        seen.append(int(span_len.sum()))
        if seen[-1] > 600:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(xs, span_len, **kw)

    monkeypatch.setattr(fz, "factorize_many", small_device)
    monkeypatch.setattr(C, "free_bytes", lambda device: 8_000_000)  # whole layers at first
    got = C.compress_window(res, p)
    _close(got.tensors, ref.tensors)
    assert seen[0] > 600 and max(seen[-10:]) <= 600  # whole layers failed; chunks of under 600 rows made the piece

    def broken(xs, span_len, **kw):
        raise RuntimeError("not a memory problem")

    monkeypatch.setattr(fz, "factorize_many", broken)
    with pytest.raises(RuntimeError, match="not a memory problem"):
        C.compress_window(res, p)
    monkeypatch.setattr(fz, "factorize_many", small_device)
    monkeypatch.setattr(C, "OOM_RETRIES", 0)
    with pytest.raises(torch.OutOfMemoryError):
        C.compress_window(res, p)


def test_out_of_memory_in_a_later_layer_keeps_the_layers_already_made(setup, monkeypatch):
    """Running out of memory at the last layer redoes that layer only (under half the bound), not the window: one
    decomposition a layer, plus the failed one (a restart of the window would decompose layers 0 and 1 again)."""
    from sekv_core.sekv import factorize as fz

    m, res, offloaded, p = setup
    ref = C.compress_window(res, p)
    real, calls, events = fz.factorize_many, [], []

    def fails_once_at_the_last_layer(xs, span_len, **kw):
        calls.append(int(span_len.sum()))
        if len(calls) == res.shape.n_layers:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(xs, span_len, **kw)

    monkeypatch.setattr(fz, "factorize_many", fails_once_at_the_last_layer)
    monkeypatch.setattr(C, "free_bytes", lambda device: 64_000_000)  # whole layers, one a group (the CPU), at both bounds
    monkeypatch.setattr(C, "PROGRESS", lambda event, **info: events.append((event, info)))
    got = C.compress_window(res, p)
    _close(got.tensors, ref.tensors)
    assert len(calls) == res.shape.n_layers + 1 and len(set(calls)) == 1
    retries = [info for e, info in events if e == "retry"]
    assert len(retries) == 1 and retries[0]["bound"] == 32_000_000
    assert [info["done"] for e, info in events if e == "layers"] == list(range(1, res.shape.n_layers + 1))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_merge_codes_factors_on_cuda_as_on_the_cpu(setup):
    """merge.encode_factors on a GPU (what sekv ingest does there) gives the host codec's bytes exactly."""
    from sekv_core.sekv import merge

    m, res, offloaded, p = setup
    piece = C.compress_window(res, p)
    span_len = piece.seg.span_len
    kcfg, vcfg = C.codec_configs(p)
    for kind, cfg in (("fk", kcfg), ("fv", vcfg)):
        for li in range(res.shape.n_layers):
            parts = [({k: piece.tensors[f"{kind}.{li}.{k}"] for k in merge._FACTOR_PARTS if f"{kind}.{li}.{k}" in piece.tensors}, span_len)]
            f = merge.merge_factors(parts, res.shape.head_dim)
            cpu, gpu = merge.encode_factors(f, span_len, res.shape.head_dim, cfg), merge.encode_factors(f, span_len, res.shape.head_dim, cfg, "cuda")
            assert set(cpu) == set(gpu)
            for k in cpu:
                assert gpu[k].device.type == "cpu" and torch.equal(cpu[k], gpu[k]), (kind, li, k)


def test_a_whole_document_is_coded_in_compress_as_the_merge_codes_windows(setup):
    """A one-window document's factors are coded where compress makes them (compress_window code=True); the
    reference: the same window's uncoded factors merged and coded by the merge, as a windowed document's are."""
    from sekv_core.sekv import merge

    m, res, offloaded, p = setup
    got = m.compress(res, p)
    piece = C.compress_window(res, p, None)
    assert "fk.0.us" in piece.tensors and "fk.0.us.q4" not in piece.tensors
    moments = [piece.tensors.pop(f"moment.{li}") for li in range(res.shape.n_layers)]
    ref = merge.merge([piece], moments, p, res.shape, res.n_tokens, None, None, torch.device("cpu"))
    assert set(got) == set(ref) and any(k.endswith(".us.q4") for k in got) and any(k.endswith(".us_scale.l8") for k in got)
    for k in ref:
        assert got[k].dtype == ref[k].dtype and torch.equal(got[k], ref[k]), k


def test_every_window_gets_the_rest_of_the_host_arena(setup, monkeypatch):
    """A windowed document's results all go into the host arena ingest prepared (on a GPU: sekv/host_copies.py),
    each window after the bytes the ones before it took, from a 64-byte boundary; a full arena: none."""
    from sekv_core.sekv import merge

    m, res, offloaded, p = setup
    arena = torch.zeros(10_000, dtype=torch.uint8)
    seen, used = [], iter([1000, 8970, 50])

    def window(prefill, params, trained=None, arena=None, code=False):
        seen.append(None if arena is None else (arena.data_ptr(), arena.numel()))
        piece = merge.Piece(prefill.start, prefill.n_tokens, None, {f"moment.{li}": torch.zeros(1) for li in range(prefill.shape.n_layers)}, next(used))
        return piece

    monkeypatch.setattr(C, "compress_window", window)
    monkeypatch.setattr(merge, "merge", lambda *a, **k: {})
    C.compress_windows([res, res, res], p, arena)
    base = arena.data_ptr()
    assert seen == [(base, 10_000), (base + 1024, 10_000 - 1024), None]  # 1000 -> 1024; then 8970 -> 9024 of the 8976 left: none
    assert C.arena_after(None, 5) is None and C.arena_after(arena, 0).data_ptr() == base
