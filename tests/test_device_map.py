"""A model placed by accelerate's device_map (layers on the CPU and offloaded to disk) answers as the same model on
one device, for every cache method; a prefill whose KV goes to the host chunk by chunk makes the same KV.

The reference is the un-split model (loaded the usual way, one device).  On this CPU every execution device is the
CPU, so what is checked is the accelerate path itself (hooks, weights streamed from an offload folder, per-layer
device lists, host KV), not two GPUs (docs/multi-gpu.md)."""

from __future__ import annotations

import pytest
import torch

import sekv
from sekv_core import methods, models, placement
from sekv_core.errors import ModelError
from sekv_core.prefill import prefill

from conftest import SAMPLE_MD

SPLIT = {"model.embed_tokens": "cpu", "model.layers.0": "cpu", "model.layers.1": "disk", "model.norm": "cpu",
         "model.rotary_emb": "cpu", "lm_head": "cpu"}
Q = "What did the keeper write about the storm?"


@pytest.fixture(scope="module")
def split(tiny_qwen):
    """The tiny model with layer 1's weights offloaded to disk (streamed in at each forward)."""
    return models.load(str(tiny_qwen), dtype=torch.float32, device_map=SPLIT)


@pytest.fixture(scope="module")
def squeezed(tiny_qwen):
    """The tiny model placed by "auto" under a CPU memory limit smaller than its weights: the rest on disk."""
    return models.load(str(tiny_qwen), dtype=torch.float32, max_memory="cpu=250KB")


def test_placement_is_what_was_asked(split, squeezed, lm):
    assert split.model.hf_device_map["model.layers.1"] == "disk"
    assert any(p.device.type == "meta" for p in split.model.model.layers[1].parameters())  # not resident: streamed
    assert "disk" in set(squeezed.model.hf_device_map.values())
    assert placement.layer_devices(split.model) == [torch.device("cpu")] * 2
    assert placement.input_device(split.model) == torch.device("cpu")
    assert placement.is_mapped(split.model) and not placement.is_mapped(lm.model)
    assert split.fingerprint == lm.fingerprint  # the same weights: packs are interchangeable


def test_offloaded_prefill_makes_the_same_kv(lm):
    ids = torch.tensor(lm.tokenizer(SAMPLE_MD.read_text()[:3000])["input_ids"])
    a = prefill(lm.model, ids, with_surprisal=True, chunk=100, capture=("obs_queries",), offload_kv=False)
    b = prefill(lm.model, ids, with_surprisal=True, chunk=100, capture=("obs_queries",), offload_kv=True)
    assert type(b.keys).__name__ == "LayersOn"  # read a layer at a time
    for x, y in zip(list(a.keys) + list(a.values), list(b.keys) + list(b.values)):
        assert torch.equal(x, y)
    assert torch.equal(a.surprisal, b.surprisal)
    assert all(torch.equal(x, y) for x, y in zip(a.scores["obs_queries"], b.scores["obs_queries"]))


def _answer(pack_path, lm, method=None):
    return sekv.open(pack_path, model=lm, method=method).ask(Q, max_new_tokens=8).tokens.ids


@pytest.mark.parametrize("method", sorted(methods.REGISTRY))
def test_split_model_answers_as_one_device(method, lm, split, squeezed, tmp_path):
    """Ingest and ask with the model split through device_map (and the prefill's KV offloaded to the host) give the
    tokens the un-split model gives."""
    ref_pack = sekv.ingest(SAMPLE_MD, tmp_path / "ref.sekv", method=method, model=lm).pack_path
    ref = _answer(ref_pack, lm)
    assert len(ref) > 0
    assert _answer(ref_pack, split) == ref
    split_pack = sekv.ingest(SAMPLE_MD, tmp_path / "split.sekv", method=method, model=split, offload_kv=True).pack_path
    assert _answer(split_pack, lm) == ref
    if method in ("full", "sekv"):
        assert _answer(ref_pack, squeezed) == ref
        assert _answer(split_pack, split) == ref


@pytest.mark.parametrize("text,msg", [
    ("everywhere", "use auto"), ("{bad json", "not valid JSON"), ('{"model.layers.0": "gpu"}', "is not a device"),
    ("[1, 2]", "use auto"), ("{}", "non-empty object"),
])
def test_bad_device_map_is_one_line(text, msg):
    with pytest.raises(ModelError, match=msg):
        placement.parse_device_map(text)


@pytest.mark.parametrize("text,msg", [
    ("0=lots", "is not a size"), ("120GiB", "DEVICE=SIZE"), ("gpu=1GiB", "is not a device"), ("cpu=1GB,cpu=2GB", "given twice"), (",", "at least one"),
])
def test_bad_max_memory_is_one_line(text, msg):
    with pytest.raises(ModelError, match=msg):
        placement.parse_max_memory(text)


def test_parsed_values():
    assert placement.parse_device_map("balanced") == "balanced"
    assert placement.parse_device_map('{"model": 0, "lm_head": "cpu", "x": "disk"}') == {"model": 0, "lm_head": "cpu", "x": "disk"}
    assert placement.parse_max_memory("0=120GiB, cpu=200GiB") == {0: 120 * 2**30, "cpu": 200 * 2**30}
    assert placement.parse_max_memory("cuda:1=1.5GB") == {1: 1_500_000_000}


def test_cli_bad_values_exit_2(tiny_qwen, tmp_path):
    from typer.testing import CliRunner

    from sekv_cli.app import app

    runner = CliRunner()
    doc = tmp_path / "d.txt"
    doc.write_text("A short document.")
    for args in (["--device-map", "{nope"], ["--max-memory", "cpu"], ["--device-map", '{"model": 3}'], ["--device", "cpu", "--device-map", "auto"],
                 ["--device-map", '{"model.no_such_module": "cpu"}']):
        r = runner.invoke(app, ["ingest", str(doc), "--model", str(tiny_qwen), *args])
        assert r.exit_code == 2, r.output
        lines = [x for x in r.output.splitlines() if x.strip()]
        assert lines[-1].startswith("sekv: error: ") and "Traceback" not in r.output, r.output


def test_offloaded_windowed_ingest_writes_the_same_pack(lm, tmp_path, monkeypatch):
    """A document read in windows (sekv_core/windows.py: later windows' keys re-positioned as they are read) makes
    the same sekv pack with its prefill's KV on the host."""
    from sekv_core.ingest import WINDOW_ENV
    from sekv_core.pack import read_pack

    monkeypatch.setenv(WINDOW_ENV, "1024")
    a = sekv.ingest(SAMPLE_MD, tmp_path / "a.sekv", model=lm, offload_kv=False)
    b = sekv.ingest(SAMPLE_MD, tmp_path / "b.sekv", model=lm, offload_kv=True)
    assert a.windows == b.windows > 2
    pa, pb = read_pack(a.pack_path), read_pack(b.pack_path)
    assert sorted(pa.keys()) == sorted(pb.keys())
    assert all(torch.equal(pa.get(k), pb.get(k)) for k in pa.keys())
