"""Online attention-output probes (DepthWeave-KV eq. 3) and the threshold controller they drive.

Every ``every`` decode steps a few (layer, KV head) pairs - one per depth window, the
layer and head rotating from probe to probe - attend twice with the step's own query:
once over the resident (routed) cache and once over a temporarily materialised
higher-fidelity cache of the same head (every token at the top residual level, from the
pack's CPU tier).  The error is

    e_{m,h} = || Attn(q, K^, V^) - Attn(q, K*, V*) || / (|| Attn(q, K*, V*) || + eps)

(the relative L2 error; the extracted eq. 3 is ambiguous between this and its square).
Per window: e > tolerance lowers the window's threshold offset by ``step`` (more tokens
get residual rank); ``quiet`` consecutive probes below tolerance raise it by ``step``.
The global offset is then re-solved so that the resident bytes stay within the budget:
quiet windows hand residual bytes to noisy ones.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


def relative_error(out: torch.Tensor, ref: torch.Tensor, eps: float = 1e-6) -> float:
    """||out - ref|| / (||ref|| + eps), averaged over leading rows: [..., d] -> float."""
    num = (out.float() - ref.float()).norm(dim=-1)
    den = ref.float().norm(dim=-1) + eps
    return float((num / den).mean())


@dataclass
class ProbeController:
    n_windows: int
    tolerance: float = 0.05
    step: float = 0.5
    quiet: int = 3
    delta: torch.Tensor = field(init=False)  # [M] threshold offsets (score units)
    quiet_count: torch.Tensor = field(init=False)  # [M]
    last_error: torch.Tensor = field(init=False)  # [M, Hkv] filled by record()
    moves: torch.Tensor = field(init=False)  # [M] net threshold change made by probes (score units)
    n_probes: int = 0

    def __post_init__(self):
        self.reset()

    def reset(self, n_kv_heads: int = 1) -> None:
        self.delta = torch.zeros(self.n_windows)
        self.quiet_count = torch.zeros(self.n_windows, dtype=torch.long)
        self.last_error = torch.zeros(self.n_windows, max(1, n_kv_heads))
        self.moves = torch.zeros(self.n_windows)
        self.n_probes = 0

    def record(self, window: int, head: int, error: float) -> bool:
        """Feed one probe's error; returns True when the window's threshold moved."""
        self.n_probes += 1
        self.last_error[window, head] = error
        if error > self.tolerance:
            self.delta[window] -= self.step
            self.moves[window] -= self.step
            self.quiet_count[window] = 0
            return True
        self.quiet_count[window] += 1
        if self.quiet_count[window] >= self.quiet:
            self.quiet_count[window] = 0
            self.delta[window] += self.step
            self.moves[window] += self.step
            return True
        return False
