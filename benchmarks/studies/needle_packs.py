"""The gpu_cli three-needle documents through packs on disk, per sekv variant: each document ingested once per
variant (``--variant NAME:key=value,...``, sekv parameters; ``full`` for the full-KV method), each of its questions
asked at each budget; the answers, whether they hold the expected number as a whole word (as benchmarks/gpu_cli.py
scores them: '11707244' does not hold 1170724), and pack bytes.

    python -m benchmarks.gpu_cli docs --out /tmp/d8 --lengths 8192
    python -m benchmarks.studies.needle_packs --docs /tmp/d8 --variant full --variant base: --variant n25:number_share=0.25 \\
        --budgets 0.1,1.0 --out X.json
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import sekv
from sekv_core import models
from sekv_core.bench.scoring import contains

from benchmarks.studies.mk_fidelity import parse_variant


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--docs", required=True, help="a folder written by `python -m benchmarks.gpu_cli docs`")
    ap.add_argument("--variant", action="append", default=[], help="full, or NAME:key=value,... (sekv parameters)")
    ap.add_argument("--budgets", default="0.1")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--device", default="cpu", help="cpu, cuda (the model's device: ingest and asks)")
    ap.add_argument("--work", default=None, help="where packs are written (default: DOCS/packs)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args()
    docs_dir = Path(a.docs)
    work = Path(a.work) if a.work else docs_dir / "packs"
    work.mkdir(parents=True, exist_ok=True)
    lm = models.load(a.model, device=a.device)
    rows = []
    for doc in json.loads((docs_dir / "docs.json").read_text())["docs"]:
        for v in a.variant or ["base:"]:
            name, over = ("full", None) if v == "full" else parse_variant(v)
            pack = work / f"{doc['name']}.{name}.sekv"
            pack.unlink(missing_ok=True)
            if name == "full":
                sekv.ingest(docs_dir / doc["file"], pack, method="full", model=lm)
            else:
                sekv.ingest(docs_dir / doc["file"], pack, params=over, model=lm)
            for b in [float(x) for x in a.budgets.split(",")] if name != "full" else [1.0]:
                p = sekv.open(pack, budget=b, model=lm) if name != "full" else sekv.open(pack, model=lm)
                for q in doc["questions"]:
                    ans = p.ask(q["question"], max_new_tokens=12).answer.strip()
                    row = {"doc": doc["name"], "variant": name, "params": over, "budget": b, "expected": q["expected"],
                           "answer": ans, "correct": contains(ans, q["expected"], whole_word=True), "pack_bytes": pack.stat().st_size}
                    rows.append(row)
                    print(json.dumps(row), flush=True)
            if a.out:
                Path(a.out).write_text(json.dumps({"command": "python -m benchmarks.studies.needle_packs " + " ".join(sys.argv[1:]),
                                                   "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
