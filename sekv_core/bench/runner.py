"""The benchmark runner: prefill each context once, then every method x budget from memory.

For each context (one generated document): prefill once (with surprisal when a
pending method needs it); then, for each method and budget, ``compress`` the
prefill, ``open`` the memory straight from the in-memory tensors (a dict-backed
store: no pack file), and answer every question greedily, resetting the memory
to the document between questions.  One JSON line per cell goes to
``DIR/results.jsonl`` as soon as it is done.

Resumable: a cell whose key (task, item, length, depth, seed, method, budget,
model) is already in the file without an error is skipped, and a context whose
cells are all done is not even prefilled.  Cells that failed are written with an
``error`` field and retried on the next run.

``full`` is always run first for each context (also when not asked for): it is the
reference for ``identical_to_full`` (the answer's token ids equal full's).

Past the model's window a context is read as ``sekv ingest`` + ``sekv ask`` would read it:
``sekv`` and ``rag`` at native RoPE from a prefill in windows; ``full`` and the other
"window" methods from one more prefill with the model at the YaRN factor
``rope_scaling.plan`` gives (up to 4x; past that they are skipped with a warning), asked at
that factor, and the model switched back to native RoPE before anything else runs.  Each
row records the factor (``rope_factor``: null for native).
"""

from __future__ import annotations

import bisect
import dataclasses
import datetime as _dt
import json
import os
import platform
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

import torch

from .. import __version__, ingest, methods, models, prompt, rope_scaling
from ..errors import DocumentError, SekvError
from ..generate import generate
from ..methods import scores as prefill_scores
from ..methods.base import DictStore, ModelShape, PrefillResult
from ..documents import Document, PageSpan
from ..prefill import prefill, prefill_window
from ..session import start_ask
from . import scoring, tasks, variants

RESULTS_FILE = "results.jsonl"
REFERENCE = "full"
KEY_FIELDS = ("task", "item", "length", "depth", "seed", "method", "budget", "model")


class SharedPrefillModified(SekvError):
    """A method's compress() wrote into the prefill that the other methods share: the run stops."""


@dataclass
class BenchConfig:
    tasks: list[str]
    methods: list[str]
    budgets: list[float]
    lengths: list[int]
    depths: list[float]
    seed: int = 0
    limit: int | None = None  # at most this many questions per task
    haystack: Path | None = None
    max_new_tokens: int | None = None  # overrides each task's default
    doc_file: Path | None = None  # qa_long's document (default: $SEKV_LONG_DOC)


@dataclass
class Outcome:
    cells: int = 0  # cells in the plan
    skipped: int = 0  # already in results.jsonl
    added: int = 0
    errors: list[str] = field(default_factory=list)
    prefills: int = 0


class Reporter:
    """Progress callbacks (no-ops here; the CLI draws a Rich progress bar)."""

    def start(self, total: int) -> None: ...

    def context(self, ctx: tasks.Context, pending: int) -> None: ...

    def stage(self, text: str) -> None: ...

    def cell(self, record: dict) -> None: ...

    def warn(self, message: str) -> None: ...


# ---------------------------------------------------------------------------------------------
# keys and the results file


def _norm_budget(b: float | None) -> float | None:
    return None if b is None else round(float(b), 6)


def cell_key(task: str, item: str, length: int, depth: float | None, seed: int, method: str, budget: float | None, model: str) -> str:
    d = None if depth is None else round(float(depth), 6)
    return json.dumps([task, item, int(length), d, int(seed), method, _norm_budget(budget), model])


def record_key(rec: dict) -> str:
    return cell_key(*(rec.get(k) for k in KEY_FIELDS))


def read_results(path: Path) -> list[dict]:
    """All records of a results file (a torn last line from a killed run is ignored)."""
    if not path.is_file():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        line = line.strip()
        if not line:
            continue
        try:
            out.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return out


class ResultsFile:
    def __init__(self, path: Path):
        self.path = path
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_file() and path.stat().st_size:
            with open(path, "rb") as f:
                f.seek(-1, os.SEEK_END)
                torn = f.read(1) != b"\n"
            if torn:
                with open(path, "a", encoding="utf-8") as f:
                    f.write("\n")

    def append(self, rec: dict) -> None:
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(rec, default=_json_default) + "\n")
            f.flush()


def _json_default(x: Any) -> Any:
    if isinstance(x, torch.Tensor):
        return x.tolist()
    if hasattr(x, "tolist"):
        return x.tolist()
    if isinstance(x, (set, tuple)):
        return list(x)
    return str(x)


# ---------------------------------------------------------------------------------------------
# planning


def method_grid(names: Iterable[str], budgets: list[float]) -> list[tuple[str, float | None]]:
    """(method, budget) pairs, `full` first; methods without a `budget` parameter run once."""
    names = list(dict.fromkeys(names))
    order = [REFERENCE] + [n for n in names if n != REFERENCE]
    grid: list[tuple[str, float | None]] = []
    for n in order:
        m = methods.get(variants.parse(n).method)
        if "budget" in m.default_params:
            grid += [(n, _norm_budget(b)) for b in budgets]
        else:
            grid.append((n, None))
    return grid


def plan_contexts(tokenizer, cfg: BenchConfig) -> list[tasks.Context]:
    """Every context of every task, probes capped at cfg.limit per task."""
    essays = None
    if any(t in tasks.HAYSTACK_TASKS for t in cfg.tasks):
        essays = tasks.load_haystack(cfg.haystack)
    out: list[tasks.Context] = []
    for t in cfg.tasks:
        left = cfg.limit
        for ctx in tasks.generate(t, tokenizer, lengths=cfg.lengths, depths=cfg.depths, seed=cfg.seed, essays=essays,
                                  doc_file=cfg.doc_file):
            if left is not None:
                ctx.probes = ctx.probes[:left]
                left -= len(ctx.probes)
            if ctx.probes:
                out.append(ctx)
            if left is not None and left <= 0:
                break
    return out


def machine_info(device: torch.device) -> str:
    cpu = platform.processor() or platform.machine()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    dev = str(device)
    if device.type == "cuda":
        dev = torch.cuda.get_device_name(device)
    return f"{platform.system()} {platform.machine()}, {cpu}, {os.cpu_count()} CPUs, torch {torch.__version__}, device {dev}"


def method_stats(extra: dict | None) -> dict | None:
    """A memory's step_stats().extra (zoom statistics, kept tokens, ...), JSON-ready;
    span_zoom_counts is reduced to its size and total."""
    if not extra:
        return None
    out: dict[str, Any] = {}
    for k, v in extra.items():
        if isinstance(v, torch.Tensor):
            v = v.tolist()
        if k == "span_zoom_counts":
            vals = list(v.values()) if isinstance(v, dict) else list(v or [])
            out["spans_zoomed"] = len(vals)
            out["span_zooms_total"] = float(sum(float(x) for x in vals)) if vals else 0
            continue
        if k == "span_order":  # evidence order for the CLI; not a statistic
            continue
        out[k] = v
    return out


def needle_token_ranges(tok, ctx: tasks.Context, doc_text: str) -> list[tuple[int, int]] | None:
    """Each needle's [start, end) token positions in the prefilled text ``doc_text`` (prompt.document_prefix of
    ctx.document, tokenized as prompt.encode does): the tokens whose characters overlap the needle's (its char
    offset in the document, ctx.meta["needle_offsets"]).  None for a context without needles."""
    needles, offsets = ctx.meta.get("needles"), ctx.meta.get("needle_offsets")
    if not needles or not offsets or len(needles) != len(offsets):
        return None
    head = len(prompt.document_header(tok))
    if doc_text[head : head + len(ctx.document)] != ctx.document:
        return None
    spans = tok(doc_text, add_special_tokens=False, return_offsets_mapping=True)["offset_mapping"]
    ends = [b for _, b in spans]
    out = []
    for needle, off in zip(needles, offsets):
        if ctx.document[off : off + len(needle)] != needle:
            return None
        c0, c1 = head + off, head + off + len(needle)
        a = bisect.bisect_right(ends, c0)  # the first token ending after the needle's first character
        b = a
        while b < len(spans) and spans[b][0] < c1:
            b += 1
        out.append((a, b))
    return out


def needle_coverage(tok, ctx: tasks.Context, probe: tasks.Probe, ids: torch.Tensor, ranges, memory) -> dict:
    """What sekv read of each needle's tokens at the answer's first forward (ZoomMemory.token_coverage): per needle
    its tokens' resolution (exact / zoomed / partly zoomed / coarse), hidden flags, zoomed rows' source, its spans and
    zoom blocks with their rank in the scout's ordering, and where blocks start inside it.  ``asked``: the needle holds
    an expected answer (mn_niah: the probe's archive)."""
    out, kept, n_blocks = [], None, None
    for i, (needle, (a, b)) in enumerate(zip(ctx.meta["needles"], ranges)):
        cov = memory.token_coverage(range(a, b))
        kept, n_blocks = cov["kept_blocks"], cov["n_blocks"]
        starts = {blk["start"] for blk in cov["blocks"].values()}
        per_layer = cov["zoomed_per_layer"]
        out.append({
            "needle": i, "asked": any(e in needle for e in probe.expected), "text": needle, "tokens": [a, b],
            "token_text": [tok.decode([t]) for t in ids[a:b].tolist()],
            "resolution": cov["resolution"], "hidden": cov["hidden"], "zoom_source": cov["zoom_source"], "zoom_share": cov["zoom_share"],
            "counts": dict(Counter(cov["resolution"]), hidden=sum(cov["hidden"])),
            "spans": sorted({blk["span"] for blk in cov["blocks"].values()}),
            "blocks": [{"block": k, **v} for k, v in sorted(cov["blocks"].items(), key=lambda kv: kv[1]["start"])],
            "block_starts": sorted(p for p in starts if a < p < b),
            "zoomed_per_layer": None if per_layer is None else [min(per_layer), max(per_layer)],
        })
    return {"n_blocks": n_blocks, "kept_blocks": kept, "needles": out}


# ---------------------------------------------------------------------------------------------
# running


def run(lm: models.LoadedModel, cfg: BenchConfig, out_dir: str | Path, reporter: Reporter | None = None) -> Outcome:
    reporter = reporter or Reporter()
    out_dir = Path(out_dir)
    results = ResultsFile(out_dir / RESULTS_FILE)
    existing = read_results(results.path)
    done = {record_key(r) for r in existing if not r.get("error")}
    reference: dict[str, list[int]] = {}  # probe key (method-free) -> full's answer ids
    for r in existing:
        if r.get("method") == REFERENCE and not r.get("error"):
            reference[_probe_key(r["task"], r["item"], r["length"], r["depth"], r["seed"], r["model"])] = r["answer_ids"]

    model, tok = lm.model, lm.tokenizer
    from ..placement import input_device
    from ..session import open_memory

    device, dtype = input_device(model), next(model.parameters()).dtype
    shape = ModelShape.of(lm.config, dtype)
    stop_ids = prompt.stop_token_ids(tok, getattr(model, "generation_config", None))
    grid = method_grid(cfg.methods, cfg.budgets)
    machine = machine_info(device)
    models.set_rope_scaling(lm, None)  # plan against the native window, whatever an earlier run left
    window = models.context_window(lm.config)
    native_rp = models.native_rope(model)[0]  # a model whose native RoPE is already scaled cannot take YaRN (set_rope_scaling)
    scalable = isinstance(native_rp, dict) and native_rp.get("rope_type", "default") == "default"

    reporter.stage("generating tasks")
    contexts = plan_contexts(tok, cfg)
    for ctx in contexts:
        if ctx.meta.get("note"):  # e.g. qa_long on a document cut short
            reporter.warn(ctx.meta["note"])
    q_ids: dict[int, list[list[int]]] = {}
    for ci, ctx in enumerate(contexts):
        q_ids[ci] = [prompt.encode(tok, prompt.question_suffix(tok, p.question)) for p in ctx.probes]
    outcome = Outcome()
    pending_by_ctx: list[list[tuple[int, str, float | None]]] = []
    rope_of: dict[int, dict[str, float | None]] = {}  # context -> method -> YaRN factor (None: native RoPE)
    for ci, ctx in enumerate(contexts):
        pend = []
        longest = max(len(q) + _max_new(cfg, p) for q, p in zip(q_ids[ci], ctx.probes))
        # past the window, "window" methods read the context with YaRN as `sekv ingest` would (rope_scaling.plan with
        # ingest's reserve: factor <= 4); sekv (re-positioned) and rag stay native; past 4x only they run
        factors = {m: _rope_factor(m, ctx.n_tokens, max(longest, ingest.RESERVE_TOKENS), window) for m in dict.fromkeys(m for m, _ in grid)}
        factors = {m: f if f is None or scalable else _UNREADABLE for m, f in factors.items()}
        readable = [(m, b) for m, b in grid if factors[m] != _UNREADABLE]
        rope_of[ci] = {m: f for m, f in factors.items() if f != _UNREADABLE}
        if not readable:
            raise SekvError(
                f"{ctx.task} at {ctx.length} tokens + question and answer ({longest} tokens) exceeds "
                f"{rope_scaling.MAX_FACTOR}x {lm.model_id}'s context window of {window} (YaRN); use shorter --lengths or --methods sekv"
            )
        if len(readable) < len(grid):
            left = sorted({m for m, _ in grid} - {m for m, _ in readable})
            reporter.warn(f"{ctx.task} at {ctx.length} tokens: past {rope_scaling.MAX_FACTOR}x {lm.model_id}'s window of {window} "
                          f"(YaRN); not run for {', '.join(left)}")
        for pi, p in enumerate(ctx.probes):
            for m, b in readable:
                outcome.cells += 1
                if cell_key(ctx.task, p.item, ctx.length, ctx.depth, ctx.seed, m, b, lm.model_id) in done:
                    outcome.skipped += 1
                else:
                    pend.append((pi, m, b))
        pending_by_ctx.append(pend)
    reporter.start(sum(len(p) for p in pending_by_ctx))

    for ci, (ctx, pend) in enumerate(zip(contexts, pending_by_ctx)):
        if not pend:
            continue
        reporter.context(ctx, len(pend))
        doc_text = prompt.document_prefix(tok, ctx.document)
        ids = torch.tensor(prompt.encode(tok, doc_text))
        # the needles' token ranges, for sekv's needle_coverage (tasks with needles, a sekv cell pending)
        ranges = needle_token_ranges(tok, ctx, doc_text) if any(variants.parse(m).method == "sekv" for _, m, _ in pend) else None
        past = window and ctx.n_tokens + max(len(q) + _max_new(cfg, p) for q, p in zip(q_ids[ci], ctx.probes)) > window
        # one prefill per RoPE scaling: the "window" methods at their YaRN factor first (full is the reference), with the
        # model switched back to native before anything else; then the rest at native RoPE (windowed past the window)
        phases: dict[float | None, list[tuple[int, str, float | None]]] = {}
        for pi, m, b in pend:
            phases.setdefault(rope_of[ci][m], []).append((pi, m, b))
        for factor in sorted(phases, key=lambda f: f is None):
            group = phases[factor]
            models.set_rope_scaling(lm, factor)
            try:
                ask_window = models.context_window(lm.config)  # W x F under YaRN
                pend_methods = {(m, b) for _, m, b in group}
                need_s = any(methods.get(variants.parse(m).method).needs_surprisal for m, _ in pend_methods)
                reporter.stage(f"prefill {ids.numel()} tokens" + (f" (YaRN x{factor:g})" if factor else ""))
                t0 = time.perf_counter()
                windowed = past and factor is None
                if windowed:  # sekv (and rag) past the window: the document prefilled in windows, as `sekv ingest` does
                    pre, prefill_with = _windowed_prefills(lm, ctx, ids.tolist(), need_s, pend_methods, window)
                else:
                    pre, prefill_with = _prefill_for(model, tok, ids, doc_text, need_s, pend_methods)
                prefill_s = time.perf_counter() - t0
                outcome.prefills += 1
                stamp = _fingerprint(pre)

                for m, b in grid:
                    todo = [pi for pi, mm, bb in group if mm == m and bb == b]
                    if not todo:
                        continue
                    variant = variants.parse(m)
                    method = methods.get(variant.method)
                    label = m if b is None else f"{m}@{b:g}"
                    base_rec = {
                        "task": ctx.task, "length": ctx.length, "depth": ctx.depth, "seed": ctx.seed, "method": m, "budget": b,
                        "base_method": variant.method, "variant": m.split(":", 1)[1] if ":" in m else None,
                        "overrides": variant.overrides or None,
                        "model": lm.model_id, "n_tokens": int(ids.numel()), "prefill_s": round(prefill_s, 4),
                        "prefill_tok_per_s": round(ids.numel() / max(prefill_s, 1e-9), 1), "prefill_with": prefill_with, "rope_factor": factor,
                        "sekv_version": __version__,
                        "machine": machine, "dtype": str(dtype).removeprefix("torch."), "threads": torch.get_num_threads(),
                    }
                    try:
                        params = method.resolve_params(variant.params(b))
                        reporter.stage(f"{label}: compress")
                        torch.manual_seed(cfg.seed)
                        t1 = time.perf_counter()
                        if windowed and method.length_policy == "windowed":
                            made = method.compress_windows(iter([_view_for(w, method, params) for w in pre]), params)
                        elif windowed:  # rag: no KV at ingest, the whole document's text statistics (as ingest.py)
                            made = method.compress(PrefillResult.without_kv(ids, shape, pre[0].scores, lm), params)
                        else:
                            made = method.compress(_view_for(pre, method, params), params)
                        tensors = {k: v.cpu() for k, v in made.items()}
                        compress_s = time.perf_counter() - t1
                        if _fingerprint(pre) != stamp:  # every later method would see corrupted K/V
                            raise SharedPrefillModified(f"method '{m}' changed the prefill's K/V in place in compress(); the benchmark shares one "
                                            "prefill between methods, so its results would be wrong: make compress() copy before writing")
                        t2 = time.perf_counter()
                        memory = open_memory(method, DictStore(tensors), params, shape, model)
                        open_s = time.perf_counter() - t2
                        # sekv under a ranking keeps each answer's first kept sets, for needle_coverage (no forward added)
                        covered = bool(ranges) and variant.method == "sekv" and getattr(memory, "ranking", None) is not None
                        if covered:
                            memory.record_kept = True
                        start = memory.n_tokens()
                    except SharedPrefillModified:
                        raise
                    except Exception as e:  # a broken method must not stop the sweep; the cells are retried next run
                        msg = f"{label} on {ctx.task}/{ctx.length}/{ctx.depth}: {type(e).__name__}: {e}"
                        outcome.errors.append(msg)
                        reporter.warn(msg)
                        for pi in todo:
                            results.append({**base_rec, "item": ctx.probes[pi].item, "error": f"{type(e).__name__}: {e}"})
                            reporter.cell({})
                        continue
                    for pi in todo:
                        probe = ctx.probes[pi]
                        pkey = _probe_key(ctx.task, probe.item, ctx.length, ctx.depth, ctx.seed, lm.model_id)
                        rec = {**base_rec, "item": probe.item, "params": params.to_dict()}
                        try:
                            reporter.stage(f"{label}: answer")
                            start = start_ask(memory, start, ask_window, len(q_ids[ci][pi]) + _max_new(cfg, probe))
                            load = _load_avg()
                            ans_ids, stats = generate(model, memory, q_ids[ci][pi], max_new_tokens=_max_new(cfg, probe), stop_ids=stop_ids, question=probe.question)
                            extra = memory.step_stats().extra
                            coverage = needle_coverage(tok, ctx, probe, ids, ranges, memory) if covered else None
                            memory.truncate(start)
                        except Exception as e:
                            msg = f"{label} on {ctx.task}/{ctx.length}/{ctx.depth}: {type(e).__name__}: {e}"
                            outcome.errors.append(msg)
                            reporter.warn(msg)
                            results.append({**rec, "error": f"{type(e).__name__}: {e}"})
                            reporter.cell({})
                            continue
                        answer = tok.decode(ans_ids, skip_special_tokens=True).strip()
                        correct, frac = scoring.score(answer, probe)
                        if m == REFERENCE:
                            reference[pkey] = ans_ids
                        ref = reference.get(pkey)
                        rec.update(
                            question=probe.question,
                            expected=probe.expected,
                            answer=answer,
                            answer_ids=ans_ids,
                            correct=bool(correct),
                            score=frac,
                            identical_to_full=None if ref is None else ans_ids == ref,
                            resident_kv_bytes_peak=stats.resident_kv_bytes_peak,
                            full_kv_bytes=stats.full_kv_bytes,
                            resident_fraction=stats.resident_kv_bytes_peak / max(stats.full_kv_bytes, 1),
                            ttft_s=round(stats.ttft_s, 5),
                            decode_s=round(stats.decode_s, 5),
                            tokens_per_s=round(stats.tokens_per_s, 3),
                            question_tokens=stats.question_tokens,
                            generated_tokens=stats.generated_tokens,
                            stop_reason=stats.stop_reason,
                            compress_s=round(compress_s, 4),
                            open_s=round(open_s, 4),
                            gpu_peak_bytes=stats.gpu_peak_bytes,
                            rss_bytes=stats.rss_bytes,
                            method_stats=method_stats(extra),
                            needle_coverage=coverage,
                            load_avg_1m=load,
                            time=_dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
                        )
                        results.append(rec)
                        outcome.added += 1
                        reporter.cell(rec)
                    del memory, tensors  # freed by reference counting (gc.collect() here costs more than a tiny cell)
                del pre
            finally:
                models.set_rope_scaling(lm, None)
    return outcome


def _fingerprint(pre) -> float:
    """A cheap checksum of the prefill's K/V (to catch a compress() that writes into them); a list: every window's."""
    if isinstance(pre, list):
        return sum(_fingerprint(w) for w in pre)
    return float(sum(torch.nan_to_num(t.float()).abs().sum(dtype=torch.float64) for t in (*pre.keys, *pre.values)))


def _needs_scores(method, params=None) -> tuple[str, ...]:
    if params is not None and hasattr(method, "needs"):
        return tuple(method.needs(params) or ())
    return tuple(getattr(method, "needs_scores", ()) or ())


def _obs_window(method, params) -> int:
    return method.obs_window(params)  # as ingest does


def _prefill_for(model, tok, ids: torch.Tensor, text: str, with_surprisal: bool, pairs: set[tuple[str, float | None]]):
    """One prefill serving every pending method: surprisal and the union of the prefill statistics they need.

    Returns (prefill result, what it computed besides K/V: its time, prefill_s, includes them).

    Methods that read the observation window's queries get the widest window asked
    for; _view_for() cuts it to each method's own window.
    """
    needs: set[str] = set()
    window = 0
    for m, b in pairs:
        variant = variants.parse(m)
        method = methods.get(variant.method)
        n = _needs_scores(method, method.resolve_params(variant.params(b)))
        needs.update(n)
        if "obs_queries" in n:
            window = max(window, _obs_window(method, method.resolve_params(variant.params(b))))
    capture = prefill_scores.capture_kinds(needs)
    kwargs = {"capture": capture, "obs_window": window or 64} if capture else {}
    pre = prefill(model, ids, with_surprisal=with_surprisal, **kwargs)
    pre.scores.update(prefill_scores.text_scores(tok, text, ids.tolist(), needs))
    return pre, (["surprisal"] if with_surprisal else []) + sorted(needs)


def _windowed_prefills(lm: models.LoadedModel, ctx: tasks.Context, ids: list[int], with_surprisal: bool, pairs, window: int):
    """A context past the model's window, prefilled in windows as `sekv ingest` plans them (sekv_core/windows.py),
    each window's statistics the union of what the pending methods need: (the windows' prefills, what they computed)."""
    needs: set[str] = set()
    obs = 0
    for m, b in pairs:
        variant = variants.parse(m)
        method = methods.get(variant.method)
        params = method.resolve_params(variant.params(b))
        needs.update(_needs_scores(method, params))
        obs = max(obs, _obs_window(method, params))
    doc = Document(None, ctx.task, "txt", ctx.document, "", (PageSpan(1, 0, len(ctx.document)),))
    _, _, header_len = ingest._tokenize(lm, doc)
    taking = [methods.get(variants.parse(m).method) for m, _ in pairs]
    planner = next((m for m in taking if m.length_policy == "windowed"), taking[0])
    plan = ingest.plan_windows(lm, doc, len(ids), planner, header_len)
    text = prompt.document_prefix(lm.tokenizer, ctx.document)
    shared = prefill_scores.text_scores(lm.tokenizer, text, ids, needs)
    out = []
    for w in plan:
        r = prefill_window(lm.model, ids, header_len, w, with_surprisal=with_surprisal, capture=prefill_scores.capture_kinds(needs), obs_window=obs or 64)
        r.scores.update(shared)
        out.append(r)
    return out, (["surprisal"] if with_surprisal else []) + sorted(needs) + [f"{len(plan)} windows"]


def _view_for(pre, method, params):
    """The prefill as this method's own ingest would have produced it (its observation window)."""
    scores = getattr(pre, "scores", None)
    if not scores or "obs_queries" not in _needs_scores(method) or "obs_window" not in scores:
        return pre
    w = min(_obs_window(method, params), int(scores["obs_window"]))
    if w == int(scores["obs_window"]):
        return pre
    cut = dict(scores, obs_queries=[q[:, q.shape[1] - w :] for q in scores["obs_queries"]], obs_window=w)
    return dataclasses.replace(pre, scores=cut)


_UNREADABLE = -1.0


def _rope_factor(m: str, n_tokens: int, reserve: int, window: int) -> float | None:
    """The RoPE scaling `sekv ingest` would give method m for this context (None: native; a YaRN factor for a "window"
    method past the window), or _UNREADABLE past what YaRN auto carries (sekv_core/rope_scaling.py)."""
    try:
        return rope_scaling.plan(methods.get(variants.parse(m).method), n_tokens, window, "auto", reserve=reserve)
    except DocumentError:
        return _UNREADABLE


def _probe_key(task, item, length, depth, seed, model) -> str:
    return cell_key(task, item, length, depth, seed, "", None, model)


def _max_new(cfg: BenchConfig, probe: tasks.Probe) -> int:
    return cfg.max_new_tokens or probe.max_new_tokens


def _load_avg() -> float | None:
    try:
        return round(os.getloadavg()[0], 2)
    except (OSError, AttributeError):
        return None
