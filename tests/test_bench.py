"""`sekv bench`: task generators, scoring, the resumable runner, reports, the command line."""

from __future__ import annotations

import importlib.util
import json
import re
from collections import Counter

import pytest
import torch
from typer.testing import CliRunner

from conftest import ROOT
from sekv_cli.app import app
from sekv_core import methods, prompt
from sekv_core.bench import report, runner, scoring, tasks
from sekv_core.bench.tasks import Probe
from sekv_core.methods.base import CacheMethod, GrowingKV, ModelShape, StepStats
from sekv_core.methods.full import FullMemory
from sekv_core.methods.params import BudgetParams

cli = CliRunner()
HAS_MPL = importlib.util.find_spec("matplotlib") is not None


# ---------------------------------------------------------------------------------------------
# fixtures




@pytest.fixture(scope="module")
def tok(tiny_qwen):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_qwen)


class _WindowMemory(FullMemory):
    """Full attention over the first token + a recent window, at the right positions."""

    def __init__(self, kv, shape, dropped: int, n_layers: int, n_heads: int):
        super().__init__(kv, shape)
        self.dropped = dropped
        self.zoom = {
            "zoom_spans_step": 0,
            "zoom_spans_total": 3,
            "h2d_bytes_total": 1024,
            "zoom_rate_per_layer": [0.25 * (i + 1) for i in range(n_layers)],
            "zoom_rate_per_layer_head": [[0.1 * h + 0.2 * i for h in range(n_heads)] for i in range(n_layers)],
            "span_zoom_counts": {0: 2, 5: 1},
        }

    def n_tokens(self) -> int:
        return self.kv.len[-1] + self.dropped

    def truncate(self, n_tokens: int) -> None:
        self.kv.truncate(n_tokens - self.dropped)

    def step_stats(self) -> StepStats:
        return StepStats(self.resident_bytes(), dict(self.zoom))


class FakeWindow(CacheMethod):
    """A tiny budgeted method for the harness tests (keeps token 0 and the last budget*N tokens)."""

    name = "fakewin"
    params_type = BudgetParams
    compress_calls = 0

    def compress(self, prefill, params):
        FakeWindow.compress_calls += 1
        n = prefill.n_tokens
        keep = max(2, int(params.budget * n))
        idx = torch.cat([torch.tensor([0]), torch.arange(n - keep + 1, n)])
        out = {"fw.n": torch.tensor([n])}
        for i, (k, v) in enumerate(zip(prefill.keys, prefill.values)):
            out[f"fw.k.{i}"] = k[:, idx].contiguous()
            out[f"fw.v.{i}"] = v[:, idx].contiguous()
        return out

    def open(self, store, params, shape: ModelShape, device):
        keys = [store.get(f"fw.k.{i}") for i in range(shape.n_layers)]
        values = [store.get(f"fw.v.{i}") for i in range(shape.n_layers)]
        n = int(store.get("fw.n")[0])
        return _WindowMemory(GrowingKV.from_tensors(keys, values, device), shape, n - keys[0].shape[1], shape.n_layers, shape.n_heads)


class Broken(FakeWindow):
    name = "broken"

    def compress(self, prefill, params):
        raise RuntimeError("boom")


class Vandal(FakeWindow):
    name = "vandal"

    def compress(self, prefill, params):
        prefill.keys[0].mul_(2)  # writes into the shared prefill
        return super().compress(prefill, params)


@pytest.fixture
def fake_methods(monkeypatch):
    monkeypatch.setitem(methods.REGISTRY, "fakewin", FakeWindow())
    monkeypatch.setitem(methods.REGISTRY, "broken", Broken())
    monkeypatch.setitem(methods.REGISTRY, "vandal", Vandal())
    FakeWindow.compress_calls = 0


# ---------------------------------------------------------------------------------------------
# task generators


def _body_token_positions(tok, ctx, char_offset: int) -> tuple[int, int]:
    """(token index of the character, token count) within the document body."""
    enc = tok(ctx.document, add_special_tokens=False, return_offsets_mapping=True)
    offs = enc["offset_mapping"]
    idx = next(i for i, (a, b) in enumerate(offs) if b > char_offset)
    return idx, len(offs)


def _sentence_tokens(tok, text: str) -> int:
    return max(len(tok(" " + s, add_special_tokens=False)["input_ids"]) for s in tasks.split_sentences(text))


@pytest.mark.parametrize("length", [512, 1024])
@pytest.mark.parametrize("depth", [0, 25, 50, 75, 100])
def test_niah_depth_length_and_single_needle(tok, haystack, length, depth):
    essays = tasks.load_haystack(haystack)
    ctx = tasks.gen_niah(tok, length, depth, 7, essays)
    needle = ctx.meta["needles"][0]
    assert ctx.document.count(needle) == 1
    assert ctx.probes[0].expected[0] in needle and ctx.document.count(ctx.probes[0].expected[0]) == 1
    # length: the whole document prefix, within one sentence below the target
    n = len(prompt.encode(tok, prompt.document_prefix(tok, ctx.document)))
    assert n == ctx.n_tokens <= length
    longest = _sentence_tokens(tok, ctx.document)
    assert length - n <= max(16, 0.02 * length), (length, n)  # the haystack is cut within a word
    # depth: the needle's token position within +-1 sentence of depth% of the body
    pos, total = _body_token_positions(tok, ctx, ctx.document.index(needle))
    assert abs(pos - depth / 100 * total) <= longest + 1, (pos, total, depth, longest)
    if depth == 0:
        assert ctx.document.startswith(needle)
    if depth == 100:
        assert ctx.document.endswith(needle)


def test_generators_are_deterministic_by_seed(tok, haystack):
    essays = tasks.load_haystack(haystack)
    for name, gen in tasks.GRID_TASKS.items():
        a = gen(tok, 600, 50, 1, essays)
        b = gen(tok, 600, 50, 1, essays)
        c = gen(tok, 600, 50, 2, essays)
        assert a.document == b.document and a.probes == b.probes, name
        assert a.document != c.document, name
        assert a.n_tokens <= 600


def test_ruler_tasks_content(tok, haystack):
    essays = tasks.load_haystack(haystack)
    mk = tasks.gen_mk_niah(tok, 800, 50, 3, essays)
    assert len(mk.meta["needles"]) == 4 and all(mk.document.count(nd) == 1 for nd in mk.meta["needles"])
    assert mk.probes[0].expected[0] in mk.meta["needles"][0]
    keys = [re.search(r"for (\w+) is", nd).group(1) for nd in mk.meta["needles"]]
    assert len(set(keys)) == 4 and keys[0] in mk.probes[0].question

    mv = tasks.gen_mv_niah(tok, 800, None, 3, essays)
    assert mv.probes[0].match == "all" and len(mv.probes[0].expected) == 4
    assert all(mv.document.count(v) == 1 for v in mv.probes[0].expected)

    vt = tasks.gen_vt(tok, 800, None, 3)
    chain = vt.probes[0].expected
    number = re.search(r"value (\d+)", vt.probes[0].question).group(1)
    assert vt.document.index(f"VAR {chain[0]} = {number}.") >= 0
    pos = [vt.document.index(f"VAR {b} = VAR {a}.") for a, b in zip(chain, chain[1:])]
    assert pos == sorted(pos) and pos[0] > vt.document.index(f"VAR {chain[0]} = {number}.")

    cwe = tasks.gen_cwe(tok, 800, None, 3)
    words = Counter(re.findall(r"^\d+\. (\w+)$", cwe.document, flags=re.M))
    top = [w for w, _ in words.most_common(5)]
    assert sorted(top) == sorted(cwe.probes[0].expected)
    assert min(words[w] for w in top) > max(c for w, c in words.items() if w not in top)
    assert cwe.n_tokens <= 800


def test_expand_tasks():
    assert tasks.expand_tasks("niah,ruler") == ["niah", "mk_niah", "mv_niah", "vt", "cwe"]
    with pytest.raises(Exception, match="unknown benchmark task"):
        tasks.expand_tasks("nope")


def test_qa_questions_parsed_with_accepted_alternatives():
    qs = tasks.parse_questions((ROOT / "sample_docs" / "QUESTIONS.md").read_text())
    assert len(qs) == 10
    by = {(d, n): a for d, n, _, a in qs}
    assert by[("halden_hx40_manual.pdf", 1)] == ["8.6 bar"]
    assert "18 months" in by[("halden_hx40_manual.pdf", 2)]
    assert by[("lighthouse_keepers_log.md", 3)] == ["seven", "7"]
    assert "Brekke" in by[("lighthouse_keepers_log.md", 5)]


def test_missing_haystack_is_a_clear_error(tmp_path):
    with pytest.raises(Exception, match="haystack directory .* does not exist"):
        tasks.load_haystack(tmp_path / "nope")


# ---------------------------------------------------------------------------------------------
# scoring


def test_scoring_hand_cases():
    p = Probe("", "q", ["copper-4217"])
    assert scoring.score("The passphrase is COPPER-4217.", p) == (True, 1.0)
    assert scoring.score("copper 4217", p) == (False, 0.0)
    assert scoring.score("", p) == (False, 0.0)
    allp = Probe("", "q", ["111", "222", "333"], match="all")
    ok, f = scoring.score("111, 333", allp)
    assert not ok and f == pytest.approx(2 / 3)
    assert scoring.score("333 222 111", allp) == (True, 1.0)
    word = Probe("", "q", ["seven", "7"], whole_word=True)
    assert scoring.score("Seven men survived", word)[0]
    assert scoring.score("7.", word)[0]
    assert not scoring.score("17 men", word)[0]
    assert scoring.contains("Marta\nSofie", "marta sofie")


# ---------------------------------------------------------------------------------------------
# runner


def _cfg(haystack, **kw):
    base = dict(tasks=["niah"], methods=["fakewin"], budgets=[0.25, 0.5], lengths=[300], depths=[0, 100], seed=0,
                haystack=haystack, max_new_tokens=6)
    base.update(kw)
    return runner.BenchConfig(**base)


def test_runner_records_and_resumes_without_recomputing(lm, haystack, tmp_path, fake_methods, monkeypatch):
    calls = {"prefill": 0}
    real = runner.prefill

    def counting(*a, **k):
        calls["prefill"] += 1
        return real(*a, **k)

    monkeypatch.setattr(runner, "prefill", counting)
    out = tmp_path / "run"
    o1 = runner.run(lm, _cfg(haystack), out)
    # 2 contexts x (full + fakewin@0.25 + fakewin@0.5), full always first as the reference
    assert (o1.cells, o1.added, o1.skipped, o1.errors) == (6, 6, 0, [])
    assert calls["prefill"] == 2 and FakeWindow.compress_calls == 4
    recs = runner.read_results(out / runner.RESULTS_FILE)
    assert len(recs) == 6
    full = [r for r in recs if r["method"] == "full"]
    assert all(r["identical_to_full"] is True and r["resident_fraction"] == 1.0 and r["budget"] is None for r in full)
    fw = [r for r in recs if r["method"] == "fakewin"]
    assert {r["budget"] for r in fw} == {0.25, 0.5}
    for r in fw:
        assert r["identical_to_full"] in (True, False)
        assert r["resident_kv_bytes_peak"] < r["full_kv_bytes"]
        assert r["method_stats"]["zoom_rate_per_layer"] == [0.25, 0.5] and r["method_stats"]["spans_zoomed"] == 2
        for k in ("ttft_s", "tokens_per_s", "prefill_s", "compress_s", "machine", "sekv_version", "answer", "expected", "n_tokens"):
            assert k in r

    o2 = runner.run(lm, _cfg(haystack), out)
    assert (o2.added, o2.skipped, o2.prefills) == (0, 6, 0)
    assert calls["prefill"] == 2 and FakeWindow.compress_calls == 4
    assert len(runner.read_results(out / runner.RESULTS_FILE)) == 6

    # drop one fakewin cell (and leave a torn line): only that cell is recomputed, reusing full's stored answer
    lines = (out / runner.RESULTS_FILE).read_text().splitlines()
    gone = next(i for i, ln in enumerate(lines) if json.loads(ln)["method"] == "fakewin")
    kept = [ln for i, ln in enumerate(lines) if i != gone]
    (out / runner.RESULTS_FILE).write_text("\n".join(kept) + "\n" + '{"task": "ni')
    o3 = runner.run(lm, _cfg(haystack), out)
    assert (o3.added, o3.skipped, o3.prefills) == (1, 5, 1)
    assert FakeWindow.compress_calls == 5
    recs = runner.read_results(out / runner.RESULTS_FILE)
    assert len(recs) == 6 and all(r.get("identical_to_full") is not None for r in recs)


def test_runner_is_deterministic_and_full_matches_itself(lm, haystack, tmp_path, fake_methods):
    runs = []
    for name in ("a", "b"):
        runner.run(lm, _cfg(haystack, methods=["full"]), tmp_path / name)
        runs.append(runner.read_results(tmp_path / name / runner.RESULTS_FILE))
    a, b = runs
    assert [r["answer_ids"] for r in a] == [r["answer_ids"] for r in b]
    assert len(a) == 2  # full has no budget: run once per context


def test_broken_method_is_recorded_and_retried(lm, haystack, tmp_path, fake_methods):
    out = tmp_path / "run"
    o = runner.run(lm, _cfg(haystack, methods=["broken"], depths=[50], budgets=[0.5]), out)
    assert o.added == 1 and len(o.errors) == 1 and "boom" in o.errors[0]
    rows, errors = report.load(out)
    assert len(rows) == 1 and len(errors) == 1
    o = runner.run(lm, _cfg(haystack, methods=["broken"], depths=[50], budgets=[0.5]), out)
    assert o.added == 0 and o.skipped == 1 and len(o.errors) == 1  # retried, failed again
    text = report.summary_markdown(rows, errors, [])
    assert "Failed cells" in text and "boom" in text


def test_method_writing_into_the_shared_prefill_stops_the_run(lm, haystack, tmp_path, fake_methods):
    with pytest.raises(runner.SharedPrefillModified, match="vandal"):
        runner.run(lm, _cfg(haystack, methods=["vandal"], depths=[50], budgets=[0.5]), tmp_path)


@pytest.fixture(scope="module")
def lm512(tmp_path_factory):
    """A tiny model with a 512-position window (sekv's windowed prefill needs room for the prompt's header)."""
    from conftest import make_tiny_model
    from sekv_core import models

    return models.load(str(make_tiny_model(tmp_path_factory.mktemp("tiny512"), "qwen2", max_positions=512)), device="cpu", dtype=torch.float32)


def test_context_window_is_checked(lm512, haystack, tmp_path):
    with pytest.raises(Exception, match="context window"):  # past what YaRN x4 carries, and no method that reads further
        runner.run(lm512, _cfg(haystack, methods=["full"], lengths=[2100], depths=[50]), tmp_path)


def test_full_past_the_window_runs_with_yarn_as_ingest_would(lm512, haystack, tmp_path):
    """A 1,000-token context on a 512-position model: full reads it with YaRN x3 (rope_scaling.plan: 1,000 + ingest's
    512 reserved tokens), its answer equals plain transformers' greedy decoding with that YaRN config (an independent
    reference); sekv reads it natively in windows; the model is native again afterwards."""
    from transformers import AutoModelForCausalLM

    from sekv_core import models

    native_inv = lm512.model.model.rotary_emb.inv_freq.clone()
    cfg = _cfg(haystack, methods=["full"], budgets=[0.5], lengths=[1000], depths=[50], max_new_tokens=8)

    def native():
        assert models.rope_factor(lm512.config) is None and torch.equal(lm512.model.model.rotary_emb.inv_freq, native_inv)
        assert lm512.model.model.rotary_emb.attention_scaling == 1.0

    o = runner.run(lm512, cfg, tmp_path)  # full alone: the YaRN phase is the last one, and the model must still be native after it
    assert o.errors == [] and o.added == 1 and o.prefills == 1
    native()
    cfg.methods = ["full", "sekv"]  # resumed: full is done, sekv reads the context natively in windows
    o = runner.run(lm512, cfg, tmp_path)
    assert o.errors == [] and (o.added, o.skipped, o.prefills) == (1, 1, 1)
    native()
    recs = {r["method"]: r for r in runner.read_results(tmp_path / runner.RESULTS_FILE)}
    full, sk = recs["full"], recs["sekv"]
    assert full["rope_factor"] == 3.0 and sk["rope_factor"] is None and sk["prefill_with"][-1].endswith("windows")
    assert full["n_tokens"] > 2 * 512 - 100

    tok = lm512.tokenizer
    ctx = runner.plan_contexts(tok, cfg)[0]
    ids = prompt.encode(tok, prompt.document_prefix(tok, ctx.document)) + prompt.encode(tok, prompt.question_suffix(tok, ctx.probes[0].question))
    stop = prompt.stop_token_ids(tok, getattr(lm512.model, "generation_config", None))

    def greedy(**kw):
        m = AutoModelForCausalLM.from_pretrained(lm512.path, dtype=torch.float32, attn_implementation="sdpa", **kw).eval()
        out = m.generate(torch.tensor([ids]), max_new_tokens=8, do_sample=False, eos_token_id=sorted(stop), pad_token_id=0)
        return [t for t in out[0, len(ids):].tolist() if t not in stop]

    yarn3 = {"rope_type": "yarn", "factor": 3.0, "original_max_position_embeddings": 512, "rope_theta": 10000.0}
    want = greedy(rope_parameters=yarn3)
    assert len(full["answer_ids"]) > 3 and full["answer_ids"] == want
    assert want != greedy()  # native RoPE answers otherwise: the test can fail
    assert runner.run(lm512, cfg, tmp_path).added == 0  # resumable


# ---------------------------------------------------------------------------------------------
# command line


def _run(*args, env=None):
    r = cli.invoke(app, [str(a) for a in args], env=env)
    return r.exit_code, r.stdout, r.stderr


def test_cli_bench_writes_results_summary_and_plots(tiny_qwen, haystack, tmp_path, fake_methods):
    out = tmp_path / "bench"
    code, stdout, stderr = _run("bench", "niah", "--model", tiny_qwen, "--methods", "full,fakewin", "--budgets", "0.2,0.5",
                                "--lengths", "256,384", "--depths", "0,100", "--haystack", haystack, "--out", out, "-n", "4", "-q")
    assert code == 0, stderr
    assert stdout.strip() == str(out / "summary.md")
    recs = runner.read_results(out / "results.jsonl")
    assert len(recs) == 2 * 2 * 3
    summary = (out / "summary.md").read_text()
    assert "## Accuracy by method and budget" in summary and "fakewin" in summary and "niah: correct by length and depth" in summary
    pngs = sorted(p.name for p in out.glob("*.png"))
    if not HAS_MPL:  # CI installs .[test] only: the summary says how to get the plots
        assert not pngs and "Plots skipped: matplotlib is not installed" in summary
    else:
        assert {"heatmap_niah.png", "accuracy_vs_budget.png", "memory_vs_length.png"} <= set(pngs)
        assert {"zoom_fakewin_0.2.png", "zoom_per_layer.png"} <= set(pngs)  # the fake memory reports zoom stats
        assert all((out / p).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in pngs)
        assert all(f"]({p})" in summary for p in pngs)

    # `bench report DIR` regenerates from the JSONL alone; a second run adds nothing
    (out / "summary.md").unlink()
    for p in out.glob("*.png"):
        p.unlink()
    code, stdout, stderr = _run("bench", "report", out)
    assert code == 0, stderr
    assert (out / "summary.md").read_text() == summary
    assert (out / "heatmap_niah.png").is_file() == HAS_MPL
    (out / "summary.md").unlink()
    code, stdout, stderr = _run("bench", "niah", "--report-only", "--no-plots", "--out", out)
    assert code == 0, stderr
    again = (out / "summary.md").read_text()
    assert "## Accuracy by method and budget" in again and "## Plots" not in again
    code, _, stderr = _run("bench", "niah", "--model", tiny_qwen, "--methods", "full,fakewin", "--budgets", "0.2,0.5",
                           "--lengths", "256,384", "--depths", "0,100", "--haystack", haystack, "--out", out, "-n", "4")
    assert code == 0, stderr
    assert "0 new cell(s), 12 already done" in stderr
    assert len(runner.read_results(out / "results.jsonl")) == 12


def _one_line_error(code, stderr, *needles):
    assert code == 2
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("sekv: error: "), stderr
    for n in needles:
        assert n in lines[0]


def test_cli_missing_haystack_and_bad_input(tiny_qwen, tmp_path):
    missing = tmp_path / "no_such_dir"
    _one_line_error(*_run("bench", "niah", "--model", tiny_qwen, "--haystack", missing, "--out", tmp_path / "o")[::2],
                    "haystack directory", str(missing))
    _one_line_error(*_run("bench", "niah", "--model", tiny_qwen, "--out", tmp_path / "o", env={"SEKV_HAYSTACK": str(missing)})[::2],
                    "SEKV_HAYSTACK")
    _one_line_error(*_run("bench", "nope", "--out", tmp_path / "o")[::2], "unknown benchmark task")
    _one_line_error(*_run("bench", "vt", "--methods", "nope", "--out", tmp_path / "o")[::2], "unknown cache method")
    _one_line_error(*_run("bench", "vt", "--budgets", "0,2", "--out", tmp_path / "o")[::2], "--budgets")
    _one_line_error(*_run("bench", "report", tmp_path / "empty")[::2], "results.jsonl not found")


@pytest.mark.parametrize("depth,doc", [(0, 0), (30, 1), (60, 2), (100, 3)])
def test_corpus_niah_is_a_corpus_with_the_needle_in_one_document(tok, haystack, tmp_path, monkeypatch, depth, doc):
    """The context is what `sekv ingest essay_1.txt ... -o pack` packs (load_corpus of the documents written to files,
    named as given); the needle is once in the corpus, in document floor(depth * 4), and the prompt fits the length."""
    from sekv_core.documents import load_corpus

    essays = tasks.load_haystack(haystack)
    ctx = tasks.gen_corpus_niah(tok, 1024, depth, 5, essays)
    needle = ctx.meta["needles"][0]
    names = ctx.meta["documents"]
    assert len(names) == 4 and ctx.meta["needle_document"] == names[doc] and ctx.document.count(needle) == 1
    bodies = re.split(r"(?:^|\n\n)## file: essay_\d\.txt\n\n", ctx.document)[1:]
    assert len(bodies) == 4 and needle in bodies[doc]
    monkeypatch.chdir(tmp_path)
    for name, body in zip(names, bodies):
        (tmp_path / name).write_text(body)
    assert load_corpus(names).text == ctx.document
    n = len(prompt.encode(tok, prompt.document_prefix(tok, ctx.document)))
    assert n == ctx.n_tokens <= 1024 and 1024 - n <= 64
    lens = [len(tok(b, add_special_tokens=False)["input_ids"]) for b in bodies]
    assert max(lens) - min(lens) <= 48  # documents of about the same length


def test_cli_bench_corpus_niah(tiny_qwen, haystack, tmp_path):
    out = tmp_path / "bench"
    code, stdout, stderr = _run("bench", "corpus_niah", "--model", tiny_qwen, "--methods", "full,sekv", "--budgets", "0.3",
                                "--lengths", "512", "--depths", "50", "--haystack", haystack, "--out", out, "-n", "4", "-q", "--no-plots")
    assert code == 0, stderr
    recs = runner.read_results(out / "results.jsonl")
    assert {r["task"] for r in recs} == {"corpus_niah"} and {r["method"] for r in recs} == {"full", "sekv"}
    assert "corpus_niah" in (out / "summary.md").read_text()


def test_sekv_rows_carry_the_needles_coverage(lm, haystack, tmp_path):
    """sekv's rows say what was read of each needle's tokens (ZoomMemory.token_coverage); other methods' say nothing.
    The token range is the needle's text; at depth 100 the needle's end lies in the end window (its length from the
    budget: sekv/compress.py lengths), read exact."""
    from sekv_core.sekv.compress import lengths
    cfg = _cfg(haystack, tasks=["niah", "mn_niah"], methods=["sekv"], budgets=[0.3], lengths=[512], depths=[0, 100], limit=2)
    runner.run(lm, cfg, tmp_path / "run")
    recs = runner.read_results(tmp_path / "run" / runner.RESULTS_FILE)
    assert not [r for r in recs if r.get("error")]
    assert all(r["needle_coverage"] is None for r in recs if r["method"] == "full")
    ctxs = {(c.task, c.depth): c for c in runner.plan_contexts(lm.tokenizer, cfg)}
    labels = {"exact", "zoomed", "partly zoomed", "coarse"}
    rows = [r for r in recs if r["method"] == "sekv"]
    assert {r["task"] for r in rows} == {"niah", "mn_niah"}
    for r in rows:
        ctx = ctxs[(r["task"], r["depth"])]
        ids = prompt.encode(lm.tokenizer, prompt.document_prefix(lm.tokenizer, ctx.document))
        cov = r["needle_coverage"]
        assert len(cov["needles"]) == len(ctx.meta["needles"])
        assert [n["asked"] for n in cov["needles"]] == [r["expected"][0] in x for x in ctx.meta["needles"]]
        assert sum(n["asked"] for n in cov["needles"]) == 1
        assert cov["n_blocks"] > 0 and 0 <= cov["kept_blocks"][0] <= cov["kept_blocks"][1] <= cov["n_blocks"]
        for n, needle in zip(cov["needles"], ctx.meta["needles"]):
            a, b = n["tokens"]
            text = lm.tokenizer.decode(ids[a:b])
            assert needle in text and len(text) <= len(needle) + 2, (text, needle)  # no token more than it takes
            assert "".join(n["token_text"]) == text
            assert len(n["resolution"]) == b - a and set(n["resolution"]) <= labels
            assert sum(n["counts"][k] for k in labels if k in n["counts"]) == b - a
            span_tokens = [x for x in n["resolution"] if x != "exact"]
            assert len(n["blocks"]) >= (1 if span_tokens else 0)
            for blk in n["blocks"]:
                assert blk["end"] > a and blk["start"] < b and 0 <= blk["rank"] < cov["n_blocks"]
            assert all(a < p < b for p in n["block_starts"])
        window = lengths(len(ids), methods.get("sekv").resolve_params(r["params"]))[2]
        in_window = [x for n in cov["needles"] for p, x in zip(range(*n["tokens"]), n["resolution"]) if p >= len(ids) - window]
        assert in_window == ["exact"] * len(in_window)
        assert bool(in_window) == (r["task"] == "niah" and r["depth"] == 100)
