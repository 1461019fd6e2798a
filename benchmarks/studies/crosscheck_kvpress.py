"""Cross-check our `snapkv`, `streamingllm` and `kvzip` against NVIDIA kvpress on the same prompts.

For each prompt (3 essay haystacks with one passphrase needle at depths 0.1 / 0.5 / 0.9,
plus the two sample documents) and each of SnapKV / StreamingLLM at kvpress compression
0.5 and 0.9 (our budget 0.5 and 0.1) it reports
  (1) the Jaccard overlap of the kept document-token positions, per layer and KV head,
      between kvpress and us, and
  (2) whether the greedy answers agree token for token (and whether each finds the answer).
Both sides use the same token ids (our chat-template split: document prefix | question),
float32 on the CPU, and kvpress's default hyper-parameters (SnapKV window 64, kernel 5,
average pooling; StreamingLLM 4 sinks), which we pass to our methods as parameters.

`--runs` picks the runs (default: SnapKV and StreamingLLM at 0.5 and 0.9).  `kvzip@CR` /
`kvzip_plus@CR` run kvpress's `KVzipPress(compression_ratio=CR)` (its defaults: 4 sinks,
2048-token chunks, one threshold over all layers and heads; `kvzip_plus_normalization`
for the latter) against our `kvzip` (`level="pair"`, `plus`), and also compare the
scores themselves (kvpress's `score_val` before it picks).  KVzipPress takes the chat
template's head from the model's own template (for Qwen2.5 its default system prompt);
our prompts carry our system prompt, so the worker is told where the context starts
(our `kvzip_prompts["context_start"]`).  A KVzip run is one more prefill plus the
reconstruction passes on each side: `--sequential` runs the two sides one after the other.

kvpress 0.5.x needs transformers < 5.3, so it runs in its own virtualenv, as a
subprocess of this script (the `--kvpress-worker` mode, which imports only torch,
transformers and kvpress); the two sides exchange JSON files.  Setup:
benchmarks/studies/README_kvpress.md.

    /work/venv/bin/python -m benchmarks.studies.crosscheck_kvpress --out /tmp/crosscheck
    /work/venv/bin/python -m benchmarks.studies.crosscheck_kvpress --model smollm2-135m --tokens 2000

Our side calls prefill(capture=...) once per prompt, then each method's compress() and
open() and the decode loop directly: the same code as `sekv ingest` + `sekv ask`,
without writing the pack file.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RUNS = [("snapkv", 0.5), ("snapkv", 0.9), ("streamingllm", 0.5), ("streamingllm", 0.9)]
KVZIP_RUNS = ("kvzip", "kvzip_plus")
KVPRESS_SNAPKV = {"window": 64, "kernel": 5, "pooling": "avg"}  # kvpress SnapKVPress defaults
KVPRESS_STREAMING = {"sinks": 4}
KVPRESS_KVZIP = {"sinks": 4, "chunk": 2048, "level": "pair", "plus": False}  # KVzipPress defaults (layerwise=False)
WORDS = ["copper", "harbor", "lantern", "meadow", "orchid", "quartz", "saffron", "timber", "violet", "walnut"]


# ------------------------------------------------------------------------------------ kvpress side


def kvpress_worker(job_path: str, out_path: str) -> None:
    """Runs inside the kvpress virtualenv: no sekv imports here."""
    import torch
    from kvpress import KVzipPress, SnapKVPress, StreamingLLMPress
    from transformers import AutoModelForCausalLM, DynamicCache

    import transformers

    transformers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    job = json.loads(Path(job_path).read_text())
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(job["model_dir"], dtype=torch.float32, attn_implementation="sdpa").eval()
    stop = set(job["stop_ids"])
    from importlib.metadata import version

    out: dict = {"versions": {"kvpress": version("kvpress"),
                              "transformers": transformers.__version__, "torch": torch.__version__}, "prompts": {}}

    def answer(cache, ctx_len: int, q_ids: list[int]) -> list[int]:
        # kvpress's pipeline (KVPressTextGenerationPipeline.generate_answer): explicit positions after the context
        pos = torch.arange(ctx_len, ctx_len + len(q_ids)).unsqueeze(0)
        with torch.inference_mode():
            o = model(input_ids=torch.tensor([q_ids]), past_key_values=cache, position_ids=pos, logits_to_keep=1)
            ids = [int(o.logits[0, -1].argmax())]
            p = pos[:, -1:] + 1
            while ids[-1] not in stop and len(ids) < job["max_new"]:
                o = model(input_ids=torch.tensor([[ids[-1]]]), past_key_values=cache, position_ids=p)
                p = p + 1
                ids.append(int(o.logits[0, -1].argmax()))
        return [t for t in ids if t not in stop]

    def make(method: str, cr: float):
        return SnapKVPress(compression_ratio=cr) if method == "snapkv" else StreamingLLMPress(compression_ratio=cr)

    def positions(full_keys, kept_keys) -> list[list[list[int]]]:
        """Each kept key is a bit-exact row of the uncompressed cache: recover the kept positions."""
        out_ = []
        for li, (fk, kk) in enumerate(zip(full_keys, kept_keys)):
            rows = []
            for h in range(fk.shape[0]):
                where = {r.tobytes(): i for i, r in enumerate(fk[h].numpy())}
                try:
                    rows.append(sorted(where[r.tobytes()] for r in kk[h].numpy()))
                except KeyError:
                    raise RuntimeError(f"a kept key of layer {li} head {h} is not a row of the full cache") from None
            out_.append(rows)
        return out_

    def kvzip_run(pr: dict, cr: float, plus: bool) -> dict:
        """KVzipPress through its own context manager (prefill + reconstruction), then the answer from the cache it
        masked; the kept positions are the complement of the masked ones (module.masked_key_indices)."""
        press = KVzipPress(compression_ratio=cr, kvzip_plus_normalization=plus)
        saved: dict = {}
        post = press.compress_post

        def keep_scores(model_):  # the scores before the press picks (and before it raises the sinks)
            saved["scores"] = press.score_val[:, 0].float().clone()
            return post(model_)

        press.compress_post = keep_scores
        ctx = torch.tensor([pr["ctx_ids"]])
        n = ctx.shape[1]
        cache = DynamicCache()
        with torch.inference_mode(), press(model):
            press.prefix_length = pr["context_start"]  # where our prompt's context starts (see the docstring)
            model.model(input_ids=ctx, past_key_values=cache)
        hkv = model.config.num_key_value_heads
        kept = []
        for layer in model.model.layers:
            _, heads, seqs = layer.self_attn.masked_key_indices
            keep = torch.ones(hkv, n, dtype=torch.bool)
            keep[heads, seqs] = False
            kept.append([keep[h].nonzero().view(-1).tolist() for h in range(hkv)])
        ans = answer(cache, n, pr["q_ids"])  # decoding attends through the mask, as kvpress's pipeline does
        for layer in model.model.layers:
            layer.self_attn.masked_key_indices = None
        return {"answer": ans, "kept": kept, "scores": [[[round(x, 9) for x in h] for h in s.tolist()] for s in saved["scores"]]}

    for pr in job["prompts"]:
        ctx = torch.tensor([pr["ctx_ids"]])
        n = ctx.shape[1]
        res: dict = {}
        t = time.perf_counter()
        for m, cr in job["runs"]:
            if m in KVZIP_RUNS:
                res[f"{m}@{cr}"] = kvzip_run(pr, cr, m == "kvzip_plus")
        presses = {f"{m}@{cr}": make(m, cr) for m, cr in job["runs"] if m not in KVZIP_RUNS}
        for press in presses.values():
            press.post_init_from_model(model)
        compressed: dict = {k: [] for k in presses}

        def hook(module, args, kwargs, output):
            # what BasePress.forward_hook does, for every press at once, leaving the real cache uncompressed:
            # the press's own compress() on this layer's cached keys/values
            layer = kwargs["past_key_values"].layers[module.layer_idx]
            for key, press in presses.items():
                k, v = press.compress(module, kwargs["hidden_states"], layer.keys, layer.values, output[1], kwargs)
                compressed[key].append((k, v))
            return output

        cache = DynamicCache()
        lm_ = model.model
        hooks = []
        for layer in lm_.layers:
            layer.self_attn.rotary_emb = lm_.rotary_emb  # as BasePress.__call__ does
            hooks.append(layer.self_attn.register_forward_hook(hook, with_kwargs=True))
        try:
            with torch.inference_mode():
                model(input_ids=ctx, past_key_values=cache)
        finally:
            for h in hooks:
                h.remove()
        full_keys = [layer.keys[0].clone() for layer in cache.layers]  # [Hkv, N, d]
        res["full"] = {"answer": answer(cache, n, pr["q_ids"])}
        for key in presses:
            c = DynamicCache()
            for li, (k, v) in enumerate(compressed[key]):
                c.update(k.clone(), v.clone(), li)
            res[key] = {"answer": answer(c, n, pr["q_ids"]), "kept": positions(full_keys, [k[0] for k, _ in compressed[key]])}
        if job.get("verify_hooks"):  # the real `with press(model):` path must keep the same positions
            for key, (m, cr) in zip(presses, [r for r in job["runs"] if r[0] not in KVZIP_RUNS]):
                c = DynamicCache()
                with torch.inference_mode(), make(m, cr)(model):
                    model(input_ids=ctx, past_key_values=c)
                res[key]["kept_via_press_hooks_equal"] = positions(full_keys, [layer.keys[0] for layer in c.layers]) == res[key]["kept"]
        res["seconds"] = round(time.perf_counter() - t, 1)
        out["prompts"][pr["name"]] = res
        print(f"kvpress: {pr['name']} done in {res['seconds']} s", file=sys.stderr, flush=True)
    Path(out_path).write_text(json.dumps(out))


# ------------------------------------------------------------------------------------ prompts


def haystack_prompt(tokenizer, target_tokens: int, depth: float, seed: int) -> tuple[str, str, list[str]]:
    """Paul Graham essays trimmed to ~target_tokens, with one passphrase needle at `depth` (sentence boundary)."""
    from sekv_core import prompt

    rng = random.Random(f"crosscheck-{seed}-{depth}")
    files = sorted((Path(os.environ.get("SEKV_HAYSTACK", "/work/shared/data/haystack/pg_essays"))).glob("*.txt"))
    rng.shuffle(files)
    text = " ".join(" ".join(f.read_text(encoding="utf-8", errors="replace").split()) for f in files[:12])
    sentences = [s.strip() + "." for s in text.split(". ") if s.strip()]
    value = f"{rng.choice(WORDS)}-{rng.randint(1000, 9999)}"
    needle = f"The secret passphrase for the archive is {value}."
    overhead = len(prompt.encode(tokenizer, prompt.document_prefix(tokenizer, needle)))
    keep, total = [], overhead
    for s in sentences:
        n = len(tokenizer(" " + s, add_special_tokens=False)["input_ids"])
        if total + n > target_tokens:
            break
        keep.append(s)
        total += n
    keep.insert(round(depth * len(keep)), needle)
    question = "What is the secret passphrase for the archive? Answer with the passphrase only."
    return " ".join(keep), question, [value]


def sample_prompts() -> list[tuple[str, str, str, list[str]]]:
    docs = ROOT / "sample_docs"
    return [
        ("lighthouse", (docs / "lighthouse_keepers_log.md").read_text(),
         "How many steps does the Skarvholm tower have from the door to the lantern room?", ["117"]),
        ("halden", (docs / "halden_hx40_manual.md").read_text(), "What is the maximum inlet water pressure of the HX-40?", ["8.6 bar"]),
    ]


# ------------------------------------------------------------------------------------ our side


def our_side(lm, prompts, runs, max_new: int, budgets_for) -> dict:
    import torch

    from sekv_core import methods, prompt
    from sekv_core.methods import kvzip
    from sekv_core.methods import scores as score_kinds
    from sekv_core.methods.base import DictStore
    from sekv_core.generate import generate
    from sekv_core.prefill import prefill

    seen: dict = {}
    score = kvzip.kvzip_scores

    def recording(pre, p):  # keep the scores compress() computes, to compare them with kvpress's
        seen["scores"] = score(pre, p)
        return seen["scores"]

    kvzip.kvzip_scores = recording

    stop = prompt.stop_token_ids(lm.tokenizer, getattr(lm.model, "generation_config", None))
    shape_layers = lm.model.config.num_hidden_layers
    out = {}
    for p in prompts:
        t = time.perf_counter()
        res = prefill(lm.model, torch.tensor(p["ctx_ids"]), with_surprisal=False, capture=("obs_queries",), obs_window=KVPRESS_SNAPKV["window"])
        res.scores.update(score_kinds.text_scores(lm.tokenizer, p["ctx_text"], p["ctx_ids"], ("kvzip_prompts",)))
        r: dict = {}
        for name, cr in [("full", None)] + runs:
            m = methods.get("kvzip" if name in KVZIP_RUNS else name)
            extra = {"snapkv": KVPRESS_SNAPKV, "streamingllm": KVPRESS_STREAMING, "kvzip": KVPRESS_KVZIP,
                     "kvzip_plus": {**KVPRESS_KVZIP, "plus": True}}.get(name, {})
            params = m.resolve_params({} if cr is None else {"budget": budgets_for(cr, len(p["ctx_ids"])), **extra})
            tensors = m.compress(res, params)
            memory = m.open(DictStore(tensors), params, res.shape, "cpu")
            ids, _ = generate(lm.model, memory, p["q_ids"], max_new_tokens=max_new, stop_ids=stop)
            entry = {"answer": ids}
            if cr is not None:
                entry["kept"] = [[h.tolist() for h in ix] for ix in m.kept_indices(DictStore(tensors), shape_layers)]
            if name in KVZIP_RUNS:
                entry["scores"] = [s.tolist() for s in seen["scores"]]
            r["full" if cr is None else f"{name}@{cr}"] = entry
        r["seconds"] = round(time.perf_counter() - t, 1)
        out[p["name"]] = r
        print(f"sekv: {p['name']} done in {r['seconds']} s", file=sys.stderr, flush=True)
    return out


# ------------------------------------------------------------------------------------ compare


def score_agreement(ours: list, theirs: list, start: int) -> dict:
    """Max |ours - kvpress| over the reconstructed positions, relative to kvpress's largest score there."""
    import torch

    a, b = torch.tensor(ours)[..., start:], torch.tensor(theirs)[..., start:]
    return {"score_max_abs_diff": float((a - b).abs().max()), "score_max_rel_diff": float((a - b).abs().max() / b.abs().max())}


def answer_positions(tok, p: dict) -> list[int]:
    """Token positions of the expected answer's first occurrence in the document prefix ([] if it is not there)."""
    text, value = p.get("ctx_text", ""), p["expected"][0]
    if value not in text:
        return []
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    if enc["input_ids"] != p["ctx_ids"]:
        return []
    a = text.index(value)
    return [i for i, (x, y) in enumerate(enc["offset_mapping"]) if x < a + len(value) and y > a]


def jaccard(a: list[int], b: list[int]) -> float:
    sa, sb = set(a), set(b)
    return len(sa & sb) / max(1, len(sa | sb))


def run_both(a, lm, out: Path, prompts: list, runs: list, stop: list) -> tuple[dict, dict]:
    """The kvpress worker (a subprocess in its virtualenv) and our side; both results, also written to OUT."""
    import torch

    job = {"model_dir": str(lm.path), "prompts": prompts, "stop_ids": stop, "max_new": a.max_new, "runs": runs,
           "verify_hooks": a.verify_hooks}
    (out / "job.json").write_text(json.dumps(job))

    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}
    env.update(HF_HUB_OFFLINE="1", TRANSFORMERS_VERBOSITY="error")
    kv_out = out / "kvpress.json"
    proc = subprocess.Popen([a.kvpress_python, str(Path(__file__).resolve()), "--kvpress-worker", str(out / "job.json"), str(kv_out)],
                            env=env, cwd="/tmp")
    # the kvpress side runs while we compute ours (2 processes; timings are not the point here), or first
    if a.sequential:
        proc.wait()
    torch.set_num_threads(max(1, (os.cpu_count() or 2) // (1 if a.sequential else 2)))

    def budgets_for(cr: float, n: int) -> float:
        return round(1.0 - cr, 6) if a.our_rounding else int(n * (1 - cr)) / n

    ours = our_side(lm, prompts, runs, a.max_new, budgets_for)
    (out / "sekv.json").write_text(json.dumps(ours))
    if proc.wait() != 0:
        sys.exit(f"the kvpress worker failed (exit {proc.returncode}); see its messages above")
    theirs = json.loads(kv_out.read_text())
    return ours, theirs


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="qwen2.5-0.5b", help="embedded model name or a model directory")
    ap.add_argument("--kvpress-python", default="/work/venvs/kvpress/bin/python")
    ap.add_argument("--runs", default=",".join(f"{m}@{cr}" for m, cr in RUNS),
                    help="comma-separated METHOD@CR, METHOD one of snapkv, streamingllm, kvzip, kvzip_plus (kvpress compression ratio CR)")
    ap.add_argument("--report-only", action="store_true", help="compare what OUT holds from an earlier run (no model runs)")
    ap.add_argument("--sequential", action="store_true", help="run the kvpress side first, then ours (one heavy process at a time)")
    ap.add_argument("--out", default="/tmp/crosscheck_kvpress")
    ap.add_argument("--tokens", type=int, default=2500, help="haystack prompt length in tokens")
    ap.add_argument("--depths", default="0.1,0.5,0.9")
    ap.add_argument("--no-samples", action="store_true", help="skip the two sample documents")
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--verify-hooks", action="store_true",
                    help="also run each press through its own `with press(model):` hooks (one more prefill per press) "
                         "and check that it keeps the same positions as the one-prefill path")
    ap.add_argument("--our-rounding", action="store_true",
                    help="budget = 1 - cr as is (we keep floor(budget * N), kvpress int(N * (1 - cr)), which can be 1 less); "
                         "by default we are given kvpress's count so the overlap measures the selection only")
    a = ap.parse_args()

    import torch

    from sekv_core import models, prompt

    out = Path(a.out).resolve()  # the worker runs in /tmp
    out.mkdir(parents=True, exist_ok=True)
    lm = models.load(a.model, device="cpu", dtype=torch.float32)
    tok = lm.tokenizer
    raw = [(f"haystack@{d}", *haystack_prompt(tok, a.tokens, float(d), 0)) for d in a.depths.split(",")]
    if not a.no_samples:
        raw += sample_prompts()
    runs = []
    for item in a.runs.split(","):
        m, _, cr = item.strip().partition("@")
        if m not in ("snapkv", "streamingllm", *KVZIP_RUNS) or not cr:
            sys.exit(f"--runs: '{item}' is not METHOD@CR with METHOD one of snapkv, streamingllm, kvzip, kvzip_plus")
        runs.append((m, float(cr)))
    from sekv_core.methods.kvzip import reconstruction_prompts

    prompts = []
    for name, text, question, expected in raw:
        ctx_text = prompt.document_prefix(tok, text)
        ctx_ids = prompt.encode(tok, ctx_text)
        prompts.append({"name": name, "ctx_ids": ctx_ids, "ctx_text": ctx_text,
                        "context_start": reconstruction_prompts(tok, ctx_text, ctx_ids)["context_start"],
                        "q_ids": prompt.encode(tok, prompt.question_suffix(tok, question)), "expected": expected})
    stop = sorted(prompt.stop_token_ids(tok, getattr(lm.model, "generation_config", None)))
    if a.report_only:  # compare what OUT already holds (the prompts and runs it was made with)
        job = json.loads((out / "job.json").read_text())
        prompts, runs = job["prompts"], [tuple(r) for r in job["runs"]]
        ours = json.loads((out / "sekv.json").read_text())
        theirs = json.loads((out / "kvpress.json").read_text())
    else:
        ours, theirs = run_both(a, lm, out, prompts, runs, stop)

    dec = lambda ids: tok.decode(ids, skip_special_tokens=True).strip()  # noqa: E731
    rows, summary = [], {}
    for p in prompts:
        o, k = ours[p["name"]], theirs["prompts"][p["name"]]
        for key in ["full"] + [f"{m}@{cr}" for m, cr in runs]:
            row = {"prompt": p["name"], "run": key, "n_doc": len(p["ctx_ids"]),
                   "answers_equal": o[key]["answer"] == k[key]["answer"],
                   "ours": dec(o[key]["answer"]), "kvpress": dec(k[key]["answer"])}
            row["ours_correct"] = any(e.lower() in row["ours"].lower() for e in p["expected"])
            row["kvpress_correct"] = any(e.lower() in row["kvpress"].lower() for e in p["expected"])
            if "kept_via_press_hooks_equal" in k[key]:
                row["kvpress_hooks_same_positions"] = k[key]["kept_via_press_hooks_equal"]
            if key != "full":
                js = [jaccard(a_, b_) for la, lb in zip(o[key]["kept"], k[key]["kept"]) for a_, b_ in zip(la, lb)]
                row["jaccard_mean"] = sum(js) / len(js)
                row["jaccard_min"] = min(js)
                row["kept_ours"] = len(o[key]["kept"][0][0])
                row["kept_kvpress"] = len(k[key]["kept"][0][0])
                row["kept_pairs_ours"] = sum(len(h) for layer in o[key]["kept"] for h in layer)
                row["kept_pairs_kvpress"] = sum(len(h) for layer in k[key]["kept"] for h in layer)
                # kept counts may differ (kvpress prunes int(L*H*N*cr) pairs, we keep L*H*floor(budget*N)):
                # the share of the smaller side's kept pairs that the other side keeps too
                both = sum(len(set(a_) & set(b_)) for la, lb in zip(o[key]["kept"], k[key]["kept"]) for a_, b_ in zip(la, lb))
                row["kept_smaller_side_contained"] = both / max(1, min(row["kept_pairs_ours"], row["kept_pairs_kvpress"]))
            if "scores" in o.get(key, {}):
                row.update(score_agreement(o[key]["scores"], k[key]["scores"], p["context_start"]))
            pos = answer_positions(tok, p)
            if key != "full" and pos:  # how much of the expected answer's tokens each side kept
                for side, res in (("ours", o[key]), ("kvpress", k[key])):
                    fr = [len(set(pos) & set(h)) / len(pos) for layer in res["kept"] for h in layer]
                    row[f"answer_tokens_kept_share_{side}"] = round(sum(fr) / len(fr), 4)
                    row[f"heads_keeping_all_answer_tokens_{side}"] = f"{sum(f == 1 for f in fr)}/{len(fr)}"
                    row[f"heads_keeping_no_answer_token_{side}"] = f"{sum(f == 0 for f in fr)}/{len(fr)}"
            rows.append(row)
    for key in ["full"] + [f"{m}@{cr}" for m, cr in runs]:
        rs = [r for r in rows if r["run"] == key]
        summary[key] = {"answers_equal": f"{sum(r['answers_equal'] for r in rs)}/{len(rs)}",
                        "ours_correct": f"{sum(r['ours_correct'] for r in rs)}/{len(rs)}",
                        "kvpress_correct": f"{sum(r['kvpress_correct'] for r in rs)}/{len(rs)}"}
        if key != "full":
            summary[key]["jaccard_mean"] = round(sum(r["jaccard_mean"] for r in rs) / len(rs), 4)
            summary[key]["jaccard_min"] = round(min(r["jaccard_min"] for r in rs), 4)
    result = {"model": lm.model_id, "versions_kvpress_side": theirs["versions"], "rows": rows, "summary": summary}
    (out / "crosscheck.json").write_text(json.dumps(result, indent=1, ensure_ascii=False))
    for r in rows:
        j = f" jaccard {r['jaccard_mean']:.4f} (min {r['jaccard_min']:.4f}) kept {r['kept_ours']}/{r['kept_kvpress']}" if "jaccard_mean" in r else ""
        print(f"{r['prompt']:14s} {r['run']:18s} equal={r['answers_equal']!s:5s}{j}  ours={r['ours']!r}  kvpress={r['kvpress']!r}")
    print(json.dumps(summary, indent=1))


if __name__ == "__main__":
    if sys.argv[1:2] == ["--kvpress-worker"]:
        kvpress_worker(sys.argv[2], sys.argv[3])
    else:
        main()
