"""`sekv ask PACK "question" ...`: answer one or more questions from a context pack (model and pack loaded once),
streaming, with memory/zoom stats; `--json` prints one JSON object per question (JSON Lines)."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import typer
from rich.console import Group
from rich.live import Live
from rich.text import Text

from sekv_core.api import result_of
from sekv_core.errors import SekvError
from sekv_core.sampling import Sampling
from sekv_core.session import Session

from .common import user_errors, BudgetOpt, QuietOpt, VerboseOpt, CompileOpt, DeviceMapOpt, DeviceOpt, MaxMemoryOpt, MethodOpt, ModelOpt, RouterOpt, RoutingOpt, method_overrides, placement
from .display import err, human_bytes, kv_table, model_progress, out, safe, safe_line, stats_rows
from sekv_core.evidence import evidence_rows, label as evidence_label


DocOpt = typer.Option(None, "--doc", help="ask only about this document of the pack (its name or file name as `sekv inspect` lists it); "
                      "repeat it or separate names with commas", metavar="NAME")


def open_session(pack: Path, model, method, budget, device, quiet: bool, router: str | None = None, routing: str | None = None,
                 docs: list[str] | None = None, device_map: str | None = None, max_memory: str | None = None) -> Session:
    """The pack's session; ``docs`` (--doc): the documents its questions are limited to, checked before the model loads."""
    if docs:
        from sekv_core.pack import check_manifest, read_pack
        from sekv_core.session import pick_documents

        p = read_pack(pack)
        try:
            check_manifest(p)
            pick_documents(p.manifest, docs)
        finally:
            p.close()
    place = placement(device, device_map, max_memory)
    with model_progress(not quiet) as cb:
        session = Session.open(pack, model=model, method=method, params=method_overrides(budget, router, routing), progress=cb, **place)
    session.restrict(docs)
    return session


#: how often a terminal's live stats line is remade while an answer streams
LIVE_HZ = 8


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


def answer_payload(session: Session, answer, question: str, sampling: Sampling | None = None) -> dict:
    return result_of(session, answer, question, sampling or Sampling()).to_dict()


TemperatureOpt = typer.Option(0.0, "--temperature", help="sampling temperature; 0 (default) decodes greedily")
TopPOpt = typer.Option(1.0, "--top-p", help="sample only from the most likely tokens whose probability reaches this (with --temperature > 0)")
SeedOpt = typer.Option(None, "--seed", help="seed for sampling: the same seed gives the same answer (default: a fresh one, shown in the stats)")


def sampling_row(sampling: Sampling) -> tuple[str, str]:
    return ("sampling", f"temperature {sampling.temperature:g}, top-p {sampling.top_p:g}, seed {sampling.seed}")


#: the most text --questions reads (every input is read with a limit)
MAX_QUESTIONS_CHARS = 16 << 20


def read_questions(positional: list[str] | None, path: Path | None) -> list[str]:
    """The questions given as arguments, then those of --questions FILE (one per line, blank lines skipped)."""
    questions = list(positional or [])
    if path is not None:
        try:
            if str(path) == "-":
                text = sys.stdin.read(MAX_QUESTIONS_CHARS + 1)
            else:
                if path.exists() and not path.is_file() and not path.is_dir():  # a FIFO or device would block or never end
                    raise SekvError(f"{path}: is not a regular file; --questions takes a text file (or - for standard input)")
                with open(path, encoding="utf-8") as f:
                    text = f.read(MAX_QUESTIONS_CHARS + 1)
            if len(text) > MAX_QUESTIONS_CHARS:
                raise SekvError(f"{path}: more than {MAX_QUESTIONS_CHARS >> 20} Mi characters of questions; split it")
        except FileNotFoundError:
            raise SekvError(f"{path}: no such questions file") from None
        except IsADirectoryError:
            raise SekvError(f"{path}: is a directory; --questions takes a text file with one question per line") from None
        except UnicodeDecodeError:
            raise SekvError(f"{path}: not UTF-8 text; --questions takes a text file with one question per line") from None
        except OSError as e:
            raise SekvError(f"{path}: cannot read it ({e.strerror})") from None
        questions += [ln.strip() for ln in text.splitlines() if ln.strip()]
    if not questions:
        raise SekvError("no question: give one or more after PACK, or --questions FILE (one per line)")
    for q in questions:
        if not q.strip():
            raise SekvError("a question is empty")
    return questions


def run_question(
    session: Session, question: str, max_new_tokens: int, as_json: bool, show_evidence: bool, history=(),
    sampling: Sampling | None = None, quiet: bool = False,
) -> object:
    sampling = (sampling or Sampling()).resolved()
    if as_json:
        answer = session.ask(question, history=history, max_new_tokens=max_new_tokens, sampling=sampling)
        sys.stdout.write(json.dumps(answer_payload(session, answer, question, sampling)) + "\n")
        sys.stdout.flush()
        return answer
    if out.is_terminal:
        text = Text()
        status = Text(style="dim")
        with Live(Group(text, status), console=out, refresh_per_second=LIVE_HZ, transient=False) as live:

            shown = [0.0]

            def on_step(memory):  # the stats line at most LIVE_HZ times a second: reading the stats waits for the device
                now = time.monotonic()
                if now - shown[0] >= 1 / LIVE_HZ:
                    status.plain = live_line(memory)
                    shown[0] = now

            answer = session.ask(question, history=history, max_new_tokens=max_new_tokens, on_text=lambda piece: text.append(safe(piece)), on_step=on_step, sampling=sampling)
            status.plain = ""
            live.update(Group(text))
    else:

        def emit(piece: str) -> None:
            sys.stdout.write(safe(piece))
            sys.stdout.flush()

        answer = session.ask(question, history=history, max_new_tokens=max_new_tokens, on_text=emit, sampling=sampling)
        sys.stdout.write("\n")
    if quiet:
        return answer
    rows = stats_rows(answer.stats.as_dict(), session.method, getattr(session.params, "budget", None))
    err.print(kv_table("", rows + ([sampling_row(sampling)] if not sampling.greedy else [])))
    if show_evidence:
        extra = answer.stats.extra or {}
        rows = evidence_rows(session, extra.get("span_zoom_counts") or {}, span_order=extra.get("span_order"))
        if not rows:
            err.print(Text("no zoomed passages (this method does not zoom, or nothing was expanded)", style="dim"))
        for r in rows[:5]:
            err.print(Text.assemble((safe_line(evidence_label(r)), "bold"), " ", safe(r["text"])))
    return answer


@user_errors
def ask(
    pack: Path = typer.Argument(..., help="a context pack made by `sekv ingest`"),
    questions: list[str] = typer.Argument(None, help="one or more questions, each answered from the pack alone", show_default=False),
    questions_file: Path = typer.Option(None, "--questions", help="a text file with one question per line ('-': stdin), after any given as arguments"),
    max_new_tokens: int = typer.Option(256, "--max-new-tokens", "-n", min=1, help="longest answer in tokens"),
    as_json: bool = typer.Option(False, "--json", help="print one JSON object per question on stdout (JSON Lines) and nothing else"),
    show_evidence: bool = typer.Option(False, "--show-evidence", help="print the most zoomed passages after the answer"),
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
    """Answer each QUESTION from PACK without re-reading the document (the model and the pack load once)."""
    sampling = Sampling(temperature, top_p, seed)
    todo = read_questions(questions, questions_file)
    quiet = quiet or as_json
    session = open_session(pack, model, method, budget, device, quiet=quiet, router=router, routing=routing, device_map=device_map, max_memory=max_memory, docs=doc)
    session.compile_layers = compile_layers
    if verbose and not quiet:
        err.print(Text(f"{safe_line(session.pack.path)}: {session.base_tokens} tokens, method {session.method}, model {safe_line(session.lm.model_id)}, "
                       f"opened in {session.load_s:.1f} s; {len(todo)} question(s)"))
    for i, question in enumerate(todo):
        if len(todo) > 1 and not as_json:
            if i:
                out.print()
            out.print(Text(f"Q: {safe_line(question)}", style="bold"))
        run_question(session, question, max_new_tokens, as_json, show_evidence, sampling=sampling, quiet=quiet)
