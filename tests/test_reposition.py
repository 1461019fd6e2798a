"""Re-positioned attention (sekv/positions.py): the resident set laid out inside the model's window.

References: plain transformers (SDPA) and the full KV memory at the document's own positions, hand-computed
rotations, and the positions the model and the key rotation actually receive.
"""

from __future__ import annotations

import json
import math

import pytest
import torch

from sekv_core import runtime
from sekv_core.sekv import rope
from sekv_core.sekv.positions import Layout

from test_sekv_method import EXACT, _logits, _setup, assert_full_kv


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("batched", [False, True])
def test_every_block_zoomed_at_shifted_positions_equals_full_kv(kind, batched):
    """zoom "all" re-positioned with the question at n + shift: every key keeps its distance to every query, so the
    logits are full KV's (and plain SDPA's) at the document's own positions."""
    model, ref, ids, res, store, p, mem, full = _setup(kind, **EXACT)
    n, s = mem.res.n_doc, mem.res.n_spans
    assert s > 5
    mem.batched = batched
    mem.question_at(n + s + 7)  # the room (p0 - full tokens - coarse entries) holds every span token
    assert mem.res.layout is not None and mem.n_tokens() == n + s + 7
    assert_full_kv(model, ref, ids, mem, full)


def test_identity_positions_equal_full_kv():
    """The question at the document's own end (p0 = n, the room opened to every span token): each key at its own
    position again, through the de-rotate / re-rotate path."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", **EXACT)
    mem.question_at(mem.res.n_doc)
    mem.res.layout.room = int(mem.res.span_len.sum())
    keep = torch.ones(2, mem.res.n_blocks, dtype=torch.bool)
    base, blocks = mem.res.layout.place(keep)
    assert torch.equal(base[:, : mem.res.n_full], mem.res.full_pos.view(1, -1).expand(2, -1))
    assert torch.equal(blocks, mem.res.block_start.view(1, -1).expand(2, -1))
    k = mem.res.base_keys(0, base)[:, : mem.res.n_full]
    assert torch.allclose(k, res.keys[0][:, mem.res.full_pos], atol=1e-5)
    q = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(3))
    a, b = _logits(model, mem, q), _logits(model, full, q)
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()


def _hand_rope(x: torch.Tensor, pos: int, theta: float) -> torch.Tensor:
    """Rotate-half RoPE of one row, pair by pair, in float64."""
    d = x.numel()
    out = torch.empty(d, dtype=torch.float64)
    for i in range(d // 2):
        a = pos * theta ** (-2 * i / d)
        c, s = math.cos(a), math.sin(a)
        out[i] = x[i] * c - x[i + d // 2] * s
        out[i + d // 2] = x[i + d // 2] * c + x[i] * s
    return out


def test_repositioning_by_an_offset_is_rope_at_that_offset():
    d, theta = 16, 10000.0
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(3, d, generator=g, dtype=torch.float64)
    start, offset = torch.tensor([5, 40, 900]), -37
    got = rope.rotate(pre.float(), start + offset, inv, 1.0, torch.float32)
    for r in range(3):
        want = _hand_rope(pre[r], int(start[r]) + offset, theta)
        assert torch.allclose(got[r].double(), want, atol=1e-4), (got[r].double() - want).abs().max()
    # the de-rotated stored key, rotated by the offset: the same rows (what reposition() + base_keys() do)
    post = torch.stack([_hand_rope(pre[r], int(start[r]), theta) for r in range(3)]).float()
    cos, sin = rope.cos_sin(start, inv)
    again = rope.rotate(rope.undo(post, cos, sin), start + offset, inv, 1.0, torch.float32)
    assert torch.allclose(again, got, atol=1e-4)


def test_layout_by_hand():
    """Two full tokens (0, 1 and 30), spans [2, 14) and [14, 30) in blocks of 4 / 8: consecutive slots in document
    order, ending right before the question at p0 = 100; a fully zoomed span hides its coarse entry."""
    lay = Layout(torch.tensor([0, 1, 30]), torch.tensor([2, 14]), torch.tensor([12, 16]), torch.tensor([2, 6, 10, 14, 22]),
                 torch.tensor([4, 4, 4, 8, 8]), torch.tensor([0, 0, 0, 1, 1]), 2, "cpu")
    lay.set_question_at(100)
    keep = torch.tensor([[False, True, False, True, True], [False, False, False, False, False]])
    base, blocks = lay.place(keep)
    # group 0: 0, 1 | coarse 0 | block 1 (4) | span 1 all zoomed (no coarse) | blocks 3, 4 (16) | 30: 24 slots
    assert base[0].tolist() == [76, 77, 99, 78, 83]  # full 0, 1, 30, coarse 0, coarse 1 (hidden: its next slot)
    assert blocks[0, [1, 3, 4]].tolist() == [79, 83, 91]
    assert blocks[0, [0, 2]].tolist() == [79 - 4, 83 - 4]  # not kept: where each would start were it added
    # group 1: 0, 1, coarse 0, coarse 1, 30: 5 slots, 95..99
    assert base[1].tolist() == [95, 96, 99, 97, 98]
    assert lay.tokens(keep).tolist() == [24, 5]
    lay.set_question_at(10)  # room 10 - 3 - 2 = 5 tokens: blocks in priority order while they fit (a prefix, as select())
    capped = lay.cap(torch.ones(2, 5, dtype=torch.bool), torch.tensor([[9.0, 1, 2, 5, 3], [1.0, 2, 3, 4, 5]]))
    assert capped.tolist() == [[True, False, False, False, False], [False, False, False, False, False]]


def _hand_layout(spread: bool) -> Layout:
    return Layout(torch.tensor([0, 1, 30]), torch.tensor([2, 14]), torch.tensor([12, 16]), torch.tensor([2, 6, 10, 14, 22]),
                  torch.tensor([4, 4, 4, 8, 8]), torch.tensor([0, 0, 0, 1, 1]), 2, "cpu", n_doc=31, spread=spread)


def test_spread_layout_by_hand():
    """The example above, spread: with room for every hidden token (p0 >= 31 tokens) each unit sits at its document
    position moved by p0 - 31; with less room the document's gaps shrink by room / hidden, floored, and the last
    unit still ends right before the question."""
    lay = _hand_layout(True)
    keep = torch.tensor([[False, True, False, True, True], [False, False, False, False, False]])
    lay.set_question_at(100)
    base, blocks = lay.place(keep)
    assert base[0].tolist() == [69 + p for p in (0, 1, 30, 2, 14)]
    assert blocks[0, [1, 3, 4]].tolist() == [69 + 6, 69 + 14, 69 + 22]
    assert base[1].tolist() == [69 + p for p in (0, 1, 30, 2, 14)]
    # p0 = 28, group 0: 24 slots, 7 hidden tokens (block 0's 4 before block 1, block 2's 4 less the coarse entry's slot
    # before span 1), room 4: gaps floor(e x 4 / 7) = 0, 0, 0 | 1 (e = 3) | 4 (e = 7) ...
    lay.set_question_at(28)
    base, blocks = lay.place(keep)
    assert base[0].tolist() == [0, 1, 27, 2, 11]
    assert blocks[0, [1, 3, 4]].tolist() == [4, 11, 19]


@pytest.mark.parametrize("seed", range(6))
def test_spread_layout_keeps_order_and_never_moves_a_unit_farther_than_the_document(seed):
    """Random spans, blocks and kept sets: held units in document order at increasing, non-overlapping slots in
    [0, p0); the last held token right before the question; each unit's distance to the question at most its
    document distance to the question's place after the document and at least its packed distance; p0 >= the
    document's length: the document's positions, shifted (the sinks and the end window exactly)."""
    g = torch.Generator().manual_seed(seed)
    n_doc, sink, end = 400, 4, 20
    cuts = sorted(set(torch.randint(sink + 1, n_doc - end, (12,), generator=g).tolist()))
    starts = torch.tensor([sink] + cuts)
    ends = torch.tensor(cuts + [n_doc - end])
    full = torch.cat([torch.arange(sink), torch.arange(n_doc - end, n_doc)])
    from sekv_core.sekv.segment import zoom_blocks

    bs, b0, b1 = zoom_blocks(starts, ends, 8)
    keep = torch.rand(2, b0.numel(), generator=g) < 0.4
    for p0 in (60, 150, 399, 400, 450):
        spread, packed = (Layout(full, starts, ends - starts, b0, b1 - b0, bs, 2, "cpu", n_doc=n_doc, spread=sp) for sp in (True, False))
        spread.set_question_at(p0), packed.set_question_at(p0)
        (sb, sk), (pb, pk) = spread.place(keep), packed.place(keep)
        for h in range(2):
            zoomed = torch.zeros(starts.numel(), dtype=torch.long).index_add_(0, bs, keep[h].long() * (b1 - b0))
            coarse = zoomed < (ends - starts)
            doc = torch.cat([full, starts[coarse], b0[keep[h]]])
            size = torch.cat([torch.ones(full.numel() + int(coarse.sum()), dtype=torch.long), (b1 - b0)[keep[h]]])
            slot = torch.cat([sb[h, : full.numel()], sb[h, full.numel() :][coarse], sk[h][keep[h]]])
            pslot = torch.cat([pb[h, : full.numel()], pb[h, full.numel() :][coarse], pk[h][keep[h]]])
            o = torch.argsort(2 * doc + torch.cat([torch.ones(full.numel()), torch.zeros(int(coarse.sum())), torch.ones(int(keep[h].sum()))]).long(), stable=True)
            slot, pslot, doc, size = slot[o], pslot[o], doc[o], size[o]
            if int(size.sum()) > p0:
                continue  # past the cap: the base entries share positions (not the spread's case)
            assert bool((slot[1:] >= slot[:-1] + size[:-1]).all()) and int(slot[0]) >= 0
            assert int(slot[-1] + size[-1]) == p0
            assert bool((p0 - slot <= n_doc - doc).all()) and bool((p0 - slot >= p0 - pslot).all())
            if p0 >= n_doc:  # a coarse entry before its span's zoomed first block takes a slot of its own: +1 until a gap
                moved = slot - (doc + (p0 - n_doc))
                assert bool(((moved >= 0) & (moved <= 1)).all()) and not bool(moved[: sink].any() or moved[-end:].any())


# -- a pack 6x longer than a tiny model's window, through the command line --------------------------------------

WINDOW = 512  # the tiny_window model's max_position_embeddings


@pytest.fixture(scope="module")
def tiny_window(tmp_path_factory):
    """A tiny model with a 512-position window (windowed ingest needs room for the prompt's header in each window)."""
    from conftest import make_tiny_model

    return make_tiny_model(tmp_path_factory.mktemp("tiny_window"), "qwen2", max_positions=WINDOW)


@pytest.fixture(scope="module")
def long_packs(tiny_window, tmp_path_factory):
    """Packs of ~2,800 tokens for a 512-position model: sekv's ingested in windows (sekv_core/windows.py); full's
    and snapkv's in one prefill planned as if the window were larger (SEKV_INGEST_WINDOW, and native RoPE where
    ingest would choose YaRN: RoPE is math past the window), as a pack made elsewhere would be."""
    from conftest import SAMPLE_MD
    from sekv_core import ingest, rope_scaling
    from test_cli import run

    d = tmp_path_factory.mktemp("long")
    text = SAMPLE_MD.read_text()
    doc = d / "log.md"
    doc.write_text(text)
    out = {}
    for method in ("sekv", "full", "snapkv"):
        out[method] = d / f"{method}.sekv"
        with pytest.MonkeyPatch.context() as mp:
            if method != "sekv":
                mp.setenv(ingest.WINDOW_ENV, "100000")
                mp.setattr(rope_scaling, "plan", lambda *a, **k: None)  # native RoPE past the window: made elsewhere
            code, _, err = run("ingest", doc, "-o", out[method], "--model", tiny_window, "--method", method, "-q")
        assert code == 0, err
    return out


@pytest.fixture
def seen_positions(monkeypatch):
    """The largest position the model's rotary embedding and sekv's key rotation receive."""
    from sekv_core.sekv import rope as rope_mod

    seen = {"model": -1, "keys": -1, "min": 0}
    fwd, rot = runtime.forward_hidden, rope_mod.rotate

    def forward_hidden(model, ids, start, memory):
        seen["model"] = max(seen["model"], start + ids.shape[-1] - 1)
        return fwd(model, ids, start, memory)

    def rotate(rows, positions, *a, **k):
        if positions.numel():
            seen["keys"] = max(seen["keys"], int(positions.max()))
            seen["min"] = min(seen["min"], int(positions.min()))
        return rot(rows, positions, *a, **k)

    monkeypatch.setattr(runtime, "forward_hidden", forward_hidden)
    monkeypatch.setattr(rope_mod, "rotate", rotate)
    return seen


@pytest.mark.parametrize("budget", ["0.1", "0.5"])
def test_long_pack_answers_inside_the_window(long_packs, seen_positions, budget):
    from sekv_core.pack import read_pack
    from test_cli import run

    pack = read_pack(long_packs["sekv"])
    n = pack.n_tokens()
    assert 4 * WINDOW <= n <= 8 * WINDOW and len(pack.manifest.get("windows") or []) > 4
    code, out, err = run("ask", long_packs["sekv"], "Who kept the lighthouse?", "-n", "8", "--json", "--budget", budget)
    assert code == 0, err
    rec = json.loads(out)
    z = rec["zoom"]
    assert rec["tokens"]["document"] == n
    p0 = z["positions"]["question_at"]
    assert z["positions"]["window"] == WINDOW and p0 + rec["tokens"]["question"] + 8 <= WINDOW
    assert 0 < z["positions"]["resident_tokens"] <= p0
    assert z["window_capped"] == (budget == "0.5")  # half of 2,800 tokens cannot fit 512 positions; a tenth can
    assert 0 <= seen_positions["min"] and seen_positions["keys"] < p0 and seen_positions["model"] < WINDOW
    assert rec["zoom"]["zoom_spans_total"] > 0


def test_long_pack_batched_and_static_steps_stay_inside_the_window(long_packs, tiny_window, seen_positions):
    """The accelerator's batched step and its static single-token path (run eagerly on the CPU): the same layout."""
    from sekv_core import prompt
    from sekv_core.generate import generate
    from sekv_core.session import Session

    s = Session.open(long_packs["sekv"], model=str(tiny_window), device="cpu")
    cpu = s.ask("Who kept the lighthouse?", max_new_tokens=8)
    s.memory.batched = True
    q = "Who kept the lighthouse?"
    ids = prompt.encode(s.lm.tokenizer, prompt.question_suffix(s.lm.tokenizer, q))
    s.memory.truncate(s.start)
    s.memory.place_in_window(s.window, len(ids) + 8)
    out, _ = generate(s.lm.model, s.memory, ids, max_new_tokens=8, stop_ids=s.stop_ids, graphs=True, question=q)
    extra = s.memory.step_stats().extra
    assert extra["positions"]["question_at"] == cpu.stats.extra["positions"]["question_at"]
    assert 0 < extra["positions"]["resident_tokens"] <= extra["positions"]["question_at"]
    assert 0 <= seen_positions["min"] and seen_positions["keys"] < WINDOW and seen_positions["model"] < WINDOW
    assert len(out) > 0
    # a second question on the same memory, re-placed outside inference mode as `sekv chat` and `sekv bench` do:
    # the batched step's tables made inside the first answer's forwards are reset, not written in place
    s.memory.truncate(s.start)
    s.memory.place_in_window(s.window, len(ids) + 8)
    again, _ = generate(s.lm.model, s.memory, ids, max_new_tokens=8, stop_ids=s.stop_ids, graphs=True, question=q)
    assert again == out


@pytest.mark.parametrize("method", ["full", "snapkv"])
def test_baselines_refuse_past_the_window(long_packs, method):
    from test_cli import assert_one_line_error, run

    code, out, err = run("ask", long_packs[method], "Who kept the lighthouse?", "-n", "4")
    assert code == 2 and not out
    assert_one_line_error(code, err, f"past ", f"window of {WINDOW}", "--method sekv")


def test_rope_scaling_recorded_in_the_pack_extends_the_baselines_reach():
    from sekv_core import reach
    from sekv_core.errors import SekvError

    yarn = {"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}}
    assert reach.effective_window(yarn, 32768) == 131072
    assert reach.effective_window({}, 32768) == reach.effective_window({"rope_scaling": {"rope_type": "linear"}}, 32768) == 32768
    reach.check("full", 100_000, reach.effective_window(yarn, 32768), "m")
    reach.check("sekv", 10**6, 32768, "m")
    with pytest.raises(SekvError, match="100000 tokens, past m's window of 32768.*--method sekv"):
        reach.check("snapkv", 100_000, 32768, "m")


# -- `sekv bench`: NIAH past the window ------------------------------------------------------------------------


def test_multi_needle_niah_and_haystack_passes(tiny_qwen, haystack):
    from transformers import AutoTokenizer

    from sekv_core.bench import tasks

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    essays = tasks.load_haystack(haystack)
    ctx = tasks.gen_mn_niah(tok, 900, 25, 3, essays)
    assert len(ctx.probes) == 4 and len({p.item for p in ctx.probes}) == 4
    for needle, p in zip(ctx.meta["needles"], ctx.probes):
        assert ctx.document.count(needle) == 1 and ctx.document.count(p.expected[0]) == 1 and p.item in needle
    assert ctx.meta["needle_depths"][0] == 25.0 and ctx.n_tokens <= 900
    # past the last essay the haystack comes again in a new seeded order, not the first pass repeated
    total = sum(len(e) for e in essays)
    import random

    out = tasks.haystack_sentences(essays, random.Random(1), 3 * total)
    passes = [out[i * total : (i + 1) * total] for i in range(3)]
    assert sorted(passes[0]) == sorted(passes[1]) and len(set(map(tuple, passes))) > 1


def test_bench_niah_past_the_window_runs_sekv_only_and_resumes(tiny_window, haystack, tmp_path):
    from sekv_core import models
    from sekv_core.bench import runner

    lm = models.load(str(tiny_window), device="cpu", dtype=torch.float32)
    cfg = runner.BenchConfig(tasks=["niah", "mn_niah"], methods=["full", "sekv"], budgets=[0.1], lengths=[2048], depths=[50],
                             seed=0, haystack=haystack, max_new_tokens=6)
    warned = []

    class Rep(runner.Reporter):
        def warn(self, message):
            warned.append(message)

    o = runner.run(lm, cfg, tmp_path, Rep())
    assert o.errors == [] and o.added == 5  # niah: 1 probe, mn_niah: 4; full cannot read 2,048 tokens in 512 positions
    assert any("past" in w and "full" in w for w in warned)
    recs = runner.read_results(tmp_path / runner.RESULTS_FILE)
    assert {r["method"] for r in recs} == {"sekv"} and all(r["n_tokens"] > 3 * WINDOW for r in recs)
    assert all(int(r["prefill_with"][-1].split()[0]) >= 4 for r in recs), recs[0]["prefill_with"]  # "N windows"
    for r in recs:
        pos = r["method_stats"]["positions"]
        assert pos["window"] == WINDOW and 0 < pos["resident_tokens"] <= pos["question_at"] < WINDOW
    assert runner.run(lm, cfg, tmp_path, Rep()).added == 0


def test_coarse_mass_by_hand():
    """coarse_mass "window": past the window every coarse entry's score drops by log(p0 / document tokens), so the
    31-token example with the question at 10 has its hidden tokens weigh 10 / 31 of themselves; nothing changes when
    the document fits before p0, nor with "document"."""
    args = (torch.tensor([0, 1, 30]), torch.tensor([2, 14]), torch.tensor([12, 16]), torch.tensor([2, 6, 10, 14, 22]),
            torch.tensor([4, 4, 4, 8, 8]), torch.tensor([0, 0, 0, 1, 1]), 2, "cpu")
    lay = Layout(*args, n_doc=31, coarse_mass="window")
    lay.set_question_at(10)
    assert lay.coarse_shift == pytest.approx(math.log(10 / 31))
    lay.set_question_at(31)
    assert lay.coarse_shift == 0.0
    lay.set_question_at(100)
    assert lay.coarse_shift == 0.0
    lay = Layout(*args, n_doc=31, coarse_mass="document")
    lay.set_question_at(10)
    assert lay.coarse_shift == 0.0
    lay = Layout(*args, n_doc=31, coarse_mass="none")
    lay.set_question_at(10)
    assert lay.coarse_shift == float("-inf")
    lay.set_question_at(31)
    assert lay.coarse_shift == 0.0


@pytest.mark.parametrize("mass", ["window", "document", "none"])
def test_coarse_entries_stand_for_a_window_of_tokens(mass):
    """Past the window with coarse_mass "window", the coarse entries' exp-scores (the tokens each stands for, SPEC
    §2.5) add up to the hidden tokens x p0 / n: the resident set weighs what p0 tokens of text do; with "document"
    to every hidden token, with "none" to nothing.  Counted from the spans and the zoomed blocks, not from the code's own shift."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=400, budget=0.2, coarse_mass=mass)
    r = mem.res
    p0 = 150
    mem.question_at(p0)
    g = torch.Generator().manual_seed(4)
    expanded = torch.rand(r.shape.n_heads, r.n_blocks, generator=g) < 0.3
    scores = r.coarse_mask(expanded)  # [H, S]
    for h in range(r.shape.n_heads):
        hidden = int(r.span_len.sum()) - int(r.block_len[expanded[h]].sum())
        want = hidden * {"window": p0 / r.n_doc, "document": 1.0, "none": 0.0}[mass]
        assert float(scores[h].double().exp().sum()) == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("delta", [0, 8192, 30_000])
def test_bfloat16_re_positioned_keys_are_rope_at_their_slot(delta):
    """The accelerators' dtype: a key the model made in bfloat16 at a window's local position, moved to the document
    position (windows.shift, prefill_window), stored, de-rotated there (Residents.reposition) and rotated to its slot
    (Residents.base_keys), equals RoPE at the slot computed by hand in float64 from the same pre-RoPE key, within
    bfloat16's rounding of the key (not of the angle: positions to 62K in bfloat16 are 256 apart)."""
    from sekv_core import windows

    d, theta, bf = 64, 1e6, torch.bfloat16  # qwen2.5's head size and RoPE base
    inv = 1.0 / theta ** (torch.arange(0, d, 2).float() / d)
    g = torch.Generator().manual_seed(0)
    pre = torch.randn(2, 6, d, generator=g)
    pre[..., [5, 37, 63]] *= 40.0  # a few large dimensions, as the model's key bias makes them
    pre = pre.to(bf)
    local = torch.tensor([3, 99, 1000, 16_000, 30_000, 32_000])
    glob = local + delta
    for slot0 in (0, 26_000, 32_700 - 6):
        slot = torch.arange(slot0, slot0 + 6)
        c, s = rope.cos_sin(local, inv)  # the model: cos / sin in float32, cast to its dtype, products in it
        k_model = pre * c.to(bf) + rope.rotate_half(pre) * s.to(bf)
        stored = windows.shift(k_model, delta, inv)
        cg, sg = rope.cos_sin(glob, inv, dtype=bf)
        base = rope.undo(stored.float(), cg, sg).to(bf)
        got = rope.rotate(base, slot.view(1, -1).expand(2, -1), inv, 1.0, bf).to(bf).double()
        want = torch.stack([torch.stack([_hand_rope(pre[h, t].double(), int(slot[t]), theta) for t in range(6)]) for h in range(2)])
        err = ((got - want).norm(dim=-1) / want.norm(dim=-1)).max()
        assert err < 4 * 2.0**-8, (delta, slot0, float(err))  # measured <= 0.008; an angle in bfloat16 gives ~1
