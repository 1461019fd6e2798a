"""`sekv ask PACK "question"`: answer from a context pack, streaming, with memory/zoom stats."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import typer
from rich.console import Group
from rich.live import Live
from rich.text import Text

from sekv_core.session import Session

from .common import user_errors, BudgetOpt, CompileOpt, DeviceOpt, MethodOpt, ModelOpt, RouterOpt, RoutingOpt, method_overrides
from .display import err, human_bytes, kv_table, model_progress, out, stats_rows
from .evidence import evidence_rows


def open_session(pack: Path, model, method, budget, device, quiet: bool, router: str | None = None, routing: str | None = None) -> Session:
    with model_progress(not quiet) as cb:
        return Session.open(pack, model=model, method=method, params=method_overrides(budget, router, routing), device=device, progress=cb)


def live_line(memory) -> str:
    s = memory.step_stats()
    full = memory.full_bytes()
    line = f"resident KV {human_bytes(s.resident_bytes)} / full {human_bytes(full)} ({100 * s.resident_bytes / max(full, 1):.1f}%)"
    x = s.extra
    if "zoom_spans_step" in x:
        rates = x.get("zoom_rate_per_layer") or []
        rate_txt = " ".join(f"{r:.0%}" for r in rates[:8]) + (" ..." if len(rates) > 8 else "")
        line += (
            f"  zoom {x['zoom_spans_step']} spans this step, {x['zoom_spans_total']} total"
            f"  CPU->device {human_bytes(x.get('h2d_bytes_total'))}  per-layer zoom rate {rate_txt}"
        )
    return line


def answer_payload(session: Session, answer, question: str) -> dict:
    s = answer.stats.as_dict()
    extra = s.pop("extra") or {}
    payload = {
        "answer": answer.text,
        "question": question,
        "pack": str(session.pack.path),
        "model": session.lm.model_id,
        "method": session.method,
        "budget": getattr(session.params, "budget", None),
        "timings": {"load_s": round(session.load_s, 4), "ttft_s": s["ttft_s"], "decode_s": s["decode_s"], "tokens_per_s": s["tokens_per_s"]},
        "tokens": {"document": session.base_tokens, "question": s["question_tokens"], "generated": s["generated_tokens"], "stop_reason": s["stop_reason"]},
        "memory": {
            "resident_kv_bytes_peak": s["resident_kv_bytes_peak"],
            "full_kv_bytes": s["full_kv_bytes"],
            "resident_fraction": s["resident_kv_bytes_peak"] / max(s["full_kv_bytes"], 1),
            "gpu_peak_bytes": s["gpu_peak_bytes"],
            "rss_bytes": s["rss_bytes"],
        },
    }
    if extra:
        zoom = {k: v for k, v in extra.items() if k not in ("span_zoom_counts", "span_order")}
        payload["zoom"] = zoom
        payload["evidence"] = evidence_rows(session, extra.get("span_zoom_counts") or {}, span_order=extra.get("span_order"))
    return payload


def run_question(session: Session, question: str, max_new_tokens: int, as_json: bool, show_evidence: bool, history=()) -> object:
    if as_json:
        answer = session.ask(question, history=history, max_new_tokens=max_new_tokens)
        sys.stdout.write(json.dumps(answer_payload(session, answer, question)) + "\n")
        return answer
    if out.is_terminal:
        text = Text()
        status = Text(style="dim")
        with Live(Group(text, status), console=out, refresh_per_second=8, transient=False) as live:

            def on_step(memory):
                status.plain = live_line(memory)

            answer = session.ask(question, history=history, max_new_tokens=max_new_tokens, on_text=text.append, on_step=on_step)
            status.plain = ""
            live.update(Group(text))
    else:

        def emit(piece: str) -> None:
            sys.stdout.write(piece)
            sys.stdout.flush()

        answer = session.ask(question, history=history, max_new_tokens=max_new_tokens, on_text=emit)
        sys.stdout.write("\n")
    err.print(kv_table("", stats_rows(answer.stats.as_dict(), session.method, getattr(session.params, "budget", None))))
    if show_evidence:
        extra = answer.stats.extra or {}
        rows = evidence_rows(session, extra.get("span_zoom_counts") or {}, span_order=extra.get("span_order"))
        if not rows:
            err.print("[dim]no zoomed passages (this method does not zoom, or nothing was expanded)[/]")
        for r in rows[:5]:
            err.print(f"[bold]page {r['page']}[/] [dim](zoomed {r['zoom_count']}x)[/] {r['text']}")
    return answer


@user_errors
def ask(
    pack: Path = typer.Argument(..., help="a context pack made by `sekv ingest`"),
    question: str = typer.Argument(..., help="the question"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1, help="longest answer in tokens"),
    as_json: bool = typer.Option(False, "--json", help="print exactly one JSON object on stdout"),
    show_evidence: bool = typer.Option(False, "--show-evidence", help="print the most zoomed passages after the answer"),
    method: str = MethodOpt,
    budget: float = BudgetOpt,
    router: str = RouterOpt,
    routing: str = RoutingOpt,
    model: str = ModelOpt,
    device: str = DeviceOpt,
    compile_layers: bool = CompileOpt,
) -> None:
    """Answer QUESTION from PACK without re-reading the document."""
    session = open_session(pack, model, method, budget, device, quiet=as_json, router=router, routing=routing)
    session.compile_layers = compile_layers
    run_question(session, question, max_new_tokens, as_json, show_evidence)
