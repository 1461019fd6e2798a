"""Torch ops between "question tokenised" and "first token", per phase, on the CPU (a proxy for CUDA launches).

On an accelerator the sekv answer's first token is launch-bound: many small ops on tiny tensors.  This counts
them on the CPU with torch.profiler, running the CUDA path's code (the batched step, sekv/gpu_step.py) on a pack
file on disk and the real model:

    python -m benchmarks.ttft_ops PACK "QUESTION" [--model qwen2.5-0.5b] [--asks 2] [--out ops.json]

Phases: ``scout`` (the scout pass: the question's forward over the per-layer router plus the block scores),
``first_forward`` (the answer's first forward over the ranked fixed sets, to its first token's logits).  For
each: top-level aten calls (what Python asks of the dispatcher), those of them that are not views (the launch
proxy: a view makes no kernel on a GPU), leaf aten ops and the wall seconds on this CPU.  The first ask includes one-off work (the factor blocks' build); the second is
the steady state.
"""

from __future__ import annotations

import argparse
import collections
import json
import time
from pathlib import Path

import torch

from sekv_core.session import Session


#: ops that only make a view (metadata, no kernel on a GPU); the rest of the top-level calls are the launch proxy
VIEWS = {"aten::" + n for n in ("view", "reshape", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "expand", "expand_as",
                                "permute", "flatten", "as_strided", "alias", "detach", "_unsafe_view", "split", "chunk", "narrow",
                                "unflatten", "view_as", "lift_fresh", "_reshape_alias", "unbind", "movedim", "diagonal", "view_as_real", "real")}


def count(prof) -> dict:
    """{top-level aten calls, leaf aten ops, the most frequent top-level names} of a profile."""
    evs = [e for e in prof.events() if e.name.startswith("aten::")]
    ids = {id(e) for e in evs}
    top, leaf, where = collections.Counter(), 0, collections.Counter()
    for e in evs:
        p = e.cpu_parent
        while p is not None and not p.name.startswith("aten::"):
            p = p.cpu_parent
        if p is None or id(p) not in ids:
            top[e.name] += 1
            where[_caller(e)] += 1
        if not any(c.name.startswith("aten::") for c in e.cpu_children):
            leaf += 1
    return {"top_level": sum(top.values()), "compute": sum(c for n, c in top.items() if n not in VIEWS), "leaf": leaf, "most": top.most_common(12), "by_function": where.most_common(25)}


def _caller(e) -> str:
    """The innermost sekv frame (file(line): function) on the call's Python stack, else "model" (the model's own code)."""
    p = e.cpu_parent
    while p is not None:
        if "sekv_core/" in p.name and ".py(" in p.name:
            return p.name.split("sekv_core/")[-1]
        p = p.cpu_parent
    return "model"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ttft_ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack")
    ap.add_argument("question")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--asks", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--by-function", action="store_true", help="attribute the calls to the sekv function making them (slower)")
    a = ap.parse_args(argv)
    stack = a.by_function
    torch.set_num_threads(1)
    s = Session.open(a.pack, model=a.model, device="cpu")
    mem = s.memory
    if hasattr(mem, "batched"):
        mem.batched = True  # the accelerator's step, run on the CPU
    results = []
    for k in range(a.asks):
        phases: dict[str, dict] = {}
        prep = mem.prepare_question

        def timed_prep(forward, question=None):
            with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=stack) as p:
                t = time.perf_counter()
                prep(forward, question)
                dt = time.perf_counter() - t
            phases["scout"] = {**count(p), "s": dt}
            state["prof"] = torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=stack)
            state["prof"].__enter__()
            state["t"] = time.perf_counter()

        state: dict = {}

        def first(_m):
            if "prof" in state:
                dt = time.perf_counter() - state["t"]
                state["prof"].__exit__(None, None, None)
                phases["first_forward"] = {**count(state.pop("prof")), "s": dt}

        mem.prepare_question = timed_prep
        try:
            ans = s.ask(a.question, max_new_tokens=2, on_step=first)
        finally:
            del mem.prepare_question
        results.append({"ask": k + 1, "answer": ans.text, "phases": phases})
        for name, ph in phases.items():
            print(f"ask {k + 1} {name:14s} top-level aten calls {ph['top_level']:6d}  not views {ph['compute']:6d}  leaf ops {ph['leaf']:6d}  {ph['s']:.3f} s")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    print("most frequent (last ask, scout):", results[-1]["phases"].get("scout", {}).get("most"))
    print("most frequent (last ask, first forward):", results[-1]["phases"].get("first_forward", {}).get("most"))
    if a.by_function:
        for name in ("scout", "first_forward"):
            print(name, "by function:", results[-1]["phases"].get(name, {}).get("by_function"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
