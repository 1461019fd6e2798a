"""DepthWeave-KV on a real model: the measurements behind docs/depthweave.md.

Document: the first --tokens tokens (default 4096) of pg_essays/worked.txt in sekv's
chat-template document prefix, prefilled once as `sekv ingest --method depthweave`
does (surprisal, accumulated attention mass, observation-window queries, token
text).  Two questions about it:

  q1 "What did the author work on before college, and what did he think of it?"
  q2 "What was the name of the programming language the author used on the IBM 1401?"

For each question a full-KV forward records every layer's query / key / value of the
question tokens and the attention output over the full cache (the reference).

Measures (per configuration of depthweave's parameters; the defaults otherwise):

* attention-output error: the recorded q / k / v are fed to the memory's ``attend``
  layer by layer, so the question routing runs as in a real ask, and
  ||o - o_full|| / ||o_full|| is averaged over query heads, question tokens and layers.
  q1 runs first on a fresh memory, q2 after it (the memory reset to the document);
* key / value error at the ingest routing: ||X^ - X|| / ||X|| over every compressed
  token, per layer, averaged over layers (keys compared after RoPE);
* basis ranks, resident fraction (resident bytes + the PyTorch path's working set,
  / the full KV), level shares after q1, pack tensor bytes vs raw fp16 KV.

Tables (positional, any number):

  keys     pre- vs post-RoPE key error at equal rank: per layer and KV head a PCA basis
           (uncentred, all tokens, unquantised) of rank 8 / 16 / 24; plus each layer's
           key and value energy in the top 8 of head_dim singular directions
  budgets  the defaults at budgets 0.10 0.125 0.15 0.20 0.25 0.30 0.50
  windows  depth_window / depth_overlap at budget 0.25 (1/0, 2/0, 2/1, 4/0)
  choices  the design decisions at budget 0.25: level unit, question routing, residual
           gate, router weights, exact first tokens
  e2e      end to end, 32 greedy tokens: teacher-forced top-1 agreement and KL with
           full on full's answer, and the free-running answers (0.25, 0.25 probes off,
           0.20, 0.125)
  hx40     `sekv ingest sample_docs/halden_hx40_manual.pdf --method depthweave` at
           0.25 / 0.125 and the README question, through ingest + Session.ask

  --config JSON  (repeatable) extra configurations for the attention-error table

Usage:
    python -m benchmarks.studies.depthweave_eval budgets windows choices --cache /tmp/dw_eval
    python -m benchmarks.studies.depthweave_eval e2e hx40 --cache /tmp/dw_eval
    python -m benchmarks.studies.depthweave_eval --config '{"budget": 0.25, "rank_k": 24}'

Results print as Markdown rows (and, with --jsonl FILE, one JSON object per
configuration).  The prefill + question records are cached under --cache (~60 MB).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]

from sekv_core import methods, models, prompt, runtime
from sekv_core.depthweave import attention as dw_attention
from sekv_core.depthweave import codec
from sekv_core.errors import SekvError
from sekv_core.generate import generate
from sekv_core.methods.base import GrowingKV, PrefillResult
from sekv_core.methods.full import FullMemory
from sekv_core.methods import scores
from sekv_core.prefill import prefill
from sekv_core.sekv import rope

ESSAYS = ROOT / "shared" / "data" / "haystack" / "pg_essays"
if not ESSAYS.is_dir():
    ESSAYS = Path("/work/shared/data/haystack/pg_essays")
QUESTIONS = {
    "q1": "What did the author work on before college, and what did he think of it?",
    "q2": "What was the name of the programming language the author used on the IBM 1401?",
}
HX40 = ROOT / "sample_docs" / "halden_hx40_manual.pdf"
HX40_QUESTION = "What is the maximum inlet water pressure of the HX-40?"

TABLES = {
    "budgets": [{"budget": b} for b in (0.10, 0.125, 0.15, 0.20, 0.25, 0.30, 0.50)],
    "windows": [{"budget": 0.25, "rank_k": 16, "rank_v": 16, "depth_window": w, "depth_overlap": o} for w, o in ((1, 0), (2, 0), (2, 1), (4, 0))],
    "choices": [
        {"budget": 0.25},
        {"budget": 0.25, "level_unit": 1},
        {"budget": 0.25, "question_routing": 0},
        {"budget": 0.25, "gate": 0},
        {"budget": 0.25, "router": "mass=0.5,spike=0.5,delim=1,energy=1,probe=4"},
        {"budget": 0.25, "router": "mass=1,spike=0.5,delim=1,energy=1,probe=4"},
        {"budget": 0.25, "router": "mass=2,spike=0.5,delim=1,energy=0,probe=4"},
        {"budget": 0.25, "router": "mass=2,spike=0.5,delim=1,energy=2,probe=4"},
        {"budget": 0.25, "router": "mass=2,spike=0,delim=0,energy=1,probe=4"},
        {"budget": 0.25, "exact_tokens": 1},
        {"budget": 0.25, "exact_tokens": 16},
    ],
    "e2e": [{"budget": 0.25}, {"budget": 0.25, "probe_every": 0}, {"budget": 0.20}, {"budget": 0.125}],
}


class Store(dict):
    """A dict-backed TensorStore (no pack file)."""

    def get(self, name):
        return self[name]


class Recorder(FullMemory):
    """Full KV attention that keeps each layer's (query, key, value, output, scaling) of the forward it serves."""

    def __init__(self, kv, shape):
        super().__init__(kv, shape)
        self.rec: dict[int, tuple] = {}

    def attend(self, layer, query, key, value, scaling):
        out = super().attend(layer, query, key, value, scaling)
        self.rec[layer] = (query.clone(), key.clone(), value.clone(), out.clone(), scaling)
        return out


# ---------------------------------------------------------------------------------------------
# the case: one prefill + the two questions' records


def build_case(lm, n_tokens: int) -> dict:
    text = (ESSAYS / "worked.txt").read_text()
    ids = prompt.encode(lm.tokenizer, prompt.document_prefix(lm.tokenizer, text))[:n_tokens]
    dw = methods.get("depthweave")
    t = time.perf_counter()
    pre = prefill(lm.model, torch.tensor(ids), with_surprisal=True, capture=scores.capture_kinds(dw.needs_scores))
    prefill_s = time.perf_counter() - t
    pre.scores["token_text"] = lm.tokenizer.batch_decode([[i] for i in ids])
    qs = {}
    for name, question in QUESTIONS.items():
        q_ids = prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, question))
        rec = Recorder(GrowingKV.from_tensors(pre.keys, pre.values, "cpu", extra=len(q_ids)), pre.shape)
        runtime.forward_hidden(lm.model, torch.tensor([q_ids]), len(ids), rec)
        qs[name] = {"ids": q_ids, "layers": [rec.rec[i] for i in range(pre.shape.n_layers)]}
    return {"prefill": pre, "questions": qs, "prefill_s": prefill_s, "model": lm.model_id}


def load_case(lm_loader, model: str, n_tokens: int, cache: Path | None) -> dict:
    path = cache / f"depthweave_eval_{model}_{n_tokens}.pt" if cache else None
    if path and path.is_file():
        return torch.load(path, weights_only=False)  # our own file
    case = build_case(lm_loader(), n_tokens)
    if path:
        path.parent.mkdir(parents=True, exist_ok=True)
        torch.save(case, path)
    return case


# ---------------------------------------------------------------------------------------------
# measurements


def attention_error(mem, layers, n_doc: int) -> float:
    mem.truncate(n_doc)
    mem.begin_step(layers[0][0].shape[2])
    errs = []
    for layer, (q, k, v, ref, scaling) in enumerate(layers):
        out = mem.attend(layer, q, k, v, scaling).float()
        ref = ref.float()
        errs.append(float(((out - ref).norm(dim=-1) / ref.norm(dim=-1)).mean()))
    mem.end_step()
    return sum(errs) / len(errs)


def kv_errors(mem, pre: PrefillResult) -> tuple[float, float]:
    """Relative key / value error of every compressed token at the memory's current routing (keys post-RoPE)."""
    spec = mem.spec
    n_c, n_e, n_l = spec.n_compressed, spec.n_exact, pre.shape.n_layers
    ek = ev = 0.0
    for layer in range(n_l):
        m = spec.window_of(layer)
        goff = codec.token_offsets(mem.ng[m])
        k = dw_attention.reconstruct(mem.codes[layer]["k"], 0, n_c, mem.ng[m], goff, spec.max_groups, mem.rot).float()
        v = dw_attention.reconstruct(mem.codes[layer]["v"], 0, n_c, mem.ng[m], goff, spec.max_groups, None).float()
        kk, vv = pre.keys[layer][:, n_e:].float(), pre.values[layer][:, n_e:].float()
        ek += float((k - kk).norm() / kk.norm()) / n_l
        ev += float((v - vv).norm() / vv.norm()) / n_l
    return ek, ev


def measure(case: dict, cfg: dict) -> dict:
    dw = methods.get("depthweave")
    pre: PrefillResult = case["prefill"]
    n = pre.n_tokens
    p = dw.resolve_params(cfg)
    torch.manual_seed(0)
    t = time.perf_counter()
    store = Store(dw.compress(pre, p))
    compress_s = time.perf_counter() - t
    mem = dw.open(store, p, pre.shape, "cpu")
    d = dw.describe(store, p)
    res = {
        "cfg": cfg,
        "ranks": d["basis_rank"],
        "resident_fraction": round((mem.resident_bytes() + mem.transient_reserve) / (n * pre.shape.kv_bytes_per_token()), 4),
        "pack_reduction_vs_fp16": d["pack_reduction_vs_raw_fp16"],
        "kv_error_ingest": [round(x, 4) for x in kv_errors(mem, pre)],
        "compress_s": round(compress_s, 1),
    }
    res["attn_error_q1"] = round(attention_error(mem, case["questions"]["q1"]["layers"], n), 4)
    res["levels_after_q1"] = dict(zip(map(str, mem.spec.levels), [round(x, 2) for x in mem.level_shares()]))
    res["attn_error_q2"] = round(attention_error(mem, case["questions"]["q2"]["layers"], n), 4)
    res["_mem"] = mem
    return res


def agreement(lm, case: dict, mem, q_ids: list[int], n_new: int = 32) -> dict:
    """Full's greedy answer; its tokens teacher-forced through mem: top-1 agreement and KL(full || mem) per step;
    then mem's own free-running answer."""
    pre: PrefillResult = case["prefill"]
    n = pre.n_tokens

    def full_mem():
        return FullMemory(GrowingKV.from_tensors(pre.keys, pre.values, "cpu", extra=n_new + len(q_ids) + 8), pre.shape)

    ref_ids, _ = generate(lm.model, full_mem(), q_ids, max_new_tokens=n_new, stop_ids=set())

    def forced_logits(memory):
        memory.truncate(n)
        out = []
        memory.begin_step(len(q_ids))
        out.append(runtime.forward_logits(lm.model, torch.tensor([q_ids]), n, memory)[0, -1])
        memory.end_step()
        for i, tok in enumerate(ref_ids[:-1]):
            memory.begin_step(1)
            out.append(runtime.forward_logits(lm.model, torch.tensor([[tok]]), n + len(q_ids) + i, memory)[0, -1])
            memory.end_step()
        return torch.stack(out).float()

    lf, lc = forced_logits(full_mem()), forced_logits(mem)
    agree = float((lf.argmax(-1) == lc.argmax(-1)).float().mean())
    kl = float(torch.nn.functional.kl_div(lc.log_softmax(-1), lf.log_softmax(-1), log_target=True, reduction="batchmean"))
    mem.truncate(n)
    ids, _ = generate(lm.model, mem, q_ids, max_new_tokens=n_new, stop_ids=set())
    extra = mem.step_stats().extra
    return {
        "top1_agreement": round(agree, 3),
        "kl_nats": round(kl, 3),
        "full": lm.tokenizer.decode(ref_ids, skip_special_tokens=True),
        "depthweave": lm.tokenizer.decode(ids, skip_special_tokens=True),
        "probes": extra.get("probes"),
        "probe_error_mean": extra.get("probe_error_mean"),
    }


def key_space_table(case: dict, ranks=(8, 16, 24)) -> list[dict]:
    """Per-layer (w = 1) PCA bases of pre- and post-RoPE keys at equal rank, unquantised; errors compared post-RoPE."""
    pre: PrefillResult = case["prefill"]
    shape, n = pre.shape, pre.n_tokens
    inv = rope.inv_freq_of(shape)
    cos, sin = rope.cos_sin(torch.arange(n), inv, shape.rope_attention_scaling, dtype=pre.keys[0].dtype)
    out = []
    for r in ranks:
        err = {"pre_rope": 0.0, "post_rope": 0.0}
        for layer in range(shape.n_layers):
            post = pre.keys[layer].float()
            for space, x in (("post_rope", post), ("pre_rope", rope.undo(post, cos, sin))):
                g = x.double().transpose(1, 2) @ x.double()  # [Hkv, d, d]
                basis = torch.linalg.eigh(g)[1].flip(-1)[..., :r].float()  # [Hkv, d, r]
                xh = (x @ basis) @ basis.transpose(1, 2)
                if space == "pre_rope":
                    xh = rope.apply(xh, cos, sin)
                err[space] += float((xh - post).norm() / post.norm()) / shape.n_layers
        out.append({"rank": r, **{k: round(v, 3) for k, v in err.items()}})
    energy = {"pre_rope_keys": [], "values": []}
    for layer in range(shape.n_layers):
        post = pre.keys[layer].float()
        for name, x in (("pre_rope_keys", rope.undo(post, cos, sin)), ("values", pre.values[layer].float())):
            s2 = torch.linalg.svdvals(x[:, 1:].double()) ** 2  # the first token (attention sink) left out
            energy[name].append(float((s2[:, :8].sum(-1) / s2.sum(-1)).min()))
            energy[name].append(float((s2[:, :8].sum(-1) / s2.sum(-1)).max()))
    out.append({"energy_top8_range": {k: [round(min(v), 2), round(max(v), 2)] for k, v in energy.items()}})
    return out


def hx40_table(lm, budgets=(0.25, 0.125)) -> list[dict]:
    from sekv_core.ingest import ingest
    from sekv_core.session import Session

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for b in budgets:
            r = ingest(HX40, Path(tmp) / f"hx40_{b}.sekv", lm=lm, method="depthweave", params={"budget": b})
            s = Session.open(r.pack_path, lm=lm)
            a = s.ask(HX40_QUESTION, max_new_tokens=48)
            d = methods.get("depthweave").describe(s.pack, s.params)
            rows.append({
                "budget": b, "n_tokens": r.n_tokens, "answer": a.text,
                "resident_peak_fraction": round(a.stats.resident_kv_bytes_peak / a.stats.full_kv_bytes, 4),
                "resident_reduction_at_ingest_budget": d["resident_reduction_vs_raw_fp16"],
                "pack_reduction_vs_fp16": d["pack_reduction_vs_raw_fp16"],
            })
    return rows


# ---------------------------------------------------------------------------------------------
# output


def _md(cells) -> str:
    return "| " + " | ".join(str(c) for c in cells) + " |"


def _cfg_text(cfg: dict) -> str:
    return ", ".join(f"{k}={v}" for k, v in cfg.items())


HEAD = ["config", "ranks k/v", "resident", "levels 0/2/4/8 after q1", "attn err q1 / q2", "key / value err (ingest)", "pack vs fp16", "compress s"]


def row(res: dict) -> str:
    lv = "/".join(f"{x:.2f}".lstrip("0") for x in res["levels_after_q1"].values())
    return _md([_cfg_text(res["cfg"]), f"{res['ranks']['keys']}/{res['ranks']['values']}", res["resident_fraction"], lv,
                f"{res['attn_error_q1']:.4f} / {res['attn_error_q2']:.4f}", f"{res['kv_error_ingest'][0]:.3f} / {res['kv_error_ingest'][1]:.3f}",
                f"{res['pack_reduction_vs_fp16']}x smaller", res["compress_s"]])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("tables", nargs="*", choices=["keys", *TABLES, "hx40"], help="which tables (default: budgets)")
    ap.add_argument("--config", action="append", default=[], help="extra JSON configuration of depthweave's parameters")
    ap.add_argument("--model", default="qwen2.5-0.5b")
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--cache", type=Path, default=None, help="directory for the prefill + question records")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--jsonl", type=Path, default=None, help="also append every result as one JSON line here")
    a = ap.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    tables = a.tables or ([] if a.config else ["budgets"])
    lm_box: list = []

    def lm_loader():
        if not lm_box:
            lm_box.append(models.load(a.model))
        return lm_box[0]

    def emit(obj: dict) -> None:
        if a.jsonl:
            with open(a.jsonl, "a", encoding="utf-8") as f:
                f.write(json.dumps({k: v for k, v in obj.items() if not k.startswith("_")}) + "\n")

    need_case = any(t != "hx40" for t in tables) or a.config
    case = load_case(lm_loader, a.model, a.tokens, a.cache) if need_case else None
    if case:
        pre = case["prefill"]
        print(f"# {case['model']}, {pre.n_tokens} tokens of pg_essays/worked.txt; questions "
              + ", ".join(f"{k} ({len(v['ids'])} tokens)" for k, v in case["questions"].items()), flush=True)
    for table in tables:
        print(f"\n## {table}\n", flush=True)
        if table == "keys":
            for r in key_space_table(case):
                print(json.dumps(r), flush=True)
                emit({"table": table, **r})
            continue
        if table == "hx40":
            for r in hx40_table(lm_loader()):
                print(json.dumps(r), flush=True)
                emit({"table": table, **r})
            continue
        print(_md(HEAD if table != "e2e" else ["config", "q", "top-1 agreement", "KL nats", "probes (mean error)", "free-running answer"]))
        print(_md(["---"] * (len(HEAD) if table != "e2e" else 6)), flush=True)
        full_answers: dict[str, str] = {}
        for cfg in TABLES[table]:
            try:
                res = measure(case, cfg)
            except SekvError as e:  # e.g. a budget below the bases' floor on a short document
                print(_md([_cfg_text(cfg), f"error: {e}"]), flush=True)
                continue
            if table != "e2e":
                print(row(res), flush=True)
                emit({"table": table, **res})
                continue
            for qn, q in case["questions"].items():
                e = agreement(lm_loader(), case, res["_mem"], q["ids"])
                print(_md([_cfg_text(cfg), qn, e["top1_agreement"], e["kl_nats"], f"{e['probes']} ({e['probe_error_mean']})",
                           json.dumps(e["depthweave"])]), flush=True)
                emit({"table": table, "cfg": cfg, "question": qn, **e})
                full_answers[qn] = e["full"]
        if table == "e2e":
            for qn, text in full_answers.items():
                print(_md(["full", qn, "", "", "", json.dumps(text)]), flush=True)
    if a.config:
        print("\n## configs\n")
        print(_md(HEAD))
        print(_md(["---"] * len(HEAD)))
        for text in a.config:
            res = measure(case, json.loads(text))
            print(row(res), flush=True)
            emit({"table": "config", **res})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
