"""Pack file: exact round trip, integrity checks, atomic writes."""

from __future__ import annotations

import json

import pytest
import torch

from sekv_core import pack as packmod
from sekv_core.errors import PackError


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
    assert len(p.manifest["data_sha256"]) == 64 and p.manifest["data_sha256"] != "0" * 64


def test_corruption_is_detected(tmp_path):
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), _tensors())
    raw = bytearray(path.read_bytes())
    raw[-3] ^= 0xFF
    path.write_bytes(bytes(raw))
    with pytest.raises(PackError, match="checksum"):
        packmod.read_pack(path)


def test_truncated_and_foreign_files(tmp_path):
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), _tensors())
    path.write_bytes(path.read_bytes()[:-10])
    with pytest.raises(PackError, match="checksum|damaged|unreadable"):
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


def test_unsupported_version(tmp_path):
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, dict(_manifest(), format_version=99), _tensors())
    with pytest.raises(PackError, match="version 99.*upgrade sekv"):
        packmod.read_pack(path)


def test_interrupted_write_leaves_old_pack_and_no_temp(tmp_path, monkeypatch):
    path = tmp_path / "x.sekv"
    packmod.write_pack(path, _manifest(), _tensors())
    before = path.read_bytes()
    import safetensors.torch as st

    real = st.save_file

    def half_then_interrupt(tensors, filename, metadata=None):
        real(tensors, filename, metadata=metadata)
        with open(filename, "r+b") as f:
            f.truncate(100)
        raise KeyboardInterrupt

    monkeypatch.setattr(st, "save_file", half_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        packmod.write_pack(path, dict(_manifest(), method="other"), _tensors())
    assert path.read_bytes() == before
    assert [p.name for p in tmp_path.iterdir()] == ["x.sekv"]


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
