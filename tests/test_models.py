"""Embedded-model install: chunks joined in order, checksum enforced, clear errors."""

from __future__ import annotations

import hashlib

import pytest

from sekv_core import models
from sekv_core.errors import ModelError


def _fake(monkeypatch, tmp_path, sha):
    parts = []
    for i, data in enumerate([b"first-", b"second-", b"third"]):
        p = tmp_path / f"part{i:02d}.bin"
        p.write_bytes(data)
        parts.append(p)
    spec = models.EmbeddedModel("fake", "fake model", ("fake-a==1", "fake-b==1"), sha)
    files = {"fake-a": parts[:2], "fake-b": parts[2:]}
    monkeypatch.setattr(models, "_distribution_files", lambda dist: files.get(dist, []))
    monkeypatch.setitem(models.EMBEDDED, "fake", spec)
    monkeypatch.setenv("SEKV_HOME", str(tmp_path / "home"))
    return spec


def test_chunks_join_in_order(monkeypatch, tmp_path):
    spec = _fake(monkeypatch, tmp_path, "x")
    digest = models._join_chunks(spec, tmp_path / "joined", None)
    assert (tmp_path / "joined").read_bytes() == b"first-second-third"
    assert digest == hashlib.sha256(b"first-second-third").hexdigest()


def test_checksum_mismatch_is_a_clear_error(monkeypatch, tmp_path):
    _fake(monkeypatch, tmp_path, "0" * 64)
    monkeypatch.setattr(models, "convert_gguf", lambda *a, **k: pytest.fail("must not convert a bad file"))
    with pytest.raises(ModelError, match="checksum mismatch for fake"):
        models.install("fake")
    assert not models.is_installed("fake")
    assert not any((tmp_path / "home" / "models").iterdir())  # no half-written model directory


def test_unknown_model():
    with pytest.raises(ModelError, match="unknown model 'gpt-9'"):
        models.resolve("gpt-9")
    with pytest.raises(ModelError, match="SEKV_ONLINE=1"):
        models.resolve("someorg/some-model")


def test_local_directory_without_config(tmp_path):
    with pytest.raises(ModelError, match="no config.json"):
        models.resolve(str(tmp_path))
