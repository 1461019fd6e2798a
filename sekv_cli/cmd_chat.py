"""`sekv chat PACK`: a REPL over one context pack (input: sekv_cli/chat_input.py, /save: sekv_cli/transcript.py)."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from sekv_core.api import retune
from sekv_core.errors import SekvError
from sekv_core.prompt import Turn
from sekv_core.sampling import Sampling

from . import transcript
from .chat_input import LineReader, history_path
from .cmd_ask import DocOpt, SeedOpt, TemperatureOpt, TopPOpt, open_session, run_question
from .common import user_errors, BudgetOpt, CompileOpt, DeviceMapOpt, DeviceOpt, MaxMemoryOpt, MethodOpt, ModelOpt, QuietOpt, RouterOpt, RoutingOpt, VerboseOpt, method_overrides
from .display import err, kv_table, safe, safe_line, stats_rows
from sekv_core.evidence import evidence_rows, label as evidence_label

HELP = """commands:
  /help            this text
  /stats           statistics of the last answer
  /sources         the passages the last answer zoomed into (sekv), with their pages
  /budget F        resident KV budget from now on (0.2 or 20%; methods whose budget is set at ask time)
  /doc NAME|all    questions about these documents only (names comma-separated, as `sekv inspect` lists them), or all
  /save FILE       the conversation so far as Markdown
  /history on|off  include earlier turns in the prompt (default off: each question is answered from the pack alone)
  /clear           forget earlier turns
  /quit            leave (Ctrl-D works too)
input: a line ending in \\ continues on the next line; on a terminal Esc+Enter starts a new line too,
the arrows edit and recall earlier questions (kept in {history})."""


def say(*parts) -> None:
    """One line on stderr; parts are plain strings or (text, style) pairs, never markup."""
    err.print(Text.assemble(*parts))


def parse_budget(arg: str) -> float:
    try:
        value = float(arg[:-1]) / 100 if arg.endswith("%") else float(arg)
    except ValueError:
        raise SekvError(f"/budget takes a fraction such as 0.2 or a percentage such as 20%, not {arg!r}") from None
    if not 0.0 < value <= 1.0:
        raise SekvError(f"the budget must be in (0, 1], got {arg}")
    return value


def show_sources(session, answer) -> None:
    if answer is None:
        say("no answer yet")
        return
    extra = answer.stats.extra or {}
    rows = evidence_rows(session, extra.get("span_zoom_counts") or {}, span_order=extra.get("span_order"))
    if not rows:
        say(("no zoomed passages ", "dim"), f"(method {session.method} does not zoom, or nothing was expanded)")
    for r in rows[:5]:
        say((safe_line(evidence_label(r)), "bold"), " ", safe(r["text"]))


def save(reader: LineReader, session, exchanges: list[transcript.Exchange], arg: str) -> None:
    if not arg:
        say("usage: /save FILE")
        return
    if not exchanges:
        say("nothing to save yet")
        return
    path = Path(arg).expanduser()
    if path.is_dir():
        raise SekvError(f"cannot write {path}: it is a directory; give a file name")
    if transcript.needs_confirmation(path):
        try:
            yes = reader.read(f"{path} exists and is not a sekv transcript; overwrite it? [y/N] ").strip().lower() in ("y", "yes")
        except (EOFError, KeyboardInterrupt):
            yes = False
        if not yes:
            say(f"not saved; {path} left as it was")
            return
    text = transcript.render(session.pack.manifest["document"]["name"], str(session.pack.path), session.lm.model_id, exchanges)
    try:
        transcript.write(path, text)
    except OSError as e:
        raise SekvError(f"cannot write {path}: {e.strerror or e}") from None
    say(f"saved {len(exchanges)} answer(s) to {path}")


@user_errors
def chat(
    pack: Path = typer.Argument(..., help="a context pack made by `sekv ingest`"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1),
    history: bool = typer.Option(False, "--history/--no-history", help="start with history on"),
    show_evidence: bool = typer.Option(False, "--show-evidence", help="print zoomed passages after each answer"),
    doc: list[str] = DocOpt,
    temperature: float = TemperatureOpt,
    top_p: float = TopPOpt,
    seed: int = SeedOpt,
    method: str = MethodOpt,
    budget: float = BudgetOpt,
    router: str = RouterOpt,
    routing: str = RoutingOpt,
    model: str = ModelOpt,
    device: str = DeviceOpt,
    device_map: str = DeviceMapOpt,
    max_memory: str = MaxMemoryOpt,
    compile_layers: bool = CompileOpt,
    quiet: bool = QuietOpt,
    verbose: bool = VerboseOpt,
) -> None:
    """Ask questions about PACK's document, one after another (/help lists the commands)."""
    sampling = Sampling(temperature, top_p, seed)
    overrides = method_overrides(budget, router, routing)
    session = open_session(pack, model, method, budget, device, quiet=quiet, router=router, routing=routing, device_map=device_map, max_memory=max_memory, docs=doc)
    session.compile_layers = compile_layers
    # on CUDA, a made-up question's way through the model and the memory, run while the first question is typed:
    # the first real question then pays no first use of a kernel (Session.rehearse; docs/gpu.md)
    session.rehearse()
    reader = LineReader()
    if not quiet:
        name = session.pack.manifest["document"]["name"]
        say((safe_line(name), "bold"), f" ({session.base_tokens} tokens, method {session.method}). /help for commands, Ctrl-D to quit.")
        if session.documents:
            say(f"questions about {safe_line(', '.join(session.documents))} only (--doc)")
        if verbose:
            say(f"model {safe_line(session.lm.model_id)}, opened in {session.load_s:.1f} s; history file {history_path() if reader.interactive else '(none: input is not a terminal)'}")
        if reader.note:
            say((reader.note, "dim"))
    holder = [session]
    try:
        _loop(holder, reader, max_new_tokens, history, show_evidence, sampling, overrides, quiet)
    finally:  # a rehearsal still in flight ends before the process does
        holder[0].settle()


def _loop(holder: list, reader: LineReader, max_new_tokens: int, history: bool, show_evidence: bool, sampling: Sampling, overrides: dict, quiet: bool) -> None:
    """chat's questions and commands until /quit or the end of input; holder[0]: the session (commands replace it)."""
    session = holder[0]
    turns: list[Turn] = []
    exchanges: list[transcript.Exchange] = []
    last = last_session = None
    while True:
        try:
            line = reader.read().strip()
        except EOFError:
            err.print()
            return
        except KeyboardInterrupt:
            if not reader.interactive:
                err.print()
                return
            continue  # Ctrl-C at a terminal prompt drops the line, as in a shell
        if not line:
            continue
        try:
            if line.startswith("/"):
                cmd, _, arg = line.partition(" ")
                arg = arg.strip()
                if cmd in ("/quit", "/exit"):
                    return
                if cmd == "/help":
                    err.print(Text(HELP.format(history=history_path())))
                elif cmd == "/stats":
                    err.print(kv_table("", stats_rows(last.stats.as_dict(), last_session.method, getattr(last_session.params, "budget", None))) if last else "no answer yet")
                elif cmd == "/sources":
                    show_sources(last_session, last)
                elif cmd == "/budget":
                    if not arg:
                        b = getattr(session.params, "budget", None)
                        say(f"budget {b:.0%}" if isinstance(b, float) else f"method {session.method} has no budget")
                    else:
                        overrides = overrides | {"budget": parse_budget(arg)}
                        session = holder[0] = retune(session, overrides)
                        say(f"budget {session.params.budget:.0%} from the next question on")
                elif cmd == "/doc":
                    if arg:
                        new = retune(session, overrides)
                        new.restrict(None if arg == "all" else [arg])
                        session = holder[0] = new
                    say(f"questions about {safe_line(', '.join(session.documents))} only" if session.documents else "questions about every document")
                elif cmd == "/save":
                    save(reader, session, exchanges, arg)
                elif cmd == "/history" and arg in ("on", "off"):
                    history = arg == "on"
                    say(f"history {arg}")
                elif cmd == "/clear":
                    turns.clear()
                    say("history cleared")
                else:
                    say(f"unknown command {safe_line(repr(line))}; /help lists them")
                continue
            last = run_question(session, line, max_new_tokens, False, show_evidence, history=turns if history else (), sampling=sampling, quiet=quiet)
            last_session = session
        except KeyboardInterrupt:
            say(("[answer interrupted]", "dim"))
            continue
        except SekvError as e:
            say(("error: ", "red"), safe_line(str(e)))
            continue
        exchanges.append(transcript.Exchange(line, last.text, session.method, getattr(session.params, "budget", None), last.stats.generated_tokens))
        if history:
            turns.append(Turn(line, last.text))
