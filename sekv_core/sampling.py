"""Choosing the next token: greedy (the default) or temperature / top-p sampling with a seed.

One rule, used by ``generate``: with ``temperature == 0`` the next token is the argmax of the logits
(exactly the greedy path); otherwise the logits are divided by the temperature, the smallest set of
most likely tokens whose probability reaches ``top_p`` is kept (the nucleus; the most likely token is
always kept), and one token is drawn from it with a CPU ``torch.Generator`` seeded with ``seed``, so
the same seed gives the same tokens on any device.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass, replace

import torch

from .errors import SekvError


@dataclass(frozen=True)
class Sampling:
    temperature: float = 0.0  # 0: greedy
    top_p: float = 1.0
    seed: int | None = None  # None: a fresh random seed per answer (``resolved`` draws it)

    def __post_init__(self) -> None:
        if not self.temperature >= 0.0:  # also catches NaN
            raise SekvError(f"--temperature must be >= 0 (0 is greedy), got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise SekvError(f"--top-p must be in (0, 1], got {self.top_p}")
        if self.seed is not None and self.seed < 0:
            raise SekvError(f"--seed must be >= 0, got {self.seed}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    def resolved(self) -> "Sampling":
        """The same settings with a concrete seed (drawn now when none was given), so an answer can be reproduced."""
        if self.greedy or self.seed is not None:
            return self
        return replace(self, seed=secrets.randbits(63))


GREEDY = Sampling()


class Sampler:
    """Callable logits [vocab] -> token id; one per answer (its generator state advances with every token)."""

    def __init__(self, sampling: Sampling):
        self.s = sampling.resolved()
        self.gen = None
        if not self.s.greedy:
            self.gen = torch.Generator(device="cpu")
            self.gen.manual_seed(self.s.seed)

    def __call__(self, logits: torch.Tensor) -> int:
        logits = logits.reshape(-1)
        if self.gen is None:
            return int(logits.argmax().item())
        return int(draw(logits.float().cpu(), self.s.temperature, self.s.top_p, self.gen))


def nucleus(probs: torch.Tensor, top_p: float) -> torch.Tensor:
    """Boolean mask of the smallest most-likely set whose probability reaches top_p (ties: lower id first)."""
    order = torch.sort(probs, descending=True, stable=True).indices
    sorted_p = probs[order]
    before = torch.cumsum(sorted_p, 0) - sorted_p  # mass of the more likely tokens
    keep_sorted = before < top_p
    keep_sorted[0] = True
    mask = torch.zeros_like(probs, dtype=torch.bool)
    mask[order[keep_sorted]] = True
    return mask


def draw(logits: torch.Tensor, temperature: float, top_p: float, gen: torch.Generator) -> int:
    scaled = logits / temperature
    if not torch.isfinite(scaled).all():  # a temperature so small that it overflows: its limit, greedy
        return int(logits.argmax().item())
    probs = torch.softmax(scaled, dim=-1)
    if top_p < 1.0:
        probs = torch.where(nucleus(probs, top_p), probs, torch.zeros_like(probs))
    return int(torch.multinomial(probs, 1, generator=gen).item())
