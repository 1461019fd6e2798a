"""Teacher and student attention memories for training the router (SPEC §3).

Both plug into the same attention hook as the product (sekv_core/runtime.py):
the frozen model runs the query tokens of one training sample over a document
memory.

* ``TeacherMemory`` -- full KV: exact attention over every document token.  It
  records, per layer, the attention mass each span receives from each (query
  head, query token) (the zoom target) and the share of mass beyond the local
  window (for mining query positions).
* ``StudentMemory`` -- the SeKV mixed-resolution attention in a differentiable,
  dense form: every span is present twice, as its coarse entry weighted
  (1 - z) n_i and as its rank-gated reconstruction weighted z, with
  z = hard + soft - stop_grad(soft) the straight-through zoom decision
  (hard = 1[p > tau], soft = sigmoid((p - tau) / T)).  At z = 0 or 1 this is
  exactly the product's attention (sekv/attention.py: coarse entry with
  + log n_i, or the span's reconstructed tokens); the budget cap is not applied
  in training (the budget loss stands for it).

``compress_context`` computes, once per training context and without gradient,
what both need: the segmentation, the coarse means, and every span's leading
singular triplets of pre-RoPE keys and of values (float32, rank R).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..methods.base import PrefillResult
from ..sekv import factorize as fz
from ..sekv import rope
from ..sekv.summarize import span_weights, weighted_means


@dataclass
class LayerData:
    kbar: torch.Tensor  # [Hkv, S, d] float32 (post-RoPE space, like the pack's coarse keys)
    vbar: torch.Tensor
    us_k: torch.Tensor  # [Hkv, S, n_max, R] pre-RoPE keys' U*sigma
    sig_k: torch.Tensor  # [Hkv, S, R]
    vt_k: torch.Tensor  # [Hkv, S, R, d]
    us_v: torch.Tensor
    sig_v: torch.Tensor
    vt_v: torch.Tensor


@dataclass
class CompressedContext:
    n_tokens: int
    keys: list[torch.Tensor]  # per layer [Hkv, N, d] post-RoPE (model dtype)
    values: list[torch.Tensor]
    full_idx: torch.Tensor  # [F]
    span_start: torch.Tensor  # [S]
    span_len: torch.Tensor  # [S]
    pos: torch.Tensor  # [T] compressed token positions, span order
    sid: torch.Tensor  # [T]
    row_valid: torch.Tensor  # [S, n_max] bool
    cos: torch.Tensor | None  # [S, n_max, d] RoPE of each span row (pre-RoPE keys), or None
    sin: torch.Tensor | None
    window: int
    layers: list[LayerData] = field(default_factory=list)

    @property
    def n_spans(self) -> int:
        return int(self.span_len.numel())


def compress_context(prefill: PrefillResult, seg, *, weighting: str = "surprisal", rank: int = 32, pre_rope: bool = True) -> CompressedContext:
    shape = prefill.shape
    pos, sid = seg.span_tokens()
    S = seg.n_spans
    n = seg.span_len.long()
    n_max = int(n.max()) if S else 0
    w = span_weights(prefill.surprisal, pos, sid, S, weighting)
    inv = rope.inv_freq_of(shape)
    pre = pre_rope and inv is not None
    j = torch.arange(n_max)
    row_valid = j.view(1, -1) < n.view(-1, 1)
    cos = sin = None
    if pre:
        rows = seg.span_start.view(-1, 1) + j.view(1, -1)
        cos, sin = rope.cos_sin(rows.flatten(), inv, shape.rope_attention_scaling, dtype=prefill.keys[0].dtype)
        cos, sin = cos.view(S, n_max, -1), sin.view(S, n_max, -1)
        cpos, spos = rope.cos_sin(pos, inv, shape.rope_attention_scaling, dtype=prefill.keys[0].dtype)
    ctx = CompressedContext(
        prefill.n_tokens, prefill.keys, prefill.values, seg.full_idx, seg.span_start, n, pos, sid, row_valid, cos, sin, 0
    )
    dev = prefill.keys[0].device
    pos_d, sid_d, w_d = pos.to(dev), sid.to(dev), w.to(dev)
    if pre:
        cpos, spos = cpos.to(dev), spos.to(dev)
    with torch.no_grad(), fz.single_thread():
        for li in range(shape.n_layers):
            k, v = prefill.keys[li].float(), prefill.values[li].float()
            kx = k[:, pos_d]
            if pre:
                kx = rope.undo(kx, cpos, spos)
            us_k, sig_k, vt_k = fz.decompose_spans(kx, n, rank)
            us_v, sig_v, vt_v = fz.decompose_spans(v[:, pos_d], n, rank)
            kbar, vbar = (weighted_means(x, pos_d, sid_d, w_d, S).to(dev) for x in (k, v))
            ctx.layers.append(LayerData(kbar, vbar, us_k, sig_k, vt_k, us_v, sig_v, vt_v))
    return ctx


def _causal_tail(scores_tail: torch.Tensor, m: int) -> torch.Tensor:
    """Mask future tokens among the m new query tokens: scores [..., G*m, m] laid out (head-in-group, token)."""
    t = torch.arange(m, device=scores_tail.device)
    ok = (t.view(1, -1) <= t.view(-1, 1)).repeat(scores_tail.shape[-2] // m, 1)
    return scores_tail.masked_fill(~ok, float("-inf"))


def span_mass(probs_doc: torch.Tensor, ctx: CompressedContext) -> torch.Tensor:
    """probs over document tokens [..., N] -> attention mass per span [..., S]."""
    pm = probs_doc[..., ctx.pos.to(probs_doc.device)]
    out = probs_doc.new_zeros(*probs_doc.shape[:-1], ctx.n_spans)
    return out.index_add_(-1, ctx.sid.to(probs_doc.device), pm)


class TeacherMemory:
    """Full-KV attention; records span mass [L] x [H, m, S] and far-back mass."""

    def __init__(self, ctx: CompressedContext, far_window: int = 512, keep_queries: bool = False):
        self.ctx, self.far_window, self.keep_queries = ctx, far_window, keep_queries
        self.mass: dict[int, torch.Tensor] = {}
        self.far: dict[int, float] = {}
        self.queries: dict[int, torch.Tensor] = {}  # [H, m, d] float16, with keep_queries (warm start)

    def attend(self, layer, query, key, value, scaling):
        ctx = self.ctx
        q = query[0].float()
        h, m, d = q.shape
        hkv = key.shape[1]
        g = h // hkv
        kd, vd = ctx.keys[layer].to(q.device).float(), ctx.values[layer].to(q.device).float()
        k = torch.cat([kd, key[0].float()], 1)
        v = torch.cat([vd, value[0].float()], 1)
        qg = q.reshape(hkv, g * m, d)
        s = torch.bmm(qg, k.transpose(1, 2)) * scaling
        n = ctx.n_tokens
        s = torch.cat([s[..., :n], _causal_tail(s[..., n:], m)], -1)
        p = torch.softmax(s, -1)
        out = torch.bmm(p, v).view(h, m, d)
        pd = p[..., :n].reshape(h, m, n)
        self.mass[layer] = span_mass(pd, ctx)
        self.far[layer] = float(pd[..., : max(0, n - self.far_window)].sum(-1).mean())
        if self.keep_queries:
            self.queries[layer] = q.to(torch.float16)
        return out.unsqueeze(0).to(query.dtype)


@dataclass
class StepRecord:
    """What the student's forward leaves for the losses, per layer."""

    logits: list[torch.Tensor] = field(default_factory=list)  # [H, m, S] gate logits (p = sigmoid)
    z: list[torch.Tensor] = field(default_factory=list)  # [H, m, S] straight-through zoom decisions
    g: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (K gates, V gates) [Hkv, S, R]


def capped(prio: torch.Tensor, cost: torch.Tensor, n_kv: int, cap: float) -> torch.Tensor:
    """Per query token, the product's budget cap (sekv/attention.py select): (group, span) pairs in decreasing
    priority (max over the group's heads) while the summed cost fits.  prio [H, m, S] -> allowed [H, m, S] bool."""
    h, m, s = prio.shape
    gp = prio.detach().view(n_kv, h // n_kv, m, s).amax(1).permute(1, 0, 2).reshape(m, n_kv * s)  # [m, Hkv*S]
    order = torch.argsort(gp, dim=-1, descending=True, stable=True)
    c = cost.float().repeat(n_kv)[order]
    ok = (torch.cumsum(c, -1) <= cap) & (gp.gather(-1, order) > float("-inf"))
    ok = torch.cumprod(ok.to(torch.int8), -1).bool()
    keep = torch.zeros_like(ok).scatter(-1, order, ok).view(m, n_kv, s).permute(1, 0, 2)  # [Hkv, m, S]
    return keep.repeat_interleave(h // n_kv, 0)


class StudentMemory:
    """Differentiable SeKV attention (see module doc)."""

    def __init__(self, ctx: CompressedContext, params, temperature: float = 0.1, budget: float | None = 0.10):
        self.ctx, self.params, self.temperature, self.budget = ctx, params, temperature, budget
        self.rec = StepRecord()
        self.log_n = ctx.span_len.float().log()

    def cap_tokens(self, m: int) -> float | None:
        """Reconstructed-token cap per layer, summed over KV groups (the product's accounting, in tokens x groups):
        budget x full KV minus the persistent entries (full-resolution tokens, coarse entries, new tokens)."""
        if self.budget is None:
            return None
        ctx = self.ctx
        hkv = ctx.keys[0].shape[0]
        return max(0.0, self.budget * (ctx.n_tokens + m) * hkv - (ctx.full_idx.numel() + ctx.n_spans + m) * hkv)

    def attend(self, layer, query, key, value, scaling):
        ctx, P = self.ctx, self.params
        L = P.w.shape[0]
        q = query[0].float()
        h, m, d = q.shape
        hkv = key.shape[1]
        g = h // hkv
        dev = q.device
        lay = ctx.layers[layer]
        S = ctx.n_spans
        log_n = self.log_n.to(dev)
        full = ctx.full_idx.to(dev)
        kf = ctx.keys[layer].to(dev)[:, full].float()
        vf = ctx.values[layer].to(dev)[:, full].float()
        kn, vn = key[0].float(), value[0].float()
        qg = q.reshape(hkv, g * m, d)
        parts_s = [torch.bmm(qg, kf.transpose(1, 2)) * scaling]
        parts_v = [vf]
        weights = [None]
        if S:
            logits = P.gate_logits(layer, q, lay.kbar.to(dev), log_n)  # [H, m, S]
            p = torch.sigmoid(logits)
            tau = P.tau(layer).view(h, 1, 1)
            cand = p > tau
            hard = cand.float()
            cap = self.cap_tokens(m)
            if cap is not None:
                hard = (cand & capped(torch.where(cand, logits, float("-inf")), ctx.span_len.to(dev), hkv, cap)).float()
            soft = torch.sigmoid((p - tau) / self.temperature)
            z = hard + soft - soft.detach()
            depth = layer / max(L - 1, 1)
            gk = P.gate(lay.sig_k.to(dev), lay.kbar.to(dev), ctx.span_len, False, depth)
            gv = P.gate(lay.sig_v.to(dev), lay.vbar.to(dev), ctx.span_len, True, depth)
            gk_ste = (gk > 0.5).float() + gk - gk.detach()
            gv_ste = (gv > 0.5).float() + gv - gv.detach()
            r = gk.shape[-1]
            kh = torch.einsum("gsnr,gsrd->gsnd", lay.us_k.to(dev)[..., :r] * gk_ste.unsqueeze(2), lay.vt_k.to(dev)[:, :, :r])
            vh = torch.einsum("gsnr,gsrd->gsnd", lay.us_v.to(dev)[..., :r] * gv_ste.unsqueeze(2), lay.vt_v.to(dev)[:, :, :r])
            if ctx.cos is not None:
                kh = rope.apply(kh, ctx.cos.to(dev), ctx.sin.to(dev))
            n_max = kh.shape[2]
            kh, vh = kh.reshape(hkv, S * n_max, d), vh.reshape(hkv, S * n_max, d)
            zg = z.reshape(hkv, g * m, S)
            parts_s.append(torch.bmm(qg, lay.kbar.to(dev).transpose(1, 2)) * scaling)
            parts_v.append(lay.vbar.to(dev))
            weights.append((1 - zg) * ctx.span_len.to(dev).float().view(1, 1, S))
            parts_s.append(torch.bmm(qg, kh.transpose(1, 2)) * scaling)
            parts_v.append(vh)
            valid = ctx.row_valid.to(dev).reshape(1, 1, S * n_max).float()
            weights.append(zg.repeat_interleave(n_max, -1) * valid)
            self.rec.logits.append(logits)
            self.rec.z.append(z)
            self.rec.g.append((gk, gv))
        parts_s.append(_causal_tail(torch.bmm(qg, kn.transpose(1, 2)) * scaling, m))
        parts_v.append(vn)
        weights.append(None)
        # stabiliser: the largest logit among entries with nonzero weight (a zero-weight entry may dwarf the rest)
        live = [s_ if w_ is None else torch.where(w_ > 0, s_, float("-inf")) for s_, w_ in zip(parts_s, weights)]
        mx = torch.stack([x.detach().amax(-1) for x in live], -1).amax(-1, keepdim=True)
        num = 0
        den = 0
        for s_, v_, w_ in zip(parts_s, parts_v, weights):
            # a zero-weight entry may sit far above the stabiliser: cap its exponent so e * 0 stays 0 (not inf * 0)
            e = torch.exp((s_ - mx).clamp(max=20.0))
            if w_ is not None:
                e = e * w_
            num = num + torch.bmm(e, v_)
            den = den + e.sum(-1, keepdim=True)
        out = (num / den).view(h, m, d)
        return out.unsqueeze(0).to(query.dtype)


class RouterParams(torch.nn.Module):
    """The trainable router: W [L, H, d_r, d], tau logits [L, H], rank gate G."""

    def __init__(self, w: torch.Tensor, tau: torch.Tensor, gate):
        super().__init__()
        self.w = torch.nn.Parameter(w.float().clone())
        t = tau.double().clamp(1e-6, 1 - 1e-6)
        self.tau_logit = torch.nn.Parameter(torch.log(t / (1 - t)).float())
        self.gate = gate

    def tau(self, layer: int) -> torch.Tensor:
        return torch.sigmoid(self.tau_logit[layer])

    def gate_logits(self, layer: int, q: torch.Tensor, kbar: torch.Tensor, log_n: torch.Tensor) -> torch.Tensor:
        """q [H, m, d], kbar [Hkv, S, d] -> [H, m, S]: <W q, normalize(W kbar)> / sqrt(d_r) + log n (sekv/router.py)."""
        w = self.w[layer]  # [H, d_r, d]
        h, d_r = w.shape[0], w.shape[1]
        kb = kbar.repeat_interleave(h // kbar.shape[0], 0)  # [H, S, d]
        a = torch.einsum("hrd,hmd->hmr", w, q)
        b = torch.einsum("hrd,hsd->hsr", w, kb)
        b = b / b.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        return torch.einsum("hmr,hsr->hms", a, b) / math.sqrt(d_r) + log_n.view(1, 1, -1)
