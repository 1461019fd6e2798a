"""Pack file: exact round trip, integrity checks, atomic writes."""

from __future__ import annotations

import json
import os

import pytest
import torch

from sekv_core import pack as packmod
from sekv_core.errors import PackError, SekvError


def _tensors():
    g = torch.Generator().manual_seed(0)
    return {
        "a.bf16": torch.randn(2, 5, 8, generator=g).to(torch.bfloat16),
        "b.f32": torch.randn(7, generator=g),
        "c.i32": torch.randint(-5, 5, (3, 4), generator=g, dtype=torch.int32),
        "d.u8": torch.randint(0, 255, (9,), generator=g, dtype=torch.uint8),
    }


def _manifest():
    return {"method": "full", "method_params": {}, "token_ids": [1, 2, 3], "document": {"name": "x"}, "model": {}}


def test_round_trip_is_exact(tmp_path):
    t = _tensors()
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), t)
    p = packmod.read_pack(path)
    assert set(p.keys()) == set(t)
    for k, v in t.items():
        got = p.get(k)
        assert got.dtype == v.dtype and torch.equal(got, v)
    assert p.manifest["magic"] == packmod.MAGIC
    assert p.token_ids == [1, 2, 3]
    assert all(len(e["sha256"]) == 64 for e in p.manifest["tensors"].values())
    # a plain safetensors file too: other tools read the same tensors
    from safetensors.torch import load_file

    assert all(torch.equal(load_file(str(path))[k], v) for k, v in t.items())


def test_corruption_is_detected(tmp_path):
    """Tensor bytes: caught when that tensor is read; manifest / tensor table bytes: caught at open."""
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), _tensors())
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF  # inside the last tensor, d.u8
    path.write_bytes(bytes(raw))
    p = packmod.read_pack(path)
    p.get("a.bf16")
    with pytest.raises(PackError, match="checksum mismatch in tensor 'd.u8'"):
        p.get("d.u8")
    packmod.write_pack(path, _manifest(), _tensors())
    raw = bytearray(path.read_bytes())
    at = raw.index(b"token_ids")
    raw[at + 15] = ord("7") if raw[at + 15] != ord("7") else ord("8")  # a token id in the manifest
    path.write_bytes(bytes(raw))
    with pytest.raises(PackError, match="checksum mismatch in the header"):
        packmod.read_pack(path)


def test_open_reads_only_the_header_and_reads_from_the_file_it_opened(tmp_path):
    """The pack is opened once: replacing the path afterwards does not mix two packs' manifest and tensors."""
    a, b = tmp_path / "a.sekv", tmp_path / "b.sekv"
    ta = _tensors()
    tb = {k: torch.zeros_like(v) for k, v in ta.items()}
    packmod.write_pack(a, _manifest(), ta)
    packmod.write_pack(b, dict(_manifest(), token_ids=[9]), tb)
    p = packmod.read_pack(a)
    b.replace(a)
    assert p.token_ids == [1, 2, 3] and all(torch.equal(p.get(k), v) for k, v in ta.items())


def test_truncated_and_foreign_files(tmp_path):
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), _tensors())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(PackError, match="truncated"):
        packmod.read_pack(path)
    junk = tmp_path / "junk.sekv"
    junk.write_bytes(b"hello world, not a pack at all")
    with pytest.raises(PackError, match="not a sekv pack"):
        packmod.read_pack(junk)
    from safetensors.torch import save_file

    plain = tmp_path / "plain.sekv"
    save_file({"x": torch.zeros(2)}, str(plain))
    with pytest.raises(PackError, match="no sekv manifest"):
        packmod.read_pack(plain)
    with pytest.raises(PackError, match="no such pack"):
        packmod.read_pack(tmp_path / "missing.sekv")


def test_unsupported_version(tmp_path, monkeypatch):
    path = tmp_path / "x.sekv"
    monkeypatch.setattr(packmod, "FORMAT_VERSION", 99)
    packmod.write_pack(path, _manifest(), _tensors())
    monkeypatch.undo()
    with pytest.raises(PackError, match="version 99.*upgrade sekv"):
        packmod.read_pack(path)
    assert packmod.FORMAT_VERSION == 4 and packmod.READABLE_VERSIONS == (4,)
    three = tmp_path / "three.sekv"  # format 3: this integrity format with the method parameters of before
    monkeypatch.setattr(packmod, "FORMAT_VERSION", 3)
    packmod.write_pack(three, _manifest(), _tensors())
    monkeypatch.undo()
    with pytest.raises(PackError, match=r"version 3 is older than this sekv reads \(4\); re-ingest the document$"):
        packmod.read_pack(three)
    old = tmp_path / "old.sekv"  # a format 2 pack: the data checksum in its manifest, no header checksum
    from safetensors.torch import save_file

    save_file({"x": torch.zeros(2)}, str(old), metadata={"sekv": json.dumps({"magic": packmod.MAGIC, "format_version": 2, "data_sha256": "0" * 64})})
    with pytest.raises(PackError, match="version 2 is older.*re-ingest"):
        packmod.read_pack(old)


def test_interrupted_write_leaves_old_pack_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), _tensors())
    before = path.read_bytes()
    real = packmod.os.fsync

    def interrupt(fd):
        real(fd)
        raise KeyboardInterrupt

    monkeypatch.setattr(packmod.os, "fsync", interrupt)
    with pytest.raises(KeyboardInterrupt):
        packmod.write_pack(path, dict(_manifest(), method="other"), _tensors())
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.sekv"]


def test_interrupted_while_the_tensors_are_written_leaves_nothing(tmp_path, monkeypatch):
    """The data region is written before the header (which waits for the sha256s): an interrupt there leaves no
    pack and no temporary file."""
    path = tmp_path / "x.sekv"

    def interrupt(futures):
        raise KeyboardInterrupt

    monkeypatch.setattr(packmod, "_finish_digest", interrupt)
    with pytest.raises(KeyboardInterrupt):
        packmod.write_pack(path, _manifest(), _tensors())
    assert list(tmp_path.iterdir()) == []


def test_the_written_file_is_safetensors_with_chunked_sha256s(tmp_path):
    """Checked by an independent reader (the safetensors library) and hashlib: the tensors' bytes where the header
    says, each manifest sha256 the sha256 of its 16 MiB chunks' sha256s (a tensor of several chunks, one of none)."""
    import hashlib

    from safetensors import safe_open

    g = torch.Generator().manual_seed(1)
    t = dict(_tensors(), big=torch.randint(0, 255, (packmod._CHUNK * 2 + 12345,), generator=g, dtype=torch.uint8), empty=torch.zeros(0))
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), t)
    with safe_open(str(path), "pt") as f:
        assert set(f.keys()) == set(t)
        for k in t:
            assert torch.equal(f.get_tensor(k), t[k]), k
        listed = json.loads(f.metadata()["sekv"])["tensors"]
    for k, v in t.items():
        raw = v.reshape(-1).view(torch.uint8).numpy().tobytes()
        chunks = [raw[i : i + packmod._CHUNK] for i in range(0, len(raw), packmod._CHUNK)] or [b""]
        assert listed[k]["sha256"] == hashlib.sha256(b"".join(hashlib.sha256(c).digest() for c in chunks)).hexdigest(), k
    p = packmod.read_pack(path)
    assert torch.equal(p.get("big"), t["big"])
    p.close()


def test_output_checks(tmp_path):
    """-o never replaces what is not a pack (unless forced), nor the input; the directory must be writable."""
    doc = tmp_path / "v.txt"
    doc.write_text("precious")
    with pytest.raises(SekvError, match="overwrite the input"):
        packmod.prepare_output(doc, inputs=[doc], force=True)
    with pytest.raises(SekvError, match="not a sekv pack; refusing"):
        packmod.prepare_output(doc)
    with pytest.raises(SekvError, match="is a directory"):
        packmod.prepare_output(tmp_path)
    with pytest.raises(SekvError, match="does not exist"):
        packmod.prepare_output(tmp_path / "nope" / "x.sekv")
    with pytest.raises(SekvError, match="MiB free"):
        packmod.prepare_output(tmp_path / "x.sekv", needed_bytes=1 << 60)
    pk = tmp_path / "x.sekv"
    packmod.write_pack(pk, _manifest(), _tensors())
    slot = packmod.prepare_output(pk)  # a pack may be replaced
    slot.discard()
    slot = packmod.prepare_output(doc, force=True)
    slot.discard()
    assert doc.read_text() == "precious" and sorted(p.name for p in tmp_path.iterdir()) == ["v.txt", "x.sekv"]
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    try:
        if not os.access(ro, os.W_OK):  # root writes anywhere
            with pytest.raises(SekvError, match="cannot write"):
                packmod.prepare_output(ro / "x.sekv")
    finally:
        ro.chmod(0o700)


def test_interrupted_reservation_and_writes_leave_nothing(tmp_path, monkeypatch):
    """Temporary files are known before they exist: an interrupt landing just after the file is made (before any
    caller could hold it), or in a writer that never finishes, is cleaned by discard_unfinished; a finished pack
    and another process's file of the same pattern are left alone."""
    real_open = os.open

    def open_then_interrupt(*a, **k):
        fd = real_open(*a, **k)
        os.close(fd)
        raise KeyboardInterrupt  # the signal's handler runs right after the system call

    monkeypatch.setattr(packmod.os, "open", open_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        packmod.prepare_output(tmp_path / "a.sekv")
    monkeypatch.setattr(packmod.os, "open", real_open)
    assert len(list(tmp_path.glob(".a.sekv.*.tmp"))) == 1
    theirs = tmp_path / ".b.sekv.0123456789abcdef.tmp"
    theirs.write_text("another process's")
    slot = packmod.prepare_output(tmp_path / "c.sekv")  # made, then dropped without discard (an interrupted caller)
    assert slot.tmp.exists()
    packmod.write_pack(tmp_path / "d.sekv", _manifest(), _tensors())
    packmod.discard_unfinished()
    assert sorted(p.name for p in tmp_path.iterdir()) == [theirs.name, "d.sekv"]


def test_model_check(tmp_path):
    path = tmp_path / "x.sekv"
    m = dict(_manifest(), model={"id": "a", "fingerprint": "f" * 64, "tokenizer_fingerprint": "t" * 64})
    packmod.write_pack(path, m, _tensors())
    p = packmod.read_pack(path)
    packmod.check_model(p, "a", "f" * 64, "t" * 64)
    with pytest.raises(PackError, match="made with model 'a'"):
        packmod.check_model(p, "b", "e" * 64, "t" * 64)
    with pytest.raises(PackError, match="tokenizer"):
        packmod.check_model(p, "a", "f" * 64, "u" * 64)
    assert json.loads(json.dumps(p.manifest))  # manifest is plain JSON


def test_full_disk_while_writing_is_one_line_and_leaves_nothing(tmp_path, monkeypatch):
    import errno

    path = tmp_path / "x.sekv"

    def no_space(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(packmod.os, "fsync", no_space)
    with pytest.raises(SekvError, match="cannot write the pack \\(No space left on device\\); nothing was written"):
        packmod.write_pack(path, _manifest(), _tensors())
    assert list(tmp_path.iterdir()) == []
