"""The ingest command's one progress display: a spinner per stage (load, prefill, compress, write), tokens and pages
done, tokens/s, the window being read and an ETA from the first window on.  The core reports IngestProgress events
(sekv_core/ingest.py); the rates and the ETA are worked out here."""

from __future__ import annotations

import contextlib
import time

from rich.progress import BarColumn, Progress, SpinnerColumn, TextColumn

from sekv_core.ingest import IngestProgress

from .display import err


def _clock(seconds: float) -> str:
    s = int(seconds + 0.5)
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


def detail(e: IngestProgress, elapsed: float) -> str:
    """The readout after the bar: tokens, pages, tokens/s, window k of n, ETA (once the first window is read)."""
    rate = e.tokens_done / elapsed if elapsed > 0 else 0.0
    parts = [f"{e.tokens_done:,}/{e.tokens_total:,} tok", f"page {e.pages_done}/{e.pages_total}", f"{rate:,.0f} tok/s"]
    if e.windows > 1:
        parts.append(f"window {e.window} of {e.windows}")
    if e.stage == "write":
        parts.append("writing")
    elif e.window > 1 and rate > 0:  # the first window's rate (prefill and compress) predicts the rest
        parts.append(f"ETA {_clock((e.tokens_total - e.tokens_done) / rate)}")
    elif e.windows > 1:
        parts.append("ETA after window 1")
    return "  ".join(parts)


class IngestView:
    """Callbacks into one rich Progress: model(stage, done, total) while the model loads, then the ingest's events."""

    def __init__(self, progress: Progress):
        self.p = progress
        self.task = progress.add_task("load", total=None, detail="")
        self.t0: float | None = None

    def model(self, stage: str, done: int, total: int) -> None:
        self.p.update(self.task, description=f"load: {stage}", completed=done, total=total or None)

    def __call__(self, e: IngestProgress) -> None:
        now = time.monotonic()
        if self.t0 is None:
            self.t0 = now
        self.p.update(self.task, description=e.stage, completed=e.tokens_done, total=max(e.tokens_total, 1),
                      detail=detail(e, now - self.t0))


@contextlib.contextmanager
def ingest_progress(enabled: bool = True):
    """An IngestView on stderr, or None when disabled (-q)."""
    if not enabled:
        yield None
        return
    cols = (SpinnerColumn(), TextColumn("[bold]{task.description:<9}"), BarColumn(), TextColumn("{task.fields[detail]}"))
    with Progress(*cols, console=err, transient=False) as p:
        view = IngestView(p)
        try:
            yield view
        except BaseException:  # the error is the one line left (sekv: error: ...): no half-drawn display above it
            p.remove_task(view.task)
            raise
