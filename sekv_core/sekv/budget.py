"""The budget -> per-step cap rule and the zoom statistics of an ask, one object for both decode steps.

The budget is b x the full KV of the DOCUMENT's tokens, held against the document's persistent part (full-resolution
tokens, coarse entries, router state) plus what a step rebuilds.  The question's and generated tokens (the appended
tail) are resident on top, like the baselines that never compress the question, and are reported separately
(``appended_bytes``).  What is left, the expansion room, is split equally over the layers: each layer's cap.  A
step may hold more persistent bytes of its own (the batched step's tables and masks): it passes them as
``overhead``.

Stats live on the step's device (the batched step never syncs for them) and are read only when asked for.
"""

from __future__ import annotations

import torch

from ..methods.base import ModelShape


def zoom_stats(keep: torch.Tensor, expanded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """What a layer's zoom adds to the stats: the spans any group rebuilt [S] (bool), the heads that see each span [S]
    (long) and the share of (head, span) pairs seen (float64 scalar), of keep [Hkv, S] and expanded [H, S]."""
    return keep.any(0), expanded.long().sum(0), expanded.double().mean()


class ZoomLedger:
    def __init__(self, *, budget: float | None, zoom: str, shape: ModelShape, n_doc: int, n_base: int, router_bytes: int,
                 entry_bytes: int, n_spans: int, device):
        self.budget, self.zoom, self.shape = budget, zoom, shape
        self.n_doc, self.n_base, self.router_bytes, self.entry_bytes = n_doc, n_base, router_bytes, entry_bytes
        L = shape.n_layers
        self.per_token = shape.n_kv_heads * entry_bytes * L  # resident bytes of one token, every layer
        self.doc_persistent = n_base * self.per_token + router_bytes
        self.budget_bytes = 0 if budget is None else int(budget * n_doc * shape.kv_bytes_per_token())
        self.appended_bytes = self.persistent = self.resident = 0
        self.steps = 0
        self.stale = False
        dev = torch.device(device)
        self.step_spans = torch.zeros(n_spans, dtype=torch.bool, device=dev)
        self.ask_spans = torch.zeros(n_spans, dtype=torch.bool, device=dev)
        self.span_counts = torch.zeros(n_spans, dtype=torch.long, device=dev)
        self.rate_sum = torch.zeros(L, dtype=torch.float64, device=dev)
        self.h2d_step = torch.zeros((), dtype=torch.long, device=dev)
        self.h2d_total = torch.zeros((), dtype=torch.long, device=dev)
        #: re-positioned attention (sekv/positions.py): (window, the question's position, whether the window capped
        #: the zoom below the budget), and the most positions a layer's resident set took this ask
        self.window: tuple[int, int, bool] | None = None
        self.positions = torch.zeros((), dtype=torch.long, device=dev)

    # -- the cap --------------------------------------------------------------------------------------------

    def room(self, overhead: int = 0) -> int | None:
        """Bytes every layer together may rebuild at a step (None: no cap, "zoom all" or no budget; 0: no zoom)."""
        if self.zoom == "none":
            return 0
        if self.budget is None or self.zoom == "all":
            return None
        return max(0, self.budget_bytes - self.doc_persistent - overhead)

    def layer_cap(self, overhead: int = 0) -> int | None:
        """One layer's share of the room, bytes."""
        room = self.room(overhead)
        return None if room is None else room // self.shape.n_layers

    # -- one forward ----------------------------------------------------------------------------------------

    def begin_forward(self, n_appended: int) -> None:
        """Before a forward that leaves n_appended tokens after the document's (question, answer so far, new ones)."""
        if self.stale:
            self.reset()
        self.steps += 1
        self.step_spans.zero_()
        self.h2d_step.zero_()
        self.appended_bytes = n_appended * self.per_token
        self.persistent = self.doc_persistent + self.appended_bytes
        self.resident = self.persistent
        if self.budget is None:  # no cap: the budget is the full KV
            self.budget_bytes = (self.n_doc + n_appended) * self.shape.kv_bytes_per_token()

    def count(self, layer: int, keep: torch.Tensor, expanded: torch.Tensor, h2d_bytes=0, stats=None) -> None:
        """A layer's zoom: keep [Hkv, S] (the (group, span) pairs rebuilt), expanded [H, S] (what each head sees); a
        layer on another device than the ledger's (a model placed across devices) has them copied here, no host sync
        where the ledger is on an accelerator.  stats: :func:`zoom_stats` of keep and expanded where the caller has
        them already (a fixed set's, the same for every layer)."""
        if stats is None or keep.device != self.step_spans.device:
            if keep.device != self.step_spans.device:
                keep, expanded = _here(keep, self.step_spans.device), _here(expanded, self.step_spans.device)
                h2d_bytes = _here(h2d_bytes, self.step_spans.device) if torch.is_tensor(h2d_bytes) else h2d_bytes
            stats = zoom_stats(keep, expanded)
        spans, counts, rate = stats
        self.step_spans |= spans
        self.ask_spans |= spans
        self.span_counts += counts
        self.rate_sum[layer].add_(rate)  # in place: `x[i] += y` copies x[i] back into itself
        self.h2d_step += h2d_bytes
        self.h2d_total += h2d_bytes

    def count_layers(self, stats, layers: list[int]) -> None:
        """:meth:`count` of several layers at once whose zoom is the same (a fixed set's fill on one device: its stats,
        made once), their bytes moved apart (:meth:`add_h2d`)."""
        spans, counts, rate = stats
        self.step_spans |= spans
        self.ask_spans |= spans
        self.span_counts.add_(counts, alpha=len(layers))
        if len(layers) == self.rate_sum.numel() and len(set(layers)) == len(layers):
            self.rate_sum.add_(rate)
        else:
            for layer in layers:
                self.rate_sum[layer].add_(rate)

    def add_h2d(self, h2d_bytes) -> None:
        self.h2d_step += h2d_bytes
        self.h2d_total += h2d_bytes

    def count_positions(self, n: torch.Tensor) -> None:
        """A layer's resident set took n [Hkv] positions before the question."""
        torch.maximum(self.positions, _here(n.max(), self.positions.device), out=self.positions)

    # -- the ask --------------------------------------------------------------------------------------------

    def reset(self) -> None:
        """A new ask (in place: a captured CUDA graph holds these tensors)."""
        for t in (self.step_spans, self.ask_spans, self.span_counts, self.rate_sum, self.h2d_step, self.h2d_total, self.positions):
            t.zero_()
        self.steps = 0
        self.stale = False

    def stats(self) -> dict:
        """The ``extra`` keys of ``step_stats()`` that the ledger knows (one device->host copy each)."""
        counts = self.span_counts.cpu()
        nz = torch.nonzero(counts).flatten()
        rates = [(r / self.steps if self.steps else 0.0) for r in self.rate_sum.tolist()]
        out = {
            "zoom_spans_step": int(self.step_spans.sum()),
            "zoom_spans_total": int(self.ask_spans.sum()),
            "h2d_bytes_step": int(self.h2d_step),
            "h2d_bytes_total": int(self.h2d_total),
            "zoom_rate_per_layer": rates,
            "span_zoom_counts": {int(i): int(c) for i, c in zip(nz.tolist(), counts[nz].tolist())},
            "budget_bytes": int(self.budget_bytes),
            "appended_bytes": int(self.appended_bytes),
        }
        if self.window is not None:  # re-positioned: where the resident set and the question sat in the window
            w, p0, capped = self.window
            out["positions"] = {"window": w, "question_at": p0, "resident_tokens": int(self.positions)}
            out["window_capped"] = capped
        return out


def _here(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """t on ``device``: itself there; else a copy, asynchronous unless it goes to the host (a non-blocking copy to the
    host could be read before it lands)."""
    return t if t.device == device else t.to(device, non_blocking=device.type != "cpu")
