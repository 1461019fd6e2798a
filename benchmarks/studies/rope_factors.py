"""Pre- vs post-RoPE key factorisation, rank rules and 8-bit factors, on a real model.

Prefills ~4K tokens of a Paul Graham essay (shared/data/haystack/pg_essays) with
the chat-template prompt sekv uses, appends a question, records the question's
post-RoPE queries, segments the document with the sekv defaults and measures,
for the compressed spans only (anchors / sinks / window are exact):

* relative Frobenius error ||X - X^|| / ||X|| of keys (pre- and post-RoPE
  factorisation, compared in post-RoPE space) and values, at equal rank;
* the relative attention-output error ||o - o^|| / ||o|| of the question's
  queries over the document when every span is replaced by its reconstruction
  (keys and values at the rank shown), averaged over layers and heads;
* the energy rule: mean kept rank, factor bytes / raw fp16 bytes, errors;
* int8 factors versus float16; Gram-eigh versus torch.linalg.svd timing.

Usage:
    python -m benchmarks.studies.rope_factors [--model qwen2.5-0.5b] [--tokens 4096] [--cache /tmp/sekv_bench]
"""

from __future__ import annotations

import argparse
import math
import time
from pathlib import Path

import torch

from sekv_core import models, prompt, runtime
from sekv_core.methods.base import GrowingKV, ModelShape
from sekv_core.methods.full import FullMemory
from sekv_core.prefill import prefill
from sekv_core.sekv import rope
from sekv_core.sekv.params import SekvParams
from sekv_core.sekv.factorize import factorize, reconstruct_all, single_thread
from sekv_core.sekv.segment import auto_lengths, segment

ESSAYS = Path(__file__).resolve().parents[2] / "shared" / "data" / "haystack" / "pg_essays"
if not ESSAYS.is_dir():
    ESSAYS = Path("/work/shared/data/haystack/pg_essays")
DEFAULTS = SekvParams.defaults()
QUESTION = "What did the author work on before college, and what did he think of it?"


class Recorder(FullMemory):
    """A full memory that keeps the queries of the forwards it serves."""

    def __init__(self, kv, shape):
        super().__init__(kv, shape)
        self.queries: dict[int, torch.Tensor] = {}

    def attend(self, layer, query, key, value, scaling):
        self.queries[layer] = query[0].float().clone()  # [H, q, d]
        return super().attend(layer, query, key, value, scaling)


def load_case(model_name: str, n_tokens: int, cache: Path | None):
    path = cache / f"{model_name}_{n_tokens}.pt" if cache else None
    if path and path.exists():
        case = torch.load(path)
        case["shape"] = _shape_from(case["shape"])
        return case
    lm = models.load(model_name)
    text = (ESSAYS / "worked.txt").read_text()
    doc_ids = prompt.encode(lm.tokenizer, prompt.document_prefix(lm.tokenizer, text))[:n_tokens]
    q_ids = prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, QUESTION))
    t = time.perf_counter()
    res = prefill(lm.model, torch.tensor(doc_ids), with_surprisal=True)
    t_prefill = time.perf_counter() - t
    rec = Recorder(GrowingKV.from_tensors(res.keys, res.values, "cpu", extra=len(q_ids)), res.shape)
    runtime.forward_hidden(lm.model, torch.tensor([q_ids]), len(doc_ids), rec)
    case = {
        "keys": [k.clone() for k in res.keys],
        "values": [v.clone() for v in res.values],
        "surprisal": res.surprisal,
        "queries": [rec.queries[i] for i in range(res.shape.n_layers)],
        "shape": _shape_to(res.shape),
        "prefill_s": t_prefill,
    }
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(case, path)
    case["shape"] = res.shape
    return case


def _shape_to(shape: ModelShape) -> dict:
    d = dict(shape.__dict__)
    d["dtype"] = str(shape.dtype).removeprefix("torch.")
    d["rope_inv_freq"] = list(shape.rope_inv_freq) if shape.rope_inv_freq else None
    return d


def _shape_from(d: dict) -> ModelShape:
    d = dict(d, dtype=getattr(torch, d["dtype"]))
    if d.get("rope_inv_freq") is not None:
        d["rope_inv_freq"] = tuple(d["rope_inv_freq"])
    return ModelShape(**d)


def attn(q, k, v, scaling):
    """q [H, Q, d], k/v [Hkv, T, d] -> [H, Q, d] (GQA, no mask: the queries come after every key)."""
    g = q.shape[0] // k.shape[0]
    k = k.repeat_interleave(g, 0)
    v = v.repeat_interleave(g, 0)
    return torch.softmax((q @ k.transpose(1, 2)) * scaling, -1) @ v


def run(case, *, budget=0.10, ranks=(4, 8, 16, 32), energies=(0.8, 0.9, 0.95, 0.98, 0.99, 0.995), layers=None):
    shape: ModelShape = case["shape"]
    d = shape.head_dim
    s = case["surprisal"]
    n = s.numel()
    mn, mx, w = auto_lengths(n, budget)
    seg = segment(s, min_span=mn, max_span=mx, window=w)
    pos, _ = seg.span_tokens()
    span_len = seg.span_len
    inv = rope.inv_freq_of(shape)
    cos, sin = rope.cos_sin(pos, inv, shape.rope_attention_scaling, dtype=case["keys"][0].dtype)
    layers = layers if layers is not None else range(shape.n_layers)
    print(f"N={n}  spans={seg.n_spans}  compressed tokens={pos.numel()}  mean span={span_len.float().mean():.1f}  layers={len(layers)}")

    def recon(x, energy, rank_max, int8=False):
        f = factorize(x, span_len, energy=energy, rank_max=rank_max, int8=int8)
        raw = x.shape[0] * x.shape[1] * d * 2
        return reconstruct_all(f, span_len, d), f.rank.float().mean().item(), f.nbytes() / raw

    def measure(cfg):
        """cfg(layer, kpost, kpre, v) -> (k_hat_post, v_hat, stats) ; returns mean errors."""
        ek, ev, eo, rk, rv, bk, bv = [], [], [], [], [], [], []
        for li in layers:
            kpost = case["keys"][li].float()
            vall = case["values"][li].float()
            kp, vp = kpost[:, pos], vall[:, pos]
            kpre = rope.undo(kp, cos, sin)
            khat, vhat, st = cfg(kp, kpre, vp)
            ek.append(((khat - kp).norm() / kp.norm()).item())
            ev.append(((vhat - vp).norm() / vp.norm()).item())
            k2, v2 = kpost.clone(), vall.clone()
            k2[:, pos], v2[:, pos] = khat, vhat
            q = case["queries"][li]
            o = attn(q, kpost, vall, d**-0.5)
            o2 = attn(q, k2, v2, d**-0.5)
            eo.append(((o2 - o).norm(dim=-1) / o.norm(dim=-1)).mean().item())
            rk.append(st[0]), rv.append(st[1]), bk.append(st[2]), bv.append(st[3])
        m = lambda x: sum(x) / len(x)  # noqa: E731
        return m(ek), m(ev), m(eo), m(rk), m(rv), m(bk), m(bv)

    print("\n### Equal rank: pre- vs post-RoPE key factors (values at the same rank)\n")
    print(f"(for scale: every span as its coarse entry only, no zoom: attn-out err {coarse_error(case, seg, layers):.4f})\n")
    print("| rank | key err post-RoPE | key err pre-RoPE | value err | attn-out err (post K) | attn-out err (pre K) |")
    print("|---|---|---|---|---|---|")
    for r in ranks:
        def post(kp, kpre, vp, r=r):
            kh, a, b = recon(kp, 1.0, r)
            vh, c, e = recon(vp, 1.0, r)
            return kh, vh, (a, c, b, e)

        def pre(kp, kpre, vp, r=r):
            kh, a, b = recon(kpre, 1.0, r)
            vh, c, e = recon(vp, 1.0, r)
            return rope.apply(kh, cos, sin), vh, (a, c, b, e)

        a = measure(post)
        b = measure(pre)
        print(f"| {r} | {a[0]:.4f} | {b[0]:.4f} | {a[1]:.4f} | {a[2]:.4f} | {b[2]:.4f} |")

    print("\n### Energy rule (pre-RoPE keys, rank <= 32)\n")
    print("| energy K / V | mean rank K | mean rank V | bytes K / raw | bytes V / raw | key err | value err | attn-out err |")
    print("|---|---|---|---|---|---|---|---|")
    for ek_ in energies:
        for ev_ in sorted({ek_, 0.9, 0.95, 0.99}):
            if ev_ > ek_:
                continue

            def rule(kp, kpre, vp, ek_=ek_, ev_=ev_):
                kh, a, b = recon(kpre, ek_, 32)
                vh, c, e = recon(vp, ev_, 32)
                return rope.apply(kh, cos, sin), vh, (a, c, b, e)

            r = measure(rule)
            print(f"| {ek_} / {ev_} | {r[3]:.1f} | {r[4]:.1f} | {r[5]:.3f} | {r[6]:.3f} | {r[0]:.4f} | {r[1]:.4f} | {r[2]:.4f} |")

    ek_d, ev_d = DEFAULTS["energy_k"], DEFAULTS["energy_v"]
    print(f"\n### 8-bit factors (pre-RoPE keys, energy {ek_d} / {ev_d}: the defaults)\n")
    print("| factors | bytes K / raw | bytes V / raw | key err | value err | attn-out err |")
    print("|---|---|---|---|---|---|")
    for int8 in (False, True):

        def q8(kp, kpre, vp, int8=int8):
            kh, a, b = recon(kpre, ek_d, 32, int8)
            vh, c, e = recon(vp, ev_d, 32, int8)
            return rope.apply(kh, cos, sin), vh, (a, c, b, e)

        r = measure(q8)
        print(f"| {'int8' if int8 else 'fp16'} | {r[5]:.3f} | {r[6]:.3f} | {r[0]:.4f} | {r[1]:.4f} | {r[2]:.4f} |")

    print(f"\n### Factorisation time, all layers, K and V (energy {ek_d} / {ev_d}, one thread)\n")
    for method in ("gram", "svd"):
        t = time.perf_counter()
        for li in range(shape.n_layers):
            kp = case["keys"][li].float()[:, pos]
            with single_thread():
                factorize(rope.undo(kp, cos, sin), span_len, energy=ek_d, method=method)
                factorize(case["values"][li].float()[:, pos], span_len, energy=ev_d, method=method)
        print(f"- {method}: {time.perf_counter() - t:.2f} s")


def coarse_error(case, seg, layers) -> float:
    """Attention-output error when every span is its weighted-mean entry (+ log n_i), as without any zoom."""
    from sekv_core.sekv.summarize import span_weights, weighted_means

    pos, sid = seg.span_tokens()
    S = seg.n_spans
    w = span_weights(case["surprisal"], pos, sid, S)
    d = case["shape"].head_dim
    errs = []
    for li in layers:
        k, v = case["keys"][li].float(), case["values"][li].float()
        q = case["queries"][li]
        kb, vb = weighted_means(k, pos, sid, w, S), weighted_means(v, pos, sid, w, S)
        kk = torch.cat([k[:, seg.full_idx], kb], 1)
        vv = torch.cat([v[:, seg.full_idx], vb], 1)
        g = q.shape[0] // k.shape[0]
        bias = torch.cat([torch.zeros(seg.full_idx.numel()), seg.span_len.float().log()])
        p = torch.softmax((q @ kk.repeat_interleave(g, 0).transpose(1, 2)) * d**-0.5 + bias, -1)
        o2 = p @ vv.repeat_interleave(g, 0)
        o = attn(q, k, v, d**-0.5)
        errs.append(((o2 - o).norm(dim=-1) / o.norm(dim=-1)).mean().item())
    return sum(errs) / len(errs)


def calibrate(case, *, budget=0.10, rho=0.9):
    """The untrained router against the SPEC's zoom target, and the single threshold that fits it best.

    Teacher: full attention of the question's queries over the document.  Target y = 1
    for the smallest set of spans holding rho of the mass the spans receive (per layer,
    head and query token).  Reports, over all (layer, head, token, span): the gate-logit
    threshold with the best F1, its precision / recall / expansion rate, and how much
    of the spans' teacher mass the top-k spans by gate logit hold versus the oracle top-k
    (k = spans that fit the expansion budget of one KV group).
    """
    from sekv_core.sekv import router
    from sekv_core.sekv.summarize import span_weights, weighted_means

    shape = case["shape"]
    d = shape.head_dim
    s = case["surprisal"]
    n = s.numel()
    mn, mx, w = auto_lengths(n, budget)
    seg = segment(s, min_span=mn, max_span=mx, window=w)
    pos, sid = seg.span_tokens()
    S = seg.n_spans
    wts = span_weights(s, pos, sid, S)
    log_n = seg.span_len.float().log()
    persistent = seg.full_idx.numel() + S
    k_fit = max(1, int((budget * n - persistent) * shape.n_kv_heads / seg.span_len.float().mean() / shape.n_kv_heads))
    all_z, all_y, cap_router, cap_oracle = [], [], [], []
    for li in range(shape.n_layers):
        k, v = case["keys"][li].float(), case["values"][li].float()
        q = case["queries"][li]  # [H, Q, d]
        g = q.shape[0] // k.shape[0]
        a = torch.softmax(q @ k.repeat_interleave(g, 0).transpose(1, 2) * d**-0.5, -1)  # [H, Q, N]
        mass = torch.zeros(*a.shape[:2], S).index_add_(2, sid, a[..., pos])  # [H, Q, S]
        srt, order = mass.sort(-1, descending=True)
        cum = srt.cumsum(-1) / srt.sum(-1, keepdim=True).clamp_min(1e-12)
        in_set = torch.cat([torch.ones_like(cum[..., :1], dtype=torch.bool), cum[..., :-1] < rho], -1)
        y = torch.zeros_like(in_set).scatter(-1, order, in_set)
        kbar = weighted_means(k, pos, sid, wts, S)
        W = router.pca_init(k, router.D_R, kbar)
        inv_norm = 1.0 / (router.span_norms(W, kbar).clamp_min(1e-6) * router.D_R**0.5)
        z = router.gate_logits(q, W, kbar, inv_norm, log_n)  # [H, Q, S]
        all_z.append(z.flatten()), all_y.append(y.flatten())
        top = z.topk(min(k_fit, S), -1).indices
        tot = mass.sum(-1).clamp_min(1e-12)
        cap_router.append((mass.gather(-1, top).sum(-1) / tot).mean().item())
        cap_oracle.append((srt[..., : min(k_fit, S)].sum(-1) / tot).mean().item())
    z, y = torch.cat(all_z), torch.cat(all_y)
    best = None
    for th in torch.linspace(float(z.quantile(0.01)), float(z.quantile(0.99)), 200).tolist():
        pred = z > th
        tp = (pred & y).sum().item()
        prec = tp / max(pred.sum().item(), 1)
        rec = tp / max(y.sum().item(), 1)
        f1 = 2 * prec * rec / max(prec + rec, 1e-12)
        if best is None or f1 > best[0]:
            best = (f1, th, prec, rec, pred.float().mean().item())
    print("\n### Untrained router vs the teacher's zoom target (rho = 0.9)\n")
    print(f"- spans {S}, target share {y.float().mean():.3f}; gate logit quantiles 10/50/90%: "
          f"{z.quantile(0.1):.2f} / {z.quantile(0.5):.2f} / {z.quantile(0.9):.2f}")
    print(f"- best-F1 threshold: logit {best[1]:.2f} (tau = {1 / (1 + math.exp(-best[1])):.3f}): F1 {best[0]:.3f}, "
          f"precision {best[2]:.3f}, recall {best[3]:.3f}, expansion rate {best[4]:.3f}")
    for th in (-4.0, -2.0, 0.0, 2.0, 4.0):
        pred = z > th
        tp = (pred & y).sum().item()
        print(f"- logit {th:+.0f}: precision {tp / max(pred.sum().item(), 1):.3f}, recall {tp / max(y.sum().item(), 1):.3f}, "
              f"expansion rate {pred.float().mean().item():.3f}")
    print(f"- teacher span mass held by the top-{k_fit} spans: router {sum(cap_router) / len(cap_router):.3f}, "
          f"oracle {sum(cap_oracle) / len(cap_oracle):.3f}, random {min(k_fit, S) / S:.3f}")


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--budget", type=float, default=0.10)
    ap.add_argument("--cache", type=Path, default=Path("/tmp/sekv_bench"))
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    case = load_case(args.model, args.tokens, args.cache)
    print(f"## {args.model}, {args.tokens} tokens (prefill {case['prefill_s']:.1f} s)\n")
    run(case, budget=args.budget)
    calibrate(case, budget=args.budget)


if __name__ == "__main__":
    main()
