"""Ingest time and peak host memory against document length, through the CLI (`sekv ingest`), one process per length.

The document is essays from a haystack folder, repeated until it has the length asked for (in the model's tokens).
Each length runs `sekv ingest DOC -o PACK -q` in a process of its own (its peak RSS from os.wait4); the pack's manifest
gives the tokens, the windows and the stage timings (``ingest_s`` = prefill + compress; ``wall_s`` adds the process
start, the model load and the write).

    python -m benchmarks.ingest_scale --model qwen2.5-0.5b --lengths 8192,32768 --out docs/bench/ingest_scale_cpu_0.5b.json
    python -m benchmarks.ingest_scale --model tiny --lengths 32768,65536,131072,262144 --out docs/bench/ingest_scale_cpu_tiny.json

``--model tiny``: the tests' tiny random Qwen2 (tests/conftest.py, 8,192-token window), built in a temporary folder.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def tokenizer_of(model: str):
    from transformers import AutoTokenizer

    from sekv_core import models

    return AutoTokenizer.from_pretrained(model if Path(model).is_dir() else models.resolve(model)[1])


def haystack_text(tok, haystack: Path, n_tokens: int) -> str:
    essays = [p.read_text() for p in sorted(haystack.glob("*.txt"))]
    per = [len(tok(e, add_special_tokens=False)["input_ids"]) for e in essays]
    out, have, i = [], 0, 0
    while have < n_tokens:
        e, n = essays[i % len(essays)], per[i % len(essays)]
        if have + n > n_tokens:  # cut the last essay to length (roughly: characters in proportion)
            e = e[: max(1, int(len(e) * (n_tokens - have) / n))]
            n = n_tokens - have
        out.append(e)
        have += n
        i += 1
    return "\n\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help="an embedded model, a model folder, or 'tiny'")
    ap.add_argument("--lengths", default="8192,32768")
    ap.add_argument("--method", default="sekv")
    ap.add_argument("--haystack", type=Path, default=Path("../shared/data/haystack/pg_essays"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        model = a.model
        if model == "tiny":
            sys.path.insert(0, str(ROOT / "tests"))
            from conftest import make_tiny_model

            model = str(make_tiny_model(tmp / "tiny"))
        tok = tokenizer_of(model)
        for n in [int(x) for x in a.lengths.split(",")]:
            doc = tmp / f"doc_{n}.txt"
            doc.write_text(haystack_text(tok, a.haystack, n))
            pack = tmp / f"doc_{n}.sekv"
            cmd = [sys.executable, "-m", "sekv_cli.app", "ingest", str(doc), "-o", str(pack), "--model", model, "--method", a.method, "-q"]
            t0 = time.perf_counter()
            with open(tmp / "stderr.txt", "w+") as err:
                p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=dict(os.environ, PYTHONPATH=str(ROOT)))
                _, status, usage = os.wait4(p.pid, 0)  # the child's own peak RSS (ru_maxrss, KiB on Linux)
                wall = time.perf_counter() - t0
                err.seek(0)
                if os.waitstatus_to_exitcode(status):
                    raise SystemExit(err.read()[-2000:])
            rss = usage.ru_maxrss * 1024
            from sekv_core.pack import read_pack

            m = read_pack(pack).manifest
            nt = m["n_tokens"]
            work = m["timings"]["prefill_s"] + m["timings"]["compress_s"]
            row = {"tokens": nt, "windows": len(m.get("windows", [[0, nt]])), "wall_s": round(wall, 1), "ingest_s": round(work, 1),
                   "s_per_1k_tokens": round(work / nt * 1000, 3), "prefill_s": m["timings"]["prefill_s"], "compress_s": m["timings"]["compress_s"],
                   "peak_rss_mib": round(rss / 2**20, 1), "pack_mib": round(pack.stat().st_size / 2**20, 2),
                   "pack_bytes_per_token": round(pack.stat().st_size / nt, 1), "raw_kv_fp16_mib": round(m["sizes"]["raw_kv_fp16_bytes"] / 2**20, 1)}
            rows.append(row)
            print(json.dumps(row), flush=True)
            pack.unlink()
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"model": a.model, "method": a.method, "cpu_threads": os.cpu_count(), "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
