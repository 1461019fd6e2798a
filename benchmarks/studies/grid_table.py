"""Issue 20's tables from `sekv bench` results directories: per task (NIAH per length) x method x budget the
accuracy, answers identical to full, ingest cost as compress / prefill, TTFT and resident KV; then sekv - kvzip in
points per task and budget (the target: >= 0 everywhere, >= +10 at 5 % and 10 % on multi-key and QA).

    python -m benchmarks.studies.grid_table docs/bench/grid-niah-h200 docs/bench/grid-qa-h200 ... [--methods a,b]

Reads results.jsonl (or results.jsonl.gz, as the H200 grid is kept in docs/bench/grid-h200) only (failed cells, rows with "error", are left out and counted).  compress s is the mean
over contexts of compress_s; compress / prefill the mean of compress_s / prefill_s, where prefill_s is the bench's
shared prefill, which also records what every method's scores need (surprisal, observation queries, H2O's attention
mass ...), so it is slower than a plain prefill; TTFT the mean over answers; decode tok/s the generated tokens over
the decode seconds, summed over answers.
"""

from __future__ import annotations

import argparse
import gzip
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

ORDER = ["full", "sekv", "kvzip", "snapkv", "streamingllm", "sentencekv", "depthweave", "rag"]


def load(dirs: list[str], complete: bool = False) -> tuple[list[dict], int]:
    """Successful rows and the count of failed ones; complete: only the questions every (method, budget) of their task
    answered or refused (a grid cut by time leaves some questions with a subset of methods, which would compare
    methods on different questions)."""
    rows, failed = [], 0
    for d in dirs:
        f = Path(d) / "results.jsonl"
        text = f.read_text() if f.is_file() else gzip.decompress((Path(d) / "results.jsonl.gz").read_bytes()).decode()
        for line in text.splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            rows.append(r)
    if complete:
        pairs, seen = defaultdict(set), defaultdict(set)
        for r in rows:
            pairs[r["task"]].add((r["method"], r.get("budget")))
            seen[_question(r)].add((r["method"], r.get("budget")))
        rows = [r for r in rows if seen[_question(r)] >= pairs[r["task"]]]
    ok = [r for r in rows if not r.get("error")]
    return ok, len(rows) - len(ok)


def _question(r: dict) -> tuple:
    return (r["task"], r.get("length"), r.get("depth"), r.get("seed"), r.get("item"))


def task_label(r: dict) -> str:
    return f"{r['task']} {r['length'] // 1024}K" if r["task"] != "qa" and r["task"] != "qa_heldout" and r.get("length") else r["task"]


def _context(r: dict) -> tuple:
    return (r["task"], r.get("length"), r.get("depth"), r.get("seed"), r["n_tokens"])


def _rate(rs: list[dict]) -> str:
    """Decoded tokens per second over the answers (generated tokens / decode seconds, summed)."""
    toks = sum(r.get("generated_tokens") or 0 for r in rs)
    secs = sum(r.get("decode_s") or 0 for r in rs)
    return f"{toks / secs:.1f}" if secs > 0 else "–"


def accuracy(rows: list[dict], methods: list[str] | None = None) -> str:
    """One matrix: task x budget rows, method columns, correct / asked (full's column repeats its one row)."""
    by = defaultdict(list)
    for r in rows:
        by[(task_label(r), r["method"], r.get("budget"))].append(r)
    present = {k[1] for k in by}
    order = [m for m in (methods or ORDER) if m in present] + sorted(present - set(methods or ORDER))
    budgets = sorted({k[2] for k in by if k[2] is not None})
    out = ["| task | budget | " + " | ".join(order) + " |", "|---|---|" + "---|" * len(order)]
    for t in sorted({k[0] for k in by}):
        for b in budgets:
            cells = []
            for m in order:
                rs = by.get((t, m, None if m == "full" else b))
                cells.append(f"{sum(bool(r['correct']) for r in rs)}/{len(rs)}" if rs else "–")
            out.append(f"| {t} | {b:g} | " + " | ".join(cells) + " |")
    return "\n".join(out)


def tables(rows: list[dict], methods: list[str] | None = None) -> str:
    by = defaultdict(list)
    for r in rows:
        by[(task_label(r), r["method"], r.get("budget"))].append(r)
    tasks = sorted({k[0] for k in by})
    present = {k[1] for k in by}
    order = [m for m in (methods or ORDER) if m in present] + sorted(present - set(methods or ORDER))
    budgets = sorted({k[2] for k in by if k[2] is not None})
    out = []
    for t in tasks:
        out += [f"#### {t}", "", "| method | budget | correct | identical to full | compress s | compress / prefill | TTFT s | decode tok/s | resident KV |",
                "|---|---|---|---|---|---|---|---|---|"]
        for m in order:
            for b in ([None] if m == "full" else budgets):
                rs = by.get((t, m, b))
                if not rs:
                    continue
                n_ok = sum(bool(r["correct"]) for r in rs)
                ident = [r for r in rs if r.get("identical_to_full") is not None]
                ctx = {_context(r): (r.get("compress_s") or 0.0, r.get("prefill_s") or 0.0) for r in rs}
                comp = "–" if m == "full" else f"{mean(c for c, _ in ctx.values()):.3g}"
                ratio = "–" if m == "full" else f"{mean(c / max(p, 1e-9) for c, p in ctx.values()):.2f}"
                out.append("| {} | {} | {}/{} ({:.0f} %) | {} | {} | {} | {:.2f} | {} | {:.1f} % |".format(
                    m, "–" if b is None else f"{b:g}", n_ok, len(rs), 100 * n_ok / len(rs),
                    f"{100 * sum(bool(r['identical_to_full']) for r in ident) / len(ident):.0f} %" if ident else "–",
                    comp, ratio, mean(r["ttft_s"] for r in rs if r.get("ttft_s") is not None),
                    _rate(rs), 100 * mean(r["resident_fraction"] for r in rs)))
        out.append("")
    if "sekv" in present and "kvzip" in present:
        out += ["#### sekv - kvzip (accuracy points)", "", "| task | " + " | ".join(f"{b:g}" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets)]
        for t in tasks:
            cells = []
            for b in budgets:
                s, z = by.get((t, "sekv", b)), by.get((t, "kvzip", b))
                cells.append(f"{100 * (mean(bool(r['correct']) for r in s) - mean(bool(r['correct']) for r in z)):+.0f}" if s and z else "–")
            out.append(f"| {t} | " + " | ".join(cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("dirs", nargs="+")
    ap.add_argument("--methods", default="", help="comma-separated order of methods (default: the grid's)")
    ap.add_argument("--complete", action="store_true", help="only questions that every (method, budget) of their task reached")
    ap.add_argument("--accuracy", action="store_true", help="one accuracy matrix (task x budget, method columns) instead of the tables")
    a = ap.parse_args(argv)
    rows, failed = load(a.dirs, a.complete)
    methods = [m for m in a.methods.split(",") if m] or None
    print(accuracy(rows, methods) if a.accuracy else tables(rows, methods))
    if failed:
        print(f"({failed} failed cells left out)")


if __name__ == "__main__":
    main()
