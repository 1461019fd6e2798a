"""Issue 20's tables from `sekv bench` results directories: per task (NIAH per length) x method x budget the
accuracy, answers identical to full, ingest cost as compress / prefill, TTFT and resident KV; then sekv - kvzip in
points per task and budget (the target: >= 0 everywhere, >= +10 at 5 % and 10 % on multi-key and QA).

    python -m benchmarks.studies.grid_table docs/bench/grid-niah-h200 docs/bench/grid-qa-h200 ... [--methods a,b]

Reads results.jsonl only (failed cells, rows with "error", are left out and counted).  compress s is the mean
over contexts of compress_s; compress / prefill the mean of compress_s / prefill_s, where prefill_s is the bench's
shared prefill, which also records what every method's scores need (surprisal, observation queries, H2O's attention
mass ...), so it is slower than a plain prefill; TTFT the mean over answers; decode tok/s the generated tokens over
the decode seconds, summed over answers.
"""

from __future__ import annotations

import argparse
import json
from collections import defaultdict
from pathlib import Path
from statistics import mean

ORDER = ["full", "sekv", "kvzip", "snapkv", "streamingllm", "sentencekv", "depthweave", "rag"]


def load(dirs: list[str]) -> tuple[list[dict], int]:
    rows, failed = [], 0
    for d in dirs:
        for line in (Path(d) / "results.jsonl").read_text().splitlines():
            if not line.strip():
                continue
            r = json.loads(line)
            if r.get("error"):
                failed += 1
            else:
                rows.append(r)
    return rows, failed


def task_label(r: dict) -> str:
    return f"{r['task']} {r['length'] // 1024}K" if r["task"] != "qa" and r["task"] != "qa_heldout" and r.get("length") else r["task"]


def _context(r: dict) -> tuple:
    return (r["task"], r.get("length"), r.get("depth"), r.get("seed"), r["n_tokens"])


def _rate(rs: list[dict]) -> str:
    """Decoded tokens per second over the answers (generated tokens / decode seconds, summed)."""
    toks = sum(r.get("generated_tokens") or 0 for r in rs)
    secs = sum(r.get("decode_s") or 0 for r in rs)
    return f"{toks / secs:.1f}" if secs > 0 else "–"


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
    a = ap.parse_args(argv)
    rows, failed = load(a.dirs)
    print(tables(rows, [m for m in a.methods.split(",") if m] or None))
    if failed:
        print(f"({failed} failed cells left out)")


if __name__ == "__main__":
    main()
