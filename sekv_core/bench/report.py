"""summary.md (and the plots) from DIR/results.jsonl, without re-running anything."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path
from statistics import mean
from typing import Any, Callable, Iterable

from .runner import REFERENCE, RESULTS_FILE, read_results, record_key

SUMMARY_FILE = "summary.md"


def load(out_dir: str | Path) -> tuple[list[dict], list[dict]]:
    """(results, errors): the last successful record per cell, and the cells that only ever failed."""
    recs = read_results(Path(out_dir) / RESULTS_FILE)
    ok: dict[str, dict] = {}
    bad: dict[str, dict] = {}
    for r in recs:
        k = record_key(r)
        if r.get("error"):
            bad[k] = r
        else:
            ok[k] = r
    return list(ok.values()), [r for k, r in bad.items() if k not in ok]


def label(method: str, budget: float | None) -> str:
    return method if budget is None else f"{method}@{budget:g}"


def variants(rows: list[dict]) -> list[tuple[str, float | None]]:
    """(method, budget) pairs in display order: full first, then methods by first appearance, budgets ascending."""
    order: list[str] = []
    budgets: dict[str, set] = defaultdict(set)
    for r in rows:
        if r["method"] not in order:
            order.append(r["method"])
        budgets[r["method"]].add(r.get("budget"))
    first = list(order)
    order.sort(key=lambda m: (m != REFERENCE, first.index(m)))
    out = []
    for m in order:
        bs = budgets[m]
        out += [(m, b) for b in sorted(bs, key=lambda b: (b is not None, b or 0.0))]
    return out


def tasks_of(rows: list[dict]) -> list[str]:
    return list(dict.fromkeys(r["task"] for r in rows))


def select(rows: Iterable[dict], **kw: Any) -> list[dict]:
    return [r for r in rows if all(r.get(k) == v for k, v in kw.items())]


def acc(rows: list[dict]) -> str:
    if not rows:
        return "–"
    n = sum(bool(r["correct"]) for r in rows)
    return f"{n}/{len(rows)} ({100 * n / len(rows):.0f}%)"


def _mean(rows: list[dict], f: Callable[[dict], Any], fmt: str = "{:.2f}") -> str:
    vals = [f(r) for r in rows]
    vals = [v for v in vals if v is not None]
    return fmt.format(mean(vals)) if vals else "–"


def _mib(x: float) -> str:
    return f"{x / 2**20:.1f}"


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    out += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return out + [""]


def _fmt_len(n: int) -> str:
    return f"{n // 1024}K" if n % 1024 == 0 else str(n)


def _fmt_depth(d: float | None) -> str:
    return "–" if d is None else f"{d:g}%"


def summary_markdown(rows: list[dict], errors: list[dict], plots: list[Path], plot_note: str = "") -> str:
    lines = ["# sekv bench: summary", ""]
    if not rows:
        lines += ["No results yet.", ""]
    else:
        models_ = sorted({r["model"] for r in rows})
        seeds = sorted({r["seed"] for r in rows})
        machines = sorted({r.get("machine", "?") for r in rows})
        lines += [
            f"- model: {', '.join(models_)}",
            f"- seeds: {', '.join(map(str, seeds))}; cells: {len(rows)}" + (f"; failed cells: {len(errors)}" if errors else ""),
            f"- sekv {', '.join(sorted({r.get('sekv_version', '?') for r in rows}))}; dtype {', '.join(sorted({r.get('dtype', '?') for r in rows}))}; "
            f"torch threads {', '.join(sorted({str(r.get('threads', '?')) for r in rows}))}",
            f"- machine: {'; '.join(machines)}",
            "- regenerate with `sekv bench report DIR` (reads results.jsonl only)",
            "",
        ]
    if not rows:
        return "\n".join(lines)

    vs = variants(rows)
    ts = tasks_of(rows)

    var_rows = {}
    for r in rows:
        if r.get("variant"):
            var_rows.setdefault(r["method"], r)
    if var_rows:
        lines += ["## Variants", "", "Methods run with parameter overrides (`METHOD:ABLATION` / `METHOD:key=value`; "
                  "docs/benchmarks.md, \"Ablations\"):", ""]
        lines += _table(["variant", "method", "overrides"], [
            [m, r.get("base_method", "?"), ", ".join(f"{k}={v}" for k, v in (r.get("overrides") or {}).items()) or "–"]
            for m, r in var_rows.items()])

    lines += ["## Accuracy by method and budget", ""]
    both = ["all"] if len(ts) > 1 else []
    header = ["method", "budget"] + ts + both + ["identical to full", "resident KV (% of full, mean)", "TTFT s ‡", "decode tok/s ‡"]
    body = []
    for m, b in vs:
        rs = select(rows, method=m, budget=b)
        ident = [r for r in rs if r.get("identical_to_full") is not None]
        body.append(
            [m, "–" if b is None else f"{b:g}"]
            + [acc(select(rs, task=t)) for t in ts]
            + [acc(rs)] * len(both)
            + [
                f"{100 * sum(bool(r['identical_to_full']) for r in ident) / len(ident):.0f}%" if ident else "–",
                _mean(rs, lambda r: 100 * r["resident_fraction"], "{:.1f}%"),
                _mean(rs, lambda r: r.get("ttft_s")),
                _mean(rs, lambda r: r.get("tokens_per_s") or None, "{:.1f}"),
            ]
        )
    lines += _table(header, body)
    loads = [r["load_avg_1m"] for r in rows if r.get("load_avg_1m") is not None]
    load_txt = f"1-min load average during the cells {min(loads):.1f}–{max(loads):.1f}" if loads else "load unknown"
    lines += [
        f"‡ Timing columns: wall-clock means on the machine above ({load_txt}). On a shared or loaded machine they are "
        "not trustworthy; compare accuracy and memory across runs, re-measure timings on an idle machine.",
        "",
        "`identical to full`: the answer's token ids equal those of `full` for the same prompt. "
        "`resident KV`: peak KV bytes held on the compute device during a decoding step, as a share of the full KV cache.",
        "",
    ]

    lines += ["## Accuracy by context length", ""]
    for t in ts:
        trs = select(rows, task=t)
        lengths = sorted({r["length"] for r in trs})
        lines += [f"### {t}", ""]
        body = [[m, "–" if b is None else f"{b:g}"] + [acc(select(trs, method=m, budget=b, length=L)) for L in lengths] for m, b in vs]
        lines += _table(["method", "budget"] + [str(L) for L in lengths], body)

    depth_tasks = [t for t in ts if any(r.get("depth") is not None for r in select(rows, task=t))]
    for t in depth_tasks:
        trs = select(rows, task=t)
        lengths = sorted({r["length"] for r in trs})
        depths = sorted({r["depth"] for r in trs if r["depth"] is not None})
        lines += [f"## {t}: correct by length and depth", ""]

        def cell(rs: list[dict]) -> str:
            if not rs:
                return "–"
            n = sum(bool(r["correct"]) for r in rs)
            return ("✓" if n else "✗") if len(rs) == 1 else f"{n}/{len(rs)}"

        body = []
        for m, b in vs:
            mrs = select(trs, method=m, budget=b)
            if mrs:
                body.append([m, "–" if b is None else f"{b:g}"] + [cell(select(mrs, length=L, depth=d)) for L in lengths for d in depths])
        lines += _table(["method", "budget"] + [f"{_fmt_len(L)} @{d:g}%" for L in lengths for d in depths], body)

    lines += ["## Memory by context length", ""]
    body = []
    for m, b in vs:
        mrs = select(rows, method=m, budget=b)
        for L in sorted({r["length"] for r in mrs}):
            rs = select(mrs, length=L)
            body.append(
                [m, "–" if b is None else f"{b:g}", str(L), _mean(rs, lambda r: r["n_tokens"], "{:.0f}"), _rope(rs),
                 _mib(mean(r["resident_kv_bytes_peak"] for r in rs)), _mib(mean(r["full_kv_bytes"] for r in rs)),
                 _mean(rs, lambda r: 100 * r["resident_fraction"], "{:.1f}%"),
                 _mean(rs, lambda r: r.get("gpu_peak_bytes") and r["gpu_peak_bytes"] / 2**20, "{:.0f}"),
                 _mean(rs, lambda r: r.get("rss_bytes") and r["rss_bytes"] / 2**20, "{:.0f}"),
                 _mean(rs, lambda r: r.get("prefill_tok_per_s"), "{:.0f}"),
                 _mean(rs, lambda r: r.get("compress_s"))]
            )
    lines += _table(["method", "budget", "length", "tokens", "RoPE", "resident KV peak MiB", "full KV MiB", "resident %",
                     "GPU peak MiB", "process RSS MiB ‡", "prefill tok/s ‡", "compress s ‡"], body)

    zrows = [r for r in rows if any(k.startswith("zoom") for k in (r.get("method_stats") or {}))]
    if zrows:
        lines += ["## Zoom statistics (methods that report them)", ""]
        body = []
        for m, b in vs:
            rs = [r for r in select(zrows, method=m, budget=b)]
            if not rs:
                continue
            body.append([m, "–" if b is None else f"{b:g}", str(len(rs)),
                         _mean(rs, lambda r: r["method_stats"].get("zoom_spans_total"), "{:.1f}"),
                         _mean(rs, lambda r: r["method_stats"].get("h2d_bytes_total") and r["method_stats"]["h2d_bytes_total"] / 2**20, "{:.2f}"),
                         _mean(rs, lambda r: _flat_mean(r["method_stats"].get("zoom_rate_per_layer")), "{:.3f}"),
                         _mean(rs, lambda r: r["method_stats"].get("budget_bytes") and r["method_stats"]["budget_bytes"] / 2**20, "{:.1f}")])
        lines += _table(["method", "budget", "answers", "zoomed spans per answer", "CPU→device MiB per answer",
                         "mean zoom rate (layers)", "budget MiB"], body)

    if plots or plot_note:
        lines += ["## Plots", ""]
        lines += [f"![{p.stem}]({p.name})" for p in plots]
        if plot_note:
            lines.append(plot_note)
        lines.append("")

    if errors:
        lines += ["## Failed cells (retried on the next run)", ""]
        body = [[r.get("task", "?"), str(r.get("length")), _fmt_depth(r.get("depth")), label(r.get("method", "?"), r.get("budget")),
                 str(r.get("error", "")).replace("|", "\\|")[:160]] for r in errors]
        lines += _table(["task", "length", "depth", "method", "error"], body)
    return "\n".join(lines)


def _rope(rows: list[dict]) -> str:
    """The RoPE the rows were read with: native, or the YaRN factor(s) the runner chose past the window."""
    fs = sorted({r.get("rope_factor") or 1.0 for r in rows})
    return ", ".join("native" if f == 1.0 else f"YaRN x{f:g}" for f in fs)


def _flat_mean(x) -> float | None:
    if x is None:
        return None
    flat: list[float] = []

    def walk(v):
        if isinstance(v, (list, tuple)):
            for y in v:
                walk(y)
        elif isinstance(v, (int, float)):
            flat.append(float(v))

    walk(x)
    return mean(flat) if flat else None


def write(out_dir: str | Path, plots: bool = True) -> tuple[Path, list[Path]]:
    """Write DIR/summary.md and the plots; returns (summary path, plot paths)."""
    out_dir = Path(out_dir)
    rows, errors = load(out_dir)
    made: list[Path] = []
    note = ""
    if plots and rows:
        from . import plots as plotting

        try:
            made = plotting.make_all(rows, out_dir)
        except ImportError:
            note = "Plots skipped: matplotlib is not installed (`pip install 'sekv[bench]'`), then run `sekv bench report DIR`."
    path = out_dir / SUMMARY_FILE
    path.write_text(summary_markdown(rows, errors, made, note), encoding="utf-8")
    return path, made
