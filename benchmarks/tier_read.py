"""The zoom tier's read at ask time (sekv/zoom_tier.py), on a pack file of a given shape with random rows.

    python -m benchmarks.tier_read [--layers 4] [--kv-heads 8] [--head-dim 128] [--tokens 131072] [--rows 73728]
                                   [--block 16] [--device cpu|cuda] [--out tier_read.json]

The pack holds an int8 tier of ``--tokens`` span tokens per layer (the 8B shape at 128K: 8 KV heads of 128, 32 layers;
``--layers`` fewer to fit a small machine: every number is per layer).  A plan zooms ``--rows`` (KV group, token) rows,
runs of ``--block`` consecutive tokens at random places of each group, as a fixed set's plan does (the 8B shape at
128K with the default budget 0.1: about 73K rows a layer).  Timed, host seconds:

* ``open_s``: the tier's open (nothing read); ``check_s_all_layers``: its sha256 check on its thread, all layers;
* ``old_table_s``: what the read before this one did per layer before page-locking (the layer's parts read whole and
  checked, ``Pack.get``, and laid side by side as one int64 table); page-locking it came on top (2.8 GB/s on the H200,
  docs/gpu.md);
* ``rows_s``: :meth:`ZoomTier.rows` of one layer, the rows gathered from the file's map (first touch of the pages,
  then again);
* ``staged_s``: :meth:`ZoomTier.fetch` of every layer through the ring (StagedRows), to the last layer's rows on the
  device (``--device cuda``: page-locked slots, copies on a side stream), with its parts (the host gather, the waits).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch

from sekv_core.pack import read_pack, write_pack
from sekv_core.sekv import zoom_tier
from sekv_core.sekv.zoom_tier import ZoomTier


def make_pack(path: Path, layers: int, hkv: int, d: int, tokens: int) -> None:
    g = torch.Generator().manual_seed(0)
    t = {"sekv.zoom.idx": torch.arange(tokens, dtype=torch.int64) * 2}
    for li in range(layers):
        for p in ("k", "v"):
            t[f"sekv.zoom.{p}.{li}"] = torch.randint(-127, 128, (hkv, tokens, d), generator=g, dtype=torch.int8)
            t[f"sekv.zoom.{p}s.{li}"] = (torch.rand(hkv, tokens, generator=g) / 100).to(torch.float16)
    write_pack(path, {"method": "sekv", "method_params": {}}, t)


def plan(tier: ZoomTier, rows: int, block: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(hit, row) of a plan: each group's rows in runs of `block` tokens at random starts."""
    hkv, g = tier.shape.n_kv_heads, torch.Generator().manual_seed(1)
    per = rows // hkv
    starts = torch.randint(0, tier.P - block, (hkv, -(-per // block)), generator=g) // block * block
    tok_i = (starts.unsqueeze(-1) + torch.arange(block)).reshape(hkv, -1)[:, :per]
    group = torch.arange(hkv).view(-1, 1).expand_as(tok_i)
    return tier.locate(group.flatten().to(device), tier.pos[tok_i.flatten()].to(device), torch.ones(hkv * per, dtype=torch.bool, device=device))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.tier_read", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--tokens", type=int, default=131072)
    ap.add_argument("--rows", type=int, default=73728)
    ap.add_argument("--block", type=int, default=16)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device(a.device)
    zoom_tier.STAGED_ON = {dev.type}
    shape = SimpleNamespace(n_layers=a.layers, n_kv_heads=a.kv_heads, head_dim=a.head_dim, dtype=torch.bfloat16)
    out: dict = {"args": vars(a)}
    with tempfile.TemporaryDirectory() as tmp:
        path = Path(tmp) / "tier.sekv"
        t = time.perf_counter()
        make_pack(path, a.layers, a.kv_heads, a.head_dim, a.tokens)
        out["write_s"] = time.perf_counter() - t
        pack = read_pack(path)
        names = set(pack.keys())
        layer_bytes = sum(pack.info(f"sekv.zoom.{p}.0").end - pack.info(f"sekv.zoom.{p}.0").start for p in zoom_tier.LAYER_PARTS)
        out["layer_mib"] = layer_bytes / 2**20
        with torch.inference_mode():
            # the read before: a layer's parts read whole (checked) and laid out as one table (page-locking not counted)
            t = time.perf_counter()
            n = a.kv_heads * a.tokens
            cols = [pack.get(f"sekv.zoom.{p}.0").reshape(n, -1).view(torch.uint8) for p in zoom_tier.LAYER_PARTS]
            raw = torch.cat(cols, 1)
            raw = torch.cat([raw, torch.zeros(n, (-raw.shape[1]) % 8, dtype=torch.uint8)], 1).contiguous().view(torch.int64)
            out["old_table_s"] = time.perf_counter() - t
            del cols, raw
            pack._cache.clear()
            t = time.perf_counter()
            tier = ZoomTier(pack, names, shape, dev)
            out["open_s"] = time.perf_counter() - t
            tier.check.done.wait()  # the sha256 check on its thread (from the open on; waited for here, not timed with the reads)
            out["check_s_all_layers"] = time.perf_counter() - t
            out["check_ok"] = tier.damaged is None
            hit, row = plan(tier, a.rows, a.block, dev)
            out["plan_rows"] = row.numel()
            out["plan_mib_per_layer"] = row.numel() * (2 * a.head_dim + 4) / 2**20
            for k in ("first", "again"):
                t = time.perf_counter()
                _, kk, _ = tier.rows(1 % a.layers, hit, row)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                out[f"rows_{k}_s"] = time.perf_counter() - t
            for k in ("first", "again"):
                t = time.perf_counter()
                staged = tier.fetch(hit, row, a.layers)
                for li in range(a.layers):
                    _, kk, vv = staged.layer(li)
                if dev.type == "cuda":
                    torch.cuda.synchronize()
                out[f"staged_{k}_s"] = time.perf_counter() - t
                out[f"staged_{k}_parts"] = dict(staged.stats)
        pack.close()
    print(json.dumps(out, indent=1))
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
