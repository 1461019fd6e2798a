"""What one static single-token decode step does, per layer, for sekv and full KV: aten calls and the bytes they move.

On the H200 a decode step at 128K is bound by memory traffic and by the number of kernels in its CUDA graph
(docs/gpu.md).  This runs the step a graph captures (sekv_core/graphed_step.py, eagerly on the CPU: the same code)
on a random-weight Llama with the 8B model's attention geometry (32 query heads, 8 KV heads of 128; few layers, a
small MLP and vocabulary: the model's own kernels are the same for both methods) over a document of --tokens random
tokens, and counts with a TorchDispatchMode every aten call that is not a view (about one kernel each on a GPU) and
the bytes of its tensor inputs and outputs (what the kernel reads and writes, up to caching), by the sekv line that
made it ("model": the model's own code).  SDPA is counted as one call (one fused kernel on CUDA).

    python -m benchmarks.step_ops --tokens 8192                # sekv (budget 0.10, scout routing) and full
    python -m benchmarks.step_ops --tokens 8192 --sites        # and the calls by sekv line
    python -m benchmarks.step_ops --tokens 1024 --layers 32 --host   # the host's bookkeeping a step, at 32 layers

The step counted is an answer's third (the fixed set filled by the first, reused since), as generate() runs it:
greedy, the model's head and the argmax inside the step (what a CUDA graph captures), and the host's calls before the
replay (the memory's bookkeeping) counted apart as "eager".
"""

from __future__ import annotations

import argparse
import collections
import json
import sys

import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

from benchmarks.ttft_ops import VIEWS


#: in-place writes of a few rows (their index and source arguments) into a large self
INDEXED_WRITES = {"aten::index_copy_", "aten::index_fill_", "aten::index_put_", "aten::scatter_", "aten::masked_fill_"}


def _nbytes(x) -> int:
    if isinstance(x, torch.Tensor):
        return x.numel() * x.element_size()
    if isinstance(x, (list, tuple)):
        return sum(_nbytes(y) for y in x)
    return 0


class StepOps(TorchDispatchMode):
    """Non-view aten calls and their input + output bytes, by name and by the innermost sekv_core line."""

    def __init__(self):
        super().__init__()
        self.calls = 0
        self.bytes = 0
        self.by_site: collections.Counter = collections.Counter()
        self.bytes_by_site: collections.Counter = collections.Counter()
        self._inside = 0

    @staticmethod
    def _site() -> str:
        f = sys._getframe(2)
        while f is not None:
            if "sekv_core" in f.f_code.co_filename:
                if f.f_code.co_filename.endswith("graphed_step.py") and f.f_code.co_name != "_step":
                    return "model"  # beneath the step's call of the decoder: the model's own code (norms and rotary fused)
                return f"{f.f_code.co_filename.split('sekv_core/')[-1]}:{f.f_lineno} {f.f_code.co_name}"
            f = f.f_back
        return "model"

    def record(self, name: str, nbytes: int) -> None:
        site = (self._site(), name)
        self.calls += 1
        self.bytes += nbytes
        self.by_site[site] += 1
        self.bytes_by_site[site] += nbytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = "aten::" + func._schema.name.split("::")[-1]
        if self._inside:
            return out
        if name in VIEWS or func.is_view:  # `to` is one of these: a copy where it makes a new tensor
            ins = {t.untyped_storage().data_ptr() for t in args if isinstance(t, torch.Tensor)}
            if not isinstance(out, torch.Tensor) or out.untyped_storage().data_ptr() in ins:
                return out
        if name in INDEXED_WRITES:  # writes a few rows of self: what it reads and writes is the other arguments, twice
            moved = 2 * (_nbytes(list(args[1:])) + _nbytes(list((kwargs or {}).values())))
        else:
            moved = _nbytes(list(args)) + _nbytes(list((kwargs or {}).values())) + _nbytes(out)
        self.record(name, moved)
        return out

    def __enter__(self):
        raw = F.scaled_dot_product_attention

        def sdpa(q, k, v, attn_mask=None, *a, **kw):  # one fused kernel on CUDA: counted once, what it reads and writes
            self._inside += 1
            try:
                out = raw(q, k, v, attn_mask, *a, **kw)
            finally:
                self._inside -= 1
            self.record("sdpa", _nbytes([q, k, v, attn_mask, out]))
            return out

        self._raw_sdpa = raw
        F.scaled_dot_product_attention = sdpa
        return super().__enter__()

    def __exit__(self, *exc):
        F.scaled_dot_product_attention = self._raw_sdpa
        return super().__exit__(*exc)


#: the 8B model's attention geometry (query heads, KV heads, head_dim) and a small rest (hidden, MLP)
GEOMETRY_8B = {"heads": 32, "kv_heads": 8, "head_dim": 128, "hidden": 512}


def model_8b_heads(layers: int, tokens: int, dtype, kind: str = "llama", heads: int = 32, kv_heads: int = 8, head_dim: int = 128, hidden: int = 512):
    """A random Llama (or Qwen2) with that attention geometry, by default the 8B model's, and a small rest."""
    import transformers

    from sekv_core import runtime

    config = transformers.LlamaConfig if kind == "llama" else transformers.Qwen2Config
    cfg = config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                 intermediate_size=2 * hidden, vocab_size=1024, max_position_embeddings=max(8192, 2 * tokens), rope_theta=500000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    runtime.install(model)
    return model


#: the host's calls around a replay (before it, eagerly: the memory's bookkeeping, the step's inputs), by function
EAGER = ("static_begin", "begin_forward", "_step", "reserve", "_realloc", "static_end")


def count_steps(model, memory, question: list[int], steps: int = 3, greedy: bool = True) -> list[StepOps]:
    """An answer's question forward, then `steps` static single-token steps (GraphedStep, eager off CUDA), each counted;
    greedy: as generate() runs them (the head and the argmax inside the step), else the step's hidden state and the
    head and argmax after it, uncounted."""
    from sekv_core import runtime
    from sekv_core.graphed_step import GraphedStep

    q = torch.tensor([question])
    memory.prepare_question(lambda other=None: runtime.forward_hidden(model, q if other is None else other, memory.n_tokens(), memory))
    memory.begin_step(q.shape[1])
    h = runtime.forward_hidden(model, q, memory.n_tokens(), memory)
    memory.end_step()
    head = model.get_output_embeddings()
    step = GraphedStep(model, memory, capture=False, greedy=greedy)
    out = []
    with torch.inference_mode():
        tok = head(h[:, -1]).argmax(-1).view(1, 1)
        for _ in range(steps):
            c = StepOps()
            with c:
                h = step(tok)
            out.append(c)
            tok = h.view(1, 1) if greedy else head(h[:, -1]).argmax(-1).view(1, 1)
    return out


def eager_calls(c: StepOps) -> int:
    """The counted calls made on the host around the replay (EAGER), not captured."""
    return sum(n for (site, _), n in c.by_site.items() if site.split(" ")[-1] in EAGER)


def host_us(memory, n: int = 200) -> float:
    """Microseconds of host bookkeeping a replayed step costs its caller (GraphedStep._step without the replay)."""
    import time

    with torch.inference_mode():
        t = time.perf_counter()
        for _ in range(n):
            memory.static_begin()
            memory.static_key()
            memory.static_end()
        dt = (time.perf_counter() - t) / n
        memory.truncate(memory.n_tokens() - n)
    return dt * 1e6


def memories(tokens: int, layers: int, dtype, budget: float = 0.10, **geometry):
    """(model, {"sekv": memory, "full": memory}) over one random document (geometry: :func:`model_8b_heads`'s)."""
    from sekv_core import methods
    from sekv_core.methods.base import GrowingKV
    from sekv_core.methods.full import FullMemory
    from sekv_core.methods import scores
    from sekv_core.prefill import prefill

    model = model_8b_heads(layers, tokens, dtype, **geometry)
    ids = torch.randint(0, 1024, (tokens,), generator=torch.Generator().manual_seed(0))
    m = methods.get("sekv")
    p = m.resolve_params({"budget": budget})
    with torch.inference_mode():
        res = prefill(model, ids, with_surprisal=True, capture=scores.capture_kinds(m.needs(p)), obs_window=m.obs_window(p))

    class Store(dict):
        def get(self, k):
            return self[k]

    store = Store(m.compress(res, p))
    sekv = m.open(store, p, res.shape, "cpu")
    sekv.batched = True  # the accelerator's step (its static path is what a CUDA graph captures)
    full = FullMemory(GrowingKV.from_tensors(res.keys, res.values, "cpu"), res.shape)
    return model, {"sekv": sekv, "full": full}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.step_ops", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--sites", action="store_true", help="the calls and bytes by sekv line")
    ap.add_argument("--host", action="store_true", help="also time the host's bookkeeping around a replayed step (static_begin, static_key, static_end)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(2)
    model, mems = memories(a.tokens, a.layers, getattr(torch, a.dtype))
    report = {}
    for name, mem in mems.items():
        c = count_steps(model, mem, [5, 17, 42, 99, 7, 250, 31, 8])[-1]
        L = a.layers
        mine = {s: n for s, n in c.by_site.items() if s[0] != "model"}
        row = {"calls_per_step": c.calls, "eager_calls_per_step": eager_calls(c), "bytes_per_step": c.bytes, "memory_calls_per_step": sum(mine.values()),
               "memory_bytes_per_step": sum(c.bytes_by_site[s] for s in mine),
               "model_calls_per_step": sum(n for s, n in c.by_site.items() if s[0] == "model")}
        if a.sites:
            row["sites"] = [(f"{n} @ {s}", k, c.bytes_by_site[(s, n)]) for (s, n), k in c.by_site.most_common()]
        if a.host:
            row["host_us_per_step"] = host_us(mem)
            print(f"{name}: static_begin + static_key + static_end {row['host_us_per_step']:.0f} us a step (host)")
        report[name] = row
        print(f"{name}, {L} layers: {c.calls} calls ({row['eager_calls_per_step']} of them eager, before the replay), {c.bytes / 2**20:.2f} MiB per step; the memory's code (attention, K/V append, "
              f"step bookkeeping) {row['memory_calls_per_step']} calls, {row['memory_bytes_per_step'] / 2**20:.2f} MiB; the model's own "
              f"{row['model_calls_per_step']} calls")
        if a.sites:
            for s, k, b in row["sites"]:
                print(f"   {k:4d}  {b / 2**20:9.3f} MiB  {s}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(report, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
