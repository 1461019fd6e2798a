"""Token-conditional depth router (DepthWeave-KV eq. 2): residual rank levels from cache metadata.

Features per (depth window m, KV head h, document token t), all cheap and computed from
what the one prefill recorded (sekv_core.methods.scores) or online:

* ``mass``   - accumulated attention mass relative to uniform: the attention token t
  received, summed over the window's layers and the KV head's query group, divided by
  what uniform causal attention would give it (sum_{s>=t} 1/(s+1) per query row); log.
  At ask time the question's (and the probes') attention is mixed in (``online_mass``).
* ``spike``  - maximum attention spike: max over the observation-window queries (the last
  document tokens), the window's layers and the group's heads of p_{s,t} * (s+1) (the
  probability relative to uniform); log.
* ``delim``  - delimiter / instruction-boundary indicator from the token text: line
  breaks, sentence punctuation, ``:``/``;``, brackets and chat-template markup.
* ``energy`` - residual energy: ||c_{l,t}||^2 (keys + values, the window's layers)
  relative to its mean over tokens; log.  Not in the paper's list: the loss a token
  suffers at rank 0, the one signal about reconstruction difficulty the router would
  otherwise lack.  Documented in docs/depthweave.md.
* ``probe``  - the relative attention-output error of the last probe of (m, h) (0 before
  any probe).

score = u . phi (a hand-set linear router: the paper's u is learned with a frozen teacher,
we have no training; the weights are parameters).  With z = score - tau_m the level is
levels[#{k in 0,1,2 : z > k * spacing}] (levels 0/2/4/8: z <= 0 gives rank 0).  tau is
a global offset chosen by bisection so the resident bytes meet the budget, plus a
per-window offset the probes move (probe.py).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

import torch

FEATURES = ("mass", "spike", "delim", "energy", "probe")
_DELIM = re.compile(r"[\n.!?;:()\[\]{}<>|]|^\s*[-*#]")
_EPS = 1e-3


def delimiter_flags(token_text: list[str] | None, n: int) -> torch.Tensor:
    """[n] float32: 1 for delimiter / instruction-boundary tokens (0 everywhere without token text)."""
    out = torch.zeros(n)
    if token_text:
        flags = [1.0 if _DELIM.search(t or "") else 0.0 for t in token_text[:n]]
        out[: len(flags)] = torch.tensor(flags)
    return out


def uniform_mass(n: int) -> torch.Tensor:
    """[n]: the attention token t receives from queries t..n-1 under uniform causal attention."""
    inv = 1.0 / torch.arange(1, n + 1, dtype=torch.float64)
    return torch.flip(torch.cumsum(torch.flip(inv, [0]), 0), [0]).float()


def mass_feature(attn_mass: list[torch.Tensor] | None, layers: range, hkv: int, n: int) -> torch.Tensor:
    """Relative accumulated attention [Hkv, n] of a window (1 = uniform; ones without statistics)."""
    if not attn_mass:
        return torch.ones(hkv, n)
    acc = sum(attn_mass[i].float() for i in layers)  # [H, n]
    g = acc.shape[0] // hkv
    acc = acc.view(hkv, g, -1).mean(1) / len(layers)
    return acc[:, :n] / uniform_mass(n)


def spike_feature(obs_queries: list[torch.Tensor] | None, keys: list[torch.Tensor], layers: range, scaling: float, n: int) -> torch.Tensor:
    """Max relative attention [Hkv, n] of the observation-window queries (ones without statistics)."""
    hkv = keys[0].shape[0]
    if not obs_queries:
        return torch.ones(hkv, n)
    out = torch.zeros(hkv, n)
    for i in layers:
        q = obs_queries[i].float()  # [H, w, d] positions n-w..n-1
        h, w, d = q.shape
        k = keys[i].float().to(q.device)
        s = torch.einsum("kgwd,knd->kgwn", q.view(hkv, h // hkv, w, d), k) * scaling
        pos = torch.arange(n - w, n)
        s.masked_fill_(torch.arange(n)[None, :] > pos[:, None], float("-inf"))
        p = s.softmax(-1) * (pos + 1).float().view(1, 1, w, 1)
        out = torch.maximum(out, p.amax(dim=(1, 2)).cpu())
    return out


@dataclass
class RouterWeights:
    mass: float = 2.0
    spike: float = 0.5
    delim: float = 1.0
    energy: float = 1.0
    probe: float = 4.0

    @classmethod
    def parse(cls, text: str) -> "RouterWeights":
        """'mass=1,spike=0.5,...' (missing names keep their defaults)."""
        w = cls()
        for part in filter(None, (p.strip() for p in str(text).split(","))):
            name, _, val = part.partition("=")
            if name.strip() not in FEATURES:
                raise ValueError(f"unknown router feature {name!r}; known: {', '.join(FEATURES)}")
            setattr(w, name.strip(), float(val))
        return w


def score(feat: dict[str, torch.Tensor], u: RouterWeights, online_mass: torch.Tensor | None = None,
          online_weight: float = 0.0, probe_err: torch.Tensor | None = None) -> torch.Tensor:
    """Router score [M, Hkv, N] from stored features (+ online mass and probe error)."""
    mass = feat["mass"].float()
    if online_mass is not None and online_weight > 0:
        mass = (1 - online_weight) * mass + online_weight * online_mass
    s = u.mass * torch.log(mass + _EPS) + u.spike * torch.log(feat["spike"].float() + _EPS)
    s = s + u.delim * feat["delim"].float().view(1, 1, -1) + u.energy * torch.log(feat["energy"].float() + _EPS)
    if probe_err is not None:
        s = s + u.probe * probe_err.view(*probe_err.shape, 1)
    return s


def levels(score: torch.Tensor, tau: torch.Tensor, spacing: float, n_levels: int) -> torch.Tensor:
    """Level index [M, Hkv, N] uint8 in 0..n_levels-1 for thresholds tau [M] (+ k * spacing)."""
    z = score - tau.view(-1, *([1] * (score.dim() - 1)))
    idx = torch.zeros_like(z, dtype=torch.uint8)
    for k in range(n_levels - 1):
        idx += (z > k * spacing).to(torch.uint8)
    return idx


def usage(score: torch.Tensor, tau: torch.Tensor, spacing: float, level_cost: torch.Tensor) -> float:
    """Residual bytes of a routing: level_cost [M, n_levels] bytes per (token, head) of window m."""
    idx = levels(score, tau, spacing, level_cost.shape[1]).long()
    return float(level_cost.gather(1, idx.flatten(1)).sum())


def solve_offset(score: torch.Tensor, delta: torch.Tensor, spacing: float, level_cost: torch.Tensor, allowance: float,
                 iters: int = 60) -> float:
    """Smallest global offset tau_g with usage(tau_g + delta) <= allowance (bisection; usage falls with tau)."""
    lo = float(score.min() - delta.max()) - 3 * spacing - 1.0
    hi = float(score.max() - delta.min()) + 1.0
    if usage(score, lo + delta, spacing, level_cost) <= allowance:
        return lo
    for _ in range(iters):
        mid = 0.5 * (lo + hi)
        if usage(score, mid + delta, spacing, level_cost) <= allowance:
            hi = mid
        else:
            lo = mid
    return hi


def logit(p: float) -> float:
    p = min(max(p, 1e-6), 1 - 1e-6)
    return math.log(p / (1 - p))
