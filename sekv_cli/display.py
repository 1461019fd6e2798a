"""Rich helpers shared by the commands: consoles, byte formatting, progress, stats tables."""

from __future__ import annotations

import contextlib
import re

from rich.console import Console
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn
from rich.table import Table

# markup, emoji codes and highlighting off: what they print is data (documents, answers, names), never markup
out = Console(markup=False, emoji=False, highlight=False)  # answers and reports
err = Console(stderr=True, markup=False, emoji=False, highlight=False)  # progress, stats and errors: stdout stays clean for --json


#: characters that must never reach a terminal as they are: C0 controls but tab / newline, DEL, C1 controls (ESC and
#: CSI start escape sequences: colours, cursor moves, OSC-8 links, screen clears) and the bidi overrides
_UNSAFE = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")
_UNSAFE_LINE = re.compile("[\x00-\x1f\x7f-\x9f\u200e\u200f\u202a-\u202e\u2066-\u2069]")


def _escape(m: re.Match) -> str:
    c = ord(m.group())
    return f"\\x{c:02x}" if c < 0x100 else f"\\u{c:04x}"


def safe(text: str) -> str:
    """Text from a document, a pack, the user or the model, made printable: control characters (newline and tab
    kept) escaped as \\xNN / \\uNNNN.  Print it with markup off (or inside rich.text.Text), never as markup."""
    return _UNSAFE.sub(_escape, str(text))


def safe_line(text: str) -> str:
    """safe(), newlines escaped too: for names and one-line messages."""
    return _UNSAFE_LINE.sub(_escape, str(text))


def human_bytes(n: int | float | None) -> str:
    if n is None:
        return "-"
    n = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


@contextlib.contextmanager
def model_progress(enabled: bool = True):
    """Progress callback for model installation (join chunks, dequantise)."""
    if not enabled:
        yield None
        return
    with Progress(TextColumn("[bold]{task.description}"), BarColumn(), TaskProgressColumn(), console=err, transient=True) as p:
        task = p.add_task("model", total=1)

        def cb(stage: str, done: int, total: int) -> None:
            p.update(task, description=stage, completed=done, total=max(total, 1))

        yield cb


def kv_table(title: str, rows: list[tuple[str, str]]) -> Table:
    t = Table(title=title, show_header=False, title_justify="left", box=None, pad_edge=False)
    t.add_column(style="dim")
    t.add_column()
    for k, v in rows:
        t.add_row(k, v)
    return t


def stats_rows(stats: dict, method: str, budget) -> list[tuple[str, str]]:
    full = stats.get("full_kv_bytes") or 0
    res = stats.get("resident_kv_bytes_peak") or 0
    share = f" ({100 * res / full:.1f}% of full {human_bytes(full)})" if full else ""
    rows = [
        ("method", method + (f", budget {budget:.0%}" if isinstance(budget, float) else "")),
        ("time to first token", f"{stats['ttft_s'] * 1000:.0f} ms ({stats['question_tokens']} question tokens)"),
        ("decode", f"{stats['tokens_per_s']:.1f} tok/s, {stats['generated_tokens']} tokens ({stats['stop_reason']})"),
        ("resident KV (peak)", human_bytes(res) + share),
    ]
    if stats.get("gpu_peak_bytes") is not None:
        rows.append(("peak GPU memory", human_bytes(stats["gpu_peak_bytes"])))
    rows.append(("process RSS", human_bytes(stats.get("rss_bytes"))))
    extra = stats.get("extra") or {}
    if "zoom_spans_total" in extra:
        rows.append(("spans zoomed", f"{extra['zoom_spans_total']} distinct this answer"))
        rows.append(("CPU->device", human_bytes(extra.get("h2d_bytes_total"))))
    return rows
