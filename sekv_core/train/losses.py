"""The router's training losses (SPEC §3).

* ``distill``  -- KL(teacher || student) of the next-token distributions at the
  answer positions (mean over positions).
* ``zoom``     -- positive-weighted BCE of the gate probabilities p against
  y = 1 for the spans in the smallest set holding ``rho`` of the teacher's
  attention mass on spans (per layer, query head, query token).
* ``reconstruction`` -- sum_j (1 - g_j)^2 sigma_j^2 over blocks, keys and
  values: the exact squared Frobenius error of the gated reconstruction
  (orthogonal components).  No gradient reaches the SVD (its triplets are
  constants).  ``relative=True`` divides by sum sigma^2 (the training scale).
* ``budget``   -- expanded spans + beta x retained rank, normalised: the mean
  zoom decision over (layer, head, token, span) plus beta times the mean gate
  over (layer, block, component).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

RHO = 0.9
POS_WEIGHT = 10.0
BETA = 0.1
WEIGHTS = {"distill": 1.0, "zoom": 1.0, "reconstruction": 0.5, "budget": 0.1}


def distill(teacher_logits: torch.Tensor, student_logits: torch.Tensor) -> torch.Tensor:
    """[P, V] each -> mean over P of KL(softmax(teacher) || softmax(student))."""
    lt = torch.log_softmax(teacher_logits.float(), -1)
    ls = torch.log_softmax(student_logits.float(), -1)
    return (lt.exp() * (lt - ls)).sum(-1).mean()


def rho_targets(mass: torch.Tensor, rho: float = RHO) -> torch.Tensor:
    """mass [..., S] >= 0 -> {0,1} [..., S]: the smallest set of spans whose mass reaches rho of the total."""
    total = mass.sum(-1, keepdim=True).clamp_min(1e-30)
    sm, order = torch.sort(mass / total, -1, descending=True)
    before = torch.cumsum(sm, -1) - sm  # mass of the spans ranked ahead
    take = (before < rho).float()
    return torch.zeros_like(mass).scatter(-1, order, take)


def zoom(logits: torch.Tensor, target: torch.Tensor, pos_weight: float = POS_WEIGHT) -> torch.Tensor:
    """Positive-weighted BCE of p = sigmoid(logits) against the targets (computed from logits, stable)."""
    pw = torch.tensor(pos_weight, dtype=torch.float32, device=logits.device)
    return F.binary_cross_entropy_with_logits(logits.float(), target.float(), pos_weight=pw)


def listwise(logits: torch.Tensor, mass: torch.Tensor) -> torch.Tensor:
    """Warm-start ranking loss: KL(teacher span-mass distribution || softmax of the gate logits over spans).

    The gate logit is built to be the log of the attention mass a span would get (sekv/router.py), so
    matching the teacher's span distribution is its natural calibration; it orders spans the way the
    budget cap consumes them.
    """
    t = mass.float() / mass.float().sum(-1, keepdim=True).clamp_min(1e-30)
    ls = torch.log_softmax(logits.float(), -1)
    return (t * (torch.log(t.clamp_min(1e-30)) - ls)).sum(-1).mean()


def top_mass(logits: torch.Tensor, mass: torch.Tensor, k: int = 2) -> tuple[float, float]:
    """(share of the teacher's span mass in the k spans with the highest gate logits, the same for the best k)."""
    t = mass.float() / mass.float().sum(-1, keepdim=True).clamp_min(1e-30)
    k = min(k, t.shape[-1])
    got = t.gather(-1, logits.topk(k, -1).indices).sum(-1).mean()
    best = t.topk(k, -1).values.sum(-1).mean()
    return float(got), float(best)


def reconstruction(sigma: torch.Tensor, gates: torch.Tensor, relative: bool = False) -> torch.Tensor:
    """sigma, gates [..., R] -> sum (1 - g)^2 sigma^2 (over everything), or that / sum sigma^2."""
    s2 = sigma.float() ** 2
    err = ((1 - gates) ** 2 * s2).sum()
    return err / s2.sum().clamp_min(1e-30) if relative else err


def budget(z: list[torch.Tensor], gates: list[torch.Tensor], beta: float = BETA) -> torch.Tensor:
    zm = torch.stack([t.mean() for t in z]).mean() if z else torch.zeros(())
    gm = torch.stack([t.mean() for t in gates]).mean() if gates else torch.zeros(())
    return zm + beta * gm
