"""Where a layer group of sekv's compress goes, on the device it runs on (the H200's question: 0.155 s a layer group
at 128K on the 8B shape, 0.87 s the first).

A random-weight Qwen2 with the KV geometry asked for (default the 8B shape's: 8 KV heads of 128; --layers layers, a
small hidden and MLP, a 1,024-token vocabulary: benchmarks/compress_ops.py random_prefill) prefills --tokens random
tokens on --device in the model's dtype; then sekv's compress runs as `sekv ingest`'s pipelined path runs it (the zoom
tier left to the prefill's stream, the factors coded where they are made, the results copied into a pre-faulted host
arena), --repeat times, and prints per run:

- ``groups_s``: each layer group's seconds from the progress events (host clock, no sync added: what compress_split
  shows), the first group apart (``first_group_s``; its kernels' first use unless --prepared made them beforehand);
- with --stages, a run with a device sync around the stages (inclusive seconds: the inputs' gather and RoPE undo,
  decompose_spans, of it top_eigh, the packing, the codec, the copies' submission);
- with --kernels N, a run under torch.profiler: the N kernels (and CUDA runtime calls) with the most device time,
  and the count of host syncs (cudaStreamSynchronize, cudaDeviceSynchronize, blocking memcpy).

    python -m benchmarks.compress_layer --tokens 4096 --layers 2 --cuda-path --stages  # here (CPU: CUDA's path, no kernels)
    python3 -m benchmarks.compress_layer --device cuda --tokens 131072 --layers 4 --prepared --stages --kernels 30 --out $OUT/layer.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time
from pathlib import Path

import torch

from benchmarks.compress_ops import random_prefill
from benchmarks.knobs import add_set_option, apply_sets


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


class Stages:
    """Inclusive seconds of named functions, a device sync before and after each call (nested calls counted in each)."""

    def __init__(self, dev: torch.device, targets):
        self.dev, self.targets, self.s, self.n, self.old = dev, targets, {}, {}, []

    def __enter__(self):
        for mod, name, label in self.targets:
            fn = getattr(mod, name)
            self.old.append((mod, name, fn))

            def timed(*a, _fn=fn, _label=label, **k):
                _sync(self.dev)
                t = time.perf_counter()
                try:
                    return _fn(*a, **k)
                finally:
                    _sync(self.dev)
                    self.s[_label] = self.s.get(_label, 0.0) + time.perf_counter() - t
                    self.n[_label] = self.n.get(_label, 0) + 1

            setattr(mod, name, timed)
        return self

    def __exit__(self, *exc):
        for mod, name, fn in reversed(self.old):
            setattr(mod, name, fn)
        return False


def one_run(res, p, dev, prepared: bool) -> dict:
    from sekv_core.sekv import compress as sc
    from sekv_core.sekv.host_copies import HostArena

    with torch.inference_mode(False):  # as `sekv ingest` makes it: the copies' threads write it outside inference mode
        arena = HostArena(sc.host_bound(res.n_tokens, res.shape, p)).take() if dev.type == "cuda" else None
    prep = sc.Prepared(res.n_tokens, res.shape, p, dev).result() if prepared else None
    events = []
    sc.PROGRESS = lambda e, **k: events.append((e, time.perf_counter()))
    try:
        _sync(dev)
        t = time.perf_counter()
        sc.compress(res, p, arena, None, prep)
        wall = time.perf_counter() - t
    finally:
        sc.PROGRESS = None
    at = {}
    marks = [t for e, t in events if e == "layers"]
    start = next(t for e, t in events if e == "profile")
    groups = [b - a for a, b in zip([start] + marks[:-1], marks)]
    at.update(wall_s=wall, first_group_s=groups[0] if groups else None, later_groups_s=groups[1:],
              later_group_mean_s=sum(groups[1:]) / max(1, len(groups) - 1))
    return at


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compress_layer", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--repeat", type=int, default=2, help="compress runs (the first pays its kernels' first use)")
    ap.add_argument("--prepared", action="store_true", help="compress.Prepared first (RoPE tables, kernel warm-up), as `sekv ingest` on a GPU")
    ap.add_argument("--stages", action="store_true", help="one more run with a device sync around each stage")
    ap.add_argument("--kernels", type=int, default=0, help="one more run under torch.profiler: the N kernels with the most device time")
    ap.add_argument("--cuda-path", action="store_true", help="on the CPU: CUDA's layer groups and subspace iteration")
    ap.add_argument("--out", default=None)
    add_set_option(ap)
    a = ap.parse_args(argv)
    sets = apply_sets(a.set)
    dev = torch.device(a.device)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    m, p, _, res, prefill_s = random_prefill(a.tokens, a.layers, a.kv_heads, a.head_dim, device=a.device, dtype=dtype)
    p = dataclasses.replace(p, zoom_tier="factors")  # the pipelined ingest's: the tier is the prefill's stream's
    from sekv_core.sekv import compress as sc
    from sekv_core.sekv import factorize as fz
    from sekv_core.sekv import linalg as la
    from sekv_core.sekv.host_copies import HostCopies

    flags = sc.GROUP_ON_CPU, la.SUBSPACE_ON_CPU
    if a.cuda_path:  # CUDA's grouping and subspace iteration, on the CPU (restored at the end)
        sc.GROUP_ON_CPU, la.SUBSPACE_ON_CPU = True, True
    try:
        return _runs(a, dev, m, p, res, prefill_s, sc, fz, la, HostCopies, sets)
    finally:
        sc.GROUP_ON_CPU, la.SUBSPACE_ON_CPU = flags


def _runs(a, dev, m, p, res, prefill_s, sc, fz, la, HostCopies, sets) -> int:

    seg = sc.segmentation(res, p)
    rec = {"device": str(dev), "gpu": torch.cuda.get_device_name(dev) if dev.type == "cuda" else None, "torch": torch.__version__,
           "tokens": a.tokens, "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "prefill_s": prefill_s,
           "spans": seg.n_spans, "span_len_mean": float(seg.span_len.float().mean()) if seg.n_spans else 0.0,
           "span_len_max": int(seg.span_len.max()) if seg.n_spans else 0, "prepared": a.prepared, "set": sets, "runs": []}
    with torch.no_grad():  # as `sekv ingest` runs compress: outside inference mode, on the prefill's inference tensors
        for _ in range(a.repeat):
            rec["runs"].append(one_run(res, p, dev, a.prepared))
            print(json.dumps(rec["runs"][-1]))
        if a.stages:
            targets = [(sc, "_layer_tensors", "layer tensors (full, coarse, moment)"), (sc, "_factors", "factors (inputs, decompose, pack)"),
                       (fz, "decompose_spans", "  decompose_spans"), (la, "top_eigh", "    top_eigh"), (la, "_cholqr", "      _cholqr"),
                       (fz, "pack", "  pack"), (sc, "_code_factors", "codes (codec.encode_factors)"), (HostCopies, "submit", "copies' submission")]
            with Stages(dev, targets) as st:
                rec["stages_run"] = one_run(res, p, dev, a.prepared)
            rec["stages_s"], rec["stage_calls"] = st.s, st.n
            print(json.dumps({"stages_s": st.s, "calls": st.n}))
        if a.kernels:
            acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
            with torch.profiler.profile(activities=acts) as prof:
                rec["profiled_run"] = one_run(res, p, dev, a.prepared)
            ka = prof.key_averages()
            key = "device_time_total" if dev.type == "cuda" else "self_cpu_time_total"
            rows = sorted(ka, key=lambda e: getattr(e, key, 0) or 0, reverse=True)[: a.kernels]
            rec["top"] = [{"name": e.key[:120], "calls": e.count, "device_ms": (getattr(e, "device_time_total", 0) or 0) / 1e3,
                           "self_cpu_ms": e.self_cpu_time_total / 1e3} for e in rows]
            syncs = {"cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpy", "cudaEventSynchronize", "aten::_local_scalar_dense"}
            rec["sync_calls"] = {e.key: e.count for e in ka if e.key in syncs}
            print(prof.key_averages().table(sort_by=key, row_limit=a.kernels, max_name_column_width=70))
            print(json.dumps({"sync_calls": rec["sync_calls"]}))
    if a.out:
        Path(a.out).write_text(json.dumps(rec, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
