"""`sekv chat PACK`: a REPL over one context pack."""

from __future__ import annotations

from pathlib import Path

import typer

from sekv_core.errors import SekvError
from sekv_core.prompt import Turn

from .cmd_ask import open_session, run_question
from .common import user_errors, BudgetOpt, CompileOpt, DeviceOpt, MethodOpt, ModelOpt, RouterOpt, RoutingOpt
from .display import err, kv_table, stats_rows

HELP = """commands:
  /help            this text
  /stats           statistics of the last answer
  /history on|off  include earlier turns in the prompt (default off: each question is answered from the pack alone)
  /clear           forget earlier turns
  /quit            leave (Ctrl-D works too)"""


@user_errors
def chat(
    pack: Path = typer.Argument(..., help="a context pack made by `sekv ingest`"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1),
    history: bool = typer.Option(False, "--history/--no-history", help="start with history on"),
    show_evidence: bool = typer.Option(False, "--show-evidence", help="print zoomed passages after each answer"),
    method: str = MethodOpt,
    budget: float = BudgetOpt,
    router: str = RouterOpt,
    routing: str = RoutingOpt,
    model: str = ModelOpt,
    device: str = DeviceOpt,
    compile_layers: bool = CompileOpt,
) -> None:
    """Ask questions about PACK's document, one after another."""
    session = open_session(pack, model, method, budget, device, quiet=False, router=router, routing=routing)
    session.compile_layers = compile_layers
    doc = session.pack.manifest["document"]["name"]
    err.print(f"[bold]{doc}[/] ({session.base_tokens} tokens, method {session.method}). /help for commands, Ctrl-D to quit.")
    turns: list[Turn] = []
    last = None
    while True:
        try:
            line = input("you> ").strip()
        except (EOFError, KeyboardInterrupt):
            err.print()
            return
        if not line:
            continue
        if line.startswith("/"):
            cmd, _, arg = line.partition(" ")
            if cmd in ("/quit", "/exit"):
                return
            if cmd == "/help":
                err.print(HELP)
            elif cmd == "/stats":
                err.print(kv_table("", stats_rows(last.stats.as_dict(), session.method, getattr(session.params, "budget", None))) if last else "no answer yet")
            elif cmd == "/history" and arg in ("on", "off"):
                history = arg == "on"
                err.print(f"history {arg}")
            elif cmd == "/clear":
                turns.clear()
                err.print("history cleared")
            else:
                err.print(f"unknown command {line!r}; /help lists them")
            continue
        try:
            last = run_question(session, line, max_new_tokens, False, show_evidence, history=turns if history else ())
        except KeyboardInterrupt:
            err.print("[dim][answer interrupted][/]")
            continue
        except SekvError as e:
            err.print(f"[red]error:[/] {e}")
            continue
        if history:
            turns.append(Turn(line, last.text))
