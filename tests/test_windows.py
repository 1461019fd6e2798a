"""Windowed ingest (sekv_core/windows.py, ingest.plan_windows, sekv/merge.py): documents past the model's window.

References: a direct single prefill + compress (one window), RoPE computed by hand in float64 (re-rotation),
layer-0 keys rebuilt from the embedding (they do not depend on context), factorisations of the whole
document, the kernel's peak RSS of a fresh process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from conftest import ROOT, SAMPLE_MD

from sekv_core import windows
from sekv_core.documents import load_document
from sekv_core.errors import DocumentError
from sekv_core.ingest import IngestProgress, WINDOW_ENV, ingest, plan_windows, tokenize_document
from sekv_core.pack import read_pack
from sekv_core.sekv import factorize as fz
from sekv_core.sekv.merge import merge_factors

#: a forced window of this many tokens makes the sample log (2,913 tokens with the tiny tokenizer) 6 windows
SMALL_WINDOW = 1024
EXACT = {"store_dtype": "model", "factor_bits": 8}


def _tensors(path: Path) -> dict[str, torch.Tensor]:
    p = read_pack(path)
    return {k: p.get(k) for k in p.keys()}


# -- the plan ---------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("n,header,cap,carry", [(100, 10, 100, 20), (101, 10, 100, 20), (5000, 145, 768, 256), (10_000, 0, 64, 0)])
def test_plan_covers_the_document_in_order_and_fits_the_window(n, header, cap, carry):
    plan = windows.plan(n, header, cap, carry)
    assert plan[0].start == 0 and plan[-1].end == n
    assert all(a.end == b.start for a, b in zip(plan, plan[1:]))
    ids = list(range(n))
    for w in plan:
        local = w.local_ids(ids, header)
        assert len(local) <= cap and w.count == len(plan)
        assert local[-w.n :] == ids[w.start : w.end]  # its own part last, in order
        if w.index:
            assert local[:header] == ids[:header]  # opened by the header
            assert local[header : header + w.carry] == ids[w.start - w.carry : w.start]
            assert w.offset == w.start - header - w.carry
    assert (len(plan) == 1) == (n <= cap)


def test_plan_refuses_a_window_the_header_fills():
    with pytest.raises(ValueError, match="leaves"):
        windows.plan(1000, 90, 100, 0)


# -- re-rotation ------------------------------------------------------------------------------------------------


def _rope64(x: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor) -> torch.Tensor:
    """RoPE by hand, float64: rotate_half convention, pairs (i, i + d/2) rotated by pos * inv_freq[i]."""
    x = x.double()
    ang = pos.double().view(-1, 1) * inv.double().view(1, -1)  # [T, d/2]
    c, s = ang.cos(), ang.sin()
    h = x.shape[-1] // 2
    a, b = x[..., :h], x[..., h:]
    return torch.cat([a * c - b * s, a * s + b * c], -1)


def test_shift_equals_rope_at_the_global_position():
    torch.manual_seed(0)
    d, theta = 16, 10000.0
    inv = (1.0 / theta ** (torch.arange(0, d, 2).double() / d)).float().double()  # the model's float32 frequencies
    k = torch.randn(2, 5, d)  # pre-RoPE, [Hkv, T, d]
    local = torch.arange(3, 8)
    for delta in (1, 431, 4093, 250_000):
        moved = windows.shift(_rope64(k, local, inv).float(), delta, inv.float())
        want = _rope64(k, local + delta, inv)
        assert torch.allclose(moved.double(), want, atol=2e-5), delta
    assert windows.shift(k, 0, inv.float()) is k


# -- one window: exactly today's pack ---------------------------------------------------------------------------


def test_one_window_document_gives_the_tensors_of_a_direct_single_prefill(lm, tmp_path):
    from sekv_core import methods
    from sekv_core.methods import scores
    from sekv_core.prefill import prefill
    from sekv_core import prompt

    r = ingest(SAMPLE_MD, tmp_path / "a.sekv", lm=lm, method="sekv")
    got = _tensors(r.pack_path)
    assert read_pack(r.pack_path).manifest["windows"] == [[0, r.n_tokens]]
    doc = load_document(SAMPLE_MD)
    ids, _ = tokenize_document(lm, doc)
    m = methods.get("sekv")
    params = m.resolve_params(None)
    pf = prefill(lm.model, torch.tensor(ids), with_surprisal=True, capture=scores.capture_kinds(m.needs_scores), obs_window=m.obs_window(params))
    pf.scores.update(scores.text_scores(lm.tokenizer, prompt.document_prefix(lm.tokenizer, doc.text), ids, m.needs_scores))
    want = m.compress(pf, params)
    # the pipelined ingest's tier covers every token (tests/test_pipelined_ingest.py); the rest is the same tensors
    from test_pipelined_ingest import assert_same_pack

    assert_same_pack(got, {k: v.cpu() for k, v in want.items()})


# -- several windows --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def windowed_pack(lm, tmp_path_factory):
    os.environ[WINDOW_ENV] = str(SMALL_WINDOW)
    try:
        events: list[IngestProgress] = []
        r = ingest(SAMPLE_MD, tmp_path_factory.mktemp("w") / "w.sekv", lm=lm, method="sekv", params=EXACT, progress=events.append)
    finally:
        del os.environ[WINDOW_ENV]
    return r, events


def test_a_long_document_is_read_in_windows_into_one_pack(windowed_pack, lm):
    r, events = windowed_pack
    p = read_pack(r.pack_path)
    win = p.manifest["windows"]
    assert len(win) == 6 and win[0][0] == 0 and win[-1][1] == r.n_tokens == p.n_tokens()
    assert all(a[1] == b[0] for a, b in zip(win, win[1:]))
    ids, pages = tokenize_document(lm, load_document(SAMPLE_MD))
    assert p.token_ids == ids and p.manifest["document"]["token_pages"] == pages  # document-global indices
    # progress: every window, tokens never going back, the write last
    assert sorted({e.window for e in events}) == list(range(1, 7)) and all(e.windows == 6 for e in events)
    done = [e.tokens_done for e in events]
    assert done == sorted(done) and done[-1] == r.n_tokens and events[-1].stage == "write"


def test_spans_never_straddle_two_windows(windowed_pack):
    p = read_pack(windowed_pack[0].pack_path)
    ends = [e for _, e in p.manifest["windows"]]
    s, e = p.get("sekv.span_start"), p.get("sekv.span_end")
    assert s.numel() > 20
    for a, b in zip(s.tolist(), e.tolist()):
        w = next(i for i, x in enumerate(ends) if a < x)
        assert b <= ends[w], (a, b, ends)
    covered = torch.zeros(p.n_tokens(), dtype=torch.long)  # spans + full-resolution tokens: each token once
    for a, b in zip(s.tolist(), e.tolist()):
        covered[a:b] += 1
    covered[p.get("sekv.full_idx")] += 1
    assert bool((covered == 1).all())


def test_windowed_keys_sit_at_their_global_positions(windowed_pack, lm):
    """Layer 0's pre-RoPE keys depend on the token alone, so the stored full-resolution keys of every window must
    be RoPE (by hand, float64) of k_proj(norm(embedding)) at the token's global position."""
    p = read_pack(windowed_pack[0].pack_path)
    ids = torch.tensor(p.token_ids)
    full_idx = p.get("sekv.full_idx")
    layer = lm.model.model.layers[0]
    cfg = lm.model.config
    d = cfg.hidden_size // cfg.num_attention_heads
    with torch.no_grad():
        h = layer.input_layernorm(lm.model.model.embed_tokens(ids[full_idx]))
        k = layer.self_attn.k_proj(h).view(-1, cfg.num_key_value_heads, d).transpose(0, 1)
    theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
    inv = 1.0 / theta ** (torch.arange(0, d, 2).double() / d)
    want = _rope64(k, full_idx, inv)
    got = p.get("sekv.full.k.0").double()
    late = full_idx >= p.manifest["windows"][1][0]
    assert int(late.sum()) > 10  # tokens of windows >= 2 are among them
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_merged_factors_equal_the_factors_of_the_whole(lm):
    torch.manual_seed(1)
    d = 16
    lens = torch.tensor([5, 9, 16, 7, 12, 20])
    x = torch.randn(2, int(lens.sum()), d)
    for int8 in (False, True):
        whole = fz.factorize(x, lens, energy=0.9, rank_max=8, int8=int8)
        cut = int(lens[:3].sum())
        a = fz.factorize(x[:, :cut], lens[:3], energy=0.9, rank_max=8, int8=int8)
        b = fz.factorize(x[:, cut:], lens[3:], energy=0.9, rank_max=8, int8=int8)
        parts = [({k.split(".")[-1]: v for k, v in f.tensors("x").items()}, n) for f, n in ((a, lens[:3]), (b, lens[3:]))]
        merged = merge_factors(parts, d)
        for k, v in whole.tensors("x").items():
            assert torch.allclose(merged.tensors("x")[k].float(), v.float(), atol=1e-6), (int8, k)


def test_full_and_baselines_refuse_a_document_past_the_window_naming_sekv(lm, monkeypatch):
    monkeypatch.setenv(WINDOW_ENV, str(SMALL_WINDOW))
    doc = load_document(SAMPLE_MD)
    from sekv_core import methods

    for name in ("full", "snapkv"):
        with pytest.raises(DocumentError, match="context window of 1024.*--method sekv"):
            plan_windows(lm, doc, 2913, methods.get(name), 145)
    assert len(plan_windows(lm, doc, 2913, methods.get("sekv"), 145)) == 6


def test_ctrl_c_during_a_windowed_ingest_leaves_no_pack(lm, tmp_path, monkeypatch):
    monkeypatch.setenv(WINDOW_ENV, str(SMALL_WINDOW))

    def interrupt(e: IngestProgress) -> None:
        if e.window == 3:
            raise KeyboardInterrupt

    out = tmp_path / "x.sekv"
    with pytest.raises(KeyboardInterrupt):
        ingest(SAMPLE_MD, out, lm=lm, method="sekv", progress=interrupt)
    assert list(tmp_path.iterdir()) == []


# -- host memory ------------------------------------------------------------------------------------------------

_MEM_SCRIPT = r"""
import json, os, resource, sys, torch
sys.path.insert(0, sys.argv[1])
from conftest import make_tiny_model
from pathlib import Path
from transformers import AutoModelForCausalLM, Qwen2Config
from sekv_core import models
from sekv_core.ingest import ingest
from sekv_core.documents import load_document
torch.set_num_threads(1)
d = Path(sys.argv[2])
make_tiny_model(d)
# wide attention (8 KV heads x 64) on the tiny tokenizer: 16 KiB of float32 KV a token, so the whole document's KV
# (tens of MiB) stands out of the process's noise
cfg = Qwen2Config.from_pretrained(d)
cfg.update(dict(hidden_size=512, num_attention_heads=8, num_key_value_heads=8, num_hidden_layers=4, intermediate_size=64))
cfg.layer_types = ["full_attention"] * 4
torch.manual_seed(0)
AutoModelForCausalLM.from_config(cfg, dtype=torch.float32).save_pretrained(d)
lm = models.load(str(d), device="cpu", dtype=torch.float32)
text = open(sys.argv[3]).read()
(d / "long.md").write_text((text + "\n\n") * int(sys.argv[4]))
(d / "warm.md").write_text(text[:2000])
doc = load_document(d / "long.md")
ingest(d / "warm.md", d / "warm.sekv", lm=lm, method="sekv")
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
os.environ["SEKV_INGEST_WINDOW"] = sys.argv[5]
# the factors alone: a zoom tier (sekv/zoom_tier.py) is half the document's KV, pack bytes that accumulate by design
r = ingest(doc, d / "long.sekv", lm=lm, method="sekv", params={"zoom_tier": "factors"})
peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
kv = r.n_tokens * 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads) * 4
print(json.dumps({"base": base, "peak": peak, "n_tokens": r.n_tokens, "kv_bytes": kv, "pack_bytes": r.pack_bytes}))
"""


def test_ingest_host_memory_stays_bounded_by_a_window_not_the_document(tmp_path):
    """A ~24-window document in a fresh process: the peak RSS grows by far less than the document's KV (so
    concatenating every window's KV first, or one prefill of it all, fails this)."""
    script = tmp_path / "mem.py"
    script.write_text(_MEM_SCRIPT)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, str(script), str(ROOT / "tests"), str(tmp_path / "m"), str(SAMPLE_MD), "5", "768"],
                          capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == 0, proc.stderr[-2000:]
    m = json.loads(proc.stdout.strip().splitlines()[-1])
    grew = m["peak"] - m["base"]
    window_kv = m["kv_bytes"] * 768 / m["n_tokens"]
    assert m["n_tokens"] > 20 * 600 and m["kv_bytes"] > 150 * 2**20
    # about one window's KV and what the pack keeps (its tensors before coding: int8 factors, float32 means)
    bound = 4 * window_kv + 4 * m["pack_bytes"] + 32 * 2**20
    assert bound < 0.8 * m["kv_bytes"]  # the bound means something: the document's KV alone is well over it
    assert grew < bound, {k: round(v / 2**20, 1) for k, v in dict(m, grew=grew, bound=bound).items() if k != "n_tokens"}


# -- the CLI's progress display ---------------------------------------------------------------------------------


def test_progress_readout_gives_the_eta_from_the_first_window_on():
    from sekv_cli.ingest_display import detail

    first = detail(IngestProgress("prefill", 500, 6000, 1, 12, 1, 6), 5.0)
    assert "500/6,000 tok" in first and "page 1/12" in first and "100 tok/s" in first and "window 1 of 6" in first
    assert "ETA after window 1" in first
    later = detail(IngestProgress("compress", 1000, 6000, 2, 12, 2, 6), 10.0)
    assert "window 2 of 6" in later and "ETA 0:50" in later  # 5,000 tokens left at 100 tok/s
    one = detail(IngestProgress("prefill", 10, 100, 1, 1, 1, 1), 1.0)
    assert "window" not in one and "ETA" not in one


def test_cli_ingest_shows_the_windows_and_writes_one_pack(tiny_qwen, tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from sekv_cli.app import app

    monkeypatch.setenv(WINDOW_ENV, str(SMALL_WINDOW))
    out = tmp_path / "w.sekv"
    r = CliRunner().invoke(app, ["ingest", str(SAMPLE_MD), "-o", str(out), "--model", str(tiny_qwen)])
    assert r.exit_code == 0, r.stderr
    assert "window 6 of 6" in r.stderr and "6 windows" in r.stderr
    assert r.stdout.strip() == str(out) and len(read_pack(out).manifest["windows"]) == 6


def test_a_pack_whose_windows_do_not_cover_its_tokens_is_refused(windowed_pack):
    from sekv_core.errors import PackError
    from sekv_core.pack import check_manifest

    p = read_pack(windowed_pack[0].pack_path)
    check_manifest(p)
    for bad in ([[0, 5]], [[0, 768], [769, p.n_tokens()]], "all", [[0, p.n_tokens(), 1]]):
        p.manifest["windows"] = bad
        with pytest.raises(PackError, match="windows"):
            check_manifest(p)
