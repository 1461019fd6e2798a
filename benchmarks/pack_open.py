"""Opening a large pack: format 2 (sha256 over the whole file at every open) against the current format (4: header
checksum at open, each tensor's sha256 when it is first read), on a synthetic `full`-layout pack.

    PYTHONPATH=. .venv/bin/python -m benchmarks.pack_open --gb 1.5

The format 2 reader is the one of commit 63e746e (git show), run from a temporary module.  The pack file is
written just before it is read, so both read from the page cache (as an ask right after ingest, or a second ask).
Prints one JSON object: seconds to open, to read the first tensor, and to open and read every tensor into memory of
its own, per format (and the machine's load average, since these are CPU-bound).
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def old_pack_module(tmp: Path):
    src = subprocess.run(["git", "-C", str(ROOT), "show", "63e746e:sekv_core/pack.py"], capture_output=True, text=True, check=True).stdout
    src = src.replace("from .errors import PackError", "from sekv_core.errors import PackError")
    path = tmp / "pack_v2.py"
    path.write_text(src)
    spec = importlib.util.spec_from_file_location("pack_v2", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules["pack_v2"] = mod  # dataclasses look their module up
    spec.loader.exec_module(mod)
    return mod


def timed(fn):
    t = time.perf_counter()
    out = fn()
    return out, time.perf_counter() - t


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gb", type=float, default=1.5)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--dir", default=None)
    a = ap.parse_args()
    from sekv_core import pack as new

    tmp = Path(a.dir or tempfile.mkdtemp(prefix="sekv_open_"))
    old = old_pack_module(tmp)
    per = int(a.gb * 2**30 / (2 * a.layers) / 2)  # float16 elements per tensor
    g = torch.Generator().manual_seed(0)
    tensors = {f"full.{kv}.{i}": torch.randn(per, generator=g).to(torch.float16) for i in range(a.layers) for kv in "kv"}
    manifest = {"method": "full", "method_params": {}, "token_ids": [1], "document": {"name": "x"}, "model": {}}
    res: dict = {"pack_gb": round(sum(t.numel() * 2 for t in tensors.values()) / 2**30, 3), "tensors": len(tensors),
                 "threads": torch.get_num_threads()}
    for name, mod in (("format2", old), (f"format{new.FORMAT_VERSION}", new)):
        path = tmp / f"{name}.sekv"
        _, res[f"{name}_write_s"] = timed(lambda: mod.write_pack(path, dict(manifest), tensors))
        p, res[f"{name}_open_s"] = timed(lambda: mod.read_pack(path))
        _, res[f"{name}_first_tensor_s"] = timed(lambda: p.get("full.k.0"))
        p, _ = timed(lambda: mod.read_pack(path))
        # every tensor in memory of its own, as a method's open() leaves it (format 2's safetensors tensors map the
        # file lazily: clone() makes it read them; the current format's get() reads, checks and returns its own copy)
        _, t_all = timed(lambda: [p.get(k).clone() if name == "format2" else p.get(k) for k in p.keys()])
        res[f"{name}_open_and_read_all_s"] = round(res[f"{name}_open_s"] + t_all, 3)
        path.unlink()
    import os

    res["loadavg_1min"] = os.getloadavg()[0]
    print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in res.items()}))


if __name__ == "__main__":
    main()
