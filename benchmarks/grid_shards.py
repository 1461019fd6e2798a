"""Run a `sekv bench` grid as parallel shards on one machine: each shard is a process that loads the model once and
runs its task over its seeds into its own results directory (resumable like `sekv bench`: finished cells are
skipped).  On a GPU whose small model leaves it mostly idle (the 0.5B on an H200: each step is launch- and
Python-bound) several processes answer many more cells per second than one; accuracy is unaffected, timings are
taken under that sharing (say so where they are reported).

    python -m benchmarks.grid_shards --jobs 16 --time-limit 590 --root /var/tmp/runs \\
        --methods full,sekv,kvzip,snapkv,streamingllm,sentencekv,depthweave,rag --budgets 0.05,0.1,0.2 \\
        --model qwen2.5-0.5b --device cuda --haystack /var/tmp/hay \\
        niah:4K,8K:1 niah:4K,8K:2 niah:16K:0 mk_niah:4K:0-3 vt:4K:0-19 ...

A shard is TASK:LENGTHS:SEEDS[:DIR] (SEEDS a number, a range a-b, or a list with '+' between: 0+1+2), written to
ROOT/DIR, by default ROOT/TASK-LENGTHS-sSEEDS (DIR lets a later split of a shard's seeds finish a started seed in the
folder that already holds its cells, so no cell is measured twice).  Shards beyond --jobs wait for a free slot.  The tables: benchmarks/studies/grid_table.py
over the shard directories.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from pathlib import Path


def parse_seeds(s: str) -> list[int]:
    if "-" in s:
        a, b = s.split("-")
        return list(range(int(a), int(b) + 1))
    return [int(x) for x in s.split("+")]


def shard_dir(root: Path, spec: str) -> Path:
    task, lengths, seeds, *name = spec.split(":")
    return root / (name[0] if name else f"{task}-{lengths.replace(',', '_')}-s{seeds}")


def run_one(a: argparse.Namespace, spec: str) -> int:
    import torch

    from sekv_core import models
    from sekv_core.bench import runner, tasks
    from sekv_cli.cmd_bench import parse_length, parse_list, parse_methods

    task, lengths, seeds, *_ = spec.split(":")
    torch.set_num_threads(a.threads)
    lm = models.load(a.model, device=a.device)
    out = shard_dir(Path(a.root), spec)
    errors = 0
    for seed in parse_seeds(seeds):
        cfg = runner.BenchConfig(
            tasks=tasks.expand_tasks(task), methods=parse_methods(a.methods, ""), budgets=parse_list(a.budgets, "budgets", float),
            lengths=parse_list(lengths, "lengths", parse_length), depths=parse_list(a.depths, "depths", float), seed=seed,
            haystack=Path(a.haystack) if a.haystack else None)
        t = time.perf_counter()
        o = runner.run(lm, cfg, out)
        errors += len(o.errors)
        print(f"[{spec}] seed {seed}: {o.added} new, {o.skipped} done, {len(o.errors)} errors, {time.perf_counter() - t:.0f} s", flush=True)
    return 1 if errors else 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("shards", nargs="+", help="TASK:LENGTHS:SEEDS")
    ap.add_argument("--root", required=True)
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    ap.add_argument("--time-limit", type=float, default=0, help="seconds; running shards are stopped then (their finished cells stay)")
    ap.add_argument("--methods", default="full,sekv")
    ap.add_argument("--budgets", default="0.1")
    ap.add_argument("--depths", default="0,25,50,75,100")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--device", default=None)
    ap.add_argument("--haystack", default=None)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--one", action="store_true", help=argparse.SUPPRESS)  # a worker: runs the single shard given
    a = ap.parse_args(argv)
    if a.one:
        return run_one(a, a.shards[0])
    root = Path(a.root)
    root.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    queue, running, rcs = list(a.shards), {}, {}
    passthrough = [x for x in (argv if argv is not None else sys.argv[1:]) if x not in a.shards]
    while queue or running:
        while queue and len(running) < a.jobs:
            spec = queue.pop(0)
            log = open(root / (shard_dir(root, spec).name + ".log"), "a")
            env = dict(os.environ, OMP_NUM_THREADS=str(a.threads), MKL_NUM_THREADS=str(a.threads))
            running[spec] = subprocess.Popen([sys.executable, "-m", "benchmarks.grid_shards", "--one", spec, *passthrough],
                                             stdout=log, stderr=subprocess.STDOUT, env=env)
        time.sleep(2)
        for spec, p in list(running.items()):
            if p.poll() is not None:
                rcs[spec] = p.returncode
                del running[spec]
                print(f"{time.monotonic() - t0:6.0f} s  {spec}: rc {p.returncode}", flush=True)
        if a.time_limit and time.monotonic() - t0 > a.time_limit:
            for spec, p in running.items():
                p.terminate()
                rcs[spec] = "stopped (time)"
            for spec, p in running.items():
                p.wait()
            for spec in queue:
                rcs[spec] = "not started (time)"
            break
    for spec, rc in rcs.items():
        print(f"{spec}: {rc}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
