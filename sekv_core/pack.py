"""The context pack: one safetensors file with a JSON manifest in its header.

Layout (``docs/pack-format.md`` has the full description)::

    [8-byte header length][safetensors header JSON][tensor data]
                            "__metadata__": {"sekv": "<manifest JSON>"}

The manifest carries the magic, format version, cache method and parameters,
model id and fingerprints, document name/sha256/page map, the token ids,
creation time, sizes, and ``data_sha256`` (the sha256 of the tensor-data
region).  Tensors are only ever read with safetensors (no pickle), lazily and
memory-mapped.  Writes are atomic: a temporary file in the same directory,
fsync, then ``os.replace``; an interrupted write leaves no partial pack.
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from .errors import PackError

MAGIC = "SEKV-PACK"
FORMAT_VERSION = 3
READABLE_VERSIONS = (3,)
_PLACEHOLDER = "0" * 64
_META_KEY = "sekv"


def _read_header(f) -> tuple[dict, int]:
    raw = f.read(8)
    if len(raw) < 8:
        raise PackError("file is too short to be a sekv pack")
    (n,) = struct.unpack("<Q", raw)
    if n <= 0 or n > 100 << 20:
        raise PackError("not a sekv pack (no safetensors header)")
    try:
        header = json.loads(f.read(n))
    except (UnicodeDecodeError, json.JSONDecodeError):
        raise PackError("not a sekv pack (unreadable header)") from None
    return header, 8 + n


def _hash_from(f, offset: int) -> str:
    f.seek(offset)
    h = hashlib.sha256()
    while block := f.read(16 << 20):
        h.update(block)
    return h.hexdigest()


def write_pack(path: Path, manifest: dict[str, Any], tensors: dict[str, torch.Tensor]) -> int:
    """Write atomically; return the file size."""
    from safetensors.torch import save_file

    path = Path(path)
    manifest = dict(manifest, magic=MAGIC, format_version=manifest.get("format_version", FORMAT_VERSION), data_sha256=_PLACEHOLDER)
    manifest.setdefault("created", time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))
    manifest["tensors"] = {k: [str(v.dtype).removeprefix("torch."), list(v.shape)] for k, v in sorted(tensors.items())}
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file({k: v.contiguous().cpu() for k, v in tensors.items()}, tmp, metadata={_META_KEY: json.dumps(manifest)})
        with open(tmp, "r+b") as f:
            header, data_start = _read_header(f)
            digest = _hash_from(f, data_start)
            f.seek(0)
            head = f.read(data_start)
            at = head.find(f'data_sha256\\": \\"{_PLACEHOLDER}'.encode())
            if at < 0:
                raise RuntimeError("checksum placeholder not found in pack header")
            at = head.index(_PLACEHOLDER.encode(), at)
            f.seek(at)
            f.write(digest.encode())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path.stat().st_size


@dataclass
class Pack:
    path: Path
    manifest: dict[str, Any]
    _handle: Any = None

    @property
    def method(self) -> str:
        return self.manifest["method"]

    @property
    def params(self) -> dict[str, Any]:
        return self.manifest.get("method_params", {})

    @property
    def token_ids(self) -> list[int]:
        return self.manifest["token_ids"]

    def keys(self) -> list[str]:
        return list(self._handle.keys())

    def get(self, name: str) -> torch.Tensor:
        try:
            return self._handle.get_tensor(name)
        except Exception:
            raise PackError(f"{self.path}: tensor '{name}' is missing; the pack is damaged, re-ingest the document") from None

    def size_bytes(self) -> int:
        return self.path.stat().st_size


def read_pack(path: Path, verify: bool = True) -> Pack:
    """Open a pack, checking magic, version and (by default) the data checksum."""
    from safetensors import safe_open

    path = Path(path)
    if not path.exists():
        raise PackError(f"{path}: no such pack; create one with `sekv ingest DOCUMENT`")
    if path.is_dir():
        raise PackError(f"{path}: is a directory, not a pack")
    try:
        with open(path, "rb") as f:
            header, data_start = _read_header(f)
            meta = (header.get("__metadata__") or {}).get(_META_KEY)
            if meta is None:
                raise PackError("not a sekv pack (no sekv manifest)")
            manifest = json.loads(meta)
            if manifest.get("magic") != MAGIC:
                raise PackError("not a sekv pack (bad magic)")
            version = manifest.get("format_version")
            if version not in READABLE_VERSIONS:
                newer = isinstance(version, int) and version > max(READABLE_VERSIONS)
                raise PackError(
                    f"pack format version {version} is not supported (this sekv reads {', '.join(map(str, READABLE_VERSIONS))}); "
                    + ("upgrade sekv" if newer else "re-ingest the document with this version")
                )
            if verify and _hash_from(f, data_start) != manifest.get("data_sha256"):
                raise PackError("checksum mismatch: the pack is damaged or truncated; re-ingest the document")
    except PackError as e:
        raise PackError(f"{path}: {e}") from None
    except OSError as e:
        raise PackError(f"{path}: cannot read pack: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError):
        raise PackError(f"{path}: not a sekv pack (unreadable manifest)") from None
    try:
        handle = safe_open(str(path), framework="pt", device="cpu")
    except Exception as e:
        raise PackError(f"{path}: the pack's tensor data is unreadable ({str(e).splitlines()[0]}); re-ingest the document") from None
    return Pack(path, manifest, handle)


def check_model(pack: Pack, model_id: str, fingerprint: str, tokenizer_fingerprint: str) -> None:
    m = pack.manifest["model"]
    if m["fingerprint"] != fingerprint:
        raise PackError(
            f"{pack.path}: made with model '{m['id']}' (fingerprint {m['fingerprint'][:12]}), "
            f"but '{model_id}' (fingerprint {fingerprint[:12]}) is loaded; ask with --model {m['id']} or re-ingest"
        )
    if m["tokenizer_fingerprint"] != tokenizer_fingerprint:
        raise PackError(f"{pack.path}: the tokenizer differs from the one the pack was made with; re-ingest the document")
