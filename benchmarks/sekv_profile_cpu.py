"""Where sekv's time goes, on the CPU: compress stages and the per-layer decode stages.

A random-weight Llama (4 layers, hidden 512, 8 query / 2 KV heads, head_dim 64, bf16), one
document of --tokens random tokens, budget 0.10; the router's gate logits are replaced by
random ones with --zoom-rate of (query head, span) pairs above the threshold, redrawn every
step (as benchmarks/gpu_scale.py does).  Single intra-op thread.  Each stage function is
wrapped with a wall-clock timer; the decode numbers are per generated token (all layers).

    python -m benchmarks.sekv_profile_cpu --tokens 8192                # the reference step
    python -m benchmarks.sekv_profile_cpu --tokens 8192 --batched      # the batched step (sekv/gpu_step.py)
"""

from __future__ import annotations

import argparse
import collections
import math
import time
from pathlib import Path

import torch


from sekv_core import methods, runtime
from sekv_core.sekv import compress as sm
from sekv_core.prefill import prefill
from sekv_core.sekv import blocks, cpu_step, gpu_step, residents, rope

T: dict[str, float] = collections.defaultdict(float)
C: collections.Counter = collections.Counter()


def wrap(mod, name, label):
    f = getattr(mod, name)

    def g(*a, **k):
        t = time.perf_counter()
        r = f(*a, **k)
        T[label] += time.perf_counter() - t
        C[label] += 1
        return r

    setattr(mod, name, g)


class Store(dict):
    def get(self, k):
        return self[k]


def main() -> None:
    import transformers

    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--zoom-rate", type=float, default=0.02)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--batched", action="store_true")
    a = ap.parse_args()
    torch.set_num_threads(1)
    cfg = transformers.LlamaConfig(hidden_size=512, intermediate_size=1024, num_hidden_layers=4, num_attention_heads=8,
                                   num_key_value_heads=2, vocab_size=2000, max_position_embeddings=a.tokens + 1024)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    runtime.install(model)
    ids = torch.randint(0, 2000, (a.tokens,))
    t = time.perf_counter()
    res = prefill(model, ids, with_surprisal=True, chunk=1024)
    tp = time.perf_counter() - t
    for mod, name, label in [(sm, "segment", "segment"), (sm, "weighted_means", "summaries"), (sm.router, "pca_init", "router PCA"),
                             (sm.router, "span_norms", "router norms"), (sm.rope, "undo", "RoPE undo"), (sm.fz, "factorize", "factorize (SVD + pack)"),
                             (sm.fz, "_decompose", "  of which Gram + eigh")]:
        wrap(mod, name, label)
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.10})
    t = time.perf_counter()
    out = m.compress(res, p)
    tc = time.perf_counter() - t
    print(f"N={a.tokens}: prefill {tp:.2f} s, compress {tc:.2f} s")
    for k, v in T.items():
        print(f"  {k:30s} {v:7.3f} s ({C[k]} calls)")
    T.clear()
    C.clear()
    shift = -2.0 - math.sqrt(2) * torch.erfinv(torch.tensor(1 - 2 * a.zoom_rate)).item()
    residents.router.gate_logits = lambda q, w, kbar, inv_norm, log_n: torch.randn(q.shape[0], q.shape[1], kbar.shape[1]) + shift
    mem = m.open(Store(out), p, res.shape, "cpu")
    mem.batched = a.batched
    if a.batched:
        targets = [(residents.router, "gate_logits", "gate logits"), (residents, "route", "route"), (gpu_step, "select_topk", "budget cap (top-P)"),
                   (blocks, "fetch", "fetch (one gather)"), (blocks, "unpack", "unpack (views, dequantise)"),
                   (gpu_step, "flat_attention", "attention (flat slots)"), (gpu_step.BatchedStep, "_core", "attend total")]
    else:
        targets = [(residents.router, "gate_logits", "gate logits"), (residents, "route", "route"), (cpu_step, "select", "budget cap"),
                   (cpu_step.fz, "gather", "CPU gather of factors"), (cpu_step.fz, "expand", "dequantise + reconstruct"), (rope, "apply", "RoPE redo"),
                   (cpu_step, "place", "place per group"), (cpu_step, "build_mask", "build mask"), (cpu_step, "mixed_attention", "SDPA"),
                   (cpu_step.CpuStep, "_account", "accounting"), (cpu_step.CpuStep, "attend", "attend total")]
    for mod, name, label in targets:
        wrap(mod, name, label)
    tok = torch.tensor([[11]])
    runtime.forward_hidden(model, ids[:16].view(1, -1), mem.n_tokens(), mem)
    T.clear()
    C.clear()
    t = time.perf_counter()
    for _ in range(a.steps):
        runtime.forward_hidden(model, tok, mem.n_tokens(), mem)
    td = (time.perf_counter() - t) / a.steps
    st = mem.step_stats().extra
    print(f"decode ({'batched' if a.batched else 'reference'} step): {td * 1000:.1f} ms/token, {mem.res.n_spans} spans, "
          f"{st['zoom_spans_step']} zoomed, {st['h2d_bytes_step']} factor bytes/step")
    for k, v in T.items():
        print(f"  {k:30s} {v / a.steps * 1000:7.2f} ms/token ({C[k] // a.steps}/token)")


if __name__ == "__main__":
    main()
