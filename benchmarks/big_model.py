"""A model at the edge of one GPU: Llama-3.1-70B's shape on one H200, `full` vs `sekv` through the pack path.

Random bf16 weights of the Llama-3.1-70B shape (80 layers, hidden 8192, 64 query / 8 KV heads, intermediate 28672,
vocab 128256, RoPE theta 500000 with llama3 scaling, a 128K window) are built in memory directly on the GPU (no
checkpoint: ~131 GiB of weights, ~8 GiB of the H200 left).  The full KV is 320 KiB a token (40 GiB at 128K), so the
ingest's prefill keeps it in host memory chunk by chunk (sekv_core/kv_offload.py, chosen by the prefill when the KV
would not fit) and every cell goes through what `sekv ingest` / `sekv ask` run: ``sekv.ingest`` writes a pack to
disk, ``sekv.open`` reads it, ``Pack.ask`` answers.  Random weights are honest for memory and speed, not quality.

Cells, shortest first (``--time-limit`` skips what would not finish): the `full` ladder (8K, 16K, 32K, 64K: stops at
the first that fails, out of memory) and sekv at 32K, 64K and ~128K (the document fills the window less the question's
reserve).  Per cell: ingest time (prefill / compress / write), whether the KV was offloaded, peak GPU memory beyond
the weights (ingest; open + ask), pack size, open time, TTFT of a first and a second ask (the pack's file just
written, so read from the page cache), decode ms/token, resident KV / full KV.

A run that is cut leaves its evidence: the JSON at ``--out`` is rewritten at the end of every stage of every cell
(document, prefill, compress's scout profiles, every ~10 layers of its factors, every ~10 layers of the merge, write,
open, first and second ask; the running cell under ``running``, with each stage's seconds and compress's plans),
``--stage-log FILE`` gets one JSON line a stage (flushed to disk), and stderr one line a stage.  ``--cell-limit``
caps a cell's seconds (and ``--time-limit`` the run's): a cell past its cap is abandoned at its next checkpoint (a
stage's end, a prefill chunk or decode step, a compress layer group) with an error row naming the stage it was in,
and the next cells run.

``--methods`` / ``--lengths`` choose the cells (in the given order); a sekv cell's row also records its compress
plans (sekv/compress.py: the memory bound, layer group, span chunks a layer).

    python -m benchmarks.big_model --out "$OUT/big_model.json" --time-limit 540        # one H200
    python -m benchmarks.big_model --methods sekv --lengths 32768,131072 --out "$OUT/sekv.json" --stage-log "$OUT/stages.jsonl" \
        --time-limit 500 --cell-limit 300
    python -m benchmarks.big_model --shape tiny --out /tmp/big_model_tiny.json         # the same code on a CPU
    python -m benchmarks.big_model --shape tiny --methods sekv --lengths 1024,4096 --compress-bound 1500000 \
        --offload-kv on --out /tmp/big_model_tiny.json                                 # compress's GPU chunking on a CPU
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
PROMPT_TOKENS = 0  # the chat template's and system prompt's tokens around a document (set in main)
GiB = 1 << 30
SHAPES = {
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64, num_key_value_heads=8,
                vocab_size=128256, max_position_embeddings=131072, rope_theta=500000.0, original_window=8192),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
                 vocab_size=None, max_position_embeddings=4096, rope_theta=500000.0, original_window=512),
}
#: per shape: the sekv contexts (0: the window less the question's reserve), the full ladder
PLAN = {"70b": ([32768, 65536, 0], [8192, 16384, 32768, 65536]), "tiny": ([1024, 2048, 0], [512, 1024, 2048])}
METHODS = ("sekv", "full")
PLANS: list[dict] = []  # sekv compress's plans of the running cell (sekv/compress.py plan)
QUESTION = "What does the keeper's log say about the storm and the lamp?"
CHATML = (
    "{% for m in messages %}{{ '<|im_start|>' + m['role'] + '\\n' + m['content'] + '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer():
    """A small BPE tokenizer trained on the sample documents (the model's weights are random: any tokenizer whose ids
    fit the vocabulary does)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=2000, special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(sample_texts(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>")
    fast.chat_template = CHATML
    return fast


def sample_texts() -> list[str]:
    return [p.read_text() for p in sorted((ROOT / "sample_docs").glob("*.md"))]


def config(shape: str, tok):
    from transformers import LlamaConfig

    s = dict(SHAPES[shape])
    orig = s.pop("original_window")
    s["vocab_size"] = s["vocab_size"] or len(tok)
    rope = {"rope_type": "llama3", "rope_theta": s.pop("rope_theta"), "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": orig}
    return LlamaConfig(**s, rope_parameters=rope, rms_norm_eps=1e-5, tie_word_embeddings=False, eos_token_id=tok.eos_token_id,
                       pad_token_id=tok.pad_token_id, bos_token_id=None)


def build_model(shape: str, tok, devices: list[torch.device]):
    """Random weights of the shape, made on the device(s) in bf16 (float32 on a CPU), no checkpoint.  One device:
    transformers' own init there.  Several: the layers in equal consecutive groups, one per device (embedding on the
    first, final norm and LM head on the last), each module made on its device, then placed by accelerate
    (dispatch_model: its hooks carry the hidden states from device to device), as a --device-map would."""
    from transformers import AutoModelForCausalLM

    cfg = config(shape, tok)
    dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    torch.manual_seed(0)
    if len(devices) == 1:
        with torch.device(devices[0]):
            return AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    from accelerate import dispatch_model

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(cfg, dtype=dtype)
    inner, n = model.model, cfg.num_hidden_layers
    per = -(-n // len(devices))
    first, last = devices[0], devices[-1]
    where = {"model.embed_tokens": first, "model.rotary_emb": first, "model.norm": last, "lm_head": last}
    made = {"model.embed_tokens": lambda: torch.nn.Embedding(cfg.vocab_size, cfg.hidden_size, cfg.pad_token_id),
            "model.rotary_emb": lambda: type(inner.rotary_emb)(config=cfg),
            "model.norm": lambda: type(inner.norm)(cfg.hidden_size, eps=cfg.rms_norm_eps),
            "lm_head": lambda: torch.nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)}
    for i in range(n):
        where[f"model.layers.{i}"] = devices[i // per]
        made[f"model.layers.{i}"] = lambda i=i: type(inner.layers[0])(cfg, i)
    default = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        for name, make in made.items():
            with torch.device(where[name]):
                module = make()
            parent, _, attr = name.rpartition(".")
            target = model.get_submodule(parent) if parent else model
            if attr.isdigit():
                target[int(attr)] = module
            else:
                setattr(target, attr, module)
    finally:
        torch.set_default_dtype(default)
    return dispatch_model(model, device_map={k: str(v) for k, v in where.items()}, force_hooks=True)


def document(tok, n_tokens: int, path: Path) -> Path:
    """A text file of about n_tokens tokens (the sample documents, numbered, repeated)."""
    parts, total, i = [], 0, 0
    texts = sample_texts()
    while total < n_tokens:
        t = f"\n\n## Part {i + 1}\n\n" + texts[i % len(texts)]
        parts.append(t)
        total += len(tok(t, add_special_tokens=False)["input_ids"])
        i += 1
    ids = tok("".join(parts), add_special_tokens=False)["input_ids"][:n_tokens]
    path.write_text(tok.decode(ids))
    return path


class Gpu:
    """Peak GPU memory beyond the weights, the most of any GPU used (None on a CPU); per GPU in ``per_gpu()``."""

    def __init__(self, devices: list[torch.device]):
        self.devices = sorted({d for d in devices if d.type == "cuda"}, key=str)
        self.on = bool(self.devices)
        self.weights = {d: torch.cuda.memory_allocated(d) for d in self.devices}

    def reset(self) -> None:
        if self.on:
            gc.collect()
            torch.cuda.empty_cache()
            for d in self.devices:
                torch.cuda.reset_peak_memory_stats(d)

    def per_gpu(self) -> dict[str, float]:
        return {str(d): round((torch.cuda.max_memory_allocated(d) - self.weights[d]) / GiB, 3) for d in self.devices}

    def peak_beyond_weights_gib(self) -> float | None:
        return max(self.per_gpu().values()) if self.on else None

    def free_gib(self) -> dict[str, float] | None:
        return {str(d): round(torch.cuda.mem_get_info(d)[0] / GiB, 3) for d in self.devices} if self.on else None

    def weights_gib(self) -> dict[str, float]:
        return {str(d): round(b / GiB, 2) for d, b in self.weights.items()}


def out_of_memory(e: BaseException) -> bool:
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, torch.OutOfMemoryError) or "out of memory" in str(e).lower():
            return True
        e = e.__cause__ or e.__context__
    return False


class CellTimeout(Exception):
    """A cell past its time cap (raised at its next checkpoint)."""


class Stages:
    """Where the running cell is.  Each stage's end is recorded in the cell's row (``stages``: name, seconds, run
    time at its end), saved to the JSON (``save``), appended to the stage log and printed to stderr, so a run that
    is cut shows where its time went.  :meth:`check` raises CellTimeout past the cell's deadline."""

    def __init__(self, save, log_path: str | None, t_start: float):
        self.save, self.t_start = save, t_start
        self.log = open(log_path, "a") if log_path else None
        self.row: dict | None = None
        self.name, self.since, self.deadline, self.fired, self.chunks = None, 0.0, None, None, 0

    def begin(self, row: dict, deadline: float) -> None:
        self.row, self.deadline, self.fired, self.chunks = row, deadline, None, 0
        row["stages"] = []
        self.name, self.since = None, time.perf_counter()

    def _line(self, what: str, info: dict) -> None:
        now = time.perf_counter()
        rec = {"at_s": round(now - self.t_start, 1), "cell": f"{self.row['method']} {self.row['target_tokens']}" if self.row else None,
               "event": what} | info
        print(f"[{rec['at_s']:7.1f} s] {rec['cell']}: {what} {json.dumps(info)}", file=sys.stderr, flush=True)
        if self.log is not None:
            self.log.write(json.dumps(rec) + "\n")
            self.log.flush()
            os.fsync(self.log.fileno())

    def stage(self, name: str | None, **info) -> None:
        """The current stage ends (its seconds recorded, the JSON saved); ``name`` begins (None: the cell is over)."""
        now = time.perf_counter()
        if self.name is not None and self.row is not None:
            done = {"stage": self.name, "s": round(now - self.since, 2), "at_s": round(now - self.t_start, 1)} | info
            self.row["stages"].append(done)
            self._line(f"{self.name} done", {k: v for k, v in done.items() if k not in ("stage", "at_s")})
            self.save()
        self.name, self.since = name, now
        if name is not None:
            self.check()

    def event(self, what: str, **info) -> None:
        """A checkpoint inside a stage (a compress layer group, a merge layer): logged, saved, the deadline checked."""
        if self.row is not None:
            rec = {"event": what, "at_s": round(time.perf_counter() - self.t_start, 1), "stage_s": round(time.perf_counter() - self.since, 2)} | info
            self.row.setdefault("events", []).append(rec)
            self._line(what, {k: v for k, v in rec.items() if k not in ("event", "at_s")})
            self.save()
        self.check()

    def check(self) -> None:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            return  # never inside a CUDA graph's capture: the next checkpoint
        if self.deadline is not None and self.fired is None and time.perf_counter() > self.deadline:
            self.fired = self.name or "?"
            raise CellTimeout(f"the cell's time cap passed during {self.fired}")

    def compress(self, event: str, **info) -> None:
        """sekv/compress.py's PROGRESS: its stages and every ~10 layers of its factors and of the merge."""
        if event == "window":
            self.stage("compress.profile", **({"window_start": info["start"]} if info.get("start") else {}))
            info = dict(info, bound_mib=None if info.get("bound") is None else round(info.pop("bound") / (1 << 20), 1))
            self.event("compress.plan", **info)
        elif event == "profile":
            self.stage("compress.layers")
        elif event == "retry":
            self.event("compress.retry", **dict(info, bound=round(info["bound"] / (1 << 20), 1)))
        elif event in ("layers", "merge"):
            if info["done"] % 10 == 0 or info["done"] == info["of"]:
                self.event(f"compress.{event}", done=info["done"], of=info["of"])
            else:
                self.check()
        elif event == "window_done":
            self.stage("compress.merge")
        elif event == "merge_done":
            self.stage("compress.finish")

    def forward(self, *_args) -> None:
        """A forward of the model's first layer (a prefill chunk, a decode step): the deadline checked; during the
        prefill each chunk logged."""
        if self.name == "prefill":
            self.chunks += 1
            self.event("prefill.chunk", started=self.chunks)
        else:
            self.check()


def cell(kind: str, n_target: int, lm, tok, gpu: Gpu, work: Path, a, st: Stages) -> dict:
    """One ingest + open + two asks through the API (the CLI's path), timed, its stages recorded in ``st``."""
    import sekv

    row: dict = {"method": kind, "target_tokens": n_target, "ok": False}
    cap = min(a.cell_limit or float("inf"), a.time_limit - (time.perf_counter() - st.t_start) - 10)
    st.begin(row, time.perf_counter() + cap)
    row["cap_s"] = round(cap, 1)
    doc = work / f"doc-{kind}-{n_target}.txt"
    pack = work / f"doc-{kind}-{n_target}.sekv"
    offload = {"auto": None, "on": True, "off": False}[a.offload_kv]
    t0 = time.perf_counter()
    alarm = signal.signal(signal.SIGALRM, lambda *_: st.check()) if hasattr(signal, "SIGALRM") else None
    try:
        if alarm is not None:  # a backstop for a stage without checkpoints: the deadline checked every 5 s
            signal.setitimer(signal.ITIMER_REAL, 5.0, 5.0)
        st.stage("document")
        document(tok, n_target - PROMPT_TOKENS, doc)
        st.stage("prefill")
        gpu.reset()
        if offload is None:  # what the prefill will decide (sekv_core/prefill.py)
            from sekv_core import kv_offload, placement
            from sekv_core.methods.base import ModelShape

            shape = ModelShape.of(lm.config, next(lm.model.parameters()).dtype)
            row["kv_offloaded"] = not kv_offload.kv_fits(shape, n_target, placement.layer_devices(lm.model))
        else:
            row["kv_offloaded"] = offload
        budget = a.budget if kind == "sekv" else None
        PLANS.clear()
        info = sekv.ingest(doc, pack, method=kind, budget=budget, model=lm, offload_kv=offload)
        st.stage("open", ingest_s=round(info.total_s, 2), prefill_s=round(info.prefill_s, 2), compress_s=round(info.compress_s, 2), write_s=round(info.write_s, 2))
        if PLANS:  # sekv's compress: its bound, layer group and span chunks a layer, per attempt (a retry after running out of memory halves the bound)
            row["compress_plans"] = list(PLANS)
        row.update(n_tokens=info.n_tokens, ingest_s=round(info.total_s, 2), prefill_s=round(info.prefill_s, 2), compress_s=round(info.compress_s, 2),
                   write_s=round(info.write_s, 2), pack_gib=round(info.pack_bytes / GiB, 3), raw_kv_fp16_gib=round(info.raw_kv_fp16_bytes / GiB, 3),
                   ingest_peak_gib_beyond_weights=gpu.peak_beyond_weights_gib(), ingest_peak_per_gpu=gpu.per_gpu(), windows=info.windows)
        gpu.reset()
        t1 = time.perf_counter()
        p = sekv.open(pack, model=lm)
        row["open_s"] = round(time.perf_counter() - t1, 2)
        st.stage("ask.first")
        first = p.ask(QUESTION, max_new_tokens=a.new_tokens)
        st.stage("ask.second", ttft_s=round(first.timings.ttft_s, 3))
        second = p.ask(QUESTION, max_new_tokens=a.new_tokens)
        st.stage(None, ttft_s=round(second.timings.ttft_s, 3))
        row.update(
            ttft_first_s=round(first.timings.ttft_s, 3), ttft_s=round(second.timings.ttft_s, 3),
            decode_ms_per_token=round(1000 / second.timings.tokens_per_s, 2) if second.timings.tokens_per_s else None,
            generated=second.tokens.generated, same_answer_twice=first.tokens.ids == second.tokens.ids,
            resident_kv_gib=round(second.memory.resident_kv_bytes_peak / GiB, 3), full_kv_gib=round(second.memory.full_kv_bytes / GiB, 3),
            resident_fraction=round(second.memory.resident_fraction, 4), ask_peak_gib_beyond_weights=gpu.peak_beyond_weights_gib(),
            ask_peak_per_gpu=gpu.per_gpu(),
            ok=second.tokens.generated > 0,
        )
        del p, first, second
    except Exception as e:  # noqa: BLE001 - every failure is a result of the cell
        if alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
        row.update(error=f"{type(e).__name__}: {str(e).splitlines()[0][:300] if str(e) else ''}", out_of_memory=out_of_memory(e),
                   peak_gib_beyond_weights_at_failure=gpu.peak_beyond_weights_gib(), failed_in=st.name)
        if st.fired is not None:
            row.update(timed_out=True, error=f"abandoned: the cell's cap of {cap:g} s passed during {st.fired}")
        st.stage(None, failed=True)
        e = None  # noqa: F841 - drop the traceback's tensors
    finally:
        if alarm is not None:
            signal.setitimer(signal.ITIMER_REAL, 0)
            signal.signal(signal.SIGALRM, alarm)
        row["wall_s"] = round(time.perf_counter() - t0, 2)
        st.row = None
        for f in (doc, pack):
            f.unlink(missing_ok=True)
        gc.collect()
        if gpu.on:
            torch.cuda.empty_cache()
    return row


def estimate_s(done: list[dict], n: int) -> float:
    """A cell's wall time from the measured ones: the largest scaled (half linear, half quadratic in tokens) plus the
    shortest (what a cell costs whatever its length: opening, two asks); 0 when nothing is measured yet."""
    ok = [r for r in done if r.get("n_tokens") and r.get("wall_s")]
    if not ok:
        return 0.0
    r = max(ok, key=lambda x: x["n_tokens"])
    x = n / r["n_tokens"]
    return r["wall_s"] * (0.5 * x + 0.5 * x * x) + min(c["wall_s"] for c in ok)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="70b")
    ap.add_argument("--out", required=True, help="the JSON of results, rewritten after every cell")
    ap.add_argument("--time-limit", type=float, default=540.0, help="seconds: cells that would not finish in them are skipped, a running one "
                    "is abandoned 10 s before")
    ap.add_argument("--cell-limit", type=float, default=None, help="seconds a cell may take: past them it is abandoned (an error row naming "
                    "its stage) and the next cell runs; with it, cells are not skipped by an estimate of their time")
    ap.add_argument("--stage-log", default=None, help="a file that gets one JSON line per stage of every cell as it ends (flushed)")
    ap.add_argument("--budget", type=float, default=0.1)
    ap.add_argument("--new-tokens", type=int, default=32)
    ap.add_argument("--offload-kv", choices=("auto", "on", "off"), default="auto", help="the ingest prefill's KV on the host (auto: when it would not fit)")
    ap.add_argument("--sekv", default=None, help="sekv contexts, comma-separated (default: the window's, 32K, 64K; 0 = the window less the reserve)")
    ap.add_argument("--full", default=None, help="the full ladder, comma-separated (default: 8K, 16K, 32K, 64K)")
    ap.add_argument("--methods", default="sekv,full", help="which methods' cells run, comma-separated (sekv, full)")
    ap.add_argument("--lengths", default=None,
                    help="contexts for every method in --methods, comma-separated, in this order (overrides --sekv / --full; "
                         "0 or the window's length or more = the window less the question's reserve)")
    ap.add_argument("--compress-bound", type=int, default=None,
                    help="bytes sekv's compress may hold at once (sekv/compress.py free_bytes); default: the GPU's free memory "
                         "less a margin, none on a CPU (set it there to run the GPU's chunked path)")
    ap.add_argument("--gpus", type=int, default=1, help="GPUs to split the model over (consecutive layer groups, accelerate's hooks between them)")
    ap.add_argument("--work-dir", default=None, help="where documents and packs are written (default: a temporary folder, removed)")
    a = ap.parse_args(argv)
    t_start = time.perf_counter()
    sekv_ctx, full_ctx = PLAN[a.shape]
    sekv_ctx = [int(x) for x in a.sekv.split(",")] if a.sekv else sekv_ctx
    full_ctx = [int(x) for x in a.full.split(",")] if a.full else full_ctx
    if a.lengths:
        sekv_ctx = full_ctx = [int(x) for x in a.lengths.split(",")]
    chosen = [m.strip() for m in a.methods.split(",") if m.strip()]
    if not chosen or any(m not in METHODS for m in chosen):
        ap.error(f"--methods: give some of {', '.join(METHODS)}")
    sekv_ctx = sekv_ctx if "sekv" in chosen else []
    full_ctx = full_ctx if "full" in chosen else []
    from sekv_core.sekv import compress

    if a.compress_bound is not None:
        compress.free_bytes = lambda device: a.compress_bound
    planned = compress.plan

    def plan(prefill, seg, bound, device):  # what each compress attempt chose, into the cell's row
        p = planned(prefill, seg, bound, device)
        PLANS.append({"bound_mib": None if bound is None else round(bound / (1 << 20), 1), "group": p.group, "span_chunks": len(p.chunks),
                      "profile_rows": p.profile_rows})
        return p

    compress.plan = plan
    from sekv_core import ingest as ingest_mod

    write_pack = ingest_mod.write_pack

    def write(*args, **kw):  # the ingest's last stage
        st.stage("write")
        return write_pack(*args, **kw)

    ingest_mod.write_pack = write
    cuda = torch.cuda.is_available()
    devices = [torch.device(f"cuda:{i}") if cuda else torch.device("cpu") for i in range(max(1, a.gpus))]
    device = devices[0]
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    work = Path(a.work_dir or tempfile.mkdtemp(prefix="sekv-big-"))
    work.mkdir(parents=True, exist_ok=True)

    import transformers

    from sekv_core import models, placement, prompt
    from sekv_core.ingest import RESERVE_TOKENS
    from sekv_core.methods.base import ModelShape

    result: dict = {"shape": a.shape, "device": torch.cuda.get_device_name(device) if cuda else platform.processor() or "cpu",
                    "torch": torch.__version__, "transformers": transformers.__version__, "budget": a.budget, "new_tokens": a.new_tokens,
                    "offload_kv": a.offload_kv, "time_limit_s": a.time_limit, "compress_bound": a.compress_bound, "argv": sys.argv[1:], "cells": [], "skipped": []}

    def save() -> None:
        result["elapsed_s"] = round(time.perf_counter() - t_start, 1)
        if st.row is not None:  # the cell in progress, as far as it got
            result["running"] = st.row
        else:
            result.pop("running", None)
        tmp = out.with_name(f".{out.name}.tmp")
        tmp.write_text(json.dumps(result, indent=1))
        os.replace(tmp, out)

    st = Stages(save, a.stage_log, t_start)
    compress.PROGRESS = st.compress
    tok = tokenizer()
    t0 = time.perf_counter()
    model = build_model(a.shape, tok, devices)
    model.model.layers[0].register_forward_pre_hook(st.forward)
    for d in {d for d in devices if d.type == "cuda"}:
        torch.cuda.synchronize(d)
    lm = models.wrap(model, tok, "random-llama3.1-70b-shape" if a.shape == "70b" else "random-llama-tiny")
    gpu = Gpu(devices)
    window = models.context_window(model.config)
    result.update(build_s=round(time.perf_counter() - t0, 1), weights_gib=round(sum(p.numel() * p.element_size() for p in model.parameters()) / GiB, 2),
                  allocated_after_build_gib=gpu.weights_gib(), free_after_build_gib=gpu.free_gib(), window=window, gpus=a.gpus,
                  placement=placement.describe(model) if placement.is_mapped(model) else str(device),
                  kv_kib_per_token=ModelShape.of(model.config, next(model.parameters()).dtype).kv_bytes_per_token() / 1024)
    save()
    long_ctx = window - RESERVE_TOKENS - 64  # the longest document that is one window (and its question's reserve)
    sekv_ctx = [long_ctx if not c or c > long_ctx else c for c in sekv_ctx]
    full_ctx = [long_ctx if not c or c > long_ctx else c for c in full_ctx]
    global PROMPT_TOKENS
    PROMPT_TOKENS = len(prompt.encode(tok, prompt.document_prefix(tok, "")))  # the pack's tokens = the document's + these
    if a.lengths:  # the given order, method by method
        order = [(m, n) for m in chosen for n in (sekv_ctx if m == "sekv" else full_ctx)]
    else:  # shortest first (full before sekv at the same length)
        order = sorted([("full", n) for n in full_ctx] + [("sekv", n) for n in sekv_ctx], key=lambda c: (c[1], c[0] != "full"))
    full_failed = False
    try:
        for kind, n in order:
            if kind == "full" and full_failed:
                result["skipped"].append({"method": kind, "target_tokens": n, "why": "a shorter full context already failed"})
                save()
                continue
            left = a.time_limit - (time.perf_counter() - t_start)
            need = estimate_s(result["cells"], n) if a.cell_limit is None else 30.0  # with a cap: run while 30 s are left, abandon at the cap
            if need > left:
                result["skipped"].append({"method": kind, "target_tokens": n, "why": f"time: ~{need:.0f} s needed, {left:.0f} s left"})
                save()
                continue
            print(f"[{time.perf_counter() - t_start:6.1f} s] {kind} {n} ...", file=sys.stderr, flush=True)
            row = cell(kind, n, lm, tok, gpu, work, a, st)
            print(f"[{time.perf_counter() - t_start:6.1f} s] {json.dumps(row)}", file=sys.stderr, flush=True)
            result["cells"].append(row)
            if kind == "full":
                if row["ok"]:
                    result["longest_full_tokens"] = max(result.get("longest_full_tokens", 0), row["n_tokens"])
                else:
                    full_failed = True
            save()
    finally:
        result["done"] = True
        save()
        if not a.work_dir:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
