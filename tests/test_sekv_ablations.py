"""SeKV ablations (issue 4, SPEC §4): fixed chunks, no anchors, global threshold, and their bench variants."""

from __future__ import annotations

import math
import random

import pytest
import torch
import transformers
from typer.testing import CliRunner

from sekv_cli.app import app
from sekv_core import methods, runtime
from sekv_core.bench import runner, variants
from sekv_core.errors import SekvError
from sekv_core.generate import generate
from sekv_core.methods.base import GrowingKV
from sekv_core.methods.full import FullMemory
from sekv_core.sekv.params import ABLATIONS
from sekv_core.sekv.residents import apply_tau_mode
from sekv_core.prefill import prefill
from sekv_core.sekv import router
from sekv_core.sekv.segment import fixed_segment, segment

SEKV = methods.get("sekv")
#: the ablations the current parameters support (untrained-router needs the `router` parameter)
RUNNABLE = [a for a, ov in ABLATIONS.items() if all(k in SEKV.default_params for k in ov.overrides)]


class Store(dict):
    def get(self, name):
        return self[name]


def _cover(seg, n):
    pos, _ = seg.span_tokens()
    allpos = torch.cat([seg.full_idx, pos])
    assert allpos.numel() == n and torch.equal(torch.sort(allpos).values, torch.arange(n)), "every token exactly once"
    assert set(seg.anchor_idx.tolist()) <= set(seg.full_idx.tolist())


# ---------------------------------------------------------------------------------------------
# segmentation


def test_fixed_chunks_cover_every_token_once_with_the_expected_lengths():
    rng = random.Random(0)
    for _ in range(300):
        n = rng.randint(0, 5000)
        sink, window = rng.randint(0, 6), rng.randint(0, 700)
        chunk = rng.choice([1, 2, 7, 16, 33.4, 80, 160.7])
        for anchors in (True, False):
            seg = fixed_segment(n, chunk=chunk, n_sink=sink, window=window, anchors=anchors)
            _cover(seg, n)
            lo = min(sink, n) if anchors else 0
            hi = max(lo, n - window)
            r = hi - lo
            if r < chunk:
                assert seg.n_spans == 0 and seg.full_idx.numel() == n
                continue
            # expected counts, written out independently of the implementation
            s = max(1, math.floor((r + 1) / (chunk + 1) + 0.5)) if anchors else max(1, math.floor(r / chunk + 0.5))
            assert seg.n_spans == s
            lens = seg.span_len
            assert int(lens.max()) - int(lens.min()) <= 1, "chunks differ by at most one token"
            assert int(lens.sum()) == r - (s - 1 if anchors else 0)
            if s > 1:  # the mean chunk stays within half a chunk (rounding of the count) of the asked length
                assert abs(float(lens.float().mean()) - chunk) <= chunk / 2 + 1
            # what is at full resolution: sinks, window, and (with anchors) one token between neighbouring chunks
            full = set(seg.full_idx.tolist())
            expect = set(range(0, lo)) | set(range(hi, n))
            if anchors:
                expect |= set(seg.span_end[:-1].tolist())
                assert torch.equal(seg.span_start[1:], seg.span_end[:-1] + 1)
                assert seg.anchor_idx.tolist() == seg.span_end[:-1].tolist()
            else:
                assert seg.anchor_idx.numel() == 0
                assert torch.equal(seg.span_start[1:], seg.span_end[:-1])
            assert full == expect


def test_fixed_chunks_match_the_surprisal_segmentation_in_count_when_nothing_was_split():
    g = torch.Generator().manual_seed(3)
    s = torch.rand(4096, generator=g) * 3
    s[torch.randint(4, 4000, (600,), generator=g)] += 12  # plenty of boundary candidates: no span reaches max_span
    seg = segment(s, min_span=20, max_span=10_000, n_sink=4, window=256)
    assert seg.n_spans > 50 and seg.anchor_idx.numel() == seg.n_spans - 1
    mean = float(seg.span_len.float().mean())
    fx = fixed_segment(4096, chunk=mean, n_sink=4, window=256)
    assert fx.n_spans == seg.n_spans and fx.anchor_idx.numel() == seg.anchor_idx.numel()
    assert fx.full_idx.numel() == seg.full_idx.numel()


def test_no_anchors_keeps_only_the_window_at_full_resolution():
    rng = random.Random(1)
    for seed in range(40):
        n = rng.randint(50, 3000)
        s = torch.tensor([rng.expovariate(0.4) for _ in range(n)])
        s[torch.randint(0, n, (n // 8,))] += 10
        mn = rng.randint(2, 40)
        w = rng.randint(0, 300)
        with_a = segment(s, min_span=mn, max_span=4 * mn, n_sink=4, window=w)
        seg = segment(s, min_span=mn, max_span=4 * mn, n_sink=4, window=w, anchors=False)
        _cover(seg, n)
        assert seg.anchor_idx.numel() == 0
        hi = max(0, n - w)
        if hi < mn:
            continue
        assert seg.full_idx.tolist() == list(range(hi, n)), "no sink, no boundary token outside the window"
        # the same boundaries: each kept anchor of the anchored segmentation opens a span here
        assert set(with_a.anchor_idx.tolist()) <= set(seg.span_start.tolist())
    # n_sink=0 alone is not "no anchors": the boundary anchors stay
    s = torch.zeros(1000)
    s[::50] = 20.0
    seg = segment(s, min_span=10, max_span=100, n_sink=0, window=100)
    assert seg.anchor_idx.numel() > 0 and 0 not in seg.full_idx.tolist()


# ---------------------------------------------------------------------------------------------
# global threshold


def test_global_tau_is_one_threshold_everywhere():
    g = torch.Generator().manual_seed(0)
    tau = torch.rand(6, 14, generator=g) * 0.9 + 0.05
    rt = router.Router(torch.randn(6, 2, 32, 64, generator=g), tau)
    same = apply_tau_mode(rt, "per_head")
    assert torch.equal(same.tau, tau)
    glob = apply_tau_mode(rt, "global")
    assert torch.equal(glob.w, rt.w) and glob.tau.shape == tau.shape
    assert torch.all(glob.tau == glob.tau[0, 0]), "one value for every (layer, head)"
    logit_mean = torch.log(tau.double() / (1 - tau.double())).mean()
    assert abs(float(glob.tau[0, 0]) - float(1 / (1 + torch.exp(-logit_mean)))) < 1e-6
    assert torch.allclose(glob.logit_tau(), torch.full_like(tau, float(logit_mean)), atol=1e-5)
    with pytest.raises(SekvError):
        SEKV.resolve_params({"tau_mode": "per_layer"})


# ---------------------------------------------------------------------------------------------
# every ablation end to end on tiny random models


def _tiny(kind: str):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
                  vocab_size=300, max_position_embeddings=4096)
    cfg = transformers.Qwen2Config(**common) if kind == "qwen2" else transformers.LlamaConfig(**common, rope_theta=50000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa").eval()
    runtime.install(model)
    return model


@pytest.fixture(scope="module", params=["qwen2", "llama"])
def tiny_case(request):
    model = _tiny(request.param)
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(1))
    return model, prefill(model, ids, with_surprisal=True, chunk=128)


@pytest.mark.parametrize("ablation", RUNNABLE)
def test_each_ablation_answers_end_to_end(tiny_case, ablation):
    model, res = tiny_case
    p = SEKV.resolve_params(variants.parse(f"sekv:{ablation}").params(0.2))
    store = Store(SEKV.compress(res, p))
    mem = SEKV.open(store, p, res.shape, "cpu")
    assert mem.res.n_spans > 3
    ids, stats = generate(model, mem, [5, 6, 7, 8], max_new_tokens=5, stop_ids=set())
    assert len(ids) == 5 and stats.resident_kv_bytes_peak <= 0.2 * stats.full_kv_bytes * 1.05 + 4096
    starts, ends = store["sekv.span_start"], store["sekv.span_end"]
    if ablation == "no-anchors":
        assert store["sekv.anchor_idx"].numel() == 0
        assert int(store["sekv.full_idx"][0]) > 0, "not even the first token is an anchor"
        assert int(store["sekv.config"][7]) == 0
    if ablation == "fixed-chunks":
        lens = ends - starts
        assert int(lens.max() - lens.min()) <= 1
        assert torch.equal(starts[1:], ends[:-1] + 1)
    if ablation == "no-svd":
        assert mem.step_stats().extra["zoom_spans_total"] == 0
    if ablation == "global-tau":
        assert torch.all(mem.res.logit_tau == mem.res.logit_tau[0, 0])


@pytest.mark.parametrize("ablation", ["fixed-chunks", "no-anchors", "mean-pool"])
def test_ablated_segmentation_is_still_exact_at_full_expansion(tiny_case, ablation):
    """Every span expanded at full rank equals full KV whatever the spans are (SPEC §2.5)."""
    model, res = tiny_case
    exact = {"zoom": "all", "budget": 1.0, "energy_k": 1.0, "energy_v": 1.0, "rank_max": 64, "factors_8bit": False, "zoom_tier": "factors",
             "factor_dtype": "float32", "min_span": 8, "window": 16}
    p = SEKV.resolve_params({**exact, **ABLATIONS[ablation].overrides})
    mem = SEKV.open(Store(SEKV.compress(res, p)), p, res.shape, "cpu")
    full = FullMemory(GrowingKV.from_tensors(res.keys, res.values, "cpu"), res.shape)
    q = torch.randint(0, 300, (1, 7), generator=torch.Generator().manual_seed(2))
    a = runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)
    b = runtime.forward_logits(model, q, full.n_tokens(), full, last_only=False)
    assert mem.res.n_spans > 5
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()


# ---------------------------------------------------------------------------------------------
# variants in the bench


def test_variant_specs():
    v = variants.parse("sekv:fixed-chunks:chunk=64:anchors=off")
    assert v.label == "sekv:fixed-chunks:chunk=64:anchors=off" and v.method == "sekv"
    assert v.overrides == {"segmentation": "fixed", "chunk": 64.0, "anchors": False} and v.ablations == ("fixed-chunks",)
    assert v.params(0.1) == {**v.overrides, "budget": 0.1}
    assert SEKV.resolve_params(v.params(0.1)).anchors is False
    assert variants.parse("sekv").overrides == {} and variants.parse("full").label == "full"
    for bad, needle in (("sekv:nope=1", "no parameter 'nope'"), ("sekv:budget=0.2", "--budgets"), ("sekv:no-such", "ablations"),
                        ("sekv:anchors=maybe", "true or false"), ("sekv:rank_max=x", "number"), ("nope:zoom=none", "nope")):
        with pytest.raises(SekvError, match=needle):
            variants.parse(bad)
    specs = variants.expand_ablations("all")
    assert specs == [f"sekv:{a}" for a in RUNNABLE]
    assert variants.expand_ablations("no-svd,global-tau") == ["sekv:no-svd", "sekv:global-tau"]



def test_bench_rows_and_summary_carry_the_variant(tiny_qwen, haystack, tmp_path):
    out = tmp_path / "abl"
    r = CliRunner().invoke(app, ["bench", "niah", "--model", str(tiny_qwen), "--methods", "sekv,sekv:tau_mode=global",
                                 "--ablations", "no-svd,fixed-chunks", "--budgets", "0.3", "--lengths", "400", "--depths", "50",
                                 "--haystack", str(haystack), "--out", str(out), "-n", "3", "-q", "--no-plots"])
    assert r.exit_code == 0, r.stderr
    recs = runner.read_results(out / runner.RESULTS_FILE)
    by = {rec["method"]: rec for rec in recs}
    assert set(by) == {"full", "sekv", "sekv:tau_mode=global", "sekv:no-svd", "sekv:fixed-chunks"}
    assert not any(rec.get("error") for rec in recs)
    assert by["sekv:no-svd"]["variant"] == "no-svd" and by["sekv:no-svd"]["base_method"] == "sekv"
    assert by["sekv:no-svd"]["overrides"] == {"zoom": "none"} and by["sekv:no-svd"]["params"]["zoom"] == "none"
    assert by["sekv:fixed-chunks"]["params"]["segmentation"] == "fixed"
    assert by["sekv:tau_mode=global"]["params"]["tau_mode"] == "global"
    assert by["sekv"]["variant"] is None and by["sekv"]["params"]["zoom"] == "router"
    summary = (out / "summary.md").read_text()
    assert "## Variants" in summary and "| sekv:no-svd | sekv | zoom=none |" in summary
    assert "| sekv:fixed-chunks | 0.3 |" in summary
    # resumable per variant: the same command adds nothing
    r = CliRunner().invoke(app, ["bench", "niah", "--model", str(tiny_qwen), "--methods", "sekv,sekv:tau_mode=global",
                                 "--ablations", "no-svd,fixed-chunks", "--budgets", "0.3", "--lengths", "400", "--depths", "50",
                                 "--haystack", str(haystack), "--out", str(out), "-n", "3", "--no-plots"])
    assert r.exit_code == 0 and "0 new cell(s), 5 already done" in r.stderr
    bad = CliRunner().invoke(app, ["bench", "niah", "--ablations", "nope", "--out", str(tmp_path / "x")])
    assert bad.exit_code == 2 and "nope" in bad.stderr
