"""Torch ops and host syncs of sekv's compress stage, per layer, on the CPU (a proxy for CUDA launches and syncs).

A random-weight Qwen2 with the KV shape of a real model (default qwen2.5-0.5b's: 24 layers, 2 KV heads of 64;
small hidden and MLP, so the prefill is quick) prefills --tokens random tokens, then ``compress`` runs under
torch.profiler: top-level aten calls that are not views (the launch proxy, benchmarks/ttft_ops.py), the calls
that read a scalar or have a data-dependent shape (each a device sync on CUDA), eigensolver calls, and the wall
seconds of compress on this CPU:

    python -m benchmarks.compress_ops --tokens 8192

``--compress-bound BYTES`` runs the chunked path a GPU takes when a layer does not fit what is free (sekv/compress.py
plan: layer groups, a layer's spans in chunks); the record gives the plan and the calls per layer and per 1K
compressed tokens, to compare with the unbounded path at the same size.  The merge (sekv/merge.py: the factor codec,
on the host here as on a CPU) is timed apart, with the factor elements it codes, so its cost at another size can be
read off (elements scale with tokens x KV heads x layers):

    python -m benchmarks.compress_ops --tokens 8192 --cuda-path --compress-bound 60000000
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch

from benchmarks.ttft_ops import VIEWS, _caller

#: calls that wait for the device on CUDA (a copy to the host, a scalar read, a data-dependent shape)
SYNCS = {"aten::_local_scalar_dense", "aten::item", "aten::nonzero", "aten::unique", "aten::_unique2", "aten::masked_select", "aten::repeat_interleave"}


def random_prefill(tokens: int, layers: int, kv_heads: int, head_dim: int, hidden: int | None = None, device: str = "cpu",
                   dtype: torch.dtype = torch.float32):
    """sekv's prefill of `tokens` random tokens by a random-weight Qwen2 of that KV geometry (float32 on the CPU unless
    told, a 1,024-token vocabulary; hidden kv_heads x head_dim unless given), installed: (method, its default params,
    the token ids, the prefill, seconds)."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sekv_core import methods, runtime
    from sekv_core.methods import scores
    from sekv_core.prefill import prefill

    torch.manual_seed(0)
    hid = hidden or kv_heads * head_dim
    cfg = Qwen2Config(hidden_size=hid, num_hidden_layers=layers, num_attention_heads=kv_heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      intermediate_size=2 * hid, vocab_size=1024, max_position_embeddings=max(32768, tokens + 64))
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval().to(device)
    runtime.install(model)
    m = methods.get("sekv")
    p = m.resolve_params({})
    ids = torch.randint(0, 1024, (tokens,), generator=torch.Generator().manual_seed(0))
    t = time.perf_counter()
    with torch.inference_mode():
        res = prefill(model, ids, with_surprisal=True, capture=scores.capture_kinds(m.needs(p)), obs_window=m.obs_window(p))
    return m, p, ids, res, time.perf_counter() - t


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.compress_ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=24)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=64)
    ap.add_argument("--cuda-path", action="store_true", help="the decompositions CUDA takes (several layers a batch; subspace iteration where d > 32), run on the CPU")
    ap.add_argument("--compress-bound", type=int, default=None, help="bytes compress may hold at once (sekv/compress.py free_bytes): the chunked path")
    ap.add_argument("--by-function", action="store_true")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    m, p, _, res, _ = random_prefill(a.tokens, a.layers, a.kv_heads, a.head_dim)
    torch.set_num_threads(1)
    if a.cuda_path:
        from sekv_core.sekv import compress as sc
        from sekv_core.sekv import linalg as la

        sc.GROUP_ON_CPU = True  # several layers in one decomposition, as on CUDA

        la.SUBSPACE_ON_CPU = True  # the subspace iteration CUDA takes
    from sekv_core.sekv import compress as sc
    from sekv_core.sekv import merge as sm

    plans, merge_s, coded = [], [0.0], [0]
    if a.compress_bound is not None:
        sc.GROUP_ON_CPU = True  # the grouping a GPU does
        sc.free_bytes = lambda device: a.compress_bound
    real_plan, real_merge, real_encode = sc.plan, sm.merge, sm.encode_factors

    def plan(*args):
        q = real_plan(*args)
        plans.append({"group": q.group, "span_chunks": len(q.chunks), "profile_rows": q.profile_rows})
        return q

    def merge(*args, **kw):
        t0 = time.perf_counter()
        try:
            return real_merge(*args, **kw)
        finally:
            merge_s[0] += time.perf_counter() - t0

    def encode(f, *args):
        coded[0] += f.us.numel() + f.vt.numel()
        return real_encode(f, *args)

    sc.plan, sm.merge, sm.encode_factors = plan, merge, encode
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=a.by_function) as prof:
        t = time.perf_counter()
        out = m.compress(res, p)
        wall = time.perf_counter() - t
    evs = [e for e in prof.events() if e.name.startswith("aten::")]
    ids_ = {id(e) for e in evs}
    top = [e for e in evs if not (e.cpu_parent is not None and _aten_parent(e, ids_))]
    rec = {
        "tokens": a.tokens,
        "layers": a.layers,
        "wall_s": wall,
        "not_views": sum(1 for e in top if e.name not in VIEWS),
        "syncs": sum(1 for e in evs if e.name in SYNCS),
        "eigh": sum(1 for e in top if e.name in ("aten::linalg_eigh", "aten::_linalg_eigh")),
    }
    rec["not_views_per_layer"] = rec["not_views"] / a.layers
    rows = int(out["sekv.span_end"].sum() - out["sekv.span_start"].sum())  # compressed tokens (in spans)
    rec.update(compress_bound=a.compress_bound, plans=plans, compressed_tokens=rows, not_views_per_1k_tokens=1000 * rec["not_views"] / max(rows, 1),
               syncs_per_layer=rec["syncs"] / a.layers, merge_s=merge_s[0], coded_elements=coded[0],
               coded_per_s=coded[0] / merge_s[0] if merge_s[0] else None)
    if a.by_function:
        import collections

        rec["by_function"] = collections.Counter(_caller(e) for e in top if e.name not in VIEWS).most_common(20)
        rec["syncs_by_function"] = collections.Counter(_caller(e) for e in evs if e.name in SYNCS).most_common(12)
    print(json.dumps(rec))
    if a.out:
        Path(a.out).write_text(json.dumps(rec, indent=1))
    return 0


def _aten_parent(e, ids) -> bool:
    p = e.cpu_parent
    while p is not None:
        if id(p) in ids:
            return True
        p = p.cpu_parent
    return False


if __name__ == "__main__":
    raise SystemExit(main())
