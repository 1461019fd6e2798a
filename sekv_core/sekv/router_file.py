"""Trained router files: W, tau and the rank gate G for one model, in one safetensors file.

Tensors: ``w`` [L, H, d_r, d] float32 (one routing projection per query head),
``tau`` [L, H] float32 (probability thresholds), ``gate.*`` (the RankGate's
parameters).  Header metadata key ``sekv_router`` holds JSON: format, the
model id and fingerprint it was trained for, shape, hyper-parameters, the
training data's description and the training metrics.  Only safetensors is read
(no pickle).  Writes are atomic (temp file, fsync, replace).

Resolution of the ``router`` parameter (``resolve``):

* ``"auto"`` -- the router shipped in ``sekv_core/routers/`` whose fingerprint
  matches the model, else ``"untrained"``;
* ``"untrained"`` -- the PCA initialisation of sekv/router.py;
* a path -- that file (its fingerprint must match the model).
"""

from __future__ import annotations

import hashlib
import json
import os
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from ..errors import SekvError
from .rank_gate import RankGate

FORMAT = "sekv-router-1"
META_KEY = "sekv_router"
BUILTIN_DIR = Path(__file__).resolve().parent.parent / "routers"


@dataclass
class RouterFile:
    w: torch.Tensor  # [L, H, d_r, d]
    tau: torch.Tensor  # [L, H]
    gate: RankGate
    meta: dict[str, Any] = field(default_factory=dict)
    path: Path | None = None

    @property
    def fingerprint(self) -> str:
        return str(self.meta.get("model", {}).get("fingerprint", ""))

    def tensors(self) -> dict[str, torch.Tensor]:
        out = {"w": self.w.detach().float().cpu().contiguous(), "tau": self.tau.detach().float().cpu().contiguous()}
        out.update({f"gate.{k}": v.detach().float().cpu().contiguous() for k, v in self.gate.state_dict().items()})
        return out


def save(path: str | Path, rf: RouterFile) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = dict(rf.meta, format=FORMAT, rank=rf.gate.rank, head_dim=rf.gate.head_dim, gate_hidden=rf.gate.net[0].out_features)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    os.close(fd)
    try:
        save_file(rf.tensors(), tmp, metadata={META_KEY: json.dumps(meta)})
        with open(tmp, "rb") as f:
            os.fsync(f.fileno())
        os.chmod(tmp, 0o644)  # mkstemp makes it owner-only; a router file is shared like a model file
        os.replace(tmp, path)
    finally:
        Path(tmp).unlink(missing_ok=True)
    return path


def read_meta(path: Path) -> dict[str, Any]:
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = json.loads((f.metadata() or {}).get(META_KEY, "null"))
    except Exception:
        raise SekvError(f"{path}: not a sekv router file (unreadable safetensors)") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise SekvError(f"{path}: not a sekv router file (no {FORMAT} metadata)")
    return meta


def load(path: str | Path) -> RouterFile:
    path = Path(path)
    if not path.is_file():
        raise SekvError(f"router file not found: {path}")
    meta = read_meta(path)
    try:
        with safe_open(str(path), framework="pt") as f:
            t = {k: f.get_tensor(k) for k in f.keys()}
        gate = RankGate(int(meta["rank"]), int(meta["head_dim"]), int(meta["gate_hidden"]))
        gate.load_state_dict({k.removeprefix("gate."): v for k, v in t.items() if k.startswith("gate.")})
        w, tau = t["w"].float(), t["tau"].float()
    except (KeyError, RuntimeError, ValueError) as e:
        raise SekvError(f"{path}: damaged sekv router file ({str(e).splitlines()[0]})") from None
    if w.dim() != 4 or tau.shape != w.shape[:2]:
        raise SekvError(f"{path}: damaged sekv router file (w {tuple(w.shape)}, tau {tuple(tau.shape)})")
    gate.eval().requires_grad_(False)
    return RouterFile(w, tau, gate, meta, path)


def file_sha256(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _same_model(meta: dict[str, Any], fingerprint: str, model_id: str, shape) -> bool:
    """The file was trained for this model: same fingerprint, or the same *embedded* model.

    An embedded model name always means the same sha256-checked GGUF, but its converted directory's
    fingerprint also hashes config.json as the installed transformers writes it (its version string,
    formatting), so two installs of one embedded model can differ there; the attention shape must match.
    """
    from ..models import EMBEDDED

    m = meta.get("model", {})
    if fingerprint and m.get("fingerprint") == fingerprint:
        return True
    if not model_id or model_id not in EMBEDDED or m.get("id") != model_id:
        return False
    sh = m.get("shape") or {}
    want = {"layers": shape.n_layers, "heads": shape.n_heads, "head_dim": shape.head_dim}
    return all(int(sh.get(k, -1)) == v for k, v in want.items())


def builtin(fingerprint: str, model_id: str = "", shape=None) -> Path | None:
    """The shipped router trained for this model, if any."""
    if not BUILTIN_DIR.is_dir():
        return None
    for p in sorted(BUILTIN_DIR.glob("*.safetensors")):
        try:
            meta = read_meta(p)
        except SekvError:
            continue
        if meta.get("model", {}).get("fingerprint") == fingerprint or (shape is not None and _same_model(meta, fingerprint, model_id, shape)):
            return p
    return None


def resolve(spec: str, fingerprint: str, shape, model_id: str = "") -> str:
    """``router`` parameter -> "untrained" or an absolute path checked against the model."""
    spec = str(spec or "auto")
    if spec == "untrained":
        return spec
    if spec == "auto":
        p = builtin(fingerprint, model_id, shape)
        return str(p) if p else "untrained"
    p = Path(spec).expanduser()
    rf_meta = read_meta(p) if p.is_file() else None
    if rf_meta is None:
        raise SekvError(f"--router: {spec} is neither 'auto', 'untrained' nor a router file")
    fp = rf_meta.get("model", {}).get("fingerprint")
    if fp and fingerprint and not _same_model(rf_meta, fingerprint, model_id, shape):
        raise SekvError(f"--router: {p.name} was trained for model {rf_meta['model'].get('id')!r}, not the one in use")
    sh = rf_meta.get("model", {}).get("shape") or {}
    want = {"layers": shape.n_layers, "heads": shape.n_heads, "head_dim": shape.head_dim}
    if sh and any(int(sh.get(k, v)) != v for k, v in want.items()):
        raise SekvError(f"--router: {p.name} has attention shape {sh}, the model has {want}")
    return str(p.resolve())
