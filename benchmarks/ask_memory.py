"""What makes up the compute device's memory during a sekv `ask`, counted on the CPU.

The batched step (sekv/gpu_step.py, what CUDA runs) is run on the CPU on a pack of a random-weight model of the
geometry asked for (default: Llama-3-8B's attention, 32 query heads and 8 KV heads of 128, few layers, a small
hidden size), and every tensor the question makes is counted while it lives (:class:`LiveBytes`, a
TorchDispatchMode: a tensor's storage counted from the op that made it until the last tensor on it goes).  What was
there before the question (the resident KV and router, the factor blocks) is counted apart.  The peak of each phase
(the scout pass, the answer's first forward, single-token steps) is given with the sekv lines whose tensors were
alive at it, and :func:`scout_bound` is the formula the scout's scoring is checked against (tests/test_ask_memory.py):

    python -m benchmarks.ask_memory --tokens 4096,8192 --layers 2 [--out ask_memory.json]
    python -m benchmarks.ask_memory --tokens 131072 --tile 8192 --layers 2 --build     # the 8B's attention at 128K

Phases: the scout pass's forward (its routed attention) and its scoring, the answer's first forward (the fixed sets'
fill), single-token steps; ``--build``: one layer's factor-block build (gpu_step.build_blocks: the codes decoded and
re-laid where a CUDA build runs them on the device while a first question may wait).  Every allocation of at least
``--list-mib`` (32 MiB) is listed with its phase and site.  ``--tile M``: the model prefills M tokens, and their
KV (keys de-rotated, tiled, rotated at their new positions), tokens and surprisal are repeated to ``--tokens`` (a
128K pack without a 128K prefill on the CPU: the same shapes, budget, spans and ranks of the same kind).

Kernels' own workspaces (cuBLAS, SDPA's) are not tensors and are not counted; nor is the caching allocator's rounding.
What a CUDA kernel allocates inside one op is counted where it is known: masked_scatter_'s int64 running count of its
destination (8 bytes an element), alive during the op (``cuda_internal`` sites).
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
        self.phase = ""  # named by the caller; every allocation of at least big_bytes is listed with it in ``big``
        self.big_bytes = 32 << 20
        self.big: list[tuple[str, str, int]] = []  # (phase, site, bytes)

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
            if n >= self.big_bytes:
                self.big.append((self.phase, site, n))
            if self.live > self.peak:
                self.peak, self.at_peak = self.live, None  # sites filled lazily (below)
        entry[2].append(weakref.ref(t))
        weakref.finalize(t, self._gone, ptr)

    def _internal(self, n: int, site: str) -> None:
        """n bytes a CUDA kernel allocates and frees inside one op: a peak of live + n while it runs."""
        if n >= self.big_bytes:
            self.big.append((self.phase, site, n))
        if self.live + n > self.peak:
            self._by_ptr[-1] = (n, site, [])
            self.peak, self.at_peak = self.live + n, self._sites()
            del self._by_ptr[-1]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.masked_scatter_.default:  # CUDA: an int64 running count of the whole destination
            self._internal(8 * args[0].numel(), f"cuda_internal {_site()} masked_scatter_")
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


def tiled(res, n: int):
    """A prefill result repeated to n tokens: its keys de-rotated, repeated and rotated at their new positions (the
    model's rotary tables), its values, tokens and surprisal repeated."""
    import dataclasses

    from sekv_core.sekv import rope

    m = res.n_tokens
    if n <= m:
        return res
    reps = -(-n // m)
    inv, sc = rope.inv_freq_of(res.shape), res.shape.rope_attention_scaling
    keys = []
    for k in res.keys:
        dev = k.device
        cm, sm = rope.cos_sin(torch.arange(m, device=dev), inv, sc)
        pre = rope.undo(k.float(), cm, sm).repeat(1, reps, 1)[:, :n]
        out = torch.empty(k.shape[0], n, k.shape[2], dtype=k.dtype, device=dev)
        for a in range(0, n, m):  # a tile's rotation at a time (float32 temporaries of one tile)
            cn, sn = rope.cos_sin(torch.arange(a, min(n, a + m), device=dev), inv, sc)
            out[:, a : a + m] = rope.apply(pre[:, a : a + m], cn, sn).to(k.dtype)
        keys.append(out)
        del pre
    rep = lambda x: x.repeat(*([1] * (x.dim() - 1)), reps)[..., :n] if x.dim() == 1 else x.repeat(1, reps, 1)[:, :n].contiguous()  # noqa: E731
    surprisal = None if res.surprisal is None else res.surprisal.repeat(reps)[:n]
    return dataclasses.replace(res, token_ids=res.token_ids.repeat(reps)[:n], keys=keys, values=[rep(v) for v in res.values], surprisal=surprisal)


def open_pack(model, tokens: int, params: dict | None = None, seed: int = 0, device: str = "cpu", tile: int = 0):
    """A sekv pack of `tokens` random tokens prefilled by `model` (on ``device``), opened with the batched step there
    (the CPU: the batched step CUDA runs, run on the CPU; CUDA: the factor blocks built as an `ask` builds them).
    ``tile``: only that many tokens prefilled, their KV repeated to ``tokens`` (:func:`tiled`)."""
    from sekv_core import methods
    from sekv_core.prefill import prefill

    ids = torch.randint(0, 1024, (min(tokens, tile) if tile else tokens,), generator=torch.Generator().manual_seed(seed))
    with torch.inference_mode():
        res = prefill(model, ids, with_surprisal=True, chunk=1024)
    res = tiled(res, tokens)
    m = methods.get("sekv")
    p = m.resolve_params(params or {})
    store = _Store(m.compress(res, p))
    del res
    mem = m.open(store, p, mem_shape(model, store), device)
    mem.batched = True
    return mem, mem.shape


def mem_shape(model, store):
    from sekv_core.methods.base import ModelShape

    return ModelShape.of(model.config, next(model.parameters()).dtype)


def build_layer(mem, layer: int = 0, big_bytes: int = 32 << 20) -> dict:
    """The factor-block build under LiveBytes: on the CPU one layer's (gpu_step.build_blocks' per-layer work: the codes
    decoded, the blocks re-laid), on CUDA the whole build_blocks as BlockBuild runs it (each layer decoded and re-laid
    on the device, page-locked, copied out), with the allocator's peak beyond what was allocated before it: what a
    first question that waits for the build holds beside the resident set.  -> its peak, sites, the layer's words."""
    from sekv_core.sekv import blocks as fb
    from sekv_core.sekv import gpu_step

    res = mem.res
    cuda = res.device.type == "cuda"
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    with torch.inference_mode(), LiveBytes() as lb:
        lb.big_bytes, lb.phase = big_bytes, "build"
        if cuda:
            blocks = gpu_step.build_blocks(res, keep=0.0)
            words = blocks[layer].words.numel() * 8
        else:
            b = fb.build(res.factors.on_device(layer), res.span_len, res.shape.head_dim, "cpu", pin=False, r_max=res.factors.rank_max(layer),
                         rank_host=gpu_step._rank_host(res, layer))
            words = b.words.numel() * 8
        out = {"peak": lb.peak, "sites": lb.at_peak, "words": words, "big": lb.big}
    if cuda:
        torch.cuda.synchronize()
        out["cuda_peak"] = torch.cuda.max_memory_allocated() - base
    return out


def ask(model, mem, question: list[int], steps: int = 2, big_bytes: int = 32 << 20) -> dict:
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
        # what the device holds as the question starts, beyond the model's weights: the resident set, and what the
        # tensors counted here do not see (kernels' workspaces: cuBLAS keeps one a thread and stream, the zoom tier's
        # staging ring, graphs' outputs, ...)
        out["allocated_before"] = start["a"] - sum(p.numel() * p.element_size() for p in model.parameters())
    real = type(step).scout_masses

    def scoring(self, *a, **k):  # the scout's scoring alone: what it makes beyond what was alive before it
        out["scout_forward"] = {"peak": lb.peak, "sites": lb.at_peak if lb.at_peak is not None else lb._sites()}  # its forward, before it
        lb.phase = "scout scoring"
        base, peak = lb.live, lb.peak
        lb.peak = lb.live
        try:
            return real(self, *a, **k)
        finally:
            out["scoring"] = max(out.get("scoring", 0), lb.peak - base)
            lb.peak = max(peak, lb.peak)

    with torch.inference_mode(), LiveBytes() as lb:
        lb.big_bytes = big_bytes
        lb.reset_peak()
        lb.phase = "scout forward"
        type(step).scout_masses = scoring
        try:
            mem.prepare_question(lambda: runtime.forward_hidden(model, q, mem.n_tokens(), mem))
        finally:
            type(step).scout_masses = real
        out["scout"] = {"peak": lb.peak, "sites": lb.at_peak, **device_peak()}
        lb.reset_peak()
        lb.phase = "first forward"
        logits = runtime.forward_logits(model, q, mem.n_tokens(), mem)
        out["first_forward"] = {"peak": lb.peak, "sites": lb.at_peak, **device_peak()}
        lb.reset_peak()
        lb.phase = "step"
        for _ in range(steps):
            logits = runtime.forward_logits(model, logits[:, -1:].argmax(-1), mem.n_tokens(), mem)
        out["step"] = {"peak": lb.peak, "sites": lb.at_peak, **device_peak()}
        out["left"] = lb.live  # made by the question and still alive after it (buffers kept for the next)
        out["big"] = lb.big
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
    ap.add_argument("--tile", type=int, default=0, help="prefill this many tokens and repeat their KV to --tokens (0: prefill them all)")
    ap.add_argument("--build", action="store_true", help="also count one layer's factor-block build (what a CUDA build holds on the device)")
    ap.add_argument("--list-mib", type=float, default=32, help="list every allocation of at least this many MiB, with its phase")
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    from sekv_core import methods  # noqa: F401 - the package's import order
    from sekv_core.sekv import gpu_step

    gpu_step.SCOUT_STAGING = not a.in_place
    rows = []
    for n in [int(x) for x in a.tokens.split(",")]:
        model = geometry_model(a.layers, a.heads, a.kv_heads, a.head_dim, a.hidden, n, getattr(torch, a.dtype)).to(a.device)
        mem, shape = open_pack(model, n, device=a.device, tile=a.tile)
        q = torch.randint(0, 1024, (a.question,), generator=torch.Generator().manual_seed(1)).tolist()
        big = int(a.list_mib * (1 << 20))
        r = ask(model, mem, q, big_bytes=big)
        r2 = ask(model, mem, q, big_bytes=big)  # the second question (the step's buffers made)
        plan = scout_plan(mem.step, a.question)
        b = scout_bound(shape, plan)
        row = {"tokens": n, "layers": a.layers, "tile": a.tile, "first": r, "second": r2, "scout_plan": plan, "scout_bound": b,
               "slots": mem.step.U, "pairs": mem.step.P}
        if a.build:
            row["build"] = build_layer(mem, big_bytes=big)
        rows.append(row)
        mib = lambda x: x / (1 << 20)  # noqa: E731
        print(f"{n} tokens, {a.layers} layers: full KV {mib(r['full_kv']):.1f} MiB, budget {mib(r['budget']):.1f}, resident {mib(r['resident']):.1f} "
              f"(capacity {mib(r['kv_capacity']):.1f}), factor blocks {mib(r['blocks']):.1f} MiB ({mib(r['blocks_on_device']):.1f} on the device); "
              f"slots a layer {mem.step.U}, pairs {mem.step.P}")
        for k, x in (("first", r), ("second", r2)):
            if "allocated_before" in x:
                print(f"  {k:6s} allocated as it starts, beyond the weights {mib(x['allocated_before']):.1f} MiB (resident {mib(x['resident']):.1f})")
            for ph in ("scout_forward", "scout", "first_forward", "step"):
                if ph not in x:
                    continue
                cu = f" (allocator: {mib(x[ph]['cuda_peak']):.1f})" if "cuda_peak" in x[ph] else ""
                print(f"  {k:6s} {ph:13s} peak {mib(x[ph]['peak']):8.1f} MiB{cu}; at it: " +
                      ", ".join(f"{s} {mib(v):.1f}" for s, v in list(x[ph]["sites"].items())[:6]))
            print(f"  {k:6s} left after it {mib(x['left']):.1f} MiB")
        print(f"  scout plan {plan}: its scoring's bound {mib(b):.1f} MiB; the scoring made at most {mib(r2['scoring']):.1f} MiB")
        if "build" in row:
            bl = row["build"]
            cu = f" (allocator, the whole build: {mib(bl['cuda_peak']):.1f})" if "cuda_peak" in bl else ""
            print(f"  the block build: peak {mib(bl['peak']):.1f} MiB{cu} (a layer's words {mib(bl['words']):.1f}); at it: " +
                  ", ".join(f"{s} {mib(v):.1f}" for s, v in list(bl["sites"].items())[:6]))
        print(f"  allocations of at least {a.list_mib:g} MiB (phase, site, MiB):")
        for ph, site, nb in sorted(set((p_, s_, n_) for k in ("first", "second") for p_, s_, n_ in row[k]["big"]) | set(row.get("build", {}).get("big", [])),
                                   key=lambda x: -x[2]):
            print(f"    {ph:14s} {site:52s} {mib(nb):8.1f}")
    if a.out:
        with open(a.out, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
