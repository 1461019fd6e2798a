"""Run the `sekv` CLI unchanged in this process, with timers around its stages (benchmarks/gpu_cli.py's child).

    python -m benchmarks.cli_probe ask PACK "question" --json ...     (any `sekv` arguments)

The CLI's own code runs as `sekv` would run it; the probe only wraps functions it calls (model load and its
parts, pack read and its sha256, the method's open, the scout pass, CUDA-graph captures, each ask) with wall-clock
timers, synchronising CUDA at their ends, and writes one JSON record to $SEKV_PROBE_OUT when the CLI exits:

  startup_s   process start (the parent's clock, $SEKV_PROBE_T0) to this module running: interpreter start-up
  import_s    importing the CLI (torch, transformers, sekv)
  cuda_init_s with $SEKV_PROBE_CUDA_INIT=1, CUDA's context made up front (else it lands in the first CUDA use)
  transformers_import_s  importing what the model load imports (transformers' Auto classes, model and tokenizer
              code): a plain `sekv` run does it inside the load, so model_load here is the load without imports
  probe_install_s  wrapping the stages
  phases      {name: {"s": total seconds, "n": calls}} of the wrapped functions
  asks        one entry per question: wall seconds, the answer's DecodeStats, captures during it
  gpu         weights' bytes, peak allocated / reserved at exit

$SEKV_PROBE_WARM=0: no warm-up of the question's kernels on the factor blocks' thread (sekv/gpu_step.py
WARM_KERNELS: the rehearsal on the pack's first layer; default on), to compare; $SEKV_PROBE_REHEARSE=0: no
rehearsal of a made-up question by `sekv chat` (sekv_core/session.py Session.rehearse).  $SEKV_PROBE_FIXED_SDPA=gqa|packed|math: how sekv's fixed sets make their SDPA call (sekv/fixed_set.py
SDPA_LAYOUT; default gqa), to compare the kernels the device picks; $SEKV_PROBE_FILL_SDPA: the same for the question's
forward alone (FILL_SDPA_LAYOUT: cuDNN's plan is built per question length).  $SEKV_PROBE_PROFILE=PATH: the whole CLI under cProfile (PATH.prof, and PATH.txt: the top functions by
cumulative time).  $SEKV_PROBE_TORCH=PATH: each ask under torch.profiler (PATH.txt: operators by CUDA and by CPU
time).  $SEKV_PROBE_TORCH_TABLE=FILE: the first $SEKV_PROBE_TORCH_ASKS (default 2) asks under torch.profiler, a
compact table each appended to FILE (:func:`compact_table`), headed by $SEKV_PROBE_LABEL.  Timers synchronise the
device, so a probed run is a little slower than a plain one; gpu_cli.py can run both.
"""

from __future__ import annotations

import functools
import json
import os
import sys
import time

T_ENTRY = time.time()
PHASES: dict[str, dict[str, float]] = {}
ASKS: list[dict] = []
RECORD: dict = {"argv": sys.argv[1:]}


def _sync() -> None:
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _add(name: str, dt: float) -> None:
    p = PHASES.setdefault(name, {"s": 0.0, "n": 0})
    p["s"] += dt
    p["n"] += 1


def wrap(owner, attr: str, name: str, after=None) -> None:
    """Replace owner.attr by a timed version (a missing attribute is skipped: the code may have moved)."""
    fn = getattr(owner, attr, None)
    if fn is None:
        RECORD.setdefault("not_wrapped", []).append(name)
        return
    # a bound classmethod stays bound (a plain function on the class is not re-bound); a plain function is
    # re-bound as a method as before

    @functools.wraps(fn)
    def timed(*args, **kwargs):
        t = time.perf_counter()
        try:
            out = fn(*args, **kwargs)
            _sync()
        finally:
            _add(name, time.perf_counter() - t)
        if after is not None:
            after(out)
        return out

    setattr(owner, attr, timed)
    # names bound by `from module import fn` (sekv_cli.cmd_ingest's run_ingest, ...) point at the original: rebind
    if not isinstance(owner, type):
        for mod in list(sys.modules.values()):
            if getattr(mod, "__name__", "").startswith(("sekv_cli", "sekv_core")):
                for k, v in list(vars(mod).items()):
                    if v is fn:
                        setattr(mod, k, timed)


def _import_transformers() -> None:
    """What a plain run imports inside its model load (transformers' Auto classes, the shared model and tokenizer
    code, a Qwen2 model's module), done here first so that model_load times the load alone."""
    import importlib

    for name in ("transformers.models.auto.modeling_auto", "transformers.models.auto.tokenization_auto", "transformers.modeling_utils",
                 "transformers.tokenization_utils_tokenizers", "transformers.models.qwen2.modeling_qwen2", "transformers.models.qwen2.tokenization_qwen2"):
        try:
            importlib.import_module(name)
        except ImportError:
            pass


def _install_ingest_stages() -> None:
    """Where `sekv ingest`'s time goes inside its prefill and its compress, without a device sync added (they would
    change the overlap they measure): RECORD["ingest_stream"]: the prefill thread's seconds inside the pipelined
    stream's hook (sekv_core/chunk_stream.py ChunkStream.layer, "chunks" its calls: a layer's rows of a chunk; the
    tier's rows launched, the rows handed to the pack's writer) and, of them, the seconds it waited for the writer's queue (pack.PackWriter.submit: the writer behind);
    RECORD["compress_events"]: sekv compress's progress events (sekv/compress.py PROGRESS) as (event, seconds from
    the first window's compress start: "window_start", after that window's prefill), its end last (host clock: a layer group's event comes after its ranks' read-back, a sync)."""
    import sekv_core.chunk_stream as cs
    import sekv_core.pack as pack
    import sekv_core.sekv.compress as sc

    st = RECORD.setdefault("ingest_stream", {"on_chunk_s": 0.0, "submit_wait_s": 0.0, "chunks": 0, "compress_submit_wait_s": 0.0})
    call, submit, inside = cs.ChunkStream.layer, pack.PackWriter.submit, []

    def on_chunk(self, *a, **k):
        t = time.perf_counter()
        inside.append(1)
        try:
            return call(self, *a, **k)
        finally:
            inside.pop()
            st["on_chunk_s"] += time.perf_counter() - t
            st["chunks"] += 1

    def timed_submit(self, *a, **k):
        t = time.perf_counter()
        try:
            return submit(self, *a, **k)
        finally:
            st["submit_wait_s" if inside else "compress_submit_wait_s"] += time.perf_counter() - t

    cs.ChunkStream.layer, pack.PackWriter.submit = on_chunk, timed_submit
    events, outer, windows, window = RECORD.setdefault("compress_events", []), sc.PROGRESS, sc.compress_windows, sc.compress_window
    t0 = [None]

    def note(event: str) -> None:
        if t0[0] is None:
            t0[0] = time.perf_counter()
        events.append([event, round(time.perf_counter() - t0[0], 4)])

    def progress(event, **info):
        note(event)
        if outer is not None:
            outer(event, **info)

    def compress_window(*a, **k):  # a window's compress, after its prefill (the windows' prefills run inside compress_windows)
        note("window_start")
        return window(*a, **k)

    def compress_windows(*a, **k):
        try:
            return windows(*a, **k)
        finally:
            note("end")

    sc.PROGRESS, sc.compress_windows, sc.compress_window = progress, compress_windows, compress_window


def _install() -> None:
    import sekv_core.graphed_step as gs
    import sekv_core.ingest as ing
    import sekv_core.models as models
    import sekv_core.pack as pack
    import sekv_core.session as session
    import transformers

    wrap(models, "load", "model_load")
    wrap(models, "resolve", "model_load.resolve")
    wrap(models, "_weights_fingerprint", "model_load.weights_fingerprint")
    wrap(models, "tokenizer_fingerprint", "model_load.tokenizer_fingerprint")
    wrap(transformers.AutoTokenizer, "from_pretrained", "model_load.tokenizer")
    wrap(transformers.AutoModelForCausalLM, "from_pretrained", "model_load.from_pretrained")
    wrap(session, "read_pack", "pack_read")
    wrap(pack, "_hash_from", "pack_read.sha256")
    wrap(session, "check_model", "check_model")
    wrap(gs.GraphedStep, "_eager_then_capture", "graph_capture")
    import sekv_core.sekv.gpu_step as gpu_step

    # the batched step's factor blocks (each layer's factors decoded and laid out in pinned memory): built once, on
    # a second thread from the pack's read, before the model loads (sekv_step_build, that thread's seconds), and what
    # the first forward still waits for them (sekv_blocks_wait, inside the first question's scout pass)
    wrap(gpu_step, "build_blocks", "sekv_step_build")
    wrap(gpu_step.BlockBuild, "result", "sekv_blocks_wait")
    wrap(gpu_step.BlockBuild, "result_or_none", "sekv_blocks_wait")  # the build started before the model load
    if os.environ.get("SEKV_PROBE_WARM") == "0":  # no warm-up of the question's kernels on the blocks' thread
        gpu_step.WARM_KERNELS = False
    RECORD["warm_kernels"] = gpu_step.WARM_KERNELS
    if os.environ.get("SEKV_PROBE_REHEARSE") == "0":  # no rehearsal of a made-up question in `sekv chat`
        session.Session.rehearse = lambda self, **k: False
    RECORD["rehearse"] = os.environ.get("SEKV_PROBE_REHEARSE") != "0"
    # the layers that build kept in device memory (moved to pinned host memory in pauses: sekv/blocks.py HostPinning)
    import sekv_core.sekv.blocks as fb

    pin_init = fb.HostPinning.__init__

    def kept(self, blocks, layers, *a, **k):
        pin_init(self, blocks, layers, *a, **k)
        RECORD["blocks_kept"] = {"layers": len(layers), "of": len(blocks), "bytes": self.device_bytes()}

    fb.HostPinning.__init__ = kept
    if os.environ.get("SEKV_PROBE_FIXED_SDPA"):  # how sekv's fixed sets call SDPA (sekv/fixed_set.py SDPA_LAYOUT)
        import sekv_core.sekv.fixed_set as fixed_set

        fixed_set.SDPA_LAYOUT = RECORD["fixed_sdpa"] = os.environ["SEKV_PROBE_FIXED_SDPA"]
    if os.environ.get("SEKV_PROBE_FILL_SDPA"):  # the same for the question's forward only (fixed_set.FILL_SDPA_LAYOUT)
        import sekv_core.sekv.fixed_set as fixed_set

        fixed_set.FILL_SDPA_LAYOUT = RECORD["fill_sdpa"] = os.environ["SEKV_PROBE_FILL_SDPA"]

    def note_ingest(r) -> None:
        RECORD["ingest"] = {k: getattr(r, k) for k in ("n_tokens", "prefill_s", "compress_s", "write_s", "total_s", "pack_bytes", "raw_kv_fp16_bytes", "after_prefill_s", "written_in_prefill", "pipelined", "warm_wait_s") if hasattr(r, k)}

    wrap(ing, "ingest", "ingest", after=note_ingest)
    _install_ingest_stages()

    open_raw = session.Session.open.__func__

    def open_timed(cls, *args, **kwargs):
        t = time.perf_counter()
        s = open_raw(cls, *args, **kwargs)
        _sync()
        _add("session_open", time.perf_counter() - t)
        RECORD["session_load_s"] = s.load_s
        mem = s.memory
        if hasattr(mem, "prepare_question"):
            prep = mem.prepare_question

            def scout(*a, **k):
                t0 = time.perf_counter()
                try:
                    with _label("sekv.scout"):
                        return prep(*a, **k)
                finally:
                    _sync()
                    _add("scout", time.perf_counter() - t0)

            mem.prepare_question = scout
        params = sum(p.numel() * p.element_size() for p in s.lm.model.parameters())
        RECORD.setdefault("gpu", {})["weights_bytes"] = params
        return s

    session.Session.open = classmethod(open_timed)
    ask_raw = session.Session.ask
    torch_prof = os.environ.get("SEKV_PROBE_TORCH")

    table = os.environ.get("SEKV_PROBE_TORCH_TABLE")
    table_asks = int(os.environ.get("SEKV_PROBE_TORCH_ASKS", "2"))

    def ask_timed(self, question, **kwargs):
        caps0 = PHASES.get("graph_capture", {}).get("n", 0)
        before = {k: PHASES.get(k, {}).get("s", 0.0) for k in ("scout", "sekv_blocks_wait", "graph_capture")}
        t = time.perf_counter()
        if table and len(ASKS) < table_asks:
            import torch.profiler as tp

            acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if _cuda() else [])
            with tp.profile(activities=acts) as prof:
                ans = ask_raw(self, question, **kwargs)
            st = ans.stats
            title = (f"{os.environ.get('SEKV_PROBE_LABEL', '')} question {len(ASKS) + 1}: TTFT {st.ttft_s:.3f} s (scout {st.scout_s:.3f}, "
                     f"first forward {st.first_forward_s:.3f}), {st.generated_tokens} tokens, capture {st.capture_s:.3f} s, "
                     f"ask {time.perf_counter() - t:.3f} s; all under the profiler")
            with open(table, "a") as f:
                f.write(compact_table(prof, title) + "\n")
        elif torch_prof:
            import torch.profiler as tp

            acts = [tp.ProfilerActivity.CPU] + ([tp.ProfilerActivity.CUDA] if _cuda() else [])
            with tp.profile(activities=acts) as prof:
                ans = ask_raw(self, question, **kwargs)
            with open(f"{torch_prof}.{len(ASKS)}.txt", "w") as f:
                ka = prof.key_averages()
                if _cuda():
                    f.write(ka.table(sort_by="cuda_time_total", row_limit=40) + "\n")
                f.write(ka.table(sort_by="cpu_time_total", row_limit=40) + "\n")
        else:
            ans = ask_raw(self, question, **kwargs)
        wall = time.perf_counter() - t
        st = ans.stats.as_dict()
        extra = st.pop("extra", None) or {}
        ASKS.append(
            {
                "question": question,
                "answer": ans.text,
                "wall_s": wall,
                "scout_s": PHASES.get("scout", {}).get("s", 0.0) - before["scout"],
                "blocks_wait_s": PHASES.get("sekv_blocks_wait", {}).get("s", 0.0) - before["sekv_blocks_wait"],  # inside scout_s
                "capture_s": PHASES.get("graph_capture", {}).get("s", 0.0) - before["graph_capture"],
                "captures": PHASES.get("graph_capture", {}).get("n", 0) - caps0,
                "stats": st,
                "extra": {k: v for k, v in extra.items() if isinstance(v, (int, float, str, bool))},
                # sekv: host seconds of the way to the first token, by part (ZoomMemory.first_token_parts)
                "first_token_parts": extra.get("first_token_parts") or {},
            }
        )
        return ans

    session.Session.ask = ask_timed


def _label(name: str):
    """A torch.profiler range (a row of the tables) where torch is imported, else nothing."""
    import contextlib

    torch = sys.modules.get("torch")
    return torch.profiler.record_function(name) if torch is not None else contextlib.nullcontext()


#: runtime calls counted in the compact table's summary: launches, and the ones that make the host wait
LAUNCHES = ("cudaLaunchKernel", "cuLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernelEx", "cudaGraphLaunch")
WAITS = ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaEventSynchronize", "cudaMemcpy", "cudaStreamWaitEvent")


def compact_table(prof, title: str, rows: int = 20) -> str:
    """One profiled ask in a few lines: device and host totals, kernel launches and host waits (the runtime calls
    that block), the top ``rows`` operators and kernels by self device time (calls, device ms, host ms), and the
    runtime calls by host time (allocations, module loads and syncs show there)."""
    ev = prof.key_averages()

    def dev(e, self_=True):
        for k in (("self_device_time_total", "self_cuda_time_total") if self_ else ("device_time_total", "cuda_time_total")):
            v = getattr(e, k, None)
            if v is not None:
                return float(v) / 1e3
        return 0.0

    runtime = [e for e in ev if e.key.startswith(("cuda", "cu")) and not e.key.startswith("cudnn")]
    launches = sum(e.count for e in runtime if e.key in LAUNCHES)
    waits = {e.key: e.count for e in runtime if e.key in WAITS}
    on_device = sum(dev(e) for e in ev)
    out = [f"== {title}",
           f"device time (self, all rows) {on_device:.1f} ms; host time (self, all rows) {sum(e.self_cpu_time_total for e in ev) / 1e3:.1f} ms; "
           f"kernel launches {launches}; host waits {waits or 'none'}"]
    key = dev if on_device > 0 else (lambda e: e.self_cpu_time_total)  # no device: the host's own time
    out.append(f"{'calls':>7} {'dev ms':>9} {'host ms':>9}  operator / kernel (top {rows} by self {'device' if on_device > 0 else 'host'} time)")
    for e in sorted((e for e in ev if not e.key.startswith("sekv.")), key=key, reverse=True)[:rows]:
        out.append(f"{e.count:7d} {dev(e):9.2f} {e.cpu_time_total / 1e3:9.2f}  {e.key[:110]}")
    out.append(f"{'calls':>7} {'':>9} {'host ms':>9}  runtime calls and ranges by host time")
    marks = [e for e in ev if e.key.startswith("sekv.")]
    for e in sorted(runtime + marks, key=lambda e: e.cpu_time_total, reverse=True)[:12]:
        out.append(f"{e.count:7d} {'':>9} {e.cpu_time_total / 1e3:9.2f}  {e.key[:110]}")
    return "\n".join(out)


def _cuda() -> bool:
    torch = sys.modules.get("torch")
    return torch is not None and torch.cuda.is_available()


def _write() -> None:
    out = os.environ.get("SEKV_PROBE_OUT")
    RECORD["phases"] = PHASES
    RECORD["asks"] = ASKS
    RECORD["wall_s"] = time.time() - T_ENTRY
    if _cuda() and sys.modules["torch"].cuda.is_initialized():
        torch = sys.modules["torch"]
        g = RECORD.setdefault("gpu", {})
        g["max_allocated_bytes"] = int(torch.cuda.max_memory_allocated())
        g["max_reserved_bytes"] = int(torch.cuda.max_memory_reserved())
    try:
        import psutil

        RECORD["rss_bytes_at_exit"] = psutil.Process().memory_info().rss
    except ImportError:
        pass
    if out:
        with open(out, "w") as f:
            json.dump(RECORD, f, indent=1, default=str)


def main() -> int:
    t0 = os.environ.get("SEKV_PROBE_T0")
    if t0:
        RECORD["startup_s"] = T_ENTRY - float(t0)
    t = time.perf_counter()
    import sekv_cli.app as app

    RECORD["import_s"] = time.perf_counter() - t
    if os.environ.get("SEKV_PROBE_CUDA_INIT") == "1":
        import torch

        t = time.perf_counter()
        if torch.cuda.is_available():
            torch.zeros(1, device="cuda")
            torch.cuda.synchronize()
        RECORD["cuda_init_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _import_transformers()
    RECORD["transformers_import_s"] = time.perf_counter() - t
    t = time.perf_counter()
    _install()
    RECORD["probe_install_s"] = time.perf_counter() - t
    sys.argv = ["sekv", *sys.argv[1:]]
    code = 0
    prof_path = os.environ.get("SEKV_PROBE_PROFILE")
    prof = None
    if prof_path:
        import cProfile

        prof = cProfile.Profile()
        prof.enable()
    try:
        app.main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    finally:
        if prof is not None:
            import pstats

            prof.disable()
            prof.dump_stats(f"{prof_path}.prof")
            with open(f"{prof_path}.txt", "w") as f:
                pstats.Stats(prof, stream=f).sort_stats("cumulative").print_stats(60)
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)
        RECORD["exit_code"] = code
        _write()
    return code


if __name__ == "__main__":
    sys.exit(main())
