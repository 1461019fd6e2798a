"""PNG plots from benchmark records (matplotlib, Agg backend; the optional `bench` extra).

* ``heatmap_<task>.png``        per depth task: a grid of depth x length accuracy maps, one per method@budget
* ``accuracy_vs_budget.png``    accuracy against budget, a line per method (budget-free methods dashed)
* ``memory_vs_length.png``      resident KV peak and process peak memory against context length
* ``zoom_per_layer.png``        mean per-layer zoom rate, a column per method@budget (memories that report it)
* ``zoom_<method>_<budget>.png``  per layer x head, where a memory reports such a matrix
"""

from __future__ import annotations

import re
from collections import defaultdict
from pathlib import Path
from statistics import mean

from .report import label, select, tasks_of, variants


def _plt():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def _safe(s: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "_", s)


def make_all(rows: list[dict], out_dir: Path) -> list[Path]:
    plt = _plt()
    made: list[Path] = []
    try:
        for t in tasks_of(rows):
            if any(r.get("depth") is not None for r in select(rows, task=t)):
                made.append(depth_heatmaps(plt, rows, t, out_dir))
        made.append(accuracy_vs_budget(plt, rows, out_dir))
        made.append(memory_vs_length(plt, rows, out_dir))
        made += zoom_heatmaps(plt, rows, out_dir)
    finally:
        plt.close("all")
    return made


def depth_heatmaps(plt, rows: list[dict], task: str, out_dir: Path) -> Path:
    """One panel per method@budget: rows of panels are methods, columns budgets."""
    trs = [r for r in select(rows, task=task) if r.get("depth") is not None]
    vs = variants(trs)
    lengths = sorted({r["length"] for r in trs})
    depths = sorted({r["depth"] for r in trs})
    meths = list(dict.fromkeys(m for m, _ in vs))
    budgets = sorted({b for _, b in vs if b is not None})
    ncols = max(1, len(budgets))
    w = max(2.3, 0.55 * len(lengths) + 1.3)
    h = max(1.9, 0.28 * len(depths) + 1.1)
    fig, axes = plt.subplots(len(meths), ncols, figsize=(w * ncols + 1.2, h * len(meths) + 0.6), squeeze=False, layout="constrained")
    for ax in axes.flat:
        ax.axis("off")
    im = None
    for (m, b) in vs:
        i = meths.index(m)
        ax = axes[i][0 if b is None else budgets.index(b)]
        ax.axis("on")
        grid = [[float("nan")] * len(lengths) for _ in depths]
        for a, d in enumerate(depths):
            for c, L in enumerate(lengths):
                rs = select(trs, method=m, budget=b, depth=d, length=L)
                if rs:
                    grid[a][c] = sum(bool(r["correct"]) for r in rs) / len(rs)
                    if len(depths) * len(lengths) <= 64:
                        ax.text(c, a, f"{grid[a][c]:.2g}", ha="center", va="center", fontsize=7)
        im = ax.imshow(grid, vmin=0, vmax=1, cmap="RdYlGn", aspect="auto")
        ax.set_title(label(m, b), fontsize=9)
        ax.set_xticks(range(len(lengths)), [f"{L // 1024}K" if L % 1024 == 0 else str(L) for L in lengths], fontsize=7)
        ax.set_yticks(range(len(depths)), [f"{d:g}%" for d in depths], fontsize=7)
    for ax in axes[-1]:
        ax.set_xlabel("context length (tokens)", fontsize=8)
    for row in axes:
        row[0].set_ylabel("needle depth", fontsize=8)
    if im is not None:
        fig.colorbar(im, ax=axes, shrink=0.6, label="accuracy")
    fig.suptitle(f"{task}: accuracy by needle depth and context length", fontsize=10)
    path = out_dir / f"heatmap_{_safe(task)}.png"
    fig.savefig(path, dpi=100, bbox_inches="tight")
    plt.close(fig)
    return path


def accuracy_vs_budget(plt, rows: list[dict], out_dir: Path) -> Path:
    panels = tasks_of(rows)
    if len(panels) > 1:
        panels = panels + ["all"]
    fig, axes = plt.subplots(1, len(panels), figsize=(4.2 * len(panels), 3.4), squeeze=False)
    budgets = sorted({r["budget"] for r in rows if r.get("budget") is not None})
    methods = list(dict.fromkeys(m for m, _ in variants(rows)))
    for ax, t in zip(axes[0], panels):
        trs = rows if t == "all" else select(rows, task=t)
        for m in methods:
            mrs = select(trs, method=m)
            if not mrs:
                continue
            if all(r.get("budget") is None for r in mrs):
                a = sum(bool(r["correct"]) for r in mrs) / len(mrs)
                ax.axhline(a, linestyle="--", color="black" if m == "full" else None, label=f"{m} (no budget)")
                continue
            xs, ys = [], []
            for b in budgets:
                rs = select(mrs, budget=b)
                if rs:
                    xs.append(b)
                    ys.append(sum(bool(r["correct"]) for r in rs) / len(rs))
            ax.plot(xs, ys, marker="o", label=m)
        ax.set_title(t, fontsize=10)
        ax.set_xlabel("budget (resident KV fraction of full)")
        ax.set_ylabel("accuracy")
        ax.set_ylim(-0.05, 1.05)
        if budgets:
            ax.set_xticks(budgets, [f"{b:g}" for b in budgets])
        ax.grid(alpha=0.3)
    axes[0][-1].legend(fontsize=8, loc="best")
    path = out_dir / "accuracy_vs_budget.png"
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def _styles(vs: list[tuple[str, float | None]]):
    """Colour per method, marker per budget."""
    meths = list(dict.fromkeys(m for m, _ in vs))
    budgets = sorted({b for _, b in vs if b is not None})
    colours = [f"C{i % 10}" for i in range(len(meths))]
    markers = "osD^vP*X"
    return {(m, b): dict(color="black" if m == "full" else colours[meths.index(m)],
                         marker="s" if b is None else markers[budgets.index(b) % len(markers)]) for m, b in vs}


def memory_vs_length(plt, rows: list[dict], out_dir: Path) -> Path:
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(11, 4.2), layout="constrained")
    full_line: dict[int, list[float]] = defaultdict(list)
    gpu = any(r.get("gpu_peak_bytes") for r in rows)
    key = "gpu_peak_bytes" if gpu else "rss_bytes"
    vs = variants(rows)
    style = _styles(vs)
    for m, b in vs:
        rs = select(rows, method=m, budget=b)
        by_len: dict[int, list[dict]] = defaultdict(list)
        for r in rs:
            by_len[r["n_tokens"]].append(r)
            full_line[r["n_tokens"]].append(r["full_kv_bytes"])
        xs = sorted(by_len)
        a1.plot(xs, [mean(r["resident_kv_bytes_peak"] for r in by_len[x]) / 2**20 for x in xs], label=label(m, b), **style[(m, b)])
        pts = [(x, mean(r[key] for r in by_len[x] if r.get(key))) for x in xs if any(r.get(key) for r in by_len[x])]
        if pts:
            a2.plot([p[0] for p in pts], [p[1] / 2**20 for p in pts], **style[(m, b)])
    xs = sorted(full_line)
    a1.plot(xs, [mean(full_line[x]) / 2**20 for x in xs], linestyle=":", color="gray", label="full KV of the tokens")
    a1.set_xlabel("context length (tokens)")
    a1.set_ylabel("resident KV peak (MiB)")
    a1.set_title("resident KV during decoding", fontsize=10)
    a1.grid(alpha=0.3)
    a2.set_xlabel("context length (tokens)")
    a2.set_ylabel("GPU peak allocated (MiB)" if gpu else "process RSS (MiB)")
    a2.set_title("peak device memory" if gpu else "process RSS after the answer (CPU run: model + caches)", fontsize=9)
    a2.grid(alpha=0.3)
    fig.legend(loc="outside right center", fontsize=7, ncols=1 + len(vs) // 24)
    path = out_dir / "memory_vs_length.png"
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _numbers(v) -> list[float] | None:
    try:
        return [float(x) for x in v] if isinstance(v, list) and v else None
    except (TypeError, ValueError):
        return None


def _head_matrix(stats: dict) -> list[list[float]] | None:
    """A layer x head zoom matrix: any 2-D numeric list whose key names zoom and head/matrix."""
    for k, v in stats.items():
        if "zoom" in k and ("head" in k or "matrix" in k) and isinstance(v, list) and v and all(isinstance(row, list) for row in v):
            rows = [_numbers(row) for row in v]
            if all(rows) and len({len(r) for r in rows}) == 1:
                return rows
    return None


def zoom_heatmaps(plt, rows: list[dict], out_dir: Path) -> list[Path]:
    """zoom_per_layer.png (a column per method@budget), and zoom_<m>_<b>.png where a layer x head matrix is reported."""
    made = []
    cols: list[tuple[str, list[float], int]] = []
    for m, b in variants(rows):
        stats = [r["method_stats"] for r in select(rows, method=m, budget=b) if r.get("method_stats")]
        vecs = [v for s in stats if (v := _numbers(s.get("zoom_rate_per_layer")))]
        if vecs:
            vecs = [v for v in vecs if len(v) == len(vecs[0])]
            cols.append((label(m, b), [mean(v[i] for v in vecs) for i in range(len(vecs[0]))], len(vecs)))
        mats = [mm for s in stats if (mm := _head_matrix(s))]
        if mats:
            shape = (len(mats[0]), len(mats[0][0]))
            mats = [x for x in mats if (len(x), len(x[0])) == shape]
            avg = [[mean(x[i][j] for x in mats) for j in range(shape[1])] for i in range(shape[0])]
            fig, ax = plt.subplots(figsize=(2.8 + 0.35 * shape[1], 1.8 + 0.2 * shape[0]), layout="constrained")
            im = ax.imshow(avg, aspect="auto", cmap="viridis", origin="lower")
            ax.set_ylabel("layer")
            ax.set_xlabel("query head")
            fig.colorbar(im, ax=ax, label="zoom frequency")
            ax.set_title(f"{label(m, b)}: zoom frequency per layer and head ({len(mats)} answers)", fontsize=9)
            path = out_dir / f"zoom_{_safe(m)}_{'none' if b is None else f'{b:g}'}.png"
            fig.savefig(path, dpi=100)
            plt.close(fig)
            made.append(path)
    if cols:
        n_layers = max(len(c[1]) for c in cols)
        grid = [[c[1][i] if i < len(c[1]) else float("nan") for c in cols] for i in range(n_layers)]
        fig, ax = plt.subplots(figsize=(2.6 + 0.9 * len(cols), 1.8 + 0.2 * n_layers), layout="constrained")
        im = ax.imshow(grid, aspect="auto", cmap="viridis", origin="lower")
        ax.set_xticks(range(len(cols)), [f"{c[0]}\n({c[2]} answers)" for c in cols], fontsize=7, rotation=30, ha="right")
        ax.set_ylabel("layer")
        fig.colorbar(im, ax=ax, label="zoom rate (mean over decoding steps)")
        ax.set_title("zoom frequency per layer", fontsize=10)
        path = out_dir / "zoom_per_layer.png"
        fig.savefig(path, dpi=100)
        plt.close(fig)
        made.append(path)
    return made
