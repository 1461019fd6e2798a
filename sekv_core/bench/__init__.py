"""Benchmarks: offline task generators, a resumable runner over the method registry, reports.

    tasks.py    niah, RULER-style (mk_niah, mv_niah, vt, cwe) and qa contexts, deterministic by seed
    scoring.py  case-insensitive substring matching of expected answers
    runner.py   prefill once per context; compress -> open -> generate -> score per method x budget;
                one JSON line per cell in DIR/results.jsonl (resumable)
    report.py   DIR/summary.md from the JSONL
    plots.py    PNG plots (matplotlib, optional extra `bench`)

The command is `sekv bench` (sekv_cli/cmd_bench.py); docs/benchmarks.md has the results.
"""

from .runner import BenchConfig, Outcome, Reporter, run
from .tasks import Context, Probe, expand_tasks

__all__ = ["BenchConfig", "Context", "Outcome", "Probe", "Reporter", "expand_tasks", "run"]
