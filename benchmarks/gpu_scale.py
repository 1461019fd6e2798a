"""GPU scale: resident KV, peak GPU memory, decode speed and ingest time, `full` vs `sekv`.

Random-weight models built from real configs (Llama-3-8B shape; the embedded
Qwen2.5-0.5B shape), bf16, batch 1.  Random weights are honest for memory and
speed, not for quality: their routing is meaningless, so the zoom decision is
driven at a fixed, realistic rate (--zoom-rate, the share of (query head, span)
pairs the router expands on the real default model; docs/sekv.md) with random
priorities, and the budget cap then applies exactly as in the product.

One call through the device tool (writes JSON + Markdown under $OUT):

    python benchmarks/gpu_scale.py --configs llama3-8b,qwen2.5-0.5b --contexts 8192,32768,65536,131072 \
        --budget 0.10 --out "$OUT"
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from sekv_core import methods, runtime  # noqa: E402
from sekv_core.methods.base import DictStore, ModelShape  # noqa: E402
from sekv_core.methods.full import FullMemory  # noqa: E402
from sekv_core.prefill import prefill  # noqa: E402

CONFIGS = {
    "llama3-8b": dict(arch="llama", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                      num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "qwen2.5-0.5b": dict(arch="qwen2", hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                         num_key_value_heads=2, vocab_size=151936, rope_theta=1000000.0),
}
GiB = 1 << 30


def build(name: str, max_pos: int):
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    c = dict(CONFIGS[name])
    arch = c.pop("arch")
    cfg = (LlamaConfig if arch == "llama" else Qwen2Config)(**c, max_position_embeddings=max_pos, tie_word_embeddings=False)
    cfg._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    return model.eval().requires_grad_(False)


def cuda_ms(fn, warmup: int, repeats: int) -> list[float]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def plain_prefill_s(model, ids) -> float:
    """Reference: one plain transformers forward with SDPA and a DynamicCache (logits of the last token)."""
    model.config._attn_implementation = "sdpa"
    for m in model.modules():
        if hasattr(m, "config") and hasattr(m.config, "_attn_implementation"):
            m.config._attn_implementation = "sdpa"
    torch.cuda.synchronize()
    with torch.inference_mode():
        model(ids[:, :1024], use_cache=True, logits_to_keep=1)  # warm-up
        torch.cuda.synchronize()
        t = time.perf_counter()
        out = model(ids, use_cache=True, logits_to_keep=1)
        torch.cuda.synchronize()
        dt = time.perf_counter() - t
    del out
    return dt


def decode_bench(model, memory, steps: int, repeats: int) -> dict:
    """Median ms per decode step (one new token), CUDA events; memory returns to its state between repeats."""
    base = memory.n_tokens()
    tok = torch.tensor([[11]], device="cuda")
    peak_resident = 0

    def one_run():
        nonlocal peak_resident
        memory.truncate(base)
        for _ in range(steps):
            memory.begin_step(1)
            runtime.forward_hidden(model, tok, memory.n_tokens(), memory)
            memory.end_step()
            peak_resident = max(peak_resident, memory.step_stats().resident_bytes)

    torch.cuda.reset_peak_memory_stats()
    per_run = cuda_ms(one_run, warmup=1, repeats=repeats)
    memory.truncate(base)
    ms = statistics.median(per_run) / steps
    return {"ms_per_token": ms, "tokens_per_s": 1000.0 / ms, "peak_gpu_bytes": torch.cuda.max_memory_allocated(),
            "resident_kv_peak_bytes": peak_resident}


def force_zoom_rate(rate: float, seed: int = 0):
    """Replace the router's gate logits by random ones whose share above tau is `rate` (see module doc)."""
    from sekv_core.methods import sekv as sekv_method

    g = torch.Generator(device="cuda").manual_seed(seed)
    real = sekv_method.router.gate_logits

    def gate_logits(query, w, kbar, inv_norm, log_n):
        h, q = query.shape[0], query.shape[1]
        s = kbar.shape[1]
        z = torch.randn(h, q, s, device=query.device, generator=g)
        # logit_tau is the untrained default (logit -2): shift so that P(z + m > -2) = rate
        m = -2.0 - math.sqrt(2) * torch.erfinv(torch.tensor(1 - 2 * rate)).item()
        return z + m

    sekv_method.router.gate_logits = gate_logits
    return real


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--configs", default="llama3-8b,qwen2.5-0.5b")
    ap.add_argument("--contexts", default="8192,32768,65536,131072")
    ap.add_argument("--budget", type=float, default=0.10)
    ap.add_argument("--zoom-rate", type=float, default=0.02)
    ap.add_argument("--steps", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--chunk", type=int, default=8192)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    assert torch.cuda.is_available(), "needs CUDA"
    out_dir = Path(a.out)
    out_dir.mkdir(parents=True, exist_ok=True)
    contexts = [int(x) for x in a.contexts.split(",")]
    rows = []
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__}
    import transformers

    env["transformers"] = transformers.__version__
    print(json.dumps(env), flush=True)
    force_zoom_rate(a.zoom_rate)
    for cname in a.configs.split(","):
        model = build(cname, max(contexts) + 2048)
        shape = ModelShape.of(model.config, torch.bfloat16)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        for n in contexts:
            row = {"config": cname, "context": n, "budget": a.budget, "zoom_rate": a.zoom_rate, "weights_bytes": weights}
            ids = torch.randint(100, 20000, (1, n), device="cuda")
            try:
                row["plain_prefill_s"] = plain_prefill_s(model, ids)
                runtime.install(model)
                gc.collect()
                torch.cuda.empty_cache()
                # full: prefill into our memory, decode over all of it
                t = time.perf_counter()
                res = prefill(model, ids[0], with_surprisal=False, chunk=a.chunk)
                torch.cuda.synchronize()
                row["full_ingest_s"] = time.perf_counter() - t
                mem = FullMemory.empty(shape, "cuda", capacity=n + 64)
                for li in range(shape.n_layers):
                    mem.kv.append(li, res.keys[li][None], res.values[li][None])
                del res
                gc.collect()
                torch.cuda.empty_cache()
                r = decode_bench(model, mem, a.steps, a.repeats)
                row.update({f"full_{k}": v for k, v in r.items()})
                row["full_kv_bytes"] = n * shape.kv_bytes_per_token()
                del mem
                gc.collect()
                torch.cuda.empty_cache()
                # sekv: prefill with surprisal + compress (segment, summarise, factorise on the GPU)
                method = methods.get("sekv")
                params = method.resolve_params({"budget": a.budget})
                torch.cuda.synchronize()
                t = time.perf_counter()
                res = prefill(model, ids[0], with_surprisal=True, chunk=a.chunk)
                torch.cuda.synchronize()
                t_pre = time.perf_counter() - t
                tensors = method.compress(res, params)
                torch.cuda.synchronize()
                row["sekv_prefill_s"] = t_pre
                row["sekv_ingest_s"] = time.perf_counter() - t
                del res
                gc.collect()
                torch.cuda.empty_cache()
                store = DictStore({k: (v.pin_memory() if v.device.type == "cpu" else v.cpu().pin_memory()) for k, v in tensors.items()})
                del tensors
                mem = method.open(store, params, shape, "cuda")
                gc.collect()
                torch.cuda.empty_cache()
                r = decode_bench(model, mem, a.steps, a.repeats)
                row.update({f"sekv_{k}": v for k, v in r.items()})
                st = mem.step_stats().extra
                row["sekv_h2d_bytes_per_step"] = st.get("h2d_bytes_step")
                row["sekv_zoom_spans_step"] = st.get("zoom_spans_step")
                row["sekv_spans"] = mem.n_spans
                del mem, store
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e).splitlines()[0]}"
            gc.collect()
            torch.cuda.empty_cache()
            model.config._attn_implementation = "sdpa"
            print(json.dumps(row), flush=True)
            rows.append(row)
        del model
        gc.collect()
        torch.cuda.empty_cache()
    (out_dir / "gpu_scale.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
