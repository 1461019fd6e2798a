"""Torch ops between "question tokenised" and "first token", per phase, on the CPU (a proxy for CUDA launches).

``--device cuda`` instead profiles the product's own path there: each phase's wall, host and device-busy seconds,
its kernels with the most device time and its device memory above the phase's start.

On an accelerator the sekv answer's first token is launch-bound: many small ops on tiny tensors.  This counts
them on the CPU with torch.profiler, running the CUDA path's code (the batched step, sekv/gpu_step.py) on a pack
file on disk and the real model:

    python -m benchmarks.ttft_ops PACK "QUESTION" [--model qwen2.5-0.5b] [--asks 2] [--out ops.json]

Phases: ``scout`` (the scout pass: the question's forward over the per-layer router plus the block scores),
``first_forward`` (the answer's first forward over the ranked fixed sets, to its first token's logits).  For
each: top-level aten calls (what Python asks of the dispatcher), those of them that are not views (the launch
proxy: a view makes no kernel on a GPU), leaf aten ops and the wall seconds on this CPU.  The first ask includes one-off work (the factor blocks' build); the second is
the steady state.

``--syncs``: instead of the profile, every call on the way that would wait for the device on CUDA (a scalar read:
``.item()``, ``int()``/``bool()``/``float()`` of a tensor, ``.tolist()``; a data-dependent shape: ``nonzero``,
``unique``, ``masked_select``, boolean-mask indexing, ``repeat_interleave`` without its size; ``.cpu()``), by the
sekv line making it.  On the CPU every tensor is on the host, so a site that reads a host tensor (a pack's ranks,
the span lengths) is listed too: the CUDA-only test ``tests/test_ttft_syncs.py`` says which sites sync there.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import time
from pathlib import Path

import torch

from benchmarks.knobs import add_set_option, apply_sets

from sekv_core.session import Session


#: ops that only make a view (metadata, no kernel on a GPU); the rest of the top-level calls are the launch proxy
VIEWS = {"aten::" + n for n in ("view", "reshape", "slice", "select", "unsqueeze", "squeeze", "transpose", "t", "expand", "expand_as",
                                "permute", "flatten", "as_strided", "alias", "detach", "_unsafe_view", "split", "chunk", "narrow",
                                "unflatten", "view_as", "lift_fresh", "_reshape_alias", "unbind", "movedim", "diagonal", "view_as_real", "real")}


#: notes of calls that wait only where their tensor is on the host and the target the device (on the CPU, where this
#: runs, every tensor is on the host): ``.to(device)`` without non_blocking
MAYBE = "maybe: "


class SyncTrace(torch.utils._python_dispatch.TorchDispatchMode):
    """Records the calls that wait for the device on CUDA, by their innermost sekv_core frame ("model": the
    model's code beneath it named in parentheses), as {site: count}; ``.tolist()`` and ``.cpu()`` are wrapped while it is
    active."""

    SCALAR = {"aten::_local_scalar_dense", "aten::is_nonzero", "aten::equal"}
    SHAPE = {"aten::nonzero", "aten::unique", "aten::_unique2", "aten::unique_dim", "aten::unique_consecutive", "aten::masked_select",
             "aten::nonzero_static"}

    def __init__(self):
        super().__init__()
        self.sites: collections.Counter = collections.Counter()

    def definite(self) -> dict:
        """The sites that wait on CUDA wherever their tensors are (not the MAYBE ones)."""
        return {k: v for k, v in self.sites.items() if not k.startswith(MAYBE)}

    def _note(self, what: str) -> None:
        import sys

        f, site, outer = sys._getframe(2), None, None
        while f is not None:
            fn = f.f_code.co_filename
            if "sekv_core" in fn:
                site = f"{fn.split('sekv_core/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
                break
            if outer is None and "/torch/" not in fn and not fn.endswith("ttft_ops.py"):  # the model's code that made the call
                outer = f"{'/'.join(fn.split('/')[-2:])}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        self.sites[f"{what} @ {site}" + (f" (in {outer})" if outer else "")] += 1

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = "aten::" + func._schema.name.split("::")[-1]
        if name in self.SCALAR or name in self.SHAPE:
            self._note(name[6:])
        elif name == "aten::repeat_interleave" and kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None) and (
                len(args) == 1 or torch.is_tensor(args[1])):  # tensor repeats without output_size (int repeats: no sync)
            self._note("repeat_interleave (no output_size)")
        elif name in ("aten::index", "aten::index_put", "aten::index_put_") and any(
                torch.is_tensor(i) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 and isinstance(args[1], (list, tuple)) else ()) if i is not None):
            self._note(name[6:] + " (boolean mask)")
        return func(*args, **kwargs)

    def __enter__(self):
        self._raw = torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.to, torch.tensor
        trace = self

        def tolist(t, *a, **k):
            trace._note("tolist")
            return trace._raw[0](t, *a, **k)

        def cpu(t, *a, **k):
            trace._note("cpu")
            return trace._raw[1](t, *a, **k)

        def to(t, *a, **k):  # a blocking copy when t is on the host and the target the device (a no-op where t is there)
            if not k.get("non_blocking") and (k.get("device") is not None or any(isinstance(x, (str, torch.device)) for x in a)):
                trace._note(MAYBE + "to(device), blocking")
            return trace._raw[2](t, *a, **k)

        def tensor(*a, **k):  # data from the host copied to the device, blocking
            if k.get("device") is not None and torch.device(k["device"]).type != "cpu" or k.get("device") is not None and a and not isinstance(a[0], torch.Tensor):
                trace._note("torch.tensor(device=)")
            return trace._raw[3](*a, **k)

        torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.to, torch.tensor = tolist, cpu, to, tensor
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist, torch.Tensor.cpu, torch.Tensor.to, torch.tensor = self._raw
        return super().__exit__(*exc)


class OpCount(torch.utils._python_dispatch.TorchDispatchMode):
    """Every aten op that reaches the dispatcher below autograd (composites decomposed: ``.to(dtype)`` is one
    ``_to_copy``, ``x.float()`` of a float32 tensor nothing), views apart: on CUDA each is about one kernel launch.
    Counted by name and by the innermost sekv_core line making it (``model``: the model's own code)."""

    def __init__(self):
        super().__init__()
        self.ops: collections.Counter = collections.Counter()
        self.views: collections.Counter = collections.Counter()
        self.sites: collections.Counter = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        import sys

        name = "aten::" + func._schema.name.split("::")[-1]
        if name in VIEWS or func.is_view:
            self.views[name] += 1
        else:
            self.ops[name] += 1
            f, site = sys._getframe(1), "model"
            while f is not None:
                if "sekv_core" in f.f_code.co_filename:
                    site = f"{f.f_code.co_filename.split('sekv_core/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
                    break
                f = f.f_back
            self.sites[(site, name)] += 1
        return func(*args, **(kwargs or {}))

    def summary(self) -> dict:
        return {"ops": sum(self.ops.values()), "views": sum(self.views.values()), "most": self.ops.most_common(12),
                "sites": [(f"{n} @ {s}", c) for (s, n), c in self.sites.most_common()]}


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


def device_profile(a) -> int:
    """--device cuda: each phase of each ask under torch.profiler with the device's kernels; per phase the wall seconds
    (synchronised at its end), the host seconds to issue it, the device's busy seconds (kernels and copies, overlaps
    merged), the top --kernels kernels by device time, and the device memory's peak beyond what was allocated before
    the phase (the scout's chunks against the answer's fixed sets).  Only the last ask runs under the profiler (its
times carry the profiler's overhead); the asks before it give the times without it."""
    from torch.profiler import ProfilerActivity, profile

    if a.scout_chunk_bytes:
        from sekv_core.sekv import gpu_step

        gpu_step.SCOUT_CHUNK_BYTES = a.scout_chunk_bytes
    s = Session.open(a.pack, model=a.model, device=a.device)
    if s.rehearse():  # as `sekv chat` does before its first question (and the scout's Triton kernel is taken after it)
        s.settle()
    mem, dev = s.memory, torch.device(a.device)
    results = []
    for k in range(a.asks):
        phases: dict[str, dict] = {}
        state: dict = {}
        prep = mem.prepare_question

        def start(name):
            torch.cuda.synchronize(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) if k == a.asks - 1 else contextlib.nullcontext()
            state.update(name=name, base=torch.cuda.memory_allocated(dev), prof=prof)
            prof.__enter__()
            state["t"] = time.perf_counter()

        def stop():
            host = time.perf_counter() - state["t"]
            torch.cuda.synchronize(dev)
            wall = time.perf_counter() - state["t"]
            peak = torch.cuda.max_memory_allocated(dev) - state["base"]
            prof = state.pop("prof")
            prof.__exit__(None, None, None)
            seen = _kernels(prof, a.kernels) if k == a.asks - 1 else {"busy_s": float("nan"), "n_kernels": 0, "top": []}
            phases[state["name"]] = {"wall_s": wall, "host_s": host, "peak_above_gib": peak / 2**30, **seen}

        def timed_prep(forward, question=None):
            start("scout")
            prep(forward, question)
            stop()
            start("first_forward")

        def first(_m):
            if "prof" in state:
                stop()

        mem.prepare_question = timed_prep
        try:
            ans = s.ask(a.question, max_new_tokens=2, on_step=first)
        finally:
            del mem.prepare_question
        results.append({"ask": k + 1, "answer": ans.text, "phases": phases, "first_token_parts": (ans.stats.extra or {}).get("first_token_parts")})
        for name, ph in phases.items():
            print(f"ask {k + 1} {name:14s} wall {ph['wall_s']:.4f} s  host {ph['host_s']:.4f} s  device busy {ph['busy_s']:.4f} s  "
                  f"kernels {ph['n_kernels']}  peak above start {ph['peak_above_gib']:.3f} GiB")
            if k == a.asks - 1:
                for n, c, t in ph["top"]:
                    print(f"    {t * 1e3:9.2f} ms  {c:6d}x  {n[:110]}")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    return 0


def _kernels(prof, top: int) -> dict:
    """The device's side of a profile: busy seconds (the union of its kernels' and copies' intervals), their count,
    and the ``top`` names by summed device time [(name, count, seconds)]."""
    spans, by = [], collections.defaultdict(lambda: [0, 0.0])
    for e in prof.events():
        dt = getattr(e, "device_type", None)
        if dt is None or str(dt).split(".")[-1] != "CUDA" or e.time_range.elapsed_us() <= 0:
            continue
        spans.append((e.time_range.start, e.time_range.end))
        by[e.name][0] += 1
        by[e.name][1] += e.time_range.elapsed_us() / 1e6
    busy, end = 0.0, None
    for s0, s1 in sorted(spans):
        if end is None or s0 > end:
            busy += s1 - s0
            end = s1
        elif s1 > end:
            busy += s1 - end
            end = s1
    ranked = sorted(by.items(), key=lambda kv: -kv[1][1])[:top]
    return {"busy_s": busy / 1e6, "n_kernels": len(spans), "top": [(n, c, t) for n, (c, t) in ranked]}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ttft_ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("pack")
    ap.add_argument("question")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--asks", type=int, default=2)
    ap.add_argument("--out", default=None)
    ap.add_argument("--by-function", action="store_true", help="attribute the calls to the sekv function making them (slower)")
    ap.add_argument("--syncs", action="store_true", help="list the calls that would wait for the device on CUDA, by sekv line")
    ap.add_argument("--ops", action="store_true", help="count the aten ops below autograd (the launch proxy), by name and sekv line")
    ap.add_argument("--scout-chunk-bytes", type=int, default=None, help="SCOUT_CHUNK_BYTES (small: the chunking of a long context)")
    ap.add_argument("--device", default="cpu", help="cuda: the product's own path on the device, profiled with its kernels (--kernels)")
    ap.add_argument("--kernels", type=int, default=25, help="with --device cuda: the kernels with the most device time, per phase")
    add_set_option(ap)
    a = ap.parse_args(argv)
    apply_sets(a.set)
    if a.device != "cpu":
        return device_profile(a)
    stack = a.by_function
    torch.set_num_threads(1)
    s = Session.open(a.pack, model=a.model, device="cpu")
    mem = s.memory
    if hasattr(mem, "batched"):
        from sekv_core.sekv import zoom_tier

        mem.batched = True  # the accelerator's step, run on the CPU
        zoom_tier.STAGED_ON = {"cpu", "cuda"}  # and the zoom tier's rows staged as there (sekv/zoom_tier.py StagedRows)
    from sekv_core.sekv import gpu_step

    gpu_step.SCOUT_STAGING = True  # the scout's blocks in host memory streamed a chunk at a time, as on CUDA (ScoutRows)

    if a.scout_chunk_bytes:
        gpu_step.SCOUT_CHUNK_BYTES = a.scout_chunk_bytes
    live: list = []  # the OpCount in use
    results = []
    for k in range(a.asks):
        phases: dict[str, dict] = {}
        prep = mem.prepare_question

        def watch():
            if a.ops:
                live.append(OpCount())
                return live[-1]
            return SyncTrace() if a.syncs else torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], with_stack=stack)

        def summary(w) -> dict:
            return {"syncs": sum(w.definite().values()), "maybe": sum(w.sites.values()) - sum(w.definite().values()),
                    "sites": w.sites.most_common()} if a.syncs else w.summary() if a.ops else count(w)

        def timed_prep(forward, question=None):
            with watch() as p:
                t = time.perf_counter()
                prep(forward, question)
                dt = time.perf_counter() - t
            phases["scout"] = {**summary(p), "s": dt}
            state["prof"] = watch()
            state["prof"].__enter__()
            state["t"] = time.perf_counter()

        state: dict = {}

        def first(_m):
            if "prof" in state:
                dt = time.perf_counter() - state["t"]
                state["prof"].__exit__(None, None, None)
                phases["first_forward"] = {**summary(state.pop("prof")), "s": dt}

        mem.prepare_question = timed_prep
        try:
            ans = s.ask(a.question, max_new_tokens=2, on_step=first)
        finally:
            del mem.prepare_question
        parts = (ans.stats.extra or {}).get("first_token_parts") or {}
        results.append({"ask": k + 1, "answer": ans.text, "phases": phases, "first_token_parts": parts})
        if parts:
            print(f"ask {k + 1} host seconds by part: " + ", ".join(f"{n} {v:.4f}" if isinstance(v, float) else f"{n} {v}" for n, v in parts.items()))
        for name, ph in phases.items():
            if a.syncs:
                print(f"ask {k + 1} {name:14s} calls that sync on CUDA {ph['syncs']:5d} (and {ph['maybe']} maybe)  {ph['s']:.3f} s")
                for site, n in ph["sites"]:
                    print(f"    {n:5d}  {site}")
            elif a.ops:
                print(f"ask {k + 1} {name:14s} aten ops {ph['ops']:6d}  (and {ph['views']} views)  {ph['s']:.3f} s")
                if k == a.asks - 1:
                    print("    most:", ph["most"])
                    for site, n in ph["sites"][:30] + [x for x in ph["sites"][30:] if "copy" in x[0]]:
                        print(f"    {n:5d}  {site}")
            else:
                print(f"ask {k + 1} {name:14s} top-level aten calls {ph['top_level']:6d}  not views {ph['compute']:6d}  leaf ops {ph['leaf']:6d}  {ph['s']:.3f} s")
    if a.out:
        Path(a.out).write_text(json.dumps(results, indent=1))
    if a.syncs or a.ops:
        return 0
    print("most frequent (last ask, scout):", results[-1]["phases"].get("scout", {}).get("most"))
    print("most frequent (last ask, first forward):", results[-1]["phases"].get("first_forward", {}).get("most"))
    if a.by_function:
        for name in ("scout", "first_forward"):
            print(name, "by function:", results[-1]["phases"].get(name, {}).get("by_function"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
