"""DepthWeave-KV fused Triton kernel versus the PyTorch path, on a CUDA machine (random data, no model weights).

Run from the repository root (torch with CUDA + triton needed; nothing is downloaded):

    python -m benchmarks.studies.depthweave_gpu_check            # all checks, ~1-2 minutes on an H200
    python -m benchmarks.studies.depthweave_gpu_check --quick    # correctness only, smaller shapes

1. Correctness: for several shapes (Qwen2.5-0.5B-like, Llama-3-8B-like, odd sizes, no
   residual, no RoPE, all levels / only level 0) random DepthWeave codes are attended by
   ``kernel_triton.doc_attention`` and by the PyTorch path (``attention.doc_partials``);
   the normalised outputs and log-sum-exps must agree (ieee: 2e-4 relative, 1e-2 where cos/sin are
   rounded to bfloat16 - see CASES; tf32 and fp16 operands: 3e-2).  The default precision of a
   head size (marked *: tf32 for head_dim 64, fp16 for 128) must compile; another one running out of
   shared memory is reported as n/a.
2. Kernel timing: one layer's decode attention over the compressed document - fused
   kernel (tf32 and ieee), PyTorch path, and SDPA over the full bf16 KV of the same length.
3. Decode speed: a random-weight Qwen2 (0.5B shape, bf16) decoding 32 tokens through
   sekv's runtime over a 16K-token DepthWeave memory with the fused kernel on and off, and
   over the full KV (``full`` method) - tokens/s from sekv_core.generate.

Prints one line per check and a summary; exits 1 on any mismatch, 2 if CUDA/triton is missing.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

import torch
import torch.nn.functional as F


def fail_env(msg: str) -> None:
    print(f"SKIP-ENV: {msg}")
    sys.exit(2)


if not torch.cuda.is_available():
    fail_env("no CUDA device")
try:
    import triton  # noqa: F401

    from sekv_core.depthweave import kernel_triton as kt
except Exception as e:  # pragma: no cover
    fail_env(f"triton / the fused kernel cannot be imported: {e!r}")

from sekv_core.depthweave import attention as at
from sekv_core.depthweave import codec
from sekv_core.depthweave import quantize as qz

DEV = torch.device("cuda")
LEVEL_GROUPS = torch.tensor([0, 1, 2, 4])


def orthonormal(hkv: int, rows: int, d: int, g: torch.Generator) -> torch.Tensor:
    q, _ = torch.linalg.qr(torch.randn(hkv, d, d, generator=g, dtype=torch.float64))
    return q.transpose(1, 2)[:, :rows].float()


def random_codes(hkv: int, n: int, d: int, rank: int, unit: int, levels: torch.Tensor, g: torch.Generator, basis: torch.Tensor,
                 resbasis: torch.Tensor) -> at.ZCodes:
    """Random 8-bit coefficients (PCA-like decaying scales) and a 4-bit residual pool for the given levels."""
    block = max(b for b in range(1, min(16, rank) + 1) if rank % b == 0)
    a = torch.randn(hkv, n, rank, generator=g) * torch.logspace(0, -1, rank).view(1, 1, -1) * 2.0
    coef, cscale = qz.quantize_blocks(a, block)
    group = 2 * unit
    channels = 8 * unit
    ng = LEVEL_GROUPS[levels.long()]
    c = torch.randn(hkv, n, max(channels, group), generator=g) * 0.3
    res, rscale = qz.quantize_groups4(c[..., :channels], group) if channels else (torch.zeros(hkv, n, 0, dtype=torch.uint8), torch.zeros(hkv, n, 0, dtype=torch.float16))
    keep = torch.arange(4).view(1, 1, -1) < ng.unsqueeze(-1)
    pool = res.view(hkv, n, 4, -1)[keep] if channels else torch.zeros(0, 1, dtype=torch.uint8)
    pscale = rscale[keep] if channels else torch.zeros(0, dtype=torch.float16)
    return at.ZCodes(basis.to(DEV), resbasis[:, :channels].contiguous().to(DEV), coef.to(DEV), cscale.to(DEV), pool.to(DEV),
                     pscale.to(DEV), group if channels else 0, rank)


def make_case(hkv, G, d, n, rank_k, rank_v, seed=0, rope=True, level_mode="mixed", dtype=torch.bfloat16):
    g = torch.Generator().manual_seed(seed)
    uk, uv = (d - rank_k) // 8, (d - rank_v) // 8
    if level_mode == "mixed":
        levels = torch.randint(0, 4, (hkv, n), generator=g).to(torch.uint8)
    else:
        levels = torch.full((hkv, n), {"top": 3, "zero": 0}[level_mode], dtype=torch.uint8)
    ng, boff, _ = codec.group_offsets(levels, LEVEL_GROUPS)
    bk = orthonormal(hkv, d, d, g)
    bv = orthonormal(hkv, d, d, g)
    zk = random_codes(hkv, n, d, rank_k, uk, levels, g, bk[:, :rank_k].contiguous(), bk[:, rank_k:].contiguous())
    zv = random_codes(hkv, n, d, rank_v, uv, levels, g, bv[:, :rank_v].contiguous(), bv[:, rank_v:].contiguous())
    inv = 1.0 / (1e6 ** (torch.arange(0, d, 2).float() / d))
    rot = at.Rotary(inv.to(DEV), 1.0, dtype, 4) if rope else None
    q = torch.randn(hkv, G, d, generator=g) * (0.6 / math.sqrt(d))
    return q.to(DEV), zk, zv, ng.to(DEV), boff.to(DEV), rot


def torch_path(q, zk, zv, ng, boff, rot, chunk=4096):
    parts, _, _ = at.doc_partials(q, zk, zv, ng, 4, rot, chunk)
    return at.merge(parts)


def fused(q, zk, zv, ng, boff, rot, precision):
    o, m, l = kt.doc_attention(q, zk, zv, ng, boff, 4, rot, precision=precision)
    return o / l.unsqueeze(-1), m + torch.log(l)


def timed(fn, iters=20, warmup=3) -> float:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / iters


F32, BF16 = torch.float32, torch.bfloat16
CASES = [
    # name, Hkv, G, d, N, rank_k, rank_v, rope (None | dtype cos/sin are rounded to), levels
    # float32 cos/sin: the two paths must agree to float32 rounding.  bfloat16 cos/sin (what sekv uses for a
    # bf16 model, as the model does): torch.cos and the kernel's cos may round to neighbouring bf16 values
    # for a few positions, a 2^-8 relative difference in those entries - hence a looser ieee tolerance there.
    ("qwen0.5b-4K", 2, 7, 64, 4096, 16, 32, F32, "mixed"),
    ("qwen0.5b-4K-bf16rope", 2, 7, 64, 4096, 16, 32, BF16, "mixed"),
    ("qwen0.5b-32K", 2, 7, 64, 32768, 16, 32, F32, "mixed"),
    ("llama8b-32K", 8, 4, 128, 32768, 32, 64, F32, "mixed"),
    ("llama8b-64K-top-bf16", 8, 4, 128, 65536, 32, 64, BF16, "top"),
    ("odd-1000", 1, 3, 64, 1000, 8, 24, F32, "mixed"),
    ("no-rope-zero", 2, 7, 64, 3000, 16, 16, None, "zero"),
    ("rank=d (no residual)", 2, 4, 64, 2048, 64, 64, F32, "mixed"),
]


def check_kernel(quick: bool) -> bool:
    ok = True
    print("== 1-2. fused kernel vs PyTorch path (max abs error of the normalised output / of the log-sum-exp) and timing per layer call")
    for name, hkv, G, d, n, rk, rv, rope, lv in CASES:
        if quick and n > 8192:
            continue
        try:
            q, zk, zv, ng, boff, rot = make_case(hkv, G, d, n, rk, rv, rope=rope is not None, level_mode=lv, dtype=rope or F32)
            ref_o, ref_lse = torch_path(q, zk, zv, ng, boff, rot)
            scale = float(ref_o.abs().max())
            line = [f"{name:22s}"]
            default = "tf32" if d <= 64 else "fp16"
            times = {}
            for prec, tol in (("ieee", 2e-4 if rope is not BF16 else 1e-2), ("tf32", 3e-2), ("fp16", 3e-2)):
                try:
                    o, lse = fused(q, zk, zv, ng, boff, rot, prec)
                except triton.runtime.errors.OutOfResources as e:  # only acceptable for a non-default precision
                    good = prec != default
                    ok &= good
                    line.append(f"{prec}: {'n/a' if good else 'FAIL'} (out of {getattr(e, 'name', 'resources')})")
                    continue
                eo = float((o - ref_o).abs().max()) / max(scale, 1e-12)
                el = float((lse - ref_lse).abs().max())
                good = eo <= tol and el <= tol * 10 and bool(torch.isfinite(o).all())
                ok &= good
                line.append(f"{prec}{'*' if prec == default else ''}: out {eo:.2e} lse {el:.2e} {'ok' if good else 'MISMATCH'}")
                if not quick:
                    times[prec] = timed(lambda: fused(q, zk, zv, ng, boff, rot, prec))
            if not quick:
                t_t = timed(lambda: torch_path(q, zk, zv, ng, boff, rot), iters=5)
                kf = torch.randn(1, hkv, n, d, device=DEV, dtype=torch.bfloat16)
                qf = torch.randn(1, hkv * G, 1, d, device=DEV, dtype=torch.bfloat16)
                t_s = timed(lambda: F.scaled_dot_product_attention(qf, kf, kf, enable_gqa=True))
                comp = sum(qz.nbytes(z.coef, z.coef_scale, z.pool, z.pool_scale) for z in (zk, zv)) + qz.nbytes(ng, boff)
                full = 2 * hkv * n * d * 2
                fused_ms = " ".join(f"fused-{k} {v:.3f}" for k, v in times.items())
                line.append(f"| ms: {fused_ms} torch {t_t:.3f} full-SDPA {t_s:.3f} "
                            f"| bytes {comp / 1e6:.1f} MB vs full {full / 1e6:.1f} MB ({full / comp:.1f}x)")
            print("  " + "  ".join(line), flush=True)
        except Exception:
            ok = False
            print(f"  {name}: ERROR")
            traceback.print_exc()
    return ok


def decode_speed(n_doc: int = 16384, new_tokens: int = 32, budget: float = 0.3) -> bool:
    """Random-weight Qwen2-0.5B-shaped model: sekv generate() over depthweave (fused on/off) and full memories."""
    print(f"== 3. decode speed, random-weight Qwen2 0.5B shape (bf16), {n_doc}-token document, {new_tokens} new tokens")
    try:
        try:
            import psutil  # noqa: F401  (sekv_core.generate reports the RSS with it)
        except ImportError:
            import types

            shim = types.ModuleType("psutil")
            shim.Process = lambda *a, **k: types.SimpleNamespace(memory_info=lambda: types.SimpleNamespace(rss=0))
            sys.modules["psutil"] = shim
        from transformers import Qwen2Config, Qwen2ForCausalLM

        from sekv_core import runtime
        from sekv_core.generate import generate
        from sekv_core.methods import get
        from sekv_core.methods.base import GrowingKV, ModelShape, PrefillResult
        from sekv_core.methods.full import FullMemory
        from sekv_core.sekv import rope

        cfg = Qwen2Config(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                          vocab_size=32000, max_position_embeddings=32768, tie_word_embeddings=True)
        torch.manual_seed(0)
        with torch.device(DEV):
            model = Qwen2ForCausalLM(cfg).to(torch.bfloat16).eval()
        runtime.install(model)
        shape = ModelShape.of(cfg, torch.bfloat16)
        g = torch.Generator(device=DEV).manual_seed(1)
        if shape.rope_inv_freq is None:
            raise RuntimeError("the random model's RoPE is not static")
        inv = torch.tensor(shape.rope_inv_freq)
        cos, sin = rope.cos_sin(torch.arange(n_doc, device=DEV), inv, 1.0, torch.bfloat16)
        keys, values = [], []
        for _ in range(cfg.num_hidden_layers):
            mix = torch.randn(2, 64, 64, device=DEV, generator=g) * torch.logspace(0, -2, 64, device=DEV).view(1, 64, 1)
            keys.append(rope.apply(torch.randn(2, n_doc, 64, device=DEV, generator=g) @ mix, cos, sin).to(torch.bfloat16))
            values.append((torch.randn(2, n_doc, 64, device=DEV, generator=g) @ mix).to(torch.bfloat16))
        pre = PrefillResult(torch.zeros(n_doc, dtype=torch.long), keys, values, None, shape)
        method = get("depthweave")
        params = method.resolve_params({"budget": budget})
        t = time.perf_counter()
        store = method.compress(pre, params)
        t_c = time.perf_counter() - t

        class Store(dict):
            def get(self, k):
                return self[k]

        store = Store(store)
        q_ids = list(range(100, 130))
        results = {}
        for label, mk in (
            ("full", lambda: FullMemory(GrowingKV.from_tensors(keys, values, DEV, extra=128), shape)),
            ("depthweave fused", lambda: method.open(store, {**params, "fused": "on"}, shape, DEV)),
            ("depthweave torch", lambda: method.open(store, {**params, "fused": "off"}, shape, DEV)),
        ):
            mem = mk()
            mem.truncate(n_doc)
            generate(model, mem, q_ids, max_new_tokens=3, stop_ids=set())  # warm-up (compiles the kernel)
            mem.truncate(n_doc)
            ids, stats = generate(model, mem, q_ids, max_new_tokens=new_tokens, stop_ids=set())
            results[label] = (ids, stats)
            frac = stats.resident_kv_bytes_peak / max(stats.full_kv_bytes, 1)
            print(f"  {label:18s} {stats.tokens_per_s:7.1f} tok/s  ttft {stats.ttft_s * 1e3:7.1f} ms  "
                  f"resident KV {stats.resident_kv_bytes_peak / 2**20:7.1f} MiB ({frac:.3f} of full)", flush=True)
        same = results["depthweave fused"][0] == results["depthweave torch"][0]
        agree = sum(a == b for a, b in zip(results["depthweave fused"][0], results["depthweave torch"][0]))
        print(f"  compress {t_c:.1f} s; fused vs torch greedy tokens identical: {same} ({agree}/{new_tokens} positions agree; "
              f"tf32 rounding may flip near-ties of a random model)")
        return True
    except Exception:
        print("  decode-speed check: ERROR")
        traceback.print_exc()
        return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    print(f"torch {torch.__version__}, triton {triton.__version__}, {torch.cuda.get_device_name()}")
    t = time.perf_counter()
    ok = check_kernel(args.quick)
    if not args.quick:
        ok &= decode_speed()
    print(f"{'PASS' if ok else 'FAIL'} in {time.perf_counter() - t:.0f} s")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
