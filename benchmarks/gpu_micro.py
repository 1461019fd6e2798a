"""Micro-measurements behind sekv's GPU design choices (docs/gpu.md), one call through the device tool:

* batched eigendecomposition of span Gram matrices (float64, d = 128): torch.linalg.eigh on the whole
  batch vs the subspace iteration sekv uses on CUDA (sekv/factorize.py: top_eigh, 32 components);
* host -> device bandwidth: a pinned cudaMemcpy of a contiguous buffer vs a device-side gather of
  fixed-stride blocks straight from pinned host memory (sekv/blocks.py: the UVA view);
* device -> host of pack-sized data (2 GiB): into fresh ordinary memory, and page-locking + copying.

    python -m benchmarks.gpu_micro [--eig-only]
"""

from __future__ import annotations

import json
import sys
import time

import torch


from sekv_core.sekv import blocks, linalg


def timed(fn, reps=3):
    fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def eig_variants(out: dict, dev) -> None:
    """The compress path's eigensolver at the 128K / Llama-3-8B scale of one layer's K (11,904 span matrices of
    160 x 128, float32): Rayleigh-Ritz after orthonormalising by eigensolvers (exact_orth) or by Cholesky QR, in float32
    with 3 iterations (as compress did), then as compress does now (float64, linalg.SUBSPACE_ITERS), and the whole
    decomposition (Gram, iteration, U*sigma)."""
    g0 = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(11904, 160, 128, device=dev, generator=g0)
    a = a * torch.logspace(0, -1.5, 128, device=dev)
    g = a.transpose(1, 2) @ a
    ref = None
    for exact in (True, False):
        out[f"top_eigh32_f32_b11904_exact_orth_{exact}_s"] = timed(lambda: linalg.top_eigh(g, 32, iters=3, exact_orth=exact))
        lam, v = linalg.top_eigh(g, 32, iters=3, exact_orth=exact)
        energy = ((a @ v).norm(dim=(1, 2)) ** 2).double()
        ref = energy if ref is None else ref
        out[f"top_eigh32_energy_vs_exact_orth_{exact}"] = float((energy / ref).min())
    # what compress runs now (sekv/linalg.py _decompose): the iteration in float64, SUBSPACE_ITERS products
    gd = g.double()
    out[f"top_eigh32_f64_b11904_iters{linalg.SUBSPACE_ITERS}_s"] = timed(lambda: linalg.top_eigh(gd, 32, iters=linalg.SUBSPACE_ITERS, exact_orth=False))
    out["decompose_b11904_s"] = timed(lambda: linalg._decompose(a, "gram", want=32, rows_at_least_want=True))


def main():
    out = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    dev = torch.device("cuda")
    eig_variants(out, dev)
    if "--eig-only" in sys.argv:
        print(json.dumps(out), flush=True)
        return out
    for b in (512, 8192):
        a = torch.randn(b, 96, 128, device=dev, dtype=torch.float64)
        g = a.transpose(1, 2) @ a
        if b <= 512:
            out[f"eigh_full_b{b}_s"] = timed(lambda: torch.linalg.eigh(g), reps=1)
        out[f"top_eigh32_b{b}_s"] = timed(lambda: linalg.top_eigh(g, 32))
    size = 256 << 20
    host = torch.empty(size // 8, dtype=torch.int64, pin_memory=True)
    host.random_()
    d = torch.empty_like(host, device=dev)
    out["memcpy_h2d_GBps"] = size / timed(lambda: d.copy_(host, non_blocking=True)) / 1e9
    view = blocks.device_view(host, dev)
    out["uva_view"] = view is not None
    if view is not None:
        stride = 1600  # ~12.8 KB blocks, like one (group, span) pair's K+V factors
        nb = host.numel() // stride
        pick = torch.randperm(nb, device=dev)[:2000]
        idx = (pick.view(-1, 1) * stride + torch.arange(stride, device=dev)).flatten()
        moved = idx.numel() * 8
        out["uva_gather_GBps"] = moved / timed(lambda: view.index_select(0, idx)) / 1e9
        ok = torch.equal(view.index_select(0, idx[:4096]).cpu(), host[idx[:4096].cpu()])
        out["uva_gather_correct"] = ok
    # device -> host of pack-sized data: into fresh ordinary memory vs into freshly page-locked memory
    big = torch.empty(2 << 30, dtype=torch.uint8, device=dev).random_(0, 255)
    torch.cuda.synchronize()
    t = time.perf_counter()
    big.to("cpu")
    out["d2h_pageable_fresh_GBps"] = big.numel() / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    pinned = torch.empty(big.numel(), dtype=torch.uint8, pin_memory=True)
    out["pin_alloc_GBps"] = big.numel() / (time.perf_counter() - t) / 1e9
    t = time.perf_counter()
    pinned.copy_(big)
    torch.cuda.synchronize()
    out["d2h_pinned_GBps"] = big.numel() / (time.perf_counter() - t) / 1e9
    print(json.dumps(out), flush=True)
    return out


if __name__ == "__main__":
    main()
