"""One token's attention over a long masked memory, by kernel (a study: what sekv's static decode step should call).

sekv's static single-token step makes one SDPA call a layer over the resident buffer and the fixed set's annex under
an additive mask (sekv/fixed_set.py ``_joint_attention``): query [1, H, 1, d], keys / values [1, Hkv, T, d] in the
model dtype, mask [1, H, 1, T].  A masked GQA call has neither the flash nor the memory-efficient kernel on CUDA;
whatever kernel takes it parallelises over heads and query tiles, which for one token is H (or Hkv) thread blocks
streaming T rows each (full KV's static step makes the same masked call over its whole capacity).  Timed here, one call per
layer on its own buffers (no L2 reuse across layers), a CUDA graph of ``--layers`` calls replayed:

- ``sdpa_gqa``: F.scaled_dot_product_attention(enable_gqa=True) under the mask (the step's call now);
- ``packed``: fixed_set.grouped_attention (a group's heads on the query axis, the memory-efficient kernel);
- ``split``: sekv/decode_kernel.py (flash decoding: programs along the keys, then their fold; two Triton kernels);
- ``flash_nomask``: the same call without a mask (a lower bound: what the bytes cost under split-KV flash decoding);
- and the same over ``--full-tokens`` keys under a length mask: full KV's static step (methods/full.py).

Each variant's output is checked against a float32 reference of the masked attention (max abs error).

    python3 -m benchmarks.studies.decode_attention --tokens 8192,16384,24576 --out $OUT/decode_attention.json
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

from sekv_core.sekv import decode_kernel, fixed_set


def _timed_graph(fn, n_layers: int, repeat: int) -> float:
    """ms per layer call: a CUDA graph of n_layers calls of fn(i), replayed ``repeat`` times."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(n_layers):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        for i in range(n_layers):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(repeat):
        g.replay()
    b.record()
    torch.cuda.synchronize()
    return a.elapsed_time(b) / repeat / n_layers


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="8192,16384,24576", help="T: resident rows + annex rows a layer")
    ap.add_argument("--full-tokens", type=int, default=131072)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeat", type=int, default=20)
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    dev, dt = torch.device("cuda"), torch.bfloat16
    h, hkv, d, L = a.heads, a.kv_heads, a.head_dim, a.layers
    scaling = d**-0.5
    gen = torch.Generator(device=dev).manual_seed(0)
    rows = []
    for t in [int(x) for x in a.tokens.split(",")] + [-a.full_tokens]:
        full = t < 0
        t = abs(t)
        ks = [torch.randn(1, hkv, t, d, device=dev, dtype=dt, generator=gen) for _ in range(L)]
        vs = [torch.randn(1, hkv, t, d, device=dev, dtype=dt, generator=gen) for _ in range(L)]
        qs = [torch.randn(1, h, 1, d, device=dev, dtype=dt, generator=gen) for _ in range(L)]
        # the step's mask: a share of the columns hidden (the capacity past the length, other groups' annex rows),
        # the coarse entries with their +log n
        masks = []
        for _ in range(L):
            m = torch.zeros(1, h, 1, t, device=dev)
            m[..., int(0.98 * t) if full else int(0.9 * t):] = float("-inf")
            if not full:
                m[..., : t // 10] += torch.rand(1, h, 1, t // 10, device=dev, generator=gen) * 4
            masks.append(m.to(dt))
        outs = [torch.empty(1, h, 1, d, device=dev, dtype=dt) for _ in range(L)]
        ref = F.scaled_dot_product_attention(qs[0].float(), ks[0].float(), vs[0].float(), attn_mask=masks[0].float(), scale=scaling, enable_gqa=True)
        variants = {
            "sdpa_gqa": lambda i: outs[i].copy_(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], attn_mask=masks[i], scale=scaling, enable_gqa=True)),
            "packed": lambda i: outs[i].copy_(fixed_set.grouped_attention(qs[i], ks[i], vs[i], masks[i], scaling)),
            "split": lambda i: outs[i].copy_(decode_kernel.decode_attention(qs[i], ks[i], vs[i], masks[i], scaling)),
            "flash_nomask": lambda i: outs[i].copy_(F.scaled_dot_product_attention(qs[i], ks[i], vs[i], scale=scaling, enable_gqa=True)),
        }
        if full:  # full KV's static step: the whole capacity under a length mask (methods/full.py)
            variants.pop("packed")
        for name, fn in variants.items():
            try:
                ms = _timed_graph(fn, L, a.repeat)
                fn(0)
                torch.cuda.synchronize()
                err = None if name == "flash_nomask" else float((outs[0].float() - ref).abs().max())
                row = {"tokens": t, "full": full, "variant": name, "ms_per_layer": round(ms, 4), "ms_per_step": round(ms * L, 3),
                       "gb_per_s": round(2 * hkv * t * d * 2 / ms / 1e6, 1), "max_abs_err": err}
            except Exception as e:  # noqa: BLE001 - a study: a variant a device does not take is a row
                row = {"tokens": t, "full": full, "variant": name, "error": f"{type(e).__name__}: {e}"[:300]}
            rows.append(row)
            print(json.dumps(row), flush=True)
        del ks, vs, qs, masks, outs
        torch.cuda.empty_cache()
    if a.out:
        with open(a.out, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
