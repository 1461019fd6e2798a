"""The zoom-in router (SPEC §2.1-2.3), untrained initialisation.

Gate of span i for query head h of layer l:

    p_hi = sigmoid( <W q, normalize(W k-_i)> / sqrt(d_r) + log n_i ),   expand iff p_hi > tau_lh

Since normalize(W k-_i) = W k-_i / ||W k-_i||, the score equals
<W^T W q, k-_i> / ||W k-_i||: the memory keeps one norm per (span, W) beside
the mean key k-_i it holds anyway, never the d_r-dimensional summaries.

Untrained W (``pca_init``): per layer and KV head, the top-d_r principal
directions of that head's prefill keys (uncentred second moment, so the common
key direction, which carries most of q . k, is kept), shared by the query
heads of the group -- W is then stored once per KV head (``Hw = Hkv``) and so
are the norms.  The rows are scaled by c = sqrt(d_r / d_h) * median_i ||P k-_i||
so that the gate logit is on the scale of the coarse entry's attention logit
q . k-_i / sqrt(d_h) + log n_i, the log of the (unnormalised) attention mass the
span would receive.  A trained router may use one W per query head
(``Hw = H``); everything here takes either.

Gates are compared in logit space (p > tau  <=>  logit > log(tau / (1 - tau))):
the sigmoid saturates in float32 long before the ordering of large logits stops
mattering for the budget cap.

``load`` is the one place that decides where W and tau come from: the pack's
untrained router, the trained router the pack was ingested with, or a router
file given at ask time (sekv/router_file.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

D_R = 32
#: untrained default threshold (docs/design.md, router): logit(tau) = -2
TAU_DEFAULT = 1.0 / (1.0 + math.exp(2.0))


@dataclass
class Router:
    w: torch.Tensor  # [L, Hw, d_r, d] float32
    tau: torch.Tensor  # [L, H] float32, probability thresholds
    source: str = "pack"

    @property
    def d_r(self) -> int:
        return int(self.w.shape[-2])

    def logit_tau(self) -> torch.Tensor:
        t = self.tau.double().clamp(1e-12, 1 - 1e-12)
        return torch.log(t / (1 - t)).float()


def pca_init(keys: torch.Tensor, d_r: int = D_R, kbar: torch.Tensor | None = None) -> torch.Tensor:
    """keys [Hkv, N, d] (post-RoPE) -> W [Hkv, d_r, d]: top principal directions, scaled (see module doc)."""
    ref = kbar if kbar is not None and kbar.shape[1] > 0 else keys
    return pca_from_moment(second_moment(keys), keys.shape[1], d_r, ref)


def second_moment(keys: torch.Tensor) -> torch.Tensor:
    """sum_t k_t k_t^T per KV head: keys [Hkv, N, d] -> [Hkv, d, d] float64 (summable over a document's windows)."""
    k = keys.float()
    return (k.transpose(1, 2) @ k).double()


def pca_from_moment(moment: torch.Tensor, n: int, d_r: int, ref: torch.Tensor) -> torch.Tensor:
    """W [Hkv, d_r, d] from the keys' summed second moment [Hkv, d, d] over n keys; ref [Hkv, S, d]: the span
    means (or the keys) whose median projection sets the scale."""
    return pca_scaled(pca_directions(moment, n, d_r), ref)


def pca_directions(moment: torch.Tensor, n: int, d_r: int) -> torch.Tensor:
    """The top-d_r eigenvectors of the keys' summed second moments [..., d, d] over n keys, as orthonormal rows
    [..., d_r, d] (zero rows past d): every leading index decomposed in one batch (merge passes all layers')."""
    lead, d = moment.shape[:-2], moment.shape[-1]
    m = moment.reshape(-1, d, d) / max(n, 1)
    r = min(d_r, d)
    if m.is_cuda and r < d:  # cuSOLVER loops a d x d eigh over the batch; the leading r by subspace iteration
        from .linalg import top_eigh

        w = top_eigh(m, r, exact_orth=n < d)[1].transpose(1, 2).float()  # n >= d tokens: full rank, Cholesky QR
    else:
        evals, evecs = torch.linalg.eigh(m)
        w = evecs.flip(-1)[..., :r].transpose(1, 2).float()  # [B, r, d], orthonormal rows
    if r < d_r:
        w = torch.cat([w, w.new_zeros(w.shape[0], d_r - r, d)], 1)
    return w.reshape(*lead, d_r, d)


def pca_scaled(w: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    """Directions w [Hkv, d_r, d] scaled by c = sqrt(d_r / d) * the median over ref's rows [Hkv, S, d] of ||w k||."""
    d_r, d = w.shape[-2], w.shape[-1]
    proj = (ref.float() @ w.transpose(-1, -2)).norm(dim=-1)  # [Hkv, S]
    c = math.sqrt(d_r / d) * proj.median(dim=-1).values.clamp_min(1e-6)
    return w * c.view(*c.shape, 1, 1)


def span_norms(w: torch.Tensor, kbar: torch.Tensor) -> torch.Tensor:
    """||W k-_i|| per (W index, span): w [Hw, d_r, d], kbar [Hkv, S, d] -> [Hw, S]."""
    hw, hkv = w.shape[0], kbar.shape[0]
    kb = kbar.float()
    if hw != hkv:  # one W per query head: each sees its group's mean keys
        kb = kb.repeat_interleave(hw // hkv, 0)
    return (kb @ w.float().transpose(1, 2)).norm(dim=-1)


def gate_logits(query: torch.Tensor, w: torch.Tensor, kbar: torch.Tensor, inv_norm: torch.Tensor, log_n: torch.Tensor) -> torch.Tensor:
    """Gate logits [H, q, S] of every (query head, query token, span).

    query [H, q, d] (post-RoPE); w [Hw, d_r, d]; kbar [Hkv, S, d];
    inv_norm [Hw, S] = 1 / (||W k-_i|| sqrt(d_r)); log_n [S].  Three batched products.
    """
    h, q, d = query.shape
    hw, hkv, s = w.shape[0], kbar.shape[0], kbar.shape[1]
    wf = w.float()
    qf = query.float().reshape(hw, (h // hw) * q, d)
    u = torch.bmm(torch.bmm(qf, wf.transpose(1, 2)), wf)  # W^T W q  [Hw, Gw*q, d]
    dots = torch.bmm(u.reshape(hkv, (h // hkv) * q, d), kbar.float().transpose(1, 2)).view(h, q, s)
    scale = inv_norm.float().unsqueeze(1).expand(hw, h // hw, s).reshape(h, 1, s)
    return torch.addcmul(log_n.view(1, 1, s), dots, scale)


def load(store, params, shape) -> Router:
    """W and tau for a memory (the one place that decides; see docs/router-training.md).

    ``params.router``: ``"untrained"`` -> the pack's PCA-initialised router; a router file whose sha256
    differs from the one the pack was ingested with (``sekv.router.sha256``) -> that file's W and tau (its
    rank gate cannot act: ranks were fixed at ingest); anything else -> the trained router the pack was
    ingested with (W from its file, rounded through float16; tau from the pack), or the untrained one where
    the pack has none.
    """
    from pathlib import Path

    from . import router_file

    L = shape.n_layers
    spec = params.router or "auto"
    names = set(store.keys())
    sha = bytes(store.get("sekv.router.sha256").tolist()).hex() if "sekv.router.sha256" in names else ""
    if spec not in ("untrained", "auto"):
        p = Path(spec).expanduser()
        if p.is_file() and router_file.file_sha256(p) != sha:
            rf = router_file.load(p)
            if tuple(rf.w.shape[:2]) != (L, shape.n_heads) or rf.w.shape[-1] != shape.head_dim:
                from ..errors import SekvError

                raise SekvError(f"--router: {p.name} does not fit this model's attention shape")
            return Router(rf.w.float(), rf.tau.float(), "file")
    if spec != "untrained" and sha:
        rf = trained_file(spec, sha)
        if tuple(rf.w.shape[:2]) != (L, shape.n_heads) or rf.w.shape[-1] != shape.head_dim:
            from ..errors import PackError

            raise PackError(f"the trained router {rf.path.name} does not fit this model's attention shape")
        return Router(rf.w.to(torch.float16).float(), store.get("sekv.router.ttau").float(), "trained")
    w = torch.stack([store.get(f"sekv.router.w.{i}").float() for i in range(L)])
    tau = store.get("sekv.router.tau").float()
    if params.tau > 0:
        tau = torch.full_like(tau, params.tau)
    return Router(w, tau, "pack")


def trained_file(spec: str, sha: str):
    """The trained router file with sha256 ``sha``: the file ``spec`` names when it is that one, else one
    among the shipped routers (sekv_core/routers/); PackError if neither."""
    from pathlib import Path

    from ..errors import PackError
    from . import router_file

    p = Path(spec).expanduser() if spec not in ("auto", "untrained") else None
    cands = ([p] if p is not None and p.is_file() else []) + (sorted(router_file.BUILTIN_DIR.glob("*.safetensors")) if router_file.BUILTIN_DIR.is_dir() else [])
    for c in cands:
        if router_file.file_sha256(c) == sha:
            return router_file.load(c)
    where = f"neither at {p} nor " if p is not None else ""
    raise PackError(
        f"this pack was ingested with a trained router (sha256 {sha[:12]}...) that is {where}among the shipped routers; "
        "pass --router FILE (that file, or another router), --router untrained, or re-ingest"
    )
