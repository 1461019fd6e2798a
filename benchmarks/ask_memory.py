"""What makes up the compute device's memory during a sekv `ask`, counted on the CPU.

The batched step (sekv/gpu_step.py, what CUDA runs) is run on the CPU on a pack of a random-weight model of the
geometry asked for (default: Llama-3-8B's attention, 32 query heads and 8 KV heads of 128, few layers, a small
hidden size), and every tensor the question makes is counted while it lives (:class:`LiveBytes`, a
TorchDispatchMode: a tensor's storage counted from the op that made it until the last tensor on it goes).  What was
there before the question (the resident KV and router, the factor blocks) is counted apart.  The peak of each phase
(the scout pass, the answer's first forward, single-token steps) is given with the sekv lines whose tensors were
alive at it, and :func:`scout_bound` is the formula the scout's scoring is checked against (tests/test_ask_memory.py):

    python -m benchmarks.ask_memory --tokens 4096,8192 --layers 2 [--out ask_memory.json]

Kernels' own workspaces (cuBLAS, SDPA's) are not tensors and are not counted; nor is the caching allocator's rounding.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import weakref

import torch


class LiveBytes(torch.utils._python_dispatch.TorchDispatchMode):
    """Bytes of the storages made by ops while active, live now and at the peak, with the innermost sekv_core line
    that made each (``model``: the model's own code); views and in-place results add nothing."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self.at_peak: dict[str, int] = {}
        self._by_ptr: dict[int, tuple[int, str, list]] = {}  # storage ptr -> (bytes, site, weakrefs of its tensors)

    def reset_peak(self) -> None:
        self.peak, self.at_peak = self.live, self._sites()

    def _sites(self) -> dict[str, int]:
        out: collections.Counter = collections.Counter()
        for n, site, _ in self._by_ptr.values():
            out[site] += n
        return dict(out.most_common())

    def _gone(self, ptr: int) -> None:
        entry = self._by_ptr.get(ptr)
        if entry is not None and all(w() is None for w in entry[2]):
            self.live -= entry[0]
            del self._by_ptr[ptr]

    def _track(self, t: torch.Tensor, site: str) -> None:
        st = t.untyped_storage()
        ptr, n = st.data_ptr(), st.nbytes()
        if n == 0:
            return
        entry = self._by_ptr.get(ptr)
        if entry is None:
            entry = self._by_ptr[ptr] = (n, site, [])
            self.live += n
            if self.live > self.peak:
                self.peak, self.at_peak = self.live, None  # sites filled lazily (below)
        entry[2].append(weakref.ref(t))
        weakref.finalize(t, self._gone, ptr)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if func.is_view or func._schema.name.endswith("_") or "out" in (kwargs or {}):
            return out
        before_peak = self.peak
        site = _site()
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and not t.is_meta:
                self._track(t, site)
        if self.peak != before_peak:
            self.at_peak = self._sites()
        return out


def _site() -> str:
    f = sys._getframe(2)
    while f is not None:
        fn = f.f_code.co_filename
        if "sekv_core" in fn:
            return f"{fn.split('sekv_core/')[-1]}:{f.f_code.co_name}"
        f = f.f_back
    return "model"


def geometry_model(layers: int, heads: int, kv_heads: int, head_dim: int, hidden: int, tokens: int, dtype=torch.float32):
    """A random-weight Qwen2 with that attention geometry, installed for sekv."""
    from transformers import AutoModelForCausalLM, Qwen2Config

    from sekv_core import runtime

    torch.manual_seed(0)
    cfg = Qwen2Config(hidden_size=hidden, num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
                      intermediate_size=2 * hidden, vocab_size=1024, max_position_embeddings=max(32768, tokens + 512))
    model = AutoModelForCausalLM.from_config(cfg, dtype=dtype).eval()
    runtime.install(model)
    return model


class _Store(dict):
    def get(self, name):
        return self[name]


def open_pack(model, tokens: int, params: dict | None = None, seed: int = 0, device: str = "cpu"):
    """A sekv pack of `tokens` random tokens prefilled by `model` (on ``device``), opened with the batched step there
    (the CPU: the batched step CUDA runs, run on the CPU; CUDA: the factor blocks built as an `ask` builds them)."""
    from sekv_core import methods
    from sekv_core.prefill import prefill

    ids = torch.randint(0, 1024, (tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        res = prefill(model, ids, with_surprisal=True, chunk=1024)
    m = methods.get("sekv")
    p = m.resolve_params(params or {})
    store = _Store(m.compress(res, p))
    mem = m.open(store, p, res.shape, device)
    mem.batched = True
    return mem, res.shape


def ask(model, mem, question: list[int], steps: int = 2) -> dict:
    """One question (scout pass, first forward, `steps` single-token steps) under LiveBytes: each phase's peak of
    the bytes it made, with the sites alive at it; and what was there before (resident, factor blocks)."""
    from sekv_core import runtime

    q = torch.tensor([question], device=mem.device)
    mem.truncate(0)
    out: dict = {}
    step = mem._step()
    cuda = mem.device.type == "cuda"
    if getattr(mem, "_warming", None) is not None:  # the build's thread ends (its kernels' warm-up) before counting
        mem._warming.join()

    def device_peak() -> dict:  # on CUDA: the allocator's own peak of this phase beyond what was there before it
        if not cuda:
            return {}
        torch.cuda.synchronize()
        d = {"cuda_peak": torch.cuda.max_memory_allocated() - start["a"]}
        start["a"] = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        return d

    start = {"a": 0}
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start["a"] = torch.cuda.memory_allocated()
    real = type(step).scout_masses

    def scoring(self, *a, **k):  # the scout's scoring alone: what it makes beyond what was alive before it
        base, peak = lb.live, lb.peak
        lb.peak = lb.live
        try:
            return real(self, *a, **k)
        finally:
            out["scoring"] = max(out.get("scoring", 0), lb.peak - base)
            lb.peak = max(peak, lb.peak)

    with torch.inference_mode(), LiveBytes() as lb:
        lb.reset_peak()
        type(step).scout_masses = scoring
        try:
            mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
        finally:
            type(step).scout_masses = real
        out["scout"] = {"peak": lb.peak, "sites": lb.at_peak, **device_peak()}
        lb.reset_peak()
        logits = runtime.forward_logits(model, q, mem.n_tokens(), mem)
        out["first_forward"] = {"peak": lb.peak, "sites": lb.at_peak, **device_peak()}
        lb.reset_peak()
        for _ in range(steps):
            logits = runtime.forward_logits(model, logits[:, -1:].argmax(-1), mem.n_tokens(), mem)
        out["step"] = {"peak": lb.peak, "sites": lb.at_peak, **device_peak()}
        out["left"] = lb.live  # made by the question and still alive after it (buffers kept for the next)
    st = mem.step
    out["resident"] = mem.resident_bytes()
    out["kv_capacity"] = sum(t.numel() * t.element_size() for t in mem.res.kv.jk + mem.res.kv.jv)
    out["blocks"] = sum(b.words.numel() * 8 for b in st.blocks)
    out["blocks_on_device"] = sum(b.words.numel() * 8 for b in st.blocks if b.words.device.type != "cpu")
    out["budget"] = mem.ledger.budget_bytes
    out["full_kv"] = mem.full_bytes()
    return out


def scout_plan(step, n_q: int) -> dict:
    """The scout's chunk plan of a batched step (gpu_step.BatchedStep._scout_chunk) for a question of n_q tokens:
    layers and pairs a chunk, the most rows and rank of a block, the block stride (words), queries a group (M)."""
    sh = step.res.shape
    m = n_q * (sh.n_heads // sh.n_kv_heads)
    n_pairs = step.hkv * step.res.n_spans
    n_max, r_max = max(b.n_max for b in step.blocks), max(b.r_max for b in step.blocks)
    pairs, lc = step._scout_chunk(n_pairs, 4 * n_max * max(step.d, m, 2 * r_max))
    per_span = int(torch.bincount(step.res.block_span).max()) if step.res.n_blocks else 1
    return {"layers": min(lc, step.L), "pairs": min(pairs, n_pairs), "n_max": n_max, "r_max": r_max, "m": m,
            "stride": max(b.stride for b in step.blocks), "n_spans": step.res.n_spans, "per_span": per_span, "n_blocks": step.res.n_blocks}


def scout_bound(shape, plan: dict) -> int:
    """Bytes the scout pass's scoring (BatchedStep.scout_masses, after the question's forward) may make, by its plan:

        5 K + 2 W + 2 Lc Hkv S b M 4 + 2 L B 4

    K, the largest float32 tensor of a chunk, Lc P 4 max(n (max(d, 2r)), M max(d, n), 2 r d) (the chunk is sized so
    that it is near SCOUT_CHUNK_BYTES: 64 MiB); at most five alive at once (a layer's dequantisation: the keys, U*s and
    its scaled copy, Vt and its copy; the rotation: keys, cos, sin and two half-size products; the logits: keys, the
    gathered queries, the logits); W, one chunk's staged block words (Lc P stride 8, two buffers); the block
    logsumexps of one chunk of layers (S spans of at most b blocks, M = question tokens x group size) and their
    concatenation; the masses of every block of every layer (B blocks)."""
    p = plan
    lc, pairs, n, r, m, d = p["layers"], p["pairs"], p["n_max"], p["r_max"], p["m"], shape.head_dim
    k = lc * pairs * 4 * max(n * max(d, 2 * r), m * max(d, n), 2 * r * d)
    w = lc * pairs * p["stride"] * 8
    lse = 2 * lc * shape.n_kv_heads * p["n_spans"] * p["per_span"] * m * 4
    return 5 * k + 2 * w + lse + 2 * shape.n_layers * p["n_blocks"] * 4


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ask_memory", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", default="4096")
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--heads", type=int, default=32)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--question", type=int, default=24, help="question tokens")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--device", default="cpu", help="cpu: the batched step run on the CPU; cuda: the same on the GPU, with the allocator's peaks too")
    ap.add_argument("--out", default=None)
    ap.add_argument("--in-place", action="store_true", help="read host blocks in place (SCOUT_STAGING False); default: streamed, as on CUDA")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from sekv_core import methods  # noqa: F401 - the package's import order
    from sekv_core.sekv import gpu_step

    gpu_step.SCOUT_STAGING = not a.in_place
    rows = []
    for n in [int(x) for x in a.tokens.split(",")]:
        model = geometry_model(a.layers, a.heads, a.kv_heads, a.head_dim, a.hidden, n, getattr(torch, a.dtype)).to(a.device)
        mem, shape = open_pack(model, n, device=a.device)
        q = torch.randint(0, 1024, (a.question,), generator=torch.Generator().manual_seed(1)).tolist()
        r = ask(model, mem, q)
        r2 = ask(model, mem, q)  # the second question (the step's buffers made)
        plan = scout_plan(mem.step, a.question)
        b = scout_bound(shape, plan)
        rows.append({"tokens": n, "layers": a.layers, "first": r, "second": r2, "scout_plan": plan, "scout_bound": b})
        mib = lambda x: x / (1 << 20)  # noqa: E731
        print(f"{n} tokens, {a.layers} layers: full KV {mib(r['full_kv']):.1f} MiB, budget {mib(r['budget']):.1f}, resident {mib(r['resident']):.1f} "
              f"(capacity {mib(r['kv_capacity']):.1f}), factor blocks {mib(r['blocks']):.1f} MiB ({mib(r['blocks_on_device']):.1f} on the device)")
        for k, x in (("first", r), ("second", r2)):
            for ph in ("scout", "first_forward", "step"):
                cu = f" (allocator: {mib(x[ph]['cuda_peak']):.1f})" if "cuda_peak" in x[ph] else ""
                print(f"  {k:6s} {ph:13s} peak {mib(x[ph]['peak']):8.1f} MiB{cu}; at it: " +
                      ", ".join(f"{s} {mib(v):.1f}" for s, v in list(x[ph]["sites"].items())[:6]))
            print(f"  {k:6s} left after it {mib(x['left']):.1f} MiB")
        print(f"  scout plan {plan}: its scoring's bound {mib(b):.1f} MiB; the scoring made at most {mib(r2['scoring']):.1f} MiB")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
