"""The pipelined ingest (sekv_core/ingest.py): the zoom tier made a prefill chunk at a time and written into the pack
while the prefill runs (sekv/zoom_tier.py TierStream, pack.PackWriter).  References: the sequential ingest's pack
(SEKV_INGEST_PIPELINE=0: prefill, then compress with the tier, then write_pack), the safetensors library, hashlib."""

from __future__ import annotations

import errno
import hashlib
import json

import pytest
import torch

from sekv_core import pack as packmod
from sekv_core.errors import SekvError
from sekv_core.ingest import PIPELINE_ENV, WINDOW_ENV, ingest
from sekv_core.pack import read_pack

from conftest import SAMPLE_MD

TIER_PARTS = ("k", "ks", "v", "vs")


def _tensors(path):
    p = read_pack(path)
    try:
        return {k: p.get(k) for k in p.keys()}, p.manifest
    finally:
        p.close()


def assert_same_pack(got: dict, want: dict) -> None:
    """``got`` (pipelined: a tier of every token) holds ``want``'s (sequential: a tier of the span tokens) tensors:
    every other tensor equal, bit for bit, and the tier's rows of ``want``'s tokens bit for bit ``want``'s rows."""
    tier = lambda k: k.startswith("sekv.zoom.")  # noqa: E731
    assert {k for k in got if not tier(k)} == {k for k in want if not tier(k)}
    for k in want:
        if not tier(k):
            assert got[k].dtype == want[k].dtype and torch.equal(got[k], want[k]), k
    assert {k for k in got if tier(k)} == {k for k in want if tier(k)}
    if "sekv.zoom.idx" not in want:
        return
    n = int(want["sekv.config"][0])
    assert torch.equal(got["sekv.zoom.idx"], torch.arange(n))
    idx = want["sekv.zoom.idx"]
    assert idx.numel() > 0
    for k in want:
        if tier(k) and k != "sekv.zoom.idx":
            assert got[k].dtype == want[k].dtype and torch.equal(got[k].index_select(1, idx), want[k]), k


def _ingest_both(lm, tmp_path, monkeypatch, doc, params, window=None):
    if window:
        monkeypatch.setenv(WINDOW_ENV, str(window))
    monkeypatch.setenv(PIPELINE_ENV, "0")
    seq = ingest(doc, tmp_path / "seq.sekv", lm=lm, method="sekv", params=params)
    monkeypatch.setenv(PIPELINE_ENV, "1")
    pip = ingest(doc, tmp_path / "pip.sekv", lm=lm, method="sekv", params=params)
    assert not seq.pipelined and pip.pipelined
    return seq, pip


@pytest.mark.parametrize("kind,window", [("int8", None), ("exact", None), ("int8", 512)])
def test_the_pipelined_pack_holds_the_sequential_packs_tensors(lm, tmp_path, monkeypatch, kind, window):
    seq, pip = _ingest_both(lm, tmp_path, monkeypatch, SAMPLE_MD, {"zoom_tier": kind}, window)
    want, wm = _tensors(seq.pack_path)
    got, gm = _tensors(pip.pack_path)
    assert_same_pack(got, want)
    assert len(gm["windows"]) == len(wm["windows"]) == (1 if window is None else len(gm["windows"])) and (window is None or len(gm["windows"]) > 1)
    for k in ("method_params", "token_ids", "document", "model", "windows", "n_tokens"):
        assert gm[k] == wm[k], k
    # the tier's bytes were written while the prefill ran (the one window's, or the windows' before the last)
    assert pip.written_in_prefill > 0 and pip.after_prefill_s > 0


def test_one_forward_streams_each_layer_and_gives_the_sequential_pack(lm, tmp_path, monkeypatch):
    """The whole document in one forward (a GPU's default when it fits, prefill.default_chunk): the tier's rows are
    made and written a layer at a time inside that forward (ChunkStream.layer), and the pack is the sequential one's."""
    from sekv_core import chunk_stream

    calls = []
    real = chunk_stream.ChunkStream.layer
    monkeypatch.setattr(chunk_stream.ChunkStream, "layer", lambda self, li, a, b, rows: (calls.append((li, a, b)), real(self, li, a, b, rows))[1])
    monkeypatch.setenv("SEKV_PREFILL_CHUNK", "1000000")
    seq, pip = _ingest_both(lm, tmp_path, monkeypatch, SAMPLE_MD, {"zoom_tier": "int8"})
    n = pip.n_tokens
    assert calls == [(li, 0, n) for li in range(lm.model.config.num_hidden_layers)]
    want, _ = _tensors(seq.pack_path)
    got, _ = _tensors(pip.pack_path)
    assert_same_pack(got, want)


def test_full_kv_written_during_the_prefill_is_the_sequential_pack(lm, tmp_path, monkeypatch):
    monkeypatch.setenv(PIPELINE_ENV, "0")
    seq = ingest(SAMPLE_MD, tmp_path / "seq.sekv", lm=lm, method="full", chunk=128)
    monkeypatch.setenv(PIPELINE_ENV, "1")
    pip = ingest(SAMPLE_MD, tmp_path / "pip.sekv", lm=lm, method="full", chunk=128)
    assert pip.pipelined and not seq.pipelined and pip.written_in_prefill > 0
    want, wm = _tensors(seq.pack_path)
    got, gm = _tensors(pip.pack_path)
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)
    assert gm["sizes"] == wm["sizes"]


def test_a_one_window_document_gives_the_same_answers(lm, tmp_path, monkeypatch):
    from sekv_core.session import Session

    seq, pip = _ingest_both(lm, tmp_path, monkeypatch, SAMPLE_MD, {"zoom_tier": "int8", "zoom": "all"})
    answers = []
    for r in (seq, pip):
        s = Session.open(r.pack_path, lm=lm)
        answers.append([s.ask(q, max_new_tokens=12).token_ids for q in ("What is the maximum inlet water pressure?", "Who services the unit?")])
    assert answers[0] == answers[1]


def test_an_interrupt_or_a_full_disk_anywhere_leaves_no_pack_and_no_temp(lm, tmp_path, monkeypatch):
    """During the prefill (the writer thread busy with the tier), in the writer thread, and at the end."""
    doc = tmp_path / "d.txt"
    doc.write_text(SAMPLE_MD.read_text())
    out = tmp_path / "out"
    out.mkdir()

    def stop_in_prefill(ev):
        if ev.stage == "prefill" and ev.tokens_done > 0:
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        ingest(doc, out / "a.sekv", lm=lm, method="sekv", chunk=64, progress=stop_in_prefill)
    assert list(out.iterdir()) == []

    real = packmod.os.pwrite
    calls = {"n": 0}

    def full_disk(fd, data, at):
        calls["n"] += 1
        if calls["n"] > 20:
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data, at)

    monkeypatch.setattr(packmod.os, "pwrite", full_disk)
    with pytest.raises(SekvError, match="cannot write the pack \\(No space left on device\\); nothing was written"):
        ingest(doc, out / "a.sekv", lm=lm, method="sekv", chunk=64)
    assert list(out.iterdir()) == []
    monkeypatch.setattr(packmod.os, "pwrite", real)

    def interrupt(fd):
        raise KeyboardInterrupt

    monkeypatch.setattr(packmod.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        ingest(doc, out / "a.sekv", lm=lm, method="sekv", chunk=64)
    assert list(out.iterdir()) == []


@pytest.mark.parametrize("room", [16, 1 << 16])
def test_the_writer_writes_pieces_in_any_order_into_a_safetensors_file(tmp_path, monkeypatch, room):
    """Pieces out of order, hash chunks straddling them (a 1 KiB chunk here), a header that outgrows its room (16
    bytes: the data region moves) or fits it (padded): the file the safetensors library reads, every sha256 the
    chunked sha256 hashlib computes, the same tensors as write_pack's file."""
    from safetensors import safe_open

    monkeypatch.setattr(packmod, "_CHUNK", 1024)
    g = torch.Generator().manual_seed(3)
    x = torch.randint(-128, 127, (3, 700, 4), generator=g, dtype=torch.int8)
    y = torch.randn(5, 33, generator=g).to(torch.bfloat16)
    manifest = {"method": "full", "method_params": {}, "token_ids": [1, 2], "document": {"name": "x"}, "model": {}}
    slot = packmod.prepare_output(tmp_path / "w.sekv")
    w = packmod.PackWriter(slot, room)
    w.reserve("x", x.dtype, x.shape)
    for a in reversed(range(0, 700, 97)):  # token blocks last to first, each head's rows a piece
        b = min(700, a + 97)
        w.submit(lambda a=a, b=b: [("x", (h * 700 + a) * 4, x[h, a:b].contiguous().numpy()) for h in range(3)], reused=a % 2 == 0)
    w.put("y", y)
    w.put("empty", torch.zeros(0))
    w.finish(manifest)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["w.sekv"]
    with safe_open(str(tmp_path / "w.sekv"), "pt") as f:
        assert torch.equal(f.get_tensor("x"), x) and torch.equal(f.get_tensor("y"), y)
        listed = json.loads(f.metadata()["sekv"])["tensors"]
    for k, v in {"x": x, "y": y}.items():
        raw = v.reshape(-1).view(torch.uint8).numpy().tobytes()
        chunks = [raw[i : i + 1024] for i in range(0, len(raw), 1024)]
        assert listed[k]["sha256"] == hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in chunks)).hexdigest(), k
    packmod.write_pack(tmp_path / "ref.sekv", manifest, {"x": x, "y": y, "empty": torch.zeros(0)})
    assert packmod.safetensors_digest(tmp_path / "w.sekv") == packmod.safetensors_digest(tmp_path / "ref.sekv")
    p = read_pack(tmp_path / "w.sekv")
    assert torch.equal(p.get("x"), x)
    p.close()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_the_pipelined_pack_holds_the_sequential_packs_tier_bit_for_bit(tiny_qwen, tmp_path, monkeypatch):
    """On CUDA the tier's rows travel through the writer thread's staging copy and side stream: they must still be
    the sequential path's, bit for bit (elementwise arithmetic, RoPE's cos / sin made on the host in both), as must the
    full-resolution tokens (copies of the prefill's KV); the rest comes from the same compress (its CUDA reductions
    are not run-to-run deterministic, so those are compared by name, dtype and shape)."""
    from sekv_core import models

    lm = models.load(str(tiny_qwen), device="cuda", dtype=torch.bfloat16)
    seq, pip = _ingest_both(lm, tmp_path, monkeypatch, SAMPLE_MD, {"zoom_tier": "int8"})
    want, _ = _tensors(seq.pack_path)
    got, _ = _tensors(pip.pack_path)
    assert {k: (v.dtype, v.shape) for k, v in got.items() if not k.startswith("sekv.zoom.")} == {
        k: (v.dtype, v.shape) for k, v in want.items() if not k.startswith("sekv.zoom.")}
    idx = want["sekv.zoom.idx"]
    assert torch.equal(got["sekv.zoom.idx"], torch.arange(int(want["sekv.config"][0])))
    for k in want:
        if k.startswith("sekv.zoom.") and k != "sekv.zoom.idx":
            assert torch.equal(got[k].index_select(1, idx), want[k]), k
        if k.startswith("sekv.full."):
            assert torch.equal(got[k], want[k]), k
    # the pipelined path ran; how much its writer thread wrote before a short prefill ended is timing, not a property
    assert pip.pipelined and not seq.pipelined


def test_a_warm_up_beside_the_document_read_leaves_the_pack_as_it_was(lm, tmp_path, monkeypatch):
    """prefill.WarmUp (on a GPU: a short forward on its own thread while the document is read and tokenized), here
    made to run on the CPU: the pack is bit for bit the one of an ingest without it; a warm-up that fails is ignored."""
    import functools

    from sekv_core import ingest as ingest_mod
    from sekv_core import prefill as prefill_mod

    monkeypatch.setenv(prefill_mod.WARM_ENV, "0")
    want, _ = _tensors(ingest(SAMPLE_MD, tmp_path / "cold.sekv", lm=lm, method="sekv").pack_path)
    monkeypatch.setenv(prefill_mod.WARM_ENV, "1")
    runs = []
    real_run = prefill_mod.WarmUp._run

    def counted(model, device):
        runs.append(device)
        real_run(model, device)

    monkeypatch.setattr(prefill_mod.WarmUp, "_run", staticmethod(counted))
    monkeypatch.setattr(ingest_mod, "WarmUp", functools.partial(prefill_mod.WarmUp, on=("cpu",)))
    got, _ = _tensors(ingest(SAMPLE_MD, tmp_path / "warm.sekv", lm=lm, method="sekv").pack_path)
    assert runs == [torch.device("cpu")]
    assert set(got) == set(want) and all(torch.equal(got[k], want[k]) for k in want)

    def broken(*a, **k):
        raise RuntimeError("CUDA out of memory")

    monkeypatch.setattr(prefill_mod, "prefill", broken)  # the warm-up's forward fails
    w = prefill_mod.WarmUp(lm.model, on=("cpu",))
    w.join()
    assert w.thread is None
