"""The rank gate G (SPEC §3): which singular components of a span to keep.

One small MLP shared by every layer, KV head and span.  Its input for one
(layer, KV head, span, K-or-V) block is query-independent:

* the singular spectrum sigma_1..R divided by sigma_1 (its shape), log(1 + sigma_1) (its scale);
* the span summary: the block's mean key (or value) over its norm, and log n_i;
* whether the block holds keys or values, and the layer's depth l / (L - 1).

It outputs one gate g_j in (0, 1) per component.  In training the gates scale
the components (reconstruction sum_j g_j u_j sigma_j v_j^T; straight-through:
forward hard g_j > 1/2, backward the sigmoid).  Because the input does not
depend on the query, the decision is taken once, at ingest: the components with
g_j > 1/2 are the ones the pack stores (sekv/factorize.py ``keep``), so a
trained gate also sets the pack size.
"""

from __future__ import annotations

import torch
from torch import nn

HIDDEN = 64
#: initial gate bias: sigmoid(3) = 0.95, every component kept until training says otherwise
BIAS_INIT = 3.0


class RankGate(nn.Module):
    def __init__(self, rank: int, head_dim: int, hidden: int = HIDDEN):
        super().__init__()
        self.rank, self.head_dim = rank, head_dim
        self.net = nn.Sequential(nn.Linear(rank + head_dim + 4, hidden), nn.GELU(), nn.Linear(hidden, rank))
        with torch.no_grad():
            self.net[2].weight.mul_(0.1)
            self.net[2].bias.fill_(BIAS_INIT)

    def features(self, sigma: torch.Tensor, summary: torch.Tensor, span_len: torch.Tensor, is_value: bool, depth: float) -> torch.Tensor:
        """sigma [..., S, R], summary [..., S, d], span_len [S] -> [..., S, R + d + 4]."""
        s1 = sigma[..., :1].clamp_min(1e-6)
        shape = sigma / s1
        if shape.shape[-1] < self.rank:  # spans shorter than R in every block: pad the spectrum with zeros
            shape = torch.nn.functional.pad(shape, (0, self.rank - shape.shape[-1]))
        unit = summary / summary.norm(dim=-1, keepdim=True).clamp_min(1e-6)
        extra = torch.stack(
            torch.broadcast_tensors(
                torch.log1p(s1.squeeze(-1)),
                span_len.float().log().to(sigma.device),
                torch.full_like(s1.squeeze(-1), float(is_value)),
                torch.full_like(s1.squeeze(-1), float(depth)),
            ),
            -1,
        )
        return torch.cat([shape, unit.float(), extra], -1)

    def forward(self, sigma, summary, span_len, is_value: bool, depth: float) -> torch.Tensor:
        """Gate probabilities [..., S, r] for the r = sigma.shape[-1] components.

        Components past the gate's own rank R (a pack asking for rank_max > R) get probability 1: G has
        no opinion on them and the energy rule decides alone."""
        r = sigma.shape[-1]
        head = sigma[..., : self.rank].float()
        g = torch.sigmoid(self.net(self.features(head, summary, span_len, is_value, depth)))[..., : min(r, self.rank)]
        if r > self.rank:
            g = torch.cat([g, g.new_ones(*g.shape[:-1], r - self.rank)], -1)
        return g

    def keep(self, summary: torch.Tensor, span_len: torch.Tensor, is_value: bool, depth: float):
        """The ingest-time decision as factorize's ``keep`` callable: sigma [Hkv, S, r] -> bool [Hkv, S, r]."""

        def decide(sigma: torch.Tensor) -> torch.Tensor:
            gate = self.to(sigma.device)
            with torch.no_grad():
                return gate(sigma, summary.to(sigma.device), span_len, is_value, depth) > 0.5

        return decide


def depth_of(layer: int, n_layers: int) -> float:
    return layer / max(n_layers - 1, 1)


def n_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())

