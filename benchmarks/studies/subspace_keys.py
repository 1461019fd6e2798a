"""Do CUDA's factors (subspace iteration) keep what the CPU's (exact eigensolver) keep?  Real span keys and values.

On CUDA, ``linalg._decompose`` takes a span's leading ``rank_max`` components by subspace iteration
(``linalg.top_eigh``) when the head dimension exceeds cuSOLVER's batched eigensolver (d = 64 > 32 for
qwen2.5-0.5b); the CPU solves the d x d eigenproblem exactly.  This study runs both on the CPU
(``linalg.SUBSPACE_ON_CPU``) on the span matrices compress factorises for a real document: the pre-RoPE keys and
the values of every layer, as ``sekv.compress`` hands them to ``factorize_many`` (captured, then decomposed again).
Per path and kind: the energy rule's rank (``params.energy_k`` / ``energy_v``, ``rank_max``), the mean relative error
|x - x_r| / |x| per token row of the rank-r reconstruction (the projection the pack stores, before the codec), and the
captured share of the optimal rank-32 energy.  The reference is float64 ``torch.linalg.svd`` of every span.

    python -m benchmarks.studies.subspace_keys --length 4096 --out docs/bench/subspace-keys-4k-qwen2.5-0.5b.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

from sekv_core import methods, models, prompt
from sekv_core.bench import tasks
from sekv_core.methods import scores as prefill_scores
from sekv_core.prefill import prefill
from sekv_core.sekv import factorize as fz
from sekv_core.sekv import linalg as la


def capture(model: str, length: int, dtype, haystack: str, threads: int) -> tuple[list[tuple[torch.Tensor, torch.Tensor]], torch.Tensor, object]:
    """[(keys [Hkv, T, d], values [Hkv, T, d])] per layer as compress factorises them, the span lengths, the params."""
    torch.set_num_threads(threads)
    lm = models.load(model, device="cpu", dtype=dtype)
    tok = lm.tokenizer
    sekv = methods.get("sekv")
    params = sekv.resolve_params({})
    ctx = tasks.gen_niah(tok, length, 50, 0, tasks.load_haystack(haystack))
    text = prompt.document_prefix(tok, ctx.document)
    ids = prompt.encode(tok, text)
    res = prefill(lm.model, torch.tensor(ids), with_surprisal=True, capture=prefill_scores.capture_kinds(sekv.needs_scores),
                  obs_window=sekv.obs_window(params))
    res.scores.update(prefill_scores.text_scores(tok, text, ids, set(sekv.needs_scores)))
    got, real = [], fz.factorize_many

    def record(xs, span_len, **kw):
        got.append(([x.detach().clone() for x in xs], span_len.clone()))
        return real(xs, span_len, **kw)

    fz.factorize_many = record
    try:
        sekv.compress(res, params)
    finally:
        fz.factorize_many = real
    span_len = got[0][1]
    assert all(torch.equal(s, span_len) for _, s in got), "one layer at a time, every span at once (the CPU's compress)"
    layers = [(xs[0], xs[1]) for xs, _ in got]
    return layers, span_len, params


def reference(x: torch.Tensor, span_len: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 SVD of every span of x [H, T, d]: (sigma [H, S, min(n_max, d)], V [H, S, d, min(n_max, d)])."""
    h, _, d = x.shape
    n = span_len.long()
    first = torch.cumsum(n, 0) - n
    j = torch.arange(int(n.max()))
    valid = j.view(1, -1) < n.view(-1, 1)
    src = torch.where(valid, first.view(-1, 1) + j, 0)
    a = x.double()[:, src] * valid.view(1, *valid.shape, 1)
    _, sig, vt = torch.linalg.svd(a, full_matrices=False)
    return sig, vt.transpose(-2, -1)


def row_error(x: torch.Tensor, span_len: torch.Tensor, v: torch.Tensor, r: torch.Tensor) -> torch.Tensor:
    """Mean over token rows of |x - x V_r V_r^T| / |x|: x [H, T, d], v [H, S, d, R] (orthonormal columns), r [H, S]."""
    sid = torch.repeat_interleave(torch.arange(span_len.numel()), span_len.long())
    keep = (torch.arange(v.shape[-1]).view(1, 1, -1) < r.unsqueeze(-1)).double()  # [H, S, R]
    vr = v.double() * keep.unsqueeze(-2)
    xd = x.double()
    proj = torch.einsum("htd,htdr->htr", xd, vr[:, sid])
    rec = torch.einsum("htr,htdr->htd", proj, vr[:, sid])
    return ((xd - rec).norm(dim=-1) / xd.norm(dim=-1).clamp_min(1e-12)).mean()


def measure(layers, span_len, params, paths: dict) -> dict:
    n = span_len.long()
    out = {}
    for name, setup in paths.items():
        rows = {"k": {"rank": [], "err": [], "energy32": []}, "v": {"rank": [], "err": [], "energy32": []}}
        t = 0.0
        for kx, vx in layers:
            for kind, x, energy in (("k", kx, params.energy_k), ("v", vx, params.energy_v)):
                sig_ref, v_ref = reference(x, span_len)
                if name == "reference":
                    sig, v = sig_ref[..., : params.rank_max], v_ref[..., : params.rank_max]
                else:
                    with setup():
                        t0 = time.perf_counter()
                        _, sig, vt = fz.decompose_spans(x, span_len, params.rank_max, params.svd)
                        t += time.perf_counter() - t0
                    v = vt.transpose(-2, -1)
                h, s, rc = sig.shape
                r = torch.minimum(fz.choose_rank(sig.reshape(h * s, rc), energy, params.rank_max).view(h, s), n.view(1, -1))
                # captured share of the optimal rank-32 energy: |X V|^2 over sum of the top 32 reference sigma^2
                opt = (sig_ref[..., : params.rank_max].double() ** 2).sum(-1)
                cap = torch.zeros_like(opt)
                sid = torch.repeat_interleave(torch.arange(s), n)
                cap.index_add_(1, sid, torch.einsum("htd,htdr->htr", x.double(), v.double()[:, sid]).pow(2).sum(-1))
                rows[kind]["rank"].append(float(r.double().mean()))
                rows[kind]["err"].append(float(row_error(x, span_len, v, r)))
                rows[kind]["energy32"].append(float((cap.sum() / opt.sum())))
        out[name] = {kind: {"rank_mean": round(sum(d["rank"]) / len(d["rank"]), 3), "row_err_mean": round(sum(d["err"]) / len(d["err"]), 4),
                            "energy32_min_layer": round(min(d["energy32"]), 6),
                            "rank_by_layer": [round(x, 2) for x in d["rank"]], "row_err_by_layer": [round(x, 4) for x in d["err"]]}
                     for kind, d in rows.items()}
        out[name]["decompose_s"] = round(t, 2)
        print(f"{name:36s} keys: rank {out[name]['k']['rank_mean']:6.2f} err {out[name]['k']['row_err_mean']:.4f} energy32 min "
              f"{out[name]['k']['energy32_min_layer']:.5f} | values: rank {out[name]['v']['rank_mean']:6.2f} err "
              f"{out[name]['v']['row_err_mean']:.4f} | {t:.1f} s", flush=True)
    return out


class _switch:
    """A path of :func:`measure`: sets linalg's attributes (``SUBSPACE_ON_CPU``, ``SUBSPACE_ITERS``, ``CHOLQR_SHIFT_F32``)
    for its duration;
    ``float32_iters``: top_eigh iterates in float32 that many times (the CUDA path before its iteration was float64)."""

    def __init__(self, float32_iters: int | None = None, **kv):
        self.kv, self.f32 = kv, float32_iters

    def __call__(self):
        return self

    def __enter__(self):
        self.old = {k: getattr(la, k) for k in (*self.kv, "top_eigh")}
        for k, v in self.kv.items():
            setattr(la, k, v)
        if self.f32 is not None:
            real = self.old["top_eigh"]
            la.top_eigh = lambda g, k, iters=4, exact_orth=True, finite=False: tuple(t.double() for t in real(g.float(), k, self.f32, exact_orth))

    def __exit__(self, *exc):
        for k, v in self.old.items():
            setattr(la, k, v)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--length", type=int, default=4096)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--haystack", default="/work/shared/data/haystack/pg_essays")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--cache", default=None, help="a safetensors file keeping the captured span matrices for a later run")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    cache = Path(a.cache) if a.cache else None
    if cache is not None and cache.exists():
        from safetensors.torch import load_file

        t = load_file(str(cache))
        layers = [(t[f"k.{i}"], t[f"v.{i}"]) for i in range(sum(k.startswith("k.") for k in t))]
        span_len = t["span_len"]
        params = methods.get("sekv").resolve_params({})
    else:
        layers, span_len, params = capture(a.model, a.length, getattr(torch, a.dtype), a.haystack, a.threads)
        if cache is not None:
            from safetensors.torch import save_file

            save_file({**{f"k.{i}": k.contiguous() for i, (k, _) in enumerate(layers)}, **{f"v.{i}": v.contiguous() for i, (_, v) in enumerate(layers)},
                       "span_len": span_len.contiguous()}, str(cache))
    torch.set_num_threads(1)
    print(f"{len(layers)} layers, Hkv {layers[0][0].shape[0]}, d {layers[0][0].shape[-1]}, {span_len.numel()} spans of "
          f"{int(span_len.min())}-{int(span_len.max())} rows (mean {span_len.double().mean():.1f})", flush=True)
    paths = {"reference": None, "exact (CPU)": _switch(SUBSPACE_ON_CPU=False),
             "subspace f32, 3 iters (CUDA before)": _switch(3, SUBSPACE_ON_CPU=True),
             "subspace f32, 32 iters": _switch(32, SUBSPACE_ON_CPU=True),
             "subspace f32, 3 iters, no shift": _switch(3, SUBSPACE_ON_CPU=True, CHOLQR_SHIFT_F32=1e-12),
             "subspace f64, 3 iters": _switch(SUBSPACE_ON_CPU=True, SUBSPACE_ITERS=3),
             f"subspace f64, {la.SUBSPACE_ITERS} iters (CUDA)": _switch(SUBSPACE_ON_CPU=True)}
    res = measure(layers, span_len, params, paths)
    if a.out:
        Path(a.out).write_text(json.dumps({"command": "python -m benchmarks.studies.subspace_keys " + " ".join(sys.argv[1:]), "model": a.model,
                                           "dtype": a.dtype, "tokens": int(span_len.sum()), "spans": span_len.numel(),
                                           "energy_k": params.energy_k, "energy_v": params.energy_v, "rank_max": params.rank_max,
                                           "paths": res}, indent=1))


if __name__ == "__main__":
    main()
