"""Where the batched step's factor-block build spends its time, per layer of a pack, on the machine it runs on.

The build (sekv/gpu_step.py build_blocks, on a second thread from the pack's read: BlockBuild) reads each layer's
coded factors from the pack (``Pack.get``: the read and its sha256 check), decodes them to int8 (sekv/codec.py;
on CUDA on the device), re-lays them as fixed-stride blocks (sekv/blocks.py build; on CUDA on the device) and, on
CUDA, copies the blocks to page-locked host memory.  This times the parts separately (--device cpu: all on the
host; --device cuda: the decode and re-layout on the device, and the page-locking of each layer's blocks by torch's
pinned allocator, ``pin_s``, and by sekv/blocks.py page_locked, ``pin_exact_s``) and reports bytes and rates
(``build_s``: read + decode + re-layout + torch's page-locking, the build before the blocks were kept on the device):

    python -m benchmarks.block_build PACK [--device cpu|cuda] [--layers N] [--cprofile FILE]

``blocks / pack``: bytes of the blocks (int8 factors padded to each layer's longest span and largest rank) per
byte of the pack's coded factors: what page-locking has to lock, per byte read.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import sys
import time

import torch


class _Kept:
    """A pack whose tensors, once read (and checked), are kept: the decode after the timed read reads memory."""

    def __init__(self, pack):
        self.pack, self.cache = pack, {}

    def keys(self):
        return self.pack.keys()

    def get(self, name):
        if name not in self.cache:
            self.cache[name] = self.pack.get(name)
        return self.cache[name]


def _sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(path: str, device: str = "cpu", layers: int | None = None) -> dict:
    import sekv_core.methods  # noqa: F401 - the registry (sekv.layout imports through it)
    from sekv_core.pack import read_pack
    from sekv_core.sekv import blocks as fb
    from sekv_core.sekv import layout

    dev = torch.device(device)
    pack = read_pack(path)
    cfg = layout.read_config(pack)
    store = _Kept(pack)
    names = set(pack.keys())
    span_len = (store.get("sekv.span_end") - store.get("sekv.span_start")).long()
    factors = layout.PackFactors(store, names, cfg["n_layers"], span_len, cfg["head_dim"], dev)
    n_layers = min(layers or cfg["n_layers"], cfg["n_layers"])
    rows = []
    for i in range(n_layers):
        mine = [n for n in names if n.startswith((f"sekv.fk.{i}.", f"sekv.fv.{i}."))]
        t0 = time.perf_counter()
        for n in mine:
            store.get(n)
        t1 = time.perf_counter()
        with torch.inference_mode():
            f = factors.on_device(i)
            _sync(dev)
            t2 = time.perf_counter()
            b = fb.build(f, span_len, cfg["head_dim"], dev, pin=False, work_device=dev if dev.type == "cuda" else None,
                         r_max=factors.rank_max(i), keep=True)
            _sync(dev)
            t3 = time.perf_counter()
            pin_s = exact_s = None
            if dev.type == "cuda":  # page-locking one layer's blocks: torch's pinned allocator, then blocks.page_locked
                host = torch.empty(b.words.numel(), dtype=torch.int64, pin_memory=True)
                t4 = time.perf_counter()
                del host
                exact = fb.page_locked(b.words.numel())
                t5 = time.perf_counter()
                exact.copy_(b.words)
                del exact
                pin_s, exact_s = t4 - t3, t5 - t4
        coded = sum(pack.info(n).end - pack.info(n).start for n in mine)
        rows.append({"layer": i, "coded_bytes": coded, "block_bytes": b.words.numel() * 8, "read_s": t1 - t0, "decode_s": t2 - t1,
                     "relayout_s": t3 - t2, "pin_s": pin_s, "pin_exact_s": exact_s})
    coded = sum(r["coded_bytes"] for r in rows)
    blk = sum(r["block_bytes"] for r in rows)
    tot = {k: sum(r[k] for r in rows if r[k] is not None) for k in ("read_s", "decode_s", "relayout_s", "pin_s", "pin_exact_s")}
    out = {"pack": path, "device": str(dev), "layers": n_layers, "of_layers": cfg["n_layers"], "n_tokens": cfg["n_tokens"],
           "coded_MiB": coded / 2**20, "blocks_MiB": blk / 2**20, "blocks_per_pack_byte": blk / max(coded, 1), **tot,
           "build_s": tot["read_s"] + tot["decode_s"] + tot["relayout_s"] + tot["pin_s"]}
    for k in ("read_s", "decode_s", "relayout_s", "pin_s", "pin_exact_s"):
        if tot[k]:
            out[k.replace("_s", "_MBps")] = coded / tot[k] / 1e6  # per byte of the pack's coded factors
    out["build_MBps"] = coded / max(out["build_s"], 1e-9) / 1e6
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("pack")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--layers", type=int, default=None, help="only the first N layers")
    ap.add_argument("--cprofile", default=None, help="FILE: cProfile the measurement, print the top 25 by cumulative time")
    a = ap.parse_args(argv)
    if a.cprofile:
        prof = cProfile.Profile()
        out = prof.runcall(measure, a.pack, a.device, a.layers)
        prof.dump_stats(a.cprofile)
        pstats.Stats(a.cprofile, stream=sys.stderr).sort_stats("cumulative").print_stats(25)
    else:
        out = measure(a.pack, a.device, a.layers)
    print(json.dumps({k: round(v, 4) if isinstance(v, float) else v for k, v in out.items()}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
