"""Host-to-device copy paths of the question's reads, timed on a device (a study: which one the product should use).

The scout reads each layer's factor blocks for a run of spans of every KV group (8 strided runs of one page-locked
array) and the fill copies the zoom tier's staged rows (one slot of a page-locked ring) to the device.  Timed here,
each path GB/s over the same bytes:

- ``dma_whole``: one copy_ of a page_locked (sekv/blocks.py: registered in PIN_PIECE pieces) range;
- ``dma_pieces``: the same range copied piece by piece (fb.pieces: each copy inside one registration);
- ``torch_pinned``: one copy_ from torch's pinned allocator;
- ``uva_strided``: a kernel reading the mapped view, rows of a [groups, stride] strided view (the scout's chunk copy);
- ``dma_strided``: the same rows as one DMA copy per group run (pieces inside).

    python3 -m benchmarks.studies.host_copy_paths --mib 20 --groups 8 --repeat 20
"""

from __future__ import annotations

import argparse
import json

import torch

from benchmarks.gpu_micro import timed
from sekv_core.sekv import blocks as fb


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mib", type=int, default=20, help="bytes a copy moves")
    ap.add_argument("--groups", type=int, default=8)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev = torch.device("cuda")
    n = (a.mib << 20) // 8
    host = fb.page_locked(4 * n)  # a ring of four slots; slot 1 copied (whatever pieces it crosses)
    dst = torch.empty(n, dtype=torch.int64, device=dev)
    pinned = torch.empty(n, dtype=torch.int64, pin_memory=True)
    res = {}
    s0 = n
    res["dma_whole"] = timed(lambda: dst.copy_(host[s0 : s0 + n], non_blocking=True), a.repeat)

    def pieces():
        for x, y in fb.pieces(host, s0, s0 + n):
            dst[x - s0 : y - s0].copy_(host[x:y], non_blocking=True)

    res["dma_pieces"] = timed(pieces, a.repeat)
    res["torch_pinned"] = timed(lambda: dst.copy_(pinned, non_blocking=True), a.repeat)
    # strided: groups rows of w words, each from a run of a [groups, 4 * w] array (the chunk's spans of every group)
    g = a.groups
    w = n // g
    big = host[: g * 4 * w].view(g, 4 * w)
    b = fb.device_view(host, dev)
    if b is not None:
        view = b[: g * 4 * w].view(g, 4 * w)
        res["uva_strided"] = timed(lambda: dst[: g * w].view(g, w).copy_(view[:, w : 2 * w]), a.repeat)

    def dma_strided():
        for k in range(g):
            a0 = k * 4 * w + w
            for x, y in fb.pieces(host, a0, a0 + w):
                dst[k * w + x - a0 : k * w + y - a0].copy_(host[x:y], non_blocking=True)

    res["dma_strided"] = timed(dma_strided, a.repeat)
    del big
    out = {k: {"s": v, "gb_s": a.mib * 2**20 / v / 1e9} for k, v in res.items()}
    for k, v in out.items():
        print(f"{k:14s} {v['s'] * 1e3:8.3f} ms  {v['gb_s']:6.1f} GB/s")
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"mib": a.mib, "groups": g, "rows": out, "device": torch.cuda.get_device_name()}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
