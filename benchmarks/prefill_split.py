"""What sekv's prefill costs beyond full's, part by part: the same tokens prefilled as `sekv ingest` and `sekv
ingest --method full` prefill them (sekv_core/prefill.py), each variant run --repeat times in one process with the
device synchronised around it, after a warm-up prefill so no variant pays the process's first kernels alone:

    full       no scores (full's prefill)
    surprisal  + the surprisal read off the LM head (what segmentation needs)
    sekv       + the observation queries the scout's profile needs (sekv's prefill: both)
    sekv+arena sekv's, with the pack's host memory allocated on a second thread meanwhile, as `sekv ingest` does on
               CUDA (SekvMethod.reserve_host, sekv/host_copies.py HostArena)
    text       the text scores ingest computes before the prefill (sekv's word terms, sekv/lexical.py)

    python -m benchmarks.prefill_split --doc bench_docs/niah_16384.txt --model qwen2.5-0.5b --repeat 2 --out prefill_split.json

Prints one JSON line per run (variant, seconds) and writes them all to --out.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.prefill_split", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--doc", required=True, help="a text document (e.g. gpu_cli's niah_16384.txt)")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--device", default=None, help="cuda / cpu (default: the CLI's choice)")
    ap.add_argument("--repeat", type=int, default=2)
    ap.add_argument("--tokens", type=int, default=0, help="the document's first TOKENS tokens only (0: all)")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)

    from sekv_core import methods, models, placement
    from sekv_core.documents import load_document
    from sekv_core.ingest import _encode, model_shape
    from sekv_core.methods import scores
    from sekv_core.prefill import prefill

    lm = models.load(a.model, device=a.device)
    dev = placement.input_device(lm.model)
    doc = load_document(Path(a.doc))
    ids, _runs, _h, _parts, text, offsets = _encode(lm, doc, None)
    if a.tokens:
        ids = ids[: a.tokens]
    sekv = methods.get("sekv")
    shape = model_shape(lm)
    p = sekv.resolve_params(None)
    obs = sekv.obs_window(p)
    variants = {
        "full": dict(with_surprisal=False, capture=()),
        "surprisal": dict(with_surprisal=True, capture=()),
        "sekv": dict(with_surprisal=True, capture=scores.capture_kinds(sekv.needs(p))),
    }
    rows = []

    def run(name: str, fn) -> None:
        _sync(dev)
        t = time.perf_counter()
        fn()
        _sync(dev)
        row = {"variant": name, "tokens": len(ids), "device": str(dev), "s": round(time.perf_counter() - t, 4)}
        rows.append(row)
        print(json.dumps(row), flush=True)

    x = torch.tensor(ids)
    run("warm-up", lambda: prefill(lm.model, x[: min(len(ids), 2048)], with_surprisal=True, capture=scores.capture_kinds(sekv.needs(p)), obs_window=obs))
    for _ in range(a.repeat):
        for name, kw in variants.items():
            run(name, lambda kw=kw: prefill(lm.model, x, obs_window=obs, **kw))

        def with_arena():
            sekv.reserve_host(len(ids), shape, p)
            prefill(lm.model, x, obs_window=obs, **variants["sekv"])
            sekv._arena.take()
            sekv._arena = None

        run("sekv+arena", with_arena)
        if not a.tokens:
            run("text", lambda: scores.text_scores(lm.tokenizer, text, ids, sekv.needs(p), offsets=offsets))
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"model": a.model, "doc": str(a.doc), "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
