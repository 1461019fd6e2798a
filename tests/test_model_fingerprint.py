"""Model fingerprints cover the tensors, not the file: the same model installed again gives the same fingerprint
(so packs keep working after a reinstall), and a changed tensor gives another."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from sekv_core import models


@pytest.mark.integration
def test_reinstall_keeps_the_fingerprint(tmp_path, monkeypatch):
    """A real reinstall of smollm2-135m (join, sha256, dequantise, save) into two fresh SEKV_HOMEs."""
    fps, files = [], []
    for i in range(2):
        monkeypatch.setenv("SEKV_HOME", str(tmp_path / f"home{i}"))
        path = models.install("smollm2-135m")
        fps.append(models._weights_fingerprint(path))
        files.append(json.loads((path / models.FINGERPRINT_FILE).read_text()))
    assert fps[0] == fps[1]
    assert files[0]["tensors_sha256"] == files[1]["tensors_sha256"]


def test_fingerprint_is_over_tensor_bytes_not_header_order(tmp_path, monkeypatch):
    from safetensors.torch import save_file

    monkeypatch.setenv("SEKV_HOME", str(tmp_path / "home"))
    t = {"b.weight": torch.randn(4, 3), "a.weight": torch.randn(5), "c.bias": torch.arange(6, dtype=torch.float16)}
    dirs = []
    for i, (order, meta) in enumerate(((sorted(t), {"format": "pt"}), (sorted(t, reverse=True), {"x": "y", "format": "pt"}))):
        d = tmp_path / f"m{i}"
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"model_type": "llama", "transformers_version": f"5.{i}"}))
        save_file({k: t[k] for k in order}, str(d / "model.safetensors"), metadata=meta)
        dirs.append(d)
    assert (dirs[0] / "model.safetensors").read_bytes() != (dirs[1] / "model.safetensors").read_bytes()
    assert models._weights_fingerprint(dirs[0]) == models._weights_fingerprint(dirs[1])
    t["a.weight"][0] += 1
    save_file(t, str(dirs[1] / "model.safetensors"))
    assert models._weights_fingerprint(dirs[0]) != models._weights_fingerprint(dirs[1])


def test_cached_tokenizer_fingerprint_follows_the_files(tmp_path, monkeypatch):
    """The load's cached tokenizer fingerprint is the uncached one, and a rewritten tokenizer file is hashed again
    (a stale cache would let a pack pass against another tokenizer)."""
    from transformers import AutoTokenizer

    from conftest import _tiny_tokenizer

    monkeypatch.setenv("SEKV_HOME", str(tmp_path / "home"))
    d = tmp_path / "tok"
    tok = _tiny_tokenizer(d)
    direct = models.tokenizer_fingerprint(tok)
    assert models._tokenizer_fingerprint_cached(d, tok) == direct
    assert models._tokenizer_fingerprint_cached(d, tok) == direct  # from the cache
    tok.add_tokens(["<|a-new-token|>"])
    tok.save_pretrained(d)
    again = AutoTokenizer.from_pretrained(d)
    assert models.tokenizer_fingerprint(again) != direct
    assert models._tokenizer_fingerprint_cached(d, again) == models.tokenizer_fingerprint(again)
