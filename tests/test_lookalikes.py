"""Look-alike passages (sekv/lexical.py): hand-made term layouts, the demotion as a property of the ranking, and the
scout's ranking through a memory (the block holding the question's rare term first, look-alikes after all others)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from sekv_core import methods, runtime
from sekv_core.graphed_step import GraphedStep
from sekv_core.methods.base import GrowingKV
from sekv_core.methods.full import FullMemory
from sekv_core.sekv import lexical

from test_sekv_method import EXACT, _setup, tiny

Q = "What is the secret passphrase for the Halden archive? Answer with the passphrase only."


def _terms(n: int, at: dict[int, str]) -> torch.Tensor:
    t = torch.full((n,), -1, dtype=torch.int32)
    for i, w in at.items():
        t[i] = lexical.term_id(w)
    return t


def _needle(at: dict[int, str], start: int, place: str) -> None:
    for k, w in enumerate(("secret", "passphrase", place, "archive")):
        at[start + 2 * k] = w


def test_lookalikes_are_the_other_archives_sentences_not_the_asked_ones_neighbours():
    # 40 blocks of 16 tokens; the asked archive's sentence in block 5, two other archives' in blocks 20 and 33, the
    # word "secret" alone in block 12, "passphrase" in block 6 (the asked sentence's neighbour, within NEAR)
    at: dict[int, str] = {}
    _needle(at, 5 * 16 + 2, "halden")
    _needle(at, 20 * 16 + 2, "kestrel")
    _needle(at, 33 * 16 + 4, "morrow")
    at[12 * 16 + 5] = "secret"
    at[6 * 16 + 12] = "passphrase"
    starts, lens = torch.arange(40) * 16, torch.full((40,), 16)
    lex = lexical.Lexicon(_terms(640, at), starts, lens)
    scores = lex.scores(Q)
    assert int(scores.argmax()) == 5  # the block holding the rare term (halden) first
    # the look-alikes' cores are blocks 20 and 33 (three of the four words, not "halden"; block 19 holds two, too
    # little of the idf mass); each one's passage is the blocks within REACH (32) tokens of it
    look = lex.lookalikes(Q, starts)
    assert look is not None and look.nonzero().flatten().tolist() == [18, 19, 20, 21, 22, 31, 32, 33, 34, 35]
    # the asked archive is another one: its sentence is the best match, the Halden one a look-alike
    look2 = lex.lookalikes(Q.replace("Halden", "Kestrel"), starts)
    assert look2.nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 31, 32, 33, 34, 35]
    # a question whose best match has a single term has no look-alikes; nor one with no term in the document
    assert lex.lookalikes("Where is the archive?", starts) is None
    assert lex.lookalikes("nothing matches here", starts) is None
    # a partial match carrying less than LOOKALIKE_SHARE of the best one's idf mass is not one
    at2 = dict(at)
    for i in range(33 * 16, 34 * 16):
        at2.pop(i, None)
    at2[33 * 16 + 3], at2[33 * 16 + 9] = "secret", "answer"
    lex2 = lexical.Lexicon(_terms(640, at2), starts, lens)
    assert lex2.lookalikes(Q, starts).nonzero().flatten().tolist() == [18, 19, 20, 21, 22]
    # a partial match that holds the key term (the rarest word of the best match) is not one: "halden" alone with
    # two common words far from the Halden sentence
    at3 = dict(at2)
    at3[27 * 16 + 1], at3[27 * 16 + 3], at3[27 * 16 + 5] = "secret", "halden", "archive"
    lex3 = lexical.Lexicon(_terms(640, at3), starts, lens)
    assert not bool(lex3.lookalikes(Q, starts)[25:30].any())


def test_a_best_match_in_full_resolution_tokens_makes_every_block_sentence_a_lookalike():
    # blocks cover tokens 0..447 (28 blocks); tokens 448..511 are full resolution (the end window) and hold the asked
    # (Halden) sentence; two other archives' sentences in blocks 5 and 20
    at: dict[int, str] = {}
    _needle(at, 5 * 16 + 2, "kestrel")
    _needle(at, 20 * 16 + 2, "morrow")
    _needle(at, 480, "halden")
    starts, lens = torch.arange(28) * 16, torch.full((28,), 16)
    full = torch.cat([torch.tensor([0, 1, 2, 3]), torch.arange(448, 512)])  # the sinks (too short a run) and the end
    terms = _terms(512, at)
    look = lexical.Lexicon(terms, starts, lens, full).lookalikes(Q, starts)
    assert look.nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 18, 19, 20, 21, 22]
    # without the end window as a passage, the best match is one of the other sentences (secret, passphrase,
    # archive), which both hold whole: nothing is marked
    assert lexical.Lexicon(terms, starts, lens).lookalikes(Q, starts) is None
    assert lexical._runs(full, 16)[0].tolist() == [448, 464, 480, 496]


def test_a_lookalike_in_the_end_window_is_found_among_the_full_resolution_pieces_not_the_blocks():
    # the document's last sentence is another archive's (tokens 480..487, in the end window 448..511): the asked
    # (Halden) sentence in block 5, a third archive's in block 20.  The blocks' rule marks block 20's passage only
    # (the end window is no block: no ranking reaches it); the pieces' rule marks the end window's pieces within REACH
    # of the look-alike's core pieces, the same test on the run pieces [448, 464, 480, 496] (windows +- WINDOW)
    at: dict[int, str] = {}
    _needle(at, 5 * 16 + 2, "halden")
    _needle(at, 20 * 16 + 2, "morrow")
    _needle(at, 480, "kestrel")
    starts, lens = torch.arange(28) * 16, torch.full((28,), 16)
    full = torch.cat([torch.tensor([0, 1, 2, 3]), torch.arange(448, 512)])
    lex = lexical.Lexicon(_terms(512, at), starts, lens, full)
    assert lex.lookalikes(Q, starts).nonzero().flatten().tolist() == [18, 19, 20, 21, 22]
    # core pieces: 464 (window 456..487) and 480 (472..503) hold secret, passphrase and archive; 448 and 496 hold
    # none but lie within REACH (32) of a core piece
    assert lex.run_start.tolist() == [448, 464, 480, 496] and lex.run_len.tolist() == [16] * 4
    assert lex.resident_lookalikes(Q, starts).tolist() == [True, True, True, True]
    # asked for the end window's archive, the end window is the best match: none of its pieces is a look-alike,
    # and both block sentences are
    q2 = Q.replace("Halden", "Kestrel")
    assert lex.resident_lookalikes(q2, starts) is None
    assert lex.lookalikes(q2, starts).nonzero().flatten().tolist() == [3, 4, 5, 6, 7, 18, 19, 20, 21, 22]
    # a run piece is never a look-alike when it holds the key, nor when it lies within NEAR of the best match
    at2 = dict(at)
    for i in range(480, 488):
        at2.pop(i, None)
    _needle(at2, 440, "halden")  # the asked sentence right before the end window: the end window is its neighbour
    for i in range(5 * 16 + 2, 5 * 16 + 10):
        at2.pop(i, None)
    _needle(at2, 496, "kestrel")
    lex2 = lexical.Lexicon(_terms(512, at2), starts, lens, full)
    assert lex2.resident_lookalikes(Q, starts) is None  # 496 is 56 tokens from 440 (NEAR 64)
    # no full-resolution runs: nothing to mark
    assert lexical.Lexicon(_terms(512, at), starts, lens).resident_lookalikes(Q, starts) is None


def test_a_packs_end_window_is_where_resident_lookalikes_looks():
    """Through an opened pack: the lexicon's full-resolution pieces are the pack's own runs (the end window), and another
    archive's sentence there is marked for the asked archive's question, never for its own."""
    _, _, _, _, store, p, mem, _ = _setup("qwen2", n=500, budget=0.3, min_span=10, window=32, zoom_unit=8)
    full = mem.res.full_pos
    assert bool((full >= 468).sum() == 32)  # the end window: the last 32 tokens at full resolution
    bs = mem.res.block_start
    asked = int(bs[mem.res.n_blocks // 3])
    at: dict[int, str] = {}
    _needle(at, asked, "halden")
    _needle(at, 480, "kestrel")  # the document's last sentence
    store["sekv.lex.terms"] = _terms(500, at)
    m = methods.get("sekv").open(store, p, mem.res.shape, "cpu")
    lex = m.res.lexicon
    assert lex.run_start.tolist() == [468, 484] and lex.run_len.tolist() == [16, 16]
    res = lex.resident_lookalikes(Q, m.res.block_start)
    assert res is not None and res.tolist() == [True, True]
    assert lex.resident_lookalikes(Q.replace("Halden", "Kestrel"), m.res.block_start) is None
    # the blocks' rule cannot mark it: no block lies in the end window
    look = lex.lookalikes(Q, m.res.block_start)
    assert look is None or not bool((m.res.block_start[look] >= 468).any())


def test_demote_moves_the_masked_blocks_after_every_other_keeping_their_order():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        prio = torch.randn(30, generator=g) * 3
        prio[torch.randint(0, 30, (3,), generator=g)] = float("-inf")  # outside --doc
        mask = torch.rand(30, generator=g) < 0.3
        out = prio.clone()
        lexical.demote(out, mask)
        fin = torch.isfinite(prio)
        assert torch.equal(torch.isfinite(out), fin)  # -inf stays -inf, nothing else becomes it
        a, b = fin & ~mask, fin & mask
        if a.any() and b.any():
            assert float(out[b].max()) < float(out[a].min())
        assert torch.equal(out[a], prio[a])  # the others untouched
        for m in (a, b):  # the order within each group kept
            assert torch.equal(torch.argsort(out[m], stable=True), torch.argsort(prio[m], stable=True))
    p = torch.tensor([1.0, 2.0])
    lexical.demote(p, None)
    assert p.tolist() == [1.0, 2.0]


def test_scout_ranks_the_rare_term_block_first_and_lookalikes_last():
    """Through a memory: a large lexical weight puts the block holding every question word first; with
    lookalikes="demote" the other archive's sentence ranks after every block, and "keep" leaves the ranking as it was."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=500, budget=0.3, min_span=10, window=16, zoom_unit=8)
    bs = mem.res.block_start
    nb = mem.res.n_blocks
    asked, other = nb // 4, (3 * nb) // 4
    at: dict[int, str] = {}
    _needle(at, int(bs[asked]), "halden")
    _needle(at, int(bs[other]), "kestrel")
    store["sekv.lex.terms"] = _terms(500, at)
    q = torch.tensor([[5, 6, 7, 8]])
    prio = {}
    for mode, batched in (("keep", False), ("demote", False), ("demote-batched", True)):
        m = methods.get("sekv").open(store, p.replace(lexical_weight=50.0, lookalikes=mode.split("-")[0]), res.shape, "cpu")
        m.batched = batched  # the accelerators' step, run on the CPU
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m), Q)
        prio[mode] = m.ranking.prio.clone()
    near = lambda b, blk: abs(int(bs[b]) - int(bs[blk])) <= lexical.WINDOW + int(mem.res.block_len.max())  # noqa: E731
    assert near(int(prio["demote"].argmax()), asked) and near(int(prio["keep"].argmax()), asked)
    lk = lexical.Lexicon(store["sekv.lex.terms"], bs, mem.res.block_len).lookalikes(Q, bs)
    assert lk is not None and bool(lk[other])
    assert float(prio["demote"][lk].max()) < float(prio["demote"][~lk].min())
    assert float(prio["demote-batched"][lk].max()) < float(prio["demote-batched"][~lk].min())
    assert torch.equal(prio["demote"][~lk], prio["keep"][~lk])
    assert float(prio["keep"][other]) > float(prio["keep"].median())  # without it the look-alike ranks high
    # a question without look-alikes (one word of the best match; no word in the document) ranks as with "keep"
    for question in ("Where is the Halden archive?", "nothing matches here"):
        got = []
        for mode in ("keep", "demote"):
            m = methods.get("sekv").open(store, p.replace(lexical_weight=50.0, lookalikes=mode), res.shape, "cpu")
            m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m), question)
            got.append(m.ranking.prio.clone())
        assert torch.equal(got[0], got[1])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_demote_on_cuda_equals_the_host():
    g = torch.Generator().manual_seed(1)
    prio = torch.randn(500, generator=g)
    prio[:5] = float("-inf")
    mask = torch.rand(500, generator=g) < 0.1
    want = prio.clone()
    lexical.demote(want, mask)
    got = prio.cuda()
    lexical.demote(got, mask)  # a host mask, as the memory passes it
    assert torch.equal(got.cpu(), want)


# -- the look-alikes held at full resolution, hidden from attention (sekv/residents.py HiddenColumns) --------------


class _MaskedFull(FullMemory):
    """The reference: full KV attention with the document tokens at ``hidden_pos`` masked (plain SDPA, one additive
    mask: causal among the new tokens, -inf in those columns)."""

    def __init__(self, kv, shape, hidden_pos: torch.Tensor):
        super().__init__(kv, shape)
        self.hidden_pos = hidden_pos

    def attend(self, layer, query, key, value, scaling):
        keys, values = self.kv.append(layer, key, value)
        t, q = keys.shape[-2], query.shape[-2]
        mask = torch.where(torch.arange(t).view(1, -1) <= torch.arange(t - q, t).view(-1, 1), 0.0, float("-inf"))
        mask[:, self.hidden_pos] = float("-inf")
        return F.scaled_dot_product_attention(query, keys, values, attn_mask=mask.to(query.dtype), scale=scaling,
                                              enable_gqa=keys.shape[1] != query.shape[1])


def _answer(model, mem, q: torch.Tensor, static: bool, n: int = 3) -> torch.Tensor:
    """Logits of a question's forward and n greedy single-token steps after it (static: GraphedStep's path, run
    eagerly on the CPU: what a CUDA graph captures), the memory's appended tokens dropped after."""
    head = model.get_output_embeddings()
    start = mem.n_tokens()
    logits = [runtime.forward_logits(model, q, start, mem, last_only=False)]
    step = GraphedStep(model, mem) if static else None
    for _ in range(n):
        nxt = logits[-1][:, -1:].argmax(-1)
        if static:
            with torch.inference_mode():
                logits.append(head(step(nxt)[:, -1:]).float())
        else:
            logits.append(runtime.forward_logits(model, nxt, mem.n_tokens(), mem))
    mem.truncate(start)
    return torch.cat(logits, 1)


def _hand_set(res) -> torch.Tensor:
    """Hidden columns made by hand: a sink and a run of the end window (indices into the full-resolution tokens)."""
    n = res.n_full
    return torch.cat([torch.tensor([1]), torch.arange(n - 12, n - 4)])


@pytest.mark.parametrize("how", ["cpu", "batched", "batched-static"])
def test_hidden_columns_equal_full_kv_with_those_columns_masked(how):
    """Every span zoomed exactly (the CPU step; the batched step's fixed sets, filled and reused, eager and static):
    with a hand-made hidden set the memory's attention is full KV's with those document tokens masked."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=400, **EXACT)
    mem.batched = how != "cpu"
    cols = _hand_set(mem.res)
    mem.res.hidden.set(cols)
    masked = _MaskedFull(GrowingKV.from_tensors(res.keys, res.values, "cpu"), res.shape, mem.res.full_pos[cols])
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    a = _answer(model, mem, q, static=how.endswith("static"))
    b = _answer(model, masked, q, static=False)
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    # hiding is not a no-op here: full KV with nothing masked differs
    c = _answer(model, full, q, static=False)
    assert (a - c).abs().max() > 1e-3


@pytest.mark.parametrize("zoom", ["none", "router"])
def test_the_batched_steps_hide_what_the_cpu_step_hides(zoom):
    """Coarse entries (zoom none: the batched step's open mask, and its length mask in static steps) and per-layer
    routing: the batched step, eager and static, gives the CPU step's outputs under the same hidden set."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=500, budget=0.3, min_span=10, window=32, zoom=zoom,
                                                      routing="per_layer")
    q = torch.tensor([[5, 17, 42, 99, 7, 250]])
    out = {}
    for how in ("cpu", "batched", "batched-static"):
        m = methods.get("sekv").open(store, p, res.shape, "cpu")
        m.batched = how != "cpu"
        m.res.hidden.set(_hand_set(m.res))
        out[how] = _answer(model, m, q, static=how.endswith("static"))
    assert torch.allclose(out["cpu"], out["batched"], atol=1e-4, rtol=1e-4), (out["cpu"] - out["batched"]).abs().max()
    assert torch.allclose(out["cpu"], out["batched-static"], atol=1e-4, rtol=1e-4), (out["cpu"] - out["batched-static"]).abs().max()
    plain = _answer(model, methods.get("sekv").open(store, p, res.shape, "cpu"), q, static=False)
    assert (out["cpu"] - plain).abs().max() > 1e-3


def _end_window_pack(**params):
    """A pack whose end window (the last 32 tokens) holds another archive's sentence (the Kestrel one, the document's
    last), the asked (Halden) one in a zoom block."""
    model, _, _, res, store, p, mem, _ = _setup("qwen2", n=500, budget=0.3, min_span=10, window=32, zoom_unit=8, **params)
    at: dict[int, str] = {}
    _needle(at, int(mem.res.block_start[mem.res.n_blocks // 3]), "halden")
    _needle(at, 480, "kestrel")
    store["sekv.lex.terms"] = _terms(500, at)
    return model, res, store, p


@pytest.mark.parametrize("how", ["cpu", "batched", "batched-static"])
def test_a_question_hides_its_end_window_lookalike_and_the_next_one_nothing(how):
    """Through prepare_question: the Halden question hides the end window's Kestrel sentence (the columns
    Lexicon.resident_columns gives, in the static steps' buffer, refilled in place); the next question, which has no
    look-alike, hides nothing: its answer is that of a memory that never hid anything."""
    model, res, store, p = _end_window_pack()
    q = torch.tensor([[5, 17, 42, 99, 7, 250]])

    def ask(m, question):
        m.prepare_question(lambda: runtime.forward_hidden(model, q, m.n_tokens(), m), question)
        return _answer(model, m, q, static=how.endswith("static")), m.step_stats().extra["hidden_tokens"]

    m = methods.get("sekv").open(store, p, res.shape, "cpu")
    m.batched = how != "cpu"
    _, hidden = ask(m, Q)
    cols = m.res.hidden.cols
    want = m.res.lexicon.resident_columns(Q, m.res.block_start)
    assert cols is not None and torch.equal(cols, want) and hidden == cols.numel()
    assert bool((m.res.full_pos[cols] >= 468).all()) and bool(((m.res.full_pos[cols] >= 480) & (m.res.full_pos[cols] < 488)).sum() == 8)
    row = m.res.hidden.row("cpu")
    assert torch.equal(torch.isinf(row).nonzero().flatten(), cols)
    ptr = row.data_ptr()
    other = Q.replace("Halden", "Kestrel")  # its best match is the end window's sentence: no look-alike held there
    got, hidden = ask(m, other)
    assert m.res.hidden.cols is None and hidden == 0 and m.res.hidden.row("cpu") is None
    assert m.res.hidden._rows[torch.device("cpu")].data_ptr() == ptr  # refilled, not made anew
    assert not bool(torch.isinf(m.res.hidden._rows[torch.device("cpu")]).any())
    fresh = methods.get("sekv").open(store, p, res.shape, "cpu")
    fresh.batched = how != "cpu"
    want, _ = ask(fresh, other)
    assert torch.equal(got, want)


def test_nothing_hidden_without_the_rule():
    """lookalikes=keep (or no lexical evidence) hides nothing, and a question with look-alikes under "demote" answers
    differently from "keep" only through what it hides and demotes (here: the hidden end window changes the logits)."""
    model, res, store, p = _end_window_pack()
    for params in (p.replace(lookalikes="keep"), p.replace(lexical_weight=0.0)):
        m = methods.get("sekv").open(store, params, res.shape, "cpu")
        m.prepare_question(lambda: runtime.forward_hidden(model, torch.tensor([[5, 6]]), m.n_tokens(), m), Q)
        assert m.res.hidden.cols is None and m.step_stats().extra["hidden_tokens"] == 0


@pytest.mark.parametrize("zoom", ["all", "none"])
@pytest.mark.parametrize("how", ["batched", "batched-static"])
def test_the_cached_masks_follow_the_hidden_set(zoom, how):
    """The same question asked twice of one memory, the hidden set changed in between and nothing else (no scout pass:
    the fixed sets' ranking and the forwards' shapes the same): the masks the first ask made (the open mask, the fixed
    sets' fill) are not reused for the second, which answers as a memory that never hid anything."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=400, **{**EXACT, "zoom": zoom})
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    plain = methods.get("sekv").open(store, p, res.shape, "cpu")
    plain.batched = mem.batched = True
    static = how.endswith("static")
    want = _answer(model, plain, q, static)
    mem.res.hidden.set(_hand_set(mem.res))
    hid = _answer(model, mem, q, static)
    assert (hid - want).abs().max() > 1e-3
    mem.res.hidden.set(None)
    assert torch.equal(_answer(model, mem, q, static), want)
    mem.res.hidden.set(_hand_set(mem.res))
    assert torch.allclose(_answer(model, mem, q, static), hid, atol=1e-6, rtol=1e-6)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_a_captured_step_reads_each_questions_hidden_set():
    """One captured step (GraphedStep on CUDA) across asks: the hidden columns' buffer is refilled in place, so the
    replayed graph hides the second set (no recapture), and an ask with nothing hidden runs the graph without it; each
    answer is the CPU step's under the same set."""
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=500, budget=0.3, min_span=10, window=32, zoom="none",
                                                      routing="per_layer", zoom_tier="factors")
    gmodel = tiny("qwen2").cuda()
    gmodel.load_state_dict(model.state_dict())
    runtime.install(gmodel)
    g = methods.get("sekv").open(store, p, res.shape, "cuda")
    assert g.batched and GraphedStep.supported(gmodel, g)
    step = GraphedStep(gmodel, g)
    head = gmodel.get_output_embeddings()
    q = torch.tensor([[5, 17, 42, 99, 7, 250]])
    n = mem.res.n_full
    sets = [_hand_set(mem.res), torch.arange(n - 20, n - 14), None, _hand_set(mem.res)]
    captures = []
    for cols in sets:
        mem.res.hidden.set(cols)
        want = _answer(model, mem, q, static=False, n=4)
        g.res.hidden.set(cols)
        start = g.n_tokens()
        got = [runtime.forward_logits(gmodel, q.cuda(), start, g, last_only=False)]
        for _ in range(4):
            nxt = got[-1][:, -1:].argmax(-1)
            with torch.inference_mode():
                got.append(head(step(nxt)[:, -1:]).float())
        g.truncate(start)
        got = torch.cat(got, 1).cpu()
        assert torch.allclose(got, want, atol=2e-3, rtol=1e-3), (got - want).abs().max()
        captures.append(step.captures)
    assert captures[1] == captures[0]  # the second set: the same graph replayed, reading the refilled buffer
    assert captures[2] > captures[1]  # nothing hidden: the graph without the hidden columns' buffer
