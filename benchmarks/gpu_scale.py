"""GPU scale: resident KV, peak GPU memory, decode speed and ingest time, `full` vs `sekv`.

Random-weight models built from real configs (Llama-3-8B shape; the embedded
Qwen2.5-0.5B shape), bf16, batch 1.  Random weights are honest for memory and
speed, not for quality: their routing is meaningless, so the zoom decision is
driven.  Default (--routing scout, the product's default): one random span
ranking per answer, set where the scout pass would set it; every layer keeps
the top of it under the budget cap exactly as in the product, so the answer's
first step fetches and rebuilds that set and the later steps reuse it.
--routing per_layer: random gate logits at a fixed rate (--zoom-rate), redrawn
every step and layer, the pessimistic case where every step refetches.

One call through the device tool (writes JSON under $OUT; docs/gpu.md has the numbers):

    python -m benchmarks.gpu_scale --configs llama3-8b,qwen2.5-0.5b --contexts 8192,32768,65536,131072 \
        --steps 32 --repeats 3 --prefault-arena --out "$OUT"

Per configuration: a plain transformers prefill (SDPA, last logits only); `full` = our prefill hook
(whole document in one forward) + decode through the hook over all of the KV; `sekv` = prefill with
surprisal + compress (timed per stage) + open (host factor blocks) + decode through the batched step.
Decode modes (--modes): `eager` (the model's kernels launched one by one; sekv's part of each layer is a
captured per-layer graph) and `graphs` (sekv_core/graphed_step.py: the whole single-token step, model and
memory, captured once and replayed; both methods).  Per answer of --steps single-token steps (CUDA events,
after a warm-up answer): the mean step, the steady step (median of the steps after the first) and the
first step; then one profiled steady step (torch.profiler): GPU-busy time, kernel count, top kernels.
Peak GPU memory is the decode phase's (after ingest, prefill buffers freed).
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import json
import math
import os
import statistics
import time
from pathlib import Path

import torch


from sekv_core import methods, runtime
from sekv_core.methods.base import DictStore, ModelShape
from sekv_core.methods.full import FullMemory
from sekv_core.prefill import prefill

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


def gpu_busy(fn) -> dict:
    """Device time of one call of fn (sum of kernel and copy durations, torch.profiler): what the step costs
    the GPU, whatever the host's launch overhead; the bound a captured (CUDA-graph) step would approach."""
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", None)
        if t is None:
            t = getattr(e, "self_cuda_time_total", 0)
        if t > 0:
            rows.append((t, e.count, e.key))
    rows.sort(reverse=True)
    return {"busy_ms": sum(r[0] for r in rows) / 1000.0, "launches": int(sum(r[1] for r in rows)),
            "top": [(round(t / 1000.0, 3), c, k[:60]) for t, c, k in rows[:8]]}


def decode_bench(model, memory, steps: int, repeats: int, graphs: bool = False, compiled: bool = False, per_answer=None) -> dict:
    """One "answer" = `steps` single-token steps from the memory's document state; the memory returns to that
    state between answers.  Each step is timed with CUDA events.  ms_per_token: median over answers of the mean
    step; steady_ms_per_token: median of the steps after the first (under scout routing the first one fetches
    and rebuilds the fixed set, the others reuse it); first_step_ms likewise.  graphs: steps run through
    GraphedStep (one captured CUDA graph per step); compiled: its decoder layers torch.compile'd.  per_answer(): called before each answer (e.g. a new ranking).
    Stats are read once per answer (reading them syncs), not per step."""
    from sekv_core.graphed_step import GraphedStep

    base = memory.n_tokens()
    tok = torch.tensor([[11]], device="cuda")
    graphed = GraphedStep(model, memory, compile_layers=compiled) if graphs else None

    def step():
        if graphed is not None:
            graphed(tok)
            return
        memory.begin_step(1)
        runtime.forward_hidden(model, tok, memory.n_tokens(), memory)
        memory.end_step()

    def one_run() -> list[float]:
        memory.truncate(base)
        if per_answer:
            per_answer()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(steps + 1)]
        ev[0].record()
        for k in range(steps):
            step()
            ev[k + 1].record()
        torch.cuda.synchronize()
        return [ev[k].elapsed_time(ev[k + 1]) for k in range(steps)]

    torch.cuda.reset_peak_memory_stats()
    one_run()  # warm-up (and the captures)
    runs = [one_run() for _ in range(repeats)]
    st = memory.step_stats()  # after the last step: the largest memory of the run
    extra = dict(st.extra)
    first_h2d = None
    memory.truncate(base)
    if per_answer:
        per_answer()
    step()
    if "h2d_bytes_step" in memory.step_stats().extra:
        first_h2d = memory.step_stats().extra["h2d_bytes_step"]
    prof = gpu_busy(step)  # a steady step (the answer's second)
    memory.truncate(base)
    ms = statistics.median(statistics.mean(r) for r in runs)
    steady = statistics.median(x for r in runs for x in r[1:]) if steps > 1 else ms
    return {"ms_per_token": ms, "tokens_per_s": 1000.0 / ms, "steady_ms_per_token": steady, "steady_tokens_per_s": 1000.0 / steady,
            "first_step_ms": statistics.median(r[0] for r in runs), "captures": graphed.captures if graphed else 0,
            "peak_gpu_bytes": torch.cuda.max_memory_allocated(), "resident_kv_peak_bytes": st.resident_bytes,
            "gpu_busy_ms_per_token": prof["busy_ms"], "launches_per_token": prof["launches"], "gpu_top_kernels": prof["top"],
            "first_step_h2d_bytes": first_h2d,
            "stats": {k: v for k, v in extra.items() if k in ("h2d_bytes_step", "h2d_bytes_total", "zoom_spans_step", "budget_bytes")}}


def scout_answer(mem, seed: int = 0):
    """Scout routing's per-answer ranking, driven: a random ranking (random weights make the real scout pass's
    ranking meaningless too), set as prepare_question() would; the answer's first forward then fills the
    fixed set and the other steps reuse it."""
    g = torch.Generator().manual_seed(seed)

    def per_answer():
        mem.ranking.prio.copy_(torch.randn(mem.res.n_blocks, generator=g))  # a ranking of the zoom blocks
        mem.ranking.version += 1
        mem.ranking.pending = True

    return per_answer


class stage_timers:
    """Wall time per compress stage (sekv_core/sekv/compress.py's calls into the other stage modules), synchronising the
    compute stream around each call; "to host" is what is left of the device->host copies after the last layer."""

    def __enter__(self):
        from sekv_core.sekv import compress as sm

        self.times: dict[str, float] = {}
        self.saved = []
        targets = [(sm, "segment", "segment"), (sm, "weighted_means", "summaries"), (sm.router, "pca_init", "router PCA"),
                   (sm.router, "span_norms", "router norms"), (sm.rope, "undo", "RoPE undo"), (sm.fz, "factorize", "factorize (SVD + pack)"),
                   (sm.fz, "_decompose", "  of which Gram + eigensolver"), (sm, "to_host", "to host")]
        for mod, name, label in targets:
            if not hasattr(mod, name):
                continue
            fn = getattr(mod, name)
            self.saved.append((mod, name, fn))

            def timed(*args, _fn=fn, _label=label, **kw):  # the compute stream only: not the overlapped D2H copies
                torch.cuda.current_stream().synchronize()
                t0 = time.perf_counter()
                r = _fn(*args, **kw)
                torch.cuda.current_stream().synchronize()
                self.times[_label] = self.times.get(_label, 0.0) + time.perf_counter() - t0
                return r

            setattr(mod, name, timed)
        return self.times

    def __exit__(self, *exc):
        for mod, name, fn in self.saved:
            setattr(mod, name, fn)


def force_zoom_rate(rate: float, seed: int = 0):
    """Replace the router's gate logits by random ones whose share above tau is `rate` (see module doc)."""
    from sekv_core.sekv import residents as sekv_method

    torch.manual_seed(seed)  # the default CUDA generator: its draws are replayed fresh by captured CUDA graphs
    real = sekv_method.router.gate_logits

    def gate_logits(query, w, kbar, inv_norm, log_n):
        h, q = query.shape[0], query.shape[1]
        s = kbar.shape[1]
        z = torch.randn(h, q, s, device=query.device)
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
    ap.add_argument("--chunk", type=int, default=0, help="prefill chunk (0: the whole document in one forward, like the plain prefill)")
    ap.add_argument("--pin-arena", action="store_true", help="sekv: page-lock the pack's host memory during the prefill (docs/gpu.md)")
    ap.add_argument("--prefault-arena", action="store_true", help="sekv: allocate the pack's host memory and touch every page during the prefill")
    ap.add_argument("--routing", default="scout", choices=["scout", "per_layer"],
                    help="scout (default, as the product): one random ranking per answer, fixed set; per_layer: random gates every step")
    ap.add_argument("--modes", default="eager,graphs", help="decode modes: eager (per-layer graphs for sekv's part), graphs (whole step captured), "
                    "compiled (whole step captured, decoder layers torch.compile'd: GraphedStep(compile_layers=True))")
    ap.add_argument("--factor-bits", type=int, default=8, choices=[4, 8],
                    help="sekv pack storage of the factors (4: the at-rest codec, decoded to int8 on the CPU at open)")
    ap.add_argument("--no-stage-times", action="store_true",
                    help="time the ingest as the product runs it: without the per-stage timers (each synchronises the stream)")
    ap.add_argument("--scout-pass", action="store_true", help="also time the scout pass (prepare_question) of a 32-token question")
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
    modes = a.modes.split(",")
    if a.routing == "per_layer":
        env["zoom_driver"] = (f"per-layer routing with random gate logits, share {a.zoom_rate} of (query head, span) pairs above tau, "
                              "redrawn every step and layer (no temporal locality: every step refetches its spans); budget cap as in the product")
        force_zoom_rate(a.zoom_rate)
    else:
        env["zoom_driver"] = ("scout routing with a random span ranking per answer (what prepare_question sets); every layer keeps the "
                              "top of it under the budget cap, as in the product; the answer's first step fetches the set, the others reuse it")
    print(json.dumps(env), flush=True)
    for cname in a.configs.split(","):
        model = build(cname, max(contexts) + 2048)
        shape = ModelShape.of(model.config, torch.bfloat16)
        weights = sum(p.numel() * p.element_size() for p in model.parameters())
        for n in contexts:
            row = {"config": cname, "context": n, "budget": a.budget, "zoom_rate": a.zoom_rate, "weights_bytes": weights,
                   "host_arena": "pinned" if a.pin_arena else "prefault" if a.prefault_arena else "none"}
            ids = torch.randint(100, 20000, (1, n), device="cuda")
            try:
                row["plain_prefill_s"] = plain_prefill_s(model, ids)
                runtime.install(model)
                gc.collect()
                torch.cuda.empty_cache()
                # full: prefill into our memory, decode over all of it
                t = time.perf_counter()
                res = prefill(model, ids[0], with_surprisal=False, chunk=a.chunk or n)
                torch.cuda.synchronize()
                row["full_ingest_s"] = time.perf_counter() - t
                mem = FullMemory.empty(shape, "cuda", capacity=n + 64)
                for li in range(shape.n_layers):
                    mem.kv.append(li, res.keys[li][None], res.values[li][None])
                del res
                gc.collect()
                torch.cuda.empty_cache()
                for mode in modes:
                    r = decode_bench(model, mem, a.steps, a.repeats, graphs=mode != "eager", compiled=mode == "compiled")
                    row.update({f"full_{mode}_{k}": v for k, v in r.items()})
                row["full_kv_bytes"] = n * shape.kv_bytes_per_token()
                del mem
                gc.collect()
                torch.cuda.empty_cache()
                # sekv: prefill with surprisal + compress (segment, summarise, factorise on the GPU)
                method = methods.get("sekv")
                params = method.resolve_params({"budget": a.budget, "routing": a.routing, "factor_bits": a.factor_bits})
                torch.cuda.synchronize()
                t = time.perf_counter()
                if a.pin_arena or a.prefault_arena:  # prepare the pack's host memory in the background while the prefill runs
                    method.reserve_host(n, shape, params, pinned=a.pin_arena)
                res = prefill(model, ids[0], with_surprisal=True, chunk=a.chunk or n)
                torch.cuda.synchronize()
                t_pre = time.perf_counter() - t
                t_c = time.perf_counter()
                with (contextlib.nullcontext({}) if a.no_stage_times else stage_timers()) as stages:
                    tensors = method.compress(res, params)
                torch.cuda.synchronize()
                row["sekv_compress_stages_s"] = {k: round(v, 4) for k, v in stages.items()} if stages else "not timed (--no-stage-times)"
                row["sekv_prefill_s"] = t_pre
                row["sekv_compress_s"] = time.perf_counter() - t_c
                row["sekv_ingest_s"] = time.perf_counter() - t
                del res
                gc.collect()
                torch.cuda.empty_cache()
                store = DictStore({k: (v.pin_memory() if v.device.type == "cpu" else v.cpu().pin_memory()) for k, v in tensors.items()})
                del tensors
                t = time.perf_counter()
                mem = method.open(store, params, shape, "cuda")
                if getattr(mem, "batched", False):  # build the host factor blocks now rather than in the first step
                    mem._step()
                torch.cuda.synchronize()
                row["sekv_open_s"] = time.perf_counter() - t
                gc.collect()
                torch.cuda.empty_cache()
                per_answer = scout_answer(mem) if a.routing == "scout" else None
                for mode in modes:
                    r = decode_bench(model, mem, a.steps, a.repeats, graphs=mode != "eager", compiled=mode == "compiled", per_answer=per_answer)
                    row.update({f"sekv_{mode}_{k}": v for k, v in r.items()})
                    print(json.dumps({"config": cname, "context": n, "mode": mode, "full_ms": row.get(f"full_{mode}_steady_ms_per_token"),
                                      "sekv_ms": r["steady_ms_per_token"], "sekv_first_ms": r["first_step_ms"]}), flush=True)
                if a.scout_pass and a.routing == "scout":
                    q = torch.randint(100, 20000, (1, 32), device="cuda")
                    mem.truncate(mem.n_tokens())
                    torch.cuda.synchronize()
                    t = time.perf_counter()
                    mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
                    torch.cuda.synchronize()
                    row["sekv_scout_pass_s"] = time.perf_counter() - t
                st = r["stats"]
                row["sekv_h2d_bytes_per_step"] = st.get("h2d_bytes_step")
                row["sekv_zoom_spans_step"] = st.get("zoom_spans_step")
                row["sekv_budget_bytes"] = st.get("budget_bytes")
                row["sekv_spans"], row["sekv_blocks"] = mem.res.n_spans, mem.res.n_blocks
                dec = getattr(mem, "step", None)
                if dec is not None:
                    row["sekv_batched"] = True
                    row["sekv_uva_fetch"] = dec.uva
                    row["sekv_slots_per_layer"] = dec.U
                    row["sekv_pairs_per_layer"] = dec.P
                    row["sekv_table_bytes"] = dec.table_bytes
                del mem, store
            except torch.cuda.OutOfMemoryError as e:
                row["error"] = f"OOM: {str(e).splitlines()[0]}"
            gc.collect()
            torch.cuda.empty_cache()
            model.config._attn_implementation = "sdpa"
            print(json.dumps(row), flush=True)
            rows.append(row)
            (out_dir / "gpu_scale.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))  # so far
        del model
        gc.collect()
        torch.cuda.empty_cache()
    (out_dir / "gpu_scale.json").write_text(json.dumps({"env": env, "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
