"""`sekv bench TASK`: accuracy / memory / speed grids over cache methods and budgets; `sekv bench report DIR`."""

from __future__ import annotations

import re
from pathlib import Path

import typer
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from sekv_core import methods, models
from sekv_core.bench import tasks as bench_tasks
from sekv_core.sekv.params import ABLATIONS
from sekv_core.errors import SekvError

from .common import DeviceMapOpt, DeviceOpt, MaxMemoryOpt, ModelOpt, placement, user_errors
from .display import err

TASK_HELP = (
    f"{', '.join([*bench_tasks.GRID_TASKS, *bench_tasks.QA_TASKS])}, qa_long (one long document: --doc-file); "
    f"`ruler` = {','.join(bench_tasks.GROUPS['ruler'])}; `all` (without qa_long); comma-separated. "
    "`report` re-writes summary.md and the plots of the directory given next (or --out)"
)


def parse_list(text: str, what: str, conv) -> list:
    out = []
    for part in (p.strip() for p in text.split(",")):
        if not part:
            continue
        try:
            out.append(conv(part))
        except ValueError:
            raise SekvError(f"--{what}: cannot read '{part}'") from None
    if not out:
        raise SekvError(f"--{what} is empty")
    return out


def parse_length(s: str) -> int:
    """4096, 4K, 4k, 32K -> tokens (K = 1024)."""
    m = re.fullmatch(r"(\d+)\s*([kK]?)", s)
    if not m:
        raise ValueError(s)
    n = int(m.group(1)) * (1024 if m.group(2) else 1)
    if n <= 0:
        raise ValueError(s)
    return n


def parse_methods(text: str, ablations: str | None = None) -> list[str]:
    """--methods (names, `all`, or variants `METHOD:key=value:ABLATION`) + --ablations (sekv's named ablations)."""
    from sekv_core.bench import variants

    names = list(methods.REGISTRY) if text.strip() == "all" else parse_list(text, "methods", str)
    names = [variants.parse(n).label for n in names]  # unknown method / parameter / ablation -> SekvError
    if ablations:
        names += variants.expand_ablations(ablations)
    return list(dict.fromkeys(names))


class RichReporter:
    def __init__(self, progress: Progress | None):
        self.p = progress
        self.task = None
        self.correct = 0
        self.n = 0

    def start(self, total: int) -> None:
        if self.p:
            self.task = self.p.add_task("bench", total=total, status="")

    def context(self, ctx, pending: int) -> None:
        if self.p and self.task is not None:
            d = "" if ctx.depth is None else f" depth {ctx.depth:g}%"
            self.p.update(self.task, description=f"{ctx.task} {ctx.length} tok{d}")

    def stage(self, text: str) -> None:
        if self.p and self.task is not None:
            self.p.update(self.task, status=text)

    def cell(self, rec: dict) -> None:
        if rec:
            self.n += 1
            self.correct += bool(rec.get("correct"))
        if self.p and self.task is not None:
            self.p.update(self.task, advance=1, status=f"{self.correct}/{self.n} correct")

    def warn(self, message: str) -> None:
        err.print(f"[yellow]warning:[/] {message}", markup=True, highlight=False)


def print_report(out_dir: Path, no_plots: bool) -> None:
    from sekv_core.bench import report

    summary, plots = report.write(out_dir, plots=not no_plots)
    rows, errors = report.load(out_dir)
    if rows:
        ts = report.tasks_of(rows)
        t = Table(title=f"accuracy ({len(rows)} cells)", title_justify="left")
        for h in ["method", "budget", *ts, "identical to full", "resident KV %"]:
            t.add_column(h)
        for m, b in report.variants(rows):
            rs = report.select(rows, method=m, budget=b)
            ident = [r for r in rs if r.get("identical_to_full") is not None]
            t.add_row(
                m, "–" if b is None else f"{b:g}", *[report.acc(report.select(rs, task=x)) for x in ts],
                f"{100 * sum(bool(r['identical_to_full']) for r in ident) / len(ident):.0f}%" if ident else "–",
                f"{100 * sum(r['resident_fraction'] for r in rs) / len(rs):.1f}%",
            )
        err.print(t)
    for p in plots:
        err.print(f"[dim]plot[/] {escape(str(p))}", markup=True, highlight=False)
    if errors:
        err.print(f"[yellow]{len(errors)} cell(s) failed; see summary.md; a re-run retries them[/]", markup=True)
    print(summary)


@user_errors
def bench(
    task: str = typer.Argument(..., help=TASK_HELP),
    target: str = typer.Argument(None, help="with `report`: the results directory", show_default=False),
    method_names: str = typer.Option("full", "--methods", help="comma-separated cache methods, or `all`; `full` always runs too (the reference). "
                                     "A variant: METHOD:key=value or METHOD:ABLATION, e.g. sekv:tau_mode=global"),
    ablations: str = typer.Option(None, "--ablations", help="sekv's named ablations to add as variants (comma-separated, or `all`): "
                                  + ", ".join(ABLATIONS)),
    budgets: str = typer.Option("0.05,0.1,0.2", "--budgets", help="resident KV fractions for methods with a `budget` parameter"),
    lengths: str = typer.Option("4K,8K", "--lengths", help="context lengths in model tokens of the document prefix (4096 or 4K)"),
    depths: str = typer.Option("0,25,50,75,100", "--depths", help="needle depths in percent (niah, mk_niah, mn_niah)"),
    out: Path = typer.Option(Path("bench_results"), "--out", "-o", help="results directory: results.jsonl, summary.md, PNGs"),
    model: str = ModelOpt,
    seed: int = typer.Option(0, "--seed", help="task generation seed"),
    limit: int = typer.Option(None, "--limit", min=1, help="at most N questions per task (a quick run)"),
    haystack: Path = typer.Option(None, "--haystack", help="folder of .txt files for the NIAH haystack (default: $SEKV_HAYSTACK or shared/data/haystack/pg_essays)"),
    max_new_tokens: int = typer.Option(None, "--max-new-tokens", "-n", min=1, help="answer length cap (default: per task, 24-48)"),
    doc_file: Path = typer.Option(None, "--doc-file", help="qa_long's document (default: $SEKV_LONG_DOC; make it with "
                                  "`python -m benchmarks.long_doc fetch --out DIR`)"),
    device: str = DeviceOpt,
    device_map: str = DeviceMapOpt,
    max_memory: str = MaxMemoryOpt,
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: torch's own; 1 is often faster on a busy machine)"),
    report_only: bool = typer.Option(False, "--report-only", help="only re-write summary.md and the plots from results.jsonl"),
    no_plots: bool = typer.Option(False, "--no-plots", help="summary.md only"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress bar"),
) -> None:
    """Run benchmark TASK over cache methods x budgets; results in --out (resumable: finished cells are skipped)."""
    from sekv_core.bench import runner, tasks

    if task == "report" or report_only:
        out_dir = Path(target) if (task == "report" and target) else out
        if not (out_dir / runner.RESULTS_FILE).is_file():
            raise SekvError(f"{out_dir / runner.RESULTS_FILE} not found; run `sekv bench TASK --out {out_dir}` first")
        print_report(out_dir, no_plots)
        return
    if target is not None:
        raise SekvError(f"unexpected argument '{target}' (only `sekv bench report DIR` takes a directory argument)")
    place = placement(device, device_map, max_memory)

    cfg = runner.BenchConfig(
        tasks=tasks.expand_tasks(task),
        methods=parse_methods(method_names, ablations),
        budgets=parse_list(budgets, "budgets", float),
        lengths=parse_list(lengths, "lengths", parse_length),
        depths=parse_list(depths, "depths", float),
        seed=seed,
        limit=limit,
        haystack=haystack,
        max_new_tokens=max_new_tokens,
        doc_file=doc_file,
    )
    if any(not 0 < b <= 1 for b in cfg.budgets):
        raise SekvError("--budgets must lie in (0, 1]: fractions of the full KV cache")
    if any(not 0 <= d <= 100 for d in cfg.depths):
        raise SekvError("--depths must lie in [0, 100] (percent)")
    if any(t in tasks.HAYSTACK_TASKS for t in cfg.tasks):
        tasks.load_haystack(haystack)  # fail on a missing haystack before loading the model
    if any(t in tasks.LONG_TASKS for t in cfg.tasks):
        tasks.long_doc_path(doc_file)  # and on a missing document

    from .display import model_progress

    if threads:
        import torch

        torch.set_num_threads(threads)
    with model_progress(not quiet) as cb:
        lm = models.load(model or models.DEFAULT_MODEL, progress=cb, **place)
    cols = (TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
            TimeRemainingColumn(), TextColumn("{task.fields[status]}"))
    if quiet:
        outcome = runner.run(lm, cfg, out, RichReporter(None))
    else:
        with Progress(*cols, console=err, transient=False) as p:
            outcome = runner.run(lm, cfg, out, RichReporter(p))
    if not quiet:
        err.print(f"{outcome.added} new cell(s), {outcome.skipped} already done, {outcome.prefills} prefill(s); results in {out / runner.RESULTS_FILE}",
                  highlight=False)
    print_report(out, no_plots)
    if outcome.errors:
        raise typer.Exit(1)
