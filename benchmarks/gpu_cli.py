"""The product path on a GPU, through the CLI itself: `sekv ingest` to a pack file, then `sekv ask` and a chat.

Each `sekv` command runs as its own process (benchmarks/cli_probe.py runs the CLI unchanged, with timers around
its stages; --plain runs `python -m sekv_cli.app` bare), so every number includes what a user waits for:
interpreter start, imports, CUDA start-up, the model's load, the pack's read and checksum, the method's open, the
scout pass, the first token and the decode.

    # 1. documents: NIAH texts (three "special magic number" needles) from the essay haystack, sized in the model's tokens
    python -m benchmarks.gpu_cli docs --model qwen2.5-0.5b --lengths 4096,16384,30720 --out bench_out/gpu_cli/docs
    # 2. (optional) an 8B-shaped random-weight model as a local model directory (the tokenizer of --tokenizer)
    python -m benchmarks.gpu_cli random-model --shape 8b --out /var/tmp/rand8b --device cuda
    # 3. ingest + ask + chat for each document and method; one JSON of every number, a table on stdout
    python -m benchmarks.gpu_cli run --docs bench_out/gpu_cli/docs --model qwen2.5-0.5b --methods full,sekv \\
        --chat 3 --out bench_out/gpu_cli/result.json

Before a document's methods, a plain transformers prefill of the same tokens runs in a process of its own
(benchmarks/plain_prefill.py: one `model(ids, use_cache=True, logits_to_keep=1)` forward, or transformers' chunked
prefill when that does not fit; `plain_prefill_mode` says which): `plain_prefill_s`, and `ingest_over_plain` =
(the ingest's prefill + compress + write) / plain_prefill_s, the ingest target's ratio.  `ingest_over_own_prefill`
divides by the ingest's own prefill instead (its hooks, the surprisal's LM head and the pipelined writes inside it).
`--no-plain` skips the reference.

Each question's TTFT is split into the scout pass, the factor blocks' wait inside it, the first forward and the
CUDA-graph captures after the first token.  `--profile DIR` also runs a two-question chat per pack under
torch.profiler (a process of its own: the other numbers stay unprofiled) and appends a compact table per question
to DIR/profile.txt.

CPU smoke test (minutes): `--model smollm2-135m --lengths 2048 --device cpu`.  On the CPU the GPU columns are 0.
`found` says whether the answer contains the needle's number.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
GIB = 1 << 30

SHAPES = {
    # Llama-3-8B's transformer (hidden 4096, 32 layers, 32 query / 8 KV heads of 128, MLP 14336) with the
    # tokenizer's vocabulary; a long RoPE window for 128K documents
    "8b": dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8, intermediate_size=14336,
               rope_theta=500000.0, max_position_embeddings=139264),
    # the 8B's KV geometry (8 KV heads of 128) in 4 small layers: the CPU proxy of benchmarks/ingest_stages.py --ingest
    "kv8b": dict(hidden_size=1024, num_hidden_layers=4, num_attention_heads=8, num_key_value_heads=8, intermediate_size=1024,
                 rope_theta=500000.0, max_position_embeddings=139264),
    # a few MB, for testing this script on the CPU
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                 rope_theta=10000.0, max_position_embeddings=32768),
}


# ---------------------------------------------------------------------------------------------
# documents


def make_docs(model: str, lengths: list[int], out: Path, haystack: str | None, seed: int, depth: float, keys: int) -> list[dict]:
    from transformers import AutoTokenizer

    from sekv_core import models
    from sekv_core.bench import tasks

    _, where = models.resolve(model)
    tok = AutoTokenizer.from_pretrained(where)
    essays = tasks.load_haystack(haystack)
    out.mkdir(parents=True, exist_ok=True)
    docs = []
    for n in lengths:
        ctx = tasks.gen_mk_niah(tok, n, depth, seed, essays, n_keys=keys)
        path = out / f"niah_{n}.txt"
        path.write_text(ctx.document)
        questions = []
        for needle in ctx.meta["needles"]:  # "The special magic number for KEY is: VALUE."
            key, value = needle[len("The special magic number for ") : -1].split(" is: ")
            questions.append({"question": f"What is the special magic number for {key} mentioned in the document? Answer with the number only.",
                              "expected": value})
        assert questions[0]["question"] == ctx.probes[0].question  # the task's own probe comes first
        docs.append({"name": path.stem, "file": path.name, "length": n, "tokens": ctx.n_tokens, "questions": questions})
    (out / "docs.json").write_text(json.dumps({"model": model, "seed": seed, "depth": depth, "docs": docs}, indent=1))
    return docs


def random_model(shape: str, out: Path, tokenizer: str, device: str, seed: int) -> None:
    """An untrained Qwen2-architecture model of `shape` saved as a local model directory (bf16 safetensors)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, Qwen2Config

    from sekv_core import models

    _, where = models.resolve(tokenizer)
    tok = AutoTokenizer.from_pretrained(where)
    cfg = Qwen2Config(vocab_size=(len(tok) + 127) // 128 * 128, tie_word_embeddings=False, **SHAPES[shape])
    torch.manual_seed(seed)
    with torch.device(device):
        m = AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16)
    out.mkdir(parents=True, exist_ok=True)
    m.save_pretrained(out)
    tok.save_pretrained(out)
    gen = getattr(m, "generation_config", None)
    if gen is not None:
        gen.save_pretrained(out)
    print(f"saved {sum(p.numel() for p in m.parameters()) / 1e9:.2f}B random parameters to {out}")


# ---------------------------------------------------------------------------------------------
# running the CLI


def run_cli(args: list[str], *, probe: bool, env_extra: dict | None = None, stdin: str | None = None, pause: float = 0.0) -> dict:
    """One `sekv` process: -> {rc, wall_s, max_rss_bytes, stdout, stderr_tail, probe}.  pause: stdin written a line
    at a time, as typed: each line ``pause`` seconds after the chat is ready for it (the first after the chat shows
    that it is open, each next one after the previous answer's statistics), not counting the start-up."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    env["PYTHONUNBUFFERED"] = "1"
    env.update(env_extra or {})
    with tempfile.TemporaryDirectory() as td:
        probe_out = Path(td) / "probe.json"
        cmd = [sys.executable, "-m", "benchmarks.cli_probe" if probe else "sekv_cli.app", *args]
        env["SEKV_PROBE_OUT"] = str(probe_out)
        so, se = Path(td) / "out", Path(td) / "err"
        with open(so, "w") as fo, open(se, "w") as fe:
            env["SEKV_PROBE_T0"] = repr(time.time())
            t = time.perf_counter()
            p = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=fo, stderr=fe, stdin=subprocess.PIPE if stdin is not None else subprocess.DEVNULL, text=True)
            if stdin is not None and pause > 0:
                threading.Thread(target=_type_lines, args=(p.stdin, stdin, pause, se), daemon=True).start()
            elif stdin is not None:
                p.stdin.write(stdin)
                p.stdin.close()
            _, status, usage = os.wait4(p.pid, 0)
            wall = time.perf_counter() - t
        p.returncode = os.waitstatus_to_exitcode(status)
        rec = {
            "cmd": ["sekv", *args],
            "rc": p.returncode,
            "wall_s": wall,
            "max_rss_bytes": usage.ru_maxrss * 1024,  # Linux: KiB
            "stdout": so.read_text(),
            "stderr_tail": se.read_text()[-3000:],
        }
        if probe and probe_out.is_file():
            rec["probe"] = json.loads(probe_out.read_text())
    return rec


def run_plain(doc: dict, docs_dir: Path, a: argparse.Namespace) -> dict:
    """The document's plain transformers prefill in a process of its own (benchmarks/plain_prefill.py: the ingest's
    tokens, one forward or transformers' chunked prefill, model load excluded) -> {rc, wall_s, stderr_tail,
    plain_prefill_s, mode, tokens}."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH", "")) if p)
    cmd = [sys.executable, "-m", "benchmarks.plain_prefill", "--model", a.model, "--doc", str(docs_dir / doc["file"])]
    cmd += ["--device", a.device] if a.device else []
    t = time.perf_counter()
    p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    rec = {"rc": p.returncode, "wall_s": time.perf_counter() - t, "stderr_tail": p.stderr[-3000:]}
    lines = [ln for ln in p.stdout.splitlines() if ln.startswith("{")]
    if p.returncode == 0 and lines:
        rec.update(json.loads(lines[-1]))
    return rec


#: what `sekv chat` writes to stderr when it is open (its first line) and after each answer (its statistics' last row)
CHAT_READY, CHAT_ANSWERED = "/help for commands", "process RSS"
#: the longest a typed line waits for the chat to be ready for it (then it is written anyway)
READY_TIMEOUT_S = 900.0


def _type_lines(pipe, text: str, pause: float, stderr: Path) -> None:
    """Write ``text`` a line at a time, each ``pause`` seconds after the chat is ready for it (:data:`CHAT_READY`
    on its stderr for the first line, one more :data:`CHAT_ANSWERED` for each next one), as a user types a question
    after reading the prompt or the answer before it."""

    def ready(k: int) -> None:
        end = time.monotonic() + READY_TIMEOUT_S
        while time.monotonic() < end:
            err = " ".join((stderr.read_text(errors="replace") if stderr.is_file() else "").split())  # Rich wraps lines
            if CHAT_READY in err and err.count(CHAT_ANSWERED) >= k:
                return
            time.sleep(0.05)

    try:
        for k, line in enumerate(text.splitlines(keepends=True)):
            ready(k)
            time.sleep(pause)
            pipe.write(line)
            pipe.flush()
        pipe.close()
    except (BrokenPipeError, OSError):  # the process ended first
        pass


def _found(answer: str, expected: str) -> bool:
    from sekv_core.bench.scoring import contains

    return contains(answer, expected, whole_word=True)


def bench_doc(doc: dict, docs_dir: Path, method: str, a: argparse.Namespace, work: Path) -> dict:
    common = ["--model", a.model] + (["--device", a.device] if a.device else [])
    answering = common + shlex.split(a.answer_args)  # `ask` and `chat` only
    pack = work / f"{doc['name']}.{method}.sekv"
    rec: dict = {"doc": doc["name"], "length": doc["length"], "tokens": doc["tokens"], "method": method}
    if a.reuse_packs and pack.is_file():  # a pack this harness wrote before (same document and method): no ingest row
        ing = {"rc": 0, "skipped": "--reuse-packs"}
    else:
        pack.unlink(missing_ok=True)
        ing = run_cli(["ingest", str(docs_dir / doc["file"]), "-o", str(pack), "--method", method, "-q", *common], probe=not a.plain)
    rec["ingest"] = ing
    if ing["rc"] != 0:
        return rec
    rec["pack_bytes"] = pack.stat().st_size
    q = doc["questions"][0]
    env = {"SEKV_PROBE_CUDA_INIT": "1"}  # CUDA's start-up timed on its own, not inside the model load
    if a.cprofile:
        prof = Path(a.cprofile)
        prof.mkdir(parents=True, exist_ok=True)
        env["SEKV_PROBE_PROFILE"] = str(prof / f"ask_{doc['name']}_{method}")
        if a.torch_profile:
            env["SEKV_PROBE_TORCH"] = str(prof / f"torch_{doc['name']}_{method}")
    ask = {"rc": None, "skipped": "--no-ask"} if a.no_ask else run_cli(["ask", str(pack), q["question"], "--json", "-n", str(a.max_new_tokens), *answering], probe=not a.plain, env_extra=env)
    if ask["rc"] == 0:
        lines = [ln for ln in ask["stdout"].splitlines() if ln.startswith("{")]
        ask["json"] = json.loads(lines[-1]) if lines else None
        if ask["json"]:
            ask["found"] = _found(ask["json"]["answer"], q["expected"])
    rec["ask"] = ask
    if a.chat > 0:
        qs = (doc["questions"] * a.chat)[: a.chat]
        chat = run_cli(["chat", str(pack), "-n", str(a.max_new_tokens), *answering], probe=not a.plain, env_extra={"SEKV_PROBE_CUDA_INIT": "1"}, stdin="".join(x["question"] + "\n" for x in qs) + "/quit\n", pause=a.chat_pause)
        asks = (chat.get("probe") or {}).get("asks", [])
        chat["found"] = [_found(x["answer"], qq["expected"]) for x, qq in zip(asks, qs)]
        rec["chat"] = chat
    if a.profile and (not a.profile_lengths or doc["length"] in a.profile_lengths):
        # a process of its own, so the timings above are unprofiled: a two-question chat, each question under
        # torch.profiler, its compact table appended to DIR/profile.txt (cli_probe.compact_table)
        Path(a.profile).mkdir(parents=True, exist_ok=True)
        qs = (doc["questions"] * 2)[:2]
        env_p = {"SEKV_PROBE_CUDA_INIT": "1", "SEKV_PROBE_TORCH_TABLE": str(Path(a.profile) / "profile.txt"), "SEKV_PROBE_TORCH_ASKS": "2",
                 "SEKV_PROBE_LABEL": f"{doc['name']} ({doc['tokens']} tokens) {method}"}
        n = str(min(a.max_new_tokens, 4))  # the TTFT is what it is for: a short answer keeps the profiled decode short
        p = run_cli(["chat", str(pack), "-n", n, *common], probe=True, env_extra=env_p, stdin="".join(x["question"] + "\n" for x in qs) + "/quit\n", pause=a.chat_pause)
        rec["profile"] = {k: p[k] for k in ("rc", "wall_s", "stderr_tail")}
    if not a.keep_packs:
        pack.unlink(missing_ok=True)
    return rec


def _unattributed(p: dict) -> float | None:
    """Seconds of the probed process outside its import, CUDA start, session open and asks."""
    if not p:
        return None
    asks = sum(a["wall_s"] for a in p.get("asks", []))
    return (p["wall_s"] - p.get("import_s", 0.0) - p.get("transformers_import_s", 0.0) - p.get("cuda_init_s", 0.0)
            - p["phases"].get("session_open", {}).get("s", 0.0) - asks)


def compress_split(events: list) -> dict:
    """sekv compress's seconds by stage from the probe's events ([event, seconds], benchmarks/cli_probe.py): the
    segmentation and plan (to "window"), the scout profiles ("profile"), the layer groups (to the last "layers"), the
    merge (router, lexical index, the scales' codes: "merge_done") and the rest ("end"); {} when there are none.
    A windowed document's are summed over its windows."""
    out: dict = {}
    last = None
    names = {"window": "segment_plan_s", "profile": "profile_s", "layers": "layers_s", "window_done": "window_rest_s",
             "merge_done": "merge_s", "end": "end_s"}
    for event, t in events:
        if event == "window_start" or last is None:
            last = t
            if event == "window_start":
                continue
        key = names.get(event)
        if key is None:  # "merge" (per layer), "retry": inside the stage that follows
            continue
        out[key] = round(out.get(key, 0.0) + t - last, 4)
        last = t
    out["layer_groups"] = sum(1 for e, _ in events if e == "layers")
    return out if events else {}


def summarize(rec: dict) -> dict:
    """The row of the table: seconds, GiB, tokens/s."""
    ing, ask = rec.get("ingest", {}), rec.get("ask", {})
    ip, ap = ing.get("probe") or {}, ask.get("probe") or {}
    if not ap and rec.get("chat"):  # --no-ask: the chat process's stages (its load, open, first question)
        ask, ap = rec["chat"], rec["chat"].get("probe") or {}
    ph = ap.get("phases", {})
    a0 = (ap.get("asks") or [{}])[0]
    js = ask.get("json") or {}
    st = a0.get("stats") or {}
    gpu = ap.get("gpu", {})
    g = lambda k: ph.get(k, {}).get("s", 0.0)  # noqa: E731
    chat_asks = ((rec.get("chat") or {}).get("probe") or {}).get("asks", [])
    first = a0 if a0 else (chat_asks[0] if chat_asks else {})  # no `ask` process: the chat's first question is its process's first
    st = st or first.get("stats") or {}
    a0 = a0 or first
    ingest = ip.get("ingest") or {}
    # the prefill's wait for the model's warm-up (prefill.WarmUp, beside the tokenization) counts as the ingest's
    parts = [ingest.get(k) for k in ("prefill_s", "compress_s", "write_s")] + [ingest.get("warm_wait_s") or 0.0]
    plain = rec.get("plain") or {}
    return {
        "doc": rec["doc"],
        "tokens": rec["tokens"],
        "method": rec["method"],
        "ingest_rc": ing.get("rc"),
        "ingest_wall_s": ing.get("wall_s"),
        "prefill_s": (ip.get("ingest") or {}).get("prefill_s"),
        "compress_s": ingest.get("compress_s"),
        "write_s": ingest.get("write_s"),
        "warm_wait_s": ingest.get("warm_wait_s"),
        # the pipelined ingest writes during the prefill: what it adds after the prefill's end (= compress_s + write_s
        # for one window), and the pack bytes already written by then
        "after_prefill_s": ingest.get("after_prefill_s"),
        "written_in_prefill_mib": (ingest.get("written_in_prefill") or 0) / (1 << 20),
        # the ingest's own ratio: prefill + compress + the pack written, over the ingest's own prefill (its hooks, the
        # surprisal's LM head and the pipelined writes inside)
        "ingest_over_own_prefill": sum(parts) / parts[0] if None not in parts and parts[0] else None,
        # the reference: a plain transformers prefill of the same tokens, a process of its own (run_plain), and the
        # target's ratio: prefill + compress + the pack written, over it
        "plain_prefill_s": plain.get("plain_prefill_s"),
        "plain_prefill_mode": plain.get("mode"),
        "ingest_over_plain": sum(parts) / plain["plain_prefill_s"] if None not in parts and plain.get("plain_prefill_s") else None,
        # inside the prefill: the prefill thread's seconds in the pipelined stream's per-chunk hook, and of them its
        # waits for the pack writer's queue (the writer behind); after it: compress's stages (compress_split)
        "prefill_stream_s": (ip.get("ingest_stream") or {}).get("on_chunk_s"),
        "prefill_writer_wait_s": (ip.get("ingest_stream") or {}).get("submit_wait_s"),
        "compress_split": compress_split(ip.get("compress_events") or []),
        "ingest_gpu_peak_gib": (ip.get("gpu") or {}).get("max_allocated_bytes", 0) / GIB,
        "ingest_rss_gib": ing.get("max_rss_bytes", 0) / GIB,
        "pack_mib": rec.get("pack_bytes", 0) / (1 << 20),
        "ask_rc": ask.get("rc"),
        "ask_wall_s": ask.get("wall_s"),
        "startup_s": ap.get("startup_s"),
        "import_s": ap.get("import_s"),
        "transformers_import_s": ap.get("transformers_import_s"),
        "cuda_init_s": ap.get("cuda_init_s"),
        # the process's seconds outside the timed stages (the CLI's own code, the probe's wrapping)
        "other_s": _unattributed(ap),
        "probe_install_s": ap.get("probe_install_s"),
        "load_s": g("model_load"),
        "from_pretrained_s": g("model_load.from_pretrained"),
        "pack_read_s": g("pack_read"),
        "sha256_s": g("pack_read.sha256"),
        "open_s": g("session_open") - g("model_load") - g("pack_read") - g("check_model"),
        "scout_s": a0.get("scout_s"),
        "step_build_s": g("sekv_step_build"),  # the batched step's blocks, on a second thread from the open
        "blocks_wait_s": g("sekv_blocks_wait"),  # what the first scout waited for them
        # of them, what the build kept in device memory (the rest page-locked before the first question)
        "blocks_kept_layers": (ap.get("blocks_kept") or {}).get("layers"),
        "blocks_kept_gib": (ap.get("blocks_kept") or {}).get("bytes", 0) / GIB,
        "fixed_sdpa": ap.get("fixed_sdpa", "gqa"),  # $SEKV_PROBE_FIXED_SDPA
        "fill_sdpa": ap.get("fill_sdpa"),  # $SEKV_PROBE_FILL_SDPA (None: as fixed_sdpa)
        "warm_kernels": ap.get("warm_kernels"),  # $SEKV_PROBE_WARM
        "ttft_s": st.get("ttft_s", (js.get("timings") or {}).get("ttft_s")),
        "tok_per_s": st.get("tokens_per_s", (js.get("timings") or {}).get("tokens_per_s")),
        "generated": st.get("generated_tokens"),
        "captures": a0.get("captures"),
        "capture_s": g("graph_capture"),
        "ask_gpu_peak_gib": (st.get("gpu_peak_bytes") or 0) / GIB,
        # each chat question's own GPU peak (generate resets the peak at every question: the first one's includes
        # the resident buffers' first growth, a later one's is the steady state)
        "chat_gpu_peak_gib": [round((x["stats"].get("gpu_peak_bytes") or 0) / GIB, 2) for x in chat_asks],
        "weights_gib": gpu.get("weights_bytes", 0) / GIB,
        "ask_rss_gib": ask.get("max_rss_bytes", 0) / GIB,
        "found": ask.get("found"),
        "chat_ttft_s": [round(x["stats"].get("ttft_s") or 0, 3) for x in chat_asks],
        "chat_tok_per_s": [round(x["stats"].get("tokens_per_s") or 0, 1) for x in chat_asks],
        "chat_found": (rec.get("chat") or {}).get("found"),
        "chat_scout_s": [round(x.get("scout_s") or 0, 3) for x in chat_asks],
        # the TTFT's parts per question (DecodeStats: CUDA events), the factor blocks' wait inside the first scout,
        # and the CUDA-graph captures after the first token
        "first_forward_s": st.get("first_forward_s"),
        "chat_first_forward_s": [round(x["stats"].get("first_forward_s") or 0, 3) for x in chat_asks],
        "chat_wait_s": [round(x.get("blocks_wait_s") or 0, 3) for x in chat_asks],
        "chat_capture_s": [round(x.get("capture_s") or 0, 3) for x in chat_asks],
        # sekv: each question's host seconds by part (scout forward / scoring, the fills' plan / fill / attention, the
        # zoom tier's row ids, gather and waits): what the first forward's launches waited for
        "chat_first_token_parts": [x.get("first_token_parts") or {} for x in chat_asks],
        "chat_rehearsal_wait_s": [round((x.get("extra") or {}).get("rehearsal_wait_s") or 0, 3) for x in chat_asks],
        "skipped": rec.get("skipped"),
    }


COLS = [
    ("tokens", "tokens", "{}"), ("method", "method", "{}"), ("ingest_wall_s", "ingest", "{:.1f}"), ("pack_mib", "pack MiB", "{:.1f}"),
    ("ingest_over_plain", "ingest/plain", "{:.2f}"), ("plain_prefill_s", "plain prefill", "{:.2f}"),
    ("ingest_over_own_prefill", "ingest/own prefill", "{:.2f}"), ("prefill_s", "prefill", "{:.2f}"), ("after_prefill_s", "after prefill", "{:.2f}"),
    ("written_in_prefill_mib", "MiB in prefill", "{:.0f}"), ("ask_wall_s", "ask", "{:.2f}"), ("import_s", "import", "{:.2f}"), ("transformers_import_s", "tf import", "{:.2f}"), ("cuda_init_s", "CUDA", "{:.2f}"), ("other_s", "other", "{:.2f}"), ("load_s", "load", "{:.2f}"), ("pack_read_s", "read", "{:.2f}"),
    ("sha256_s", "sha256", "{:.2f}"), ("open_s", "open", "{:.2f}"), ("scout_s", "scout", "{:.3f}"), ("step_build_s", "build", "{:.3f}"), ("blocks_wait_s", "wait", "{:.3f}"),
    ("first_forward_s", "1st fwd", "{:.3f}"), ("ttft_s", "TTFT", "{:.3f}"),
    ("tok_per_s", "tok/s", "{:.1f}"), ("captures", "capt", "{}"), ("ask_gpu_peak_gib", "GPU GiB", "{:.2f}"),
    ("weights_gib", "weights", "{:.2f}"), ("ask_rss_gib", "RSS GiB", "{:.2f}"), ("found", "found", "{}"),
    ("chat_ttft_s", "chat TTFT", "{}"), ("chat_scout_s", "chat scout", "{}"), ("chat_wait_s", "chat wait", "{}"), ("chat_first_forward_s", "chat 1st fwd", "{}"),
    ("chat_capture_s", "chat capture", "{}"), ("chat_tok_per_s", "chat tok/s", "{}"), ("chat_gpu_peak_gib", "chat GPU GiB", "{}"),
    ("chat_found", "chat found", "{}"),
]


def table(rows: list[dict]) -> str:
    def cell(r, k, f):
        v = r.get(k)
        return "-" if v is None else f.format(v)

    head = [c[1] for c in COLS]
    body = [[cell(r, k, f) for k, _, f in COLS] for r in rows]
    w = [max(len(h), *(len(b[i]) for b in body)) if body else len(h) for i, h in enumerate(head)]
    line = lambda cs: "  ".join(c.rjust(w[i]) for i, c in enumerate(cs))  # noqa: E731
    return "\n".join([line(head)] + [line(b) for b in body])


def run(a: argparse.Namespace) -> list[dict]:
    docs_dir = Path(a.docs)
    spec = json.loads((docs_dir / "docs.json").read_text())
    by_len = {d["length"]: d for d in spec["docs"]}
    docs = [by_len[n] for n in a.lengths if n in by_len] if a.lengths else spec["docs"]  # --lengths' order: the most important first
    work = Path(a.workdir) if a.workdir else docs_dir / "packs"
    work.mkdir(parents=True, exist_ok=True)
    out = Path(a.out) if a.out else None
    results = []
    t0, longest = time.perf_counter(), 0.0
    for doc in docs:
        plain = None if a.no_plain else run_plain(doc, docs_dir, a)  # the reference every method's ingest is divided by
        if plain is not None:
            print(json.dumps({"doc": doc["name"], **{k: plain.get(k) for k in ("rc", "plain_prefill_s", "mode", "tokens")}}), flush=True)
            if plain["rc"] != 0:
                print(f"plain prefill failed (rc {plain['rc']}):\n{plain['stderr_tail']}", flush=True)
        for method in a.methods:
            spent = time.perf_counter() - t0
            if a.budget_s and spent + longest > a.budget_s:  # the next cell would likely overrun: record it as skipped
                rec = {"doc": doc["name"], "length": doc["length"], "tokens": doc["tokens"], "method": method, "skipped": f"budget {a.budget_s:.0f} s ({spent:.0f} s spent)"}
                print(json.dumps({k: rec[k] for k in ("doc", "method", "skipped")}), flush=True)
            else:
                tc = time.perf_counter()
                rec = bench_doc(doc, docs_dir, method, a, work)
                if plain is not None:
                    rec["plain"] = plain
                longest = max(longest, time.perf_counter() - tc)
            results.append(rec)
            row = summarize(rec)
            print(json.dumps({k: row[k] for k in ("doc", "method", "ingest_rc", "ask_rc", "ingest_wall_s", "ingest_over_plain", "ingest_over_own_prefill", "ask_wall_s", "ttft_s", "tok_per_s", "found", "chat_ttft_s")}), flush=True)
            for part in ("ingest", "ask", "chat", "profile"):
                if rec.get(part, {}).get("rc") not in (0, None):
                    print(f"{part} failed (rc {rec[part]['rc']}):\n{rec[part]['stderr_tail']}", flush=True)
            if out:
                out.parent.mkdir(parents=True, exist_ok=True)
                out.write_text(json.dumps({"model": a.model, "device": a.device, "rows": [summarize(r) for r in results], "runs": results}, indent=1, default=str))
    print(table([summarize(r) for r in results]))
    return results


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.gpu_cli", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    ints = lambda s: [int(x) for x in s.split(",") if x]  # noqa: E731
    d = sub.add_parser("docs", help="write the NIAH documents and docs.json")
    d.add_argument("--model", default="qwen2.5-0.5b", help="whose tokenizer sizes the documents")
    d.add_argument("--lengths", type=ints, default=[4096, 16384, 30720])
    d.add_argument("--out", required=True)
    d.add_argument("--haystack", default=None, help="a folder of .txt essays (default: $SEKV_HAYSTACK or ../shared/data/haystack/pg_essays)")
    d.add_argument("--seed", type=int, default=0)
    d.add_argument("--depth", type=float, default=50.0, help="percent depth of the first (the `ask`) needle")
    d.add_argument("--keys", type=int, default=3, help="needles per document (the chat asks each)")
    m = sub.add_parser("random-model", help="save an untrained model of a given shape as a local model directory")
    m.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    m.add_argument("--out", required=True)
    m.add_argument("--tokenizer", default="qwen2.5-0.5b")
    m.add_argument("--device", default="cpu", help="where the random weights are drawn (cuda: seconds for 8B)")
    m.add_argument("--seed", type=int, default=0)
    r = sub.add_parser("run", help="ingest + ask (+ chat) through the CLI for every document and method")
    r.add_argument("--docs", required=True, help="a folder written by `docs`")
    r.add_argument("--model", default="qwen2.5-0.5b", help="embedded model name or a local model directory")
    r.add_argument("--methods", type=lambda s: s.split(","), default=["full", "sekv"])
    r.add_argument("--lengths", type=ints, default=None, help="only these documents (default: all in docs.json)")
    r.add_argument("--device", default=None)
    r.add_argument("--max-new-tokens", type=int, default=24)
    r.add_argument("--chat", type=int, default=0, help="questions in one `sekv chat` session per pack (0: no chat)")
    r.add_argument("--chat-pause", type=float, default=0.0, help="seconds before each chat line after the chat is ready for it, as typed (0: all at once, "
                   "read as soon as the chat opens); a first question typed while the chat's rehearsal (Session.rehearse) runs waits for it")
    r.add_argument("--plain", action="store_true", help="run `python -m sekv_cli.app` without the probe (no stage timers)")
    r.add_argument("--profile", default=None, help="folder: one more two-question chat per pack, each question under torch.profiler, "
                   "compact tables (top operators and kernels, launches, host waits) appended to DIR/profile.txt")
    r.add_argument("--profile-lengths", type=ints, default=None, help="with --profile: only these documents (default: all)")
    r.add_argument("--cprofile", default=None, help="folder for cProfile dumps of each ask (CUDA context made up front)")
    r.add_argument("--torch-profile", action="store_true", help="with --cprofile: also torch.profiler tables of each ask")
    r.add_argument("--workdir", default=None, help="where packs are written (default: DOCS/packs)")
    r.add_argument("--keep-packs", action="store_true")
    r.add_argument("--out", default=None, help="JSON with every number")
    r.add_argument("--answer-args", default="", help="more options of `sekv ask` and `sekv chat`, one string (e.g. \"--compile\")")
    r.add_argument("--reuse-packs", action="store_true", help="a pack already in --workdir is asked as it is (no ingest row)")
    r.add_argument("--no-ask", action="store_true", help="no separate `ask` process: the chat's first question is a process's first ask")
    r.add_argument("--no-plain", action="store_true", help="no plain transformers prefill per document (no ingest/plain column)")
    r.add_argument("--budget-s", type=float, default=0, help="start no (document, method) cell that would likely end past this many seconds (0: no limit)")
    a = ap.parse_args(argv)
    if a.cmd == "docs":
        docs = make_docs(a.model, a.lengths, Path(a.out), a.haystack, a.seed, a.depth, a.keys)
        for doc in docs:
            print(f"{doc['file']}: {doc['tokens']} tokens, {len(doc['questions'])} needles")
    elif a.cmd == "random-model":
        random_model(a.shape, Path(a.out), a.tokenizer, a.device, a.seed)
    else:
        results = run(a)
        ran = [r for r in results if not r.get("skipped")]
        return 0 if all(r.get("ask", {}).get("rc") in (0, None) and r.get("ingest", {}).get("rc") == 0 for r in ran) else 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
