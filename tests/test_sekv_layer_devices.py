"""sekv on a model placed across devices keeps each layer's resident KV, coarse entries, router gates and zoom
buffers on that layer's device (sekv/residents.py ``Residents.at``) and answers as the same model on one device.

References: the un-split model on one device (the same tokens); the layer's execution device as accelerate reports
it (sekv_core/placement.py) for where each tensor must be.  On a CPU-only machine every execution device is the CPU,
so the placement is checked with a layer on PyTorch's "meta" device (no data, shapes only: a tensor that is not
moved there shows as "cpu"); the CUDA test (``-k cuda``) splits a tiny model between cuda:0 and the CPU.
"""

from __future__ import annotations

import pytest
import torch

import sekv
from sekv_core import methods, models, placement
from sekv_core.methods.base import ModelShape
from sekv_core.pack import read_pack
from sekv_core.session import stored_params
from sekv_core.sekv import gpu_step, residents
from sekv_core.sekv.gpu_step import BatchedStep, device_groups

from conftest import SAMPLE_MD

Q = "What did the keeper write about the storm?"
SPLIT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
         "model.rotary_emb": "cpu", "lm_head": "cpu"}
CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.fixture(scope="module")
def pack_path(lm, tmp_path_factory):
    return sekv.ingest(SAMPLE_MD, tmp_path_factory.mktemp("layer_devices") / "doc.sekv", method="sekv", model=lm).pack_path


def _ask(pack_path, lm, batched: bool | None = None, method: str | None = None):
    p = sekv.open(pack_path, model=lm, method=method)
    if batched is not None:
        p.session.memory.batched = batched
    return p.ask(Q, max_new_tokens=8).tokens.ids, p.session.memory


def test_sekv_opens_per_layer_devices():
    assert methods.get("sekv").per_layer_devices


@pytest.mark.parametrize("batched", [False, True])
def test_split_model_answers_as_one_device_with_each_layer_on_its_device(lm, tiny_qwen, pack_path, batched):
    """Both steps (the reference and the batched one): the model split through device_map (layer 1 streamed from
    disk) gives the un-split model's tokens, and the memory holds one device per layer, its execution device."""
    split = models.load(str(tiny_qwen), dtype=torch.float32, device_map=SPLIT)
    ref, _ = _ask(pack_path, lm, batched)
    got, mem = _ask(pack_path, split, batched)
    assert len(ref) > 0 and got == ref
    devices = placement.layer_devices(split.model)
    assert mem.layer_devices == devices and mem.res.kv.devices == devices


def _open(pack_path, lm, devices, **overrides):
    pack = read_pack(pack_path)
    params = methods.get("sekv").resolve_params({**stored_params(pack).to_dict(), **overrides})
    return methods.get("sekv").open(pack, params, ModelShape.of(lm.config, torch.float32), devices)


def _tensor_devices(x) -> set:
    return {t.device for t in (x if isinstance(x, (list, tuple)) else [x]) if torch.is_tensor(t)}


@pytest.mark.parametrize("routing", ["scout", "per_layer"])
def test_each_layers_tensors_are_on_its_device(lm, pack_path, routing):
    """Layer 1 on "meta": its buffers (resident KV, coarse entries, zoom annex / slots), gates, fixed-set tables and
    block table are there, layer 0's on the CPU; the pack's view on "meta" has every step table there and shares the
    buffers; the ranking's copy there follows a new ranking."""
    mem = _open(pack_path, lm, [CPU, META], routing=routing)
    res = mem.res
    assert res.split and res.device == CPU and mem.layer_devices == [CPU, META]
    for layer, dev in enumerate([CPU, META]):
        assert res.kv.k[layer].device == dev and res.kv.v[layer].device == dev
        assert _tensor_devices(res.gates[layer]) == {dev}
    view = res.at(META)
    assert res.at_layer(0) is res and res.at_layer(1) is view and res.at("meta") is view
    assert view.kv is res.kv and view.factors is res.factors
    for name in residents.DEVICE_TABLES:
        if hasattr(res, name):
            assert getattr(view, name).device == META, name
            assert getattr(res, name).device == CPU, name
    mem.batched = True
    step = mem._step()
    assert isinstance(step, BatchedStep)
    step.begin_forward(1)  # sizes the zoom buffers: the fixed sets' annex (scout) or the flat slots (per layer)
    assert step.U > 0
    for layer, dev in enumerate([CPU, META]):
        assert step.blocks[layer].used.device == dev
        assert res.kv.jk[layer].device == dev  # the annex is in the same allocation
        if step.fixed is not None:
            assert _tensor_devices(step.fixed.keep[layer]) == _tensor_devices(step.fixed.n[layer]) == {dev}
        else:
            assert step.rk[layer].device == step.rv[layer].device == dev
    assert (step.fixed is not None) == (routing == "scout")
    if mem.ranking is not None:
        first = mem.ranking.on(META)
        assert first.device == META and mem.ranking.on(META) is first and mem.ranking.on(CPU) is mem.ranking.prio
        mem.ranking.begin_pass()
        mem.ranking.finish_pass(torch.zeros_like(mem.ranking.prio), 0.0, None, 0.0)
        assert mem.ranking.on(META) is not first


def test_one_device_is_not_split(lm, pack_path):
    """Every layer on one device: no views, the gates are the stacked router's own rows (no copies)."""
    mem = _open(pack_path, lm, CPU)
    res = mem.res
    assert not res.split and res.at_layer(1) is res and res.at(CPU) is res and res._views == {}
    assert all(g[0].data_ptr() == res.w[i].data_ptr() for i, g in enumerate(res.gates))
    assert mem.layer_devices is None and not mem.static_supported()


def test_layout_follows_the_pack_on_every_device(lm, pack_path):
    """Re-positioned attention: a view's layout is on its device, at the question's position the pack's is."""
    mem = _open(pack_path, lm, [CPU, META])
    mem.question_at(200, 256)
    view = mem.res.at(META)
    assert view.layout is not None and view.layout.order.device == META and mem.res.layout.order.device == CPU
    assert (view.layout.p0, view.layout.room) == (mem.res.layout.p0, mem.res.layout.room)
    mem.question_at(150, 256)
    assert view.layout.p0 == mem.res.layout.p0 == 150


def test_scout_masses_are_scored_a_device_at_a_time(lm, pack_path, monkeypatch):
    """The batched scout scores each device's layers together, there, and gathers the masses in layer order."""
    devices = [CPU, META]
    mem = _open(pack_path, lm, devices)
    mem.batched = True
    step = mem._step()
    calls = []

    def fake(self, r, ids, qs, exact, scaling):
        calls.append((r.device, list(ids), {q.device for q in qs}))
        return torch.tensor([[float(i)] * r.n_blocks for i in ids])

    monkeypatch.setattr(BatchedStep, "_scout_masses", fake)
    qs = [torch.zeros(2, 3, 4, device=d) for d in devices]
    out = step.scout_masses(qs, qs, 1.0)
    assert calls == [(CPU, [0], {CPU}), (META, [1], {META})]
    assert out.device == CPU and out[:, 0].tolist() == [0.0, 1.0]


def _per_layer_lists(obj, n_layers: int, seen=None, depth=0):
    """Every list of n_layers tensors reachable from obj's attributes (a layer's K/V buffers, tables, gates...):
    (path, list)."""
    seen = set() if seen is None else seen
    if id(obj) in seen or depth > 3:
        return
    seen.add(id(obj))
    for name, value in vars(obj).items() if hasattr(obj, "__dict__") and not torch.is_tensor(obj) else []:
        if isinstance(value, list) and len(value) == n_layers and value and all(torch.is_tensor(t) for t in value):
            yield name, value
        elif hasattr(value, "__dict__") and not torch.is_tensor(value) and type(value).__module__.startswith("sekv_core"):
            yield from ((f"{name}.{p}", v) for p, v in _per_layer_lists(value, n_layers, seen, depth + 1))


#: lists that are not one tensor a layer: a method's host tier (the tokens sentencekv fetches from: host memory
#: whatever the layer's device); depthweave's lists are one a depth window (its routing on the host, its window
#: tables on the first layer's device, the other devices' in ``_other``): its layers' tensors are checked by name
HOST_TIERS = {"cpu_k", "cpu_v"}


@pytest.mark.parametrize("method", sorted(m for m in methods.REGISTRY if methods.get(m).per_layer_devices))
def test_every_per_layer_method_puts_each_layers_tensors_on_its_device(lm, method, tmp_path):
    """A method that takes one device per layer (Session.open gives it the model's layer devices) keeps each layer's
    tensors on its layer's device: every per-layer list of tensors of its memory, layer 1 on "meta"."""
    path = sekv.ingest(SAMPLE_MD, tmp_path / "doc.sekv", method=method, model=lm).pack_path
    pack = read_pack(path)
    m = methods.get(method)
    mem = m.open(pack, stored_params(pack), ModelShape.of(lm.config, torch.float32), [CPU, META])
    if method == "rag":
        mem = mem.kv  # its KV is made at ask time, in this full memory
    lists = {k: v for k, v in _per_layer_lists(mem, lm.config.num_hidden_layers)
             if k not in HOST_TIERS and (method != "depthweave" or k.startswith("kv."))}
    assert lists, "no per-layer tensors found"
    for name, tensors in lists.items():
        assert [t.device for t in tensors] == [CPU, META], name
    if method == "depthweave":  # each layer's codes (bases, coefficients, routed pools); the window tables on "meta"
        for layer, dev in enumerate([CPU, META]):
            for z in "kv":
                zc = mem.codes[layer][z]
                assert {t.device for t in (zc.basis, zc.resbasis, zc.coef, zc.pool, zc.coef_scale, zc.pool_scale) if t is not None} == {dev}
        assert all(t.device == META for t in mem._other[META]["ng"] + mem._other[META]["boff"])
        assert mem._tables(1, 0)[0].device == META and mem._tables(0, 0)[0] is mem.ng[0]


def test_device_groups():
    cuda1 = torch.device("cuda", 1)
    assert device_groups([CPU, META, CPU, cuda1]) == [(CPU, [0, 2]), (META, [1]), (cuda1, [3])]
    assert device_groups(["cpu"] * 3) == [(CPU, [0, 1, 2])]


# -- CUDA: a tiny model's layers split between cuda:0 and the CPU ------------------------------------------------

CUDA_SPLIT = {"model.embed_tokens": 0, "model.rotary_emb": "cpu", "model.layers.0": 0, "model.layers.1": "cpu",
              "model.norm": "cpu", "lm_head": "cpu"}
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def gpu_cpu_split(path: str, device_map: dict = CUDA_SPLIT):
    """The tiny model with layer 0 computing on cuda:0 and layer 1 on the CPU: accelerate's dispatch with the CPU
    as the main device (a CPU-mapped layer then runs there; with a GPU as the main device it would be streamed to
    the GPU and computed there, one device again)."""
    from accelerate import dispatch_model

    lm = models.load(path, device="cpu", dtype=torch.float32)
    dispatch_model(lm.model, device_map=device_map, main_device="cpu", force_hooks=True)
    lm.model.__dict__.pop("_sekv_mapped", None)  # placement.is_mapped remembered the model unplaced
    return lm


@pytest.fixture(scope="module")
def cuda_models(tiny_qwen):
    one = models.load(str(tiny_qwen), device="cuda", dtype=torch.float32)
    return one, gpu_cpu_split(str(tiny_qwen))


def test_the_gpu_cpu_split_is_placed_as_the_cuda_tests_need(tiny_qwen):
    """The CUDA tests' placement, with the CPU for cuda:0: accelerate takes the map and the main device, and
    sekv_core.placement reads the result as a placed model."""
    lm = gpu_cpu_split(str(tiny_qwen), {k: "cpu" for k in CUDA_SPLIT})
    assert placement.is_mapped(lm.model) and placement.layer_devices(lm.model) == [CPU, CPU]


@needs_cuda
@pytest.mark.parametrize("method", ["full", "sekv"])
def test_cuda_split_between_gpu_and_cpu_answers_as_one_gpu(cuda_models, tmp_path, method):
    """Layer 0 on cuda:0, layer 1 on the CPU: greedy tokens as the un-split model on cuda:0, and each layer's KV
    (sekv: resident KV, coarse entries, gates, zoom buffers, block table) on its layer's device."""
    one, split = cuda_models
    pack_path = sekv.ingest(SAMPLE_MD, tmp_path / "doc.sekv", method=method, model=one).pack_path
    ref, _ = _ask(pack_path, one)
    devices = placement.layer_devices(split.model)
    assert devices == [torch.device("cuda", 0), CPU] and placement.input_device(split.model) == torch.device("cuda", 0)
    got, mem = _ask(pack_path, split)
    assert len(ref) > 0 and got == ref
    assert mem.layer_devices == devices
    if method == "full":
        assert [mem.kv.k[i].device for i in range(2)] == devices
        return
    res = mem.res
    assert isinstance(mem.step, BatchedStep) and res.split
    for layer, dev in enumerate(devices):
        assert res.kv.k[layer].device == res.kv.jk[layer].device == dev  # resident KV, coarse entries, annex
        assert _tensor_devices(res.gates[layer]) == {dev}
        assert mem.step.blocks[layer].used.device == dev
        if mem.step.fixed is not None:
            assert mem.step.fixed.keep[layer].device == dev
        else:
            assert mem.step.rk[layer].device == dev
    for name in residents.DEVICE_TABLES:
        if hasattr(res, name):
            assert getattr(res.at(CPU), name).device == CPU, name
    # per-layer routing (the flat slots on each device) and the reference step: the one-GPU model's tokens too
    for params, batched in (({"routing": "per_layer"}, None), ({}, False)):
        p, q = (sekv.open(pack_path, model=m, params=params) for m in (split, one))
        if batched is not None:
            p.session.memory.batched = q.session.memory.batched = batched
        assert p.ask(Q, max_new_tokens=8).tokens.ids == q.ask(Q, max_new_tokens=8).tokens.ids, params
    assert p.session.memory.res.kv.k[1].device == CPU


@needs_cuda
@pytest.mark.parametrize("method", sorted(m for m in methods.REGISTRY if methods.get(m).per_layer_devices))
def test_cuda_split_every_method_answers_with_each_layer_on_its_device(cuda_models, tmp_path, method):
    """Every per-layer method on the cuda:0 / CPU split: it answers, and its per-layer tensors are on the layers'
    devices (tokens are compared for full and sekv above: a method's GPU-only kernels, e.g. depthweave's fused one,
    round otherwise than its CPU path)."""
    one, split = cuda_models
    pack_path = sekv.ingest(SAMPLE_MD, tmp_path / "doc.sekv", method=method, model=one).pack_path
    got, mem = _ask(pack_path, split)
    assert len(got) > 0
    devices = placement.layer_devices(split.model)
    lists = {k: v for k, v in _per_layer_lists(mem.kv if method == "rag" else mem, 2)
             if k not in HOST_TIERS and (method != "depthweave" or k.startswith("kv."))}
    assert lists
    for name, tensors in lists.items():
        assert [t.device for t in tensors] == devices, name
