"""Carried context between ingest windows (sekv_core/windows.py): what re-reading the last C tokens of the previous
window buys, measured on a real model with a forced small window (SEKV_INGEST_WINDOW).

For each carry C: (a) how far the windowed KV of windows >= 2 is from ONE prefill of the whole document at the same
global positions (relative Frobenius error over all layers, for the first 32 tokens after each window boundary and
for all tokens of windows >= 2; mean |surprisal difference| there), (b) needles placed right after the window
boundaries: ingest with sekv (windowed), ask, count the answers that contain the needle's value.  The unwindowed
pack (the document fits the real window) is the reference for (b).

    python -m benchmarks.studies.window_carry --model qwen2.5-0.5b --window 1024 --carry 0,64,256 \
        --out docs/experiments/window_carry.json
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

import torch

NEEDLES = [("harbour", "cobalt heron 4471"), ("granary", "velvet anchor 9302"), ("observatory", "amber lantern 5186"),
           ("foundry", "silent walrus 2768"), ("chapel", "crimson abacus 6059")]


def needle(place: str, value: str) -> str:
    return f"The secret passphrase for the {place} archive is {value}. "


def _doc(text: str):
    """The text as ingest reads it from a .txt file (normalised)."""
    from sekv_core.documents import load_document

    with tempfile.TemporaryDirectory() as d:
        (Path(d) / "haystack.txt").write_text(text)
        return load_document(Path(d) / "haystack.txt")


def build_document(lm, haystack: Path, n_tokens: int, capacity: int, carry: int, n_needles: int) -> tuple[str, list[int]]:
    """Essays up to ~n_tokens with a needle at the first sentence start after the start of each of windows 2.. (as planned for
    `carry` on the essays alone) -> text, each needle's first token (global index)."""
    from sekv_core import windows
    from sekv_core.ingest import _tokenize

    text = ""
    for p in sorted(haystack.glob("*.txt")):
        text += p.read_text() + "\n\n"
        if len(lm.tokenizer(text, add_special_tokens=False)["input_ids"]) > n_tokens:
            break
    text = _doc(text).text
    enc = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    ids, _, header = _tokenize(lm, _doc(text))
    cuts = []
    for w in windows.plan(len(ids), header, capacity, carry)[1 : n_needles + 1]:
        c = enc["offset_mapping"][min(w.start - header, len(enc["offset_mapping"]) - 1)][0]
        nxt = [x for x in (text.find(". ", c) + 2, text.find("\n", c) + 1) if x > 0]
        cuts.append(min(nxt) if nxt else c)  # the first sentence or line start after the boundary
    for c, (place, value) in sorted(zip(cuts, NEEDLES), reverse=True):
        text = text[:c] + needle(place, value) + text[c:]
    text = _doc(text).text
    _, _, header = _tokenize(lm, _doc(text))
    enc = lm.tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    starts = []
    for place, value in NEEDLES[:n_needles]:
        c = text.index(needle(place, value))
        starts.append(header + next(i for i, (_a, b) in enumerate(enc["offset_mapping"]) if b > c))
    return text, starts


def kv_deviation(lm, ids: list[int], header: int, plan) -> dict:
    from sekv_core.prefill import prefill, prefill_window

    ref = prefill(lm.model, torch.tensor(ids), with_surprisal=True)
    near, allw, ds_near, ds_all = [0.0, 0.0], [0.0, 0.0], [], []
    for w in plan[1:]:
        r = prefill_window(lm.model, ids, header, w, with_surprisal=True)
        for kind in ("keys", "values"):
            for a, b in zip(getattr(r, kind), getattr(ref, kind)):
                b = b[:, w.start : w.end].float()
                a = a.float()
                e = (a - b).pow(2).sum((0, 2))  # per token
                n = b.pow(2).sum((0, 2))
                near[0] += float(e[:32].sum()); near[1] += float(n[:32].sum())
                allw[0] += float(e.sum()); allw[1] += float(n.sum())
        ds = (r.surprisal - ref.surprisal[w.start : w.end]).abs()
        ds_near.append(ds[:32])
        ds_all.append(ds)
    return {"kv_rel_err_first32": (near[0] / near[1]) ** 0.5, "kv_rel_err_windows2plus": (allw[0] / allw[1]) ** 0.5,
            "surprisal_abs_diff_first32": float(torch.cat(ds_near).mean()), "surprisal_abs_diff_windows2plus": float(torch.cat(ds_all).mean())}


def answers(lm, text: str, n_needles: int, window: int | None, carry: int, tmp: Path) -> dict:
    import sekv
    from sekv_core import ingest as ing
    from sekv_core import windows

    src = tmp / "doc.txt"
    src.write_text(text)
    old = windows.CARRY_TOKENS
    windows.CARRY_TOKENS = carry
    if window:
        os.environ[ing.WINDOW_ENV] = str(window)
    try:
        t0 = time.perf_counter()
        r = sekv.ingest(src, tmp / "doc.sekv", model=lm)
        ingest_s = time.perf_counter() - t0
    finally:
        windows.CARRY_TOKENS = old
        os.environ.pop(ing.WINDOW_ENV, None)
    pack = sekv.open(r.pack_path, model=lm)
    rows = []
    for place, value in NEEDLES[:n_needles]:
        a = pack.ask(f"What is the secret passphrase for the {place} archive?", max_new_tokens=24).answer
        rows.append({"place": place, "value": value, "answer": a, "found": value.lower() in a.lower()})
    return {"windows": r.windows, "n_tokens": r.n_tokens, "ingest_s": round(ingest_s, 1), "found": sum(x["found"] for x in rows), "asked": len(rows), "rows": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--window", type=int, default=1024, help="forced ingest window, tokens")
    ap.add_argument("--carry", default="0,64,256")
    ap.add_argument("--tokens", type=int, default=3000, help="document length, tokens")
    ap.add_argument("--needles", type=int, default=3)
    ap.add_argument("--haystack", type=Path, default=Path("../shared/data/haystack/pg_essays"))
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    from sekv_core import models
    from sekv_core.ingest import RESERVE_TOKENS, _tokenize
    from sekv_core import windows

    lm = models.load(a.model, device="cpu")
    capacity = a.window - min(RESERVE_TOKENS, a.window // 4)
    out = {"model": a.model, "window": a.window, "capacity": capacity, "tokens": a.tokens, "cells": []}
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        for c in [int(x) for x in a.carry.split(",")]:
            text, starts = build_document(lm, a.haystack, a.tokens, capacity, c, a.needles)
            ids, _, header = _tokenize(lm, _doc(text))
            plan = windows.plan(len(ids), header, capacity, c)
            cell = {"carry": c, "header": header, "n_tokens": len(ids), "windows": [[w.start, w.end] for w in plan],
                    "needle_tokens_after_boundary": [s - max(w.start for w in plan if w.start <= s) for s in starts]}
            cell |= kv_deviation(lm, ids, header, plan)
            cell["windowed"] = answers(lm, text, a.needles, a.window, c, tmp)
            if c == 0:  # the same document, one prefill (it fits the model's own window)
                cell["one_prefill"] = answers(lm, text, a.needles, None, c, tmp)
            out["cells"].append(cell)
            print(json.dumps({k: v for k, v in cell.items() if k != "windows"}), flush=True)
    if a.out:
        a.out.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
