"""Number tokens kept exact (sekv/numbers.py, segment.keep_exact): the selection rule, the spans cut around them,
their K/V in the pack against the prefill's, and the budget that counts them."""

from __future__ import annotations

import random

import pytest
import torch

from sekv_core import methods
from sekv_core.methods.base import DictStore
from sekv_core.prefill import prefill
from sekv_core.sekv import numbers
from sekv_core.sekv.segment import keep_exact, segment

from tests.test_sekv_method import tiny
from tests.test_sekv_segment import _check_cover


def test_number_tokens_are_the_tokens_with_a_digit_and_runs_are_whole_numbers():
    text = ["The", " code", " is", " ", "7", "7", "1", "5", ".", " In", " 19", "th", " year", " x2", "²", "3"]
    assert numbers.number_flags(text).nonzero().flatten().tolist() == [4, 5, 6, 7, 10, 13, 15]  # '²' is no decimal digit
    start, end = numbers.number_runs(numbers.number_flags(text))
    assert list(zip(start.tolist(), end.tolist())) == [(4, 8), (10, 11), (13, 14), (15, 16)]


def test_the_longest_numbers_are_kept_first_whole_within_the_cap():
    f = torch.zeros(30, dtype=torch.bool)
    for a, b in ((2, 4), (6, 13), (15, 16), (20, 24), (27, 29)):  # runs of 2, 7, 1, 4, 2 tokens
        f[a:b] = True
    kept = lambda cap: numbers.exact_positions(f, cap).tolist()  # noqa: E731
    assert kept(0) == []
    assert kept(6) == [2, 3, 20, 21, 22, 23]  # the 7 does not fit: the 4, then the first 2
    assert kept(7) == list(range(6, 13))
    assert kept(11) == list(range(6, 13)) + [20, 21, 22, 23]
    assert kept(13) == [2, 3] + list(range(6, 13)) + [20, 21, 22, 23]  # the two 2-token runs tie: the earlier one
    assert kept(100) == f.nonzero().flatten().tolist()
    assert numbers.exact_positions(f, 100, lo=7, hi=22).tolist() == list(range(7, 13)) + [15, 20, 21]  # a window's part
    assert numbers.number_cap(0.25, 0.1, 8192) == 204 and numbers.number_cap(0.0, 0.1, 8192) == 0


def test_kept_positions_leave_every_span_and_every_token_is_covered_once():
    for seed in range(40):
        rng = random.Random(seed)
        n = rng.randint(20, 1500)
        s = torch.tensor([rng.expovariate(0.4) for _ in range(n)])
        mn = rng.randint(2, 30)
        seg = segment(s, min_span=mn, max_span=2 * mn, n_sink=4, window=rng.randint(0, 100))
        exact = torch.tensor(sorted(rng.sample(range(n), rng.randint(0, n // 5))), dtype=torch.long)
        cut = keep_exact(seg, exact)
        _check_cover(cut, n)
        pos, _ = cut.span_tokens()
        assert not set(exact.tolist()) & set(pos.tolist())
        assert torch.equal(cut.anchor_idx, seg.anchor_idx)
        assert cut.n_spans == 0 or int(cut.span_len.min()) >= min(2, int(seg.span_len.min()))  # no one-token piece made
        assert set(seg.full_idx.tolist()) <= set(cut.full_idx.tolist())
        # nothing else moves: a token stays in a span unless it is kept or was left alone in its span between kept ones
        opos, osid = seg.span_tokens()
        owner = dict(zip(opos.tolist(), osid.tolist()))
        for t in set(opos.tolist()) - set(pos.tolist()) - set(exact.tolist()):
            same = [u for u in (t - 1, t + 1) if owner.get(u) == owner[t]]
            assert same and set(same) <= set(exact.tolist()), t


def _compressed(n=400, budget=0.5, share=0.25, digits=(), surprisal=None, **extra):
    model = tiny("qwen2")
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(1))
    res = prefill(model, ids, with_surprisal=True, chunk=128)
    if surprisal is not None:
        res.surprisal = surprisal
    res.scores["token_text"] = ["7" if i in set(digits) else "a" for i in range(n)]
    m = methods.get("sekv")
    p = m.resolve_params(dict(budget=budget, number_share=share, min_span=8, max_span=16, window=16, router="untrained", **extra))
    store = m.compress(res, p)
    return res, p, store, m.open(DictStore(dict(store)), p, res.shape, "cpu")


def test_number_tokens_in_the_pack_are_the_prefills_kv_and_in_no_span():
    digits = [50, 51, 52, 53, 54, 55, 56, 120, 121, 300]
    res, p, store, mem = _compressed(digits=digits, store_dtype="model")
    full = store["sekv.full_idx"].tolist()
    assert set(digits) <= set(full)
    for a, b in zip(store["sekv.span_start"].tolist(), store["sekv.span_end"].tolist()):
        assert not any(a <= t < b for t in digits)
    at = torch.tensor([full.index(t) for t in digits])
    for li in range(res.shape.n_layers):  # the prefill's K/V, bit for bit (the model's float32 kept)
        assert torch.equal(store[f"sekv.full.k.{li}"][:, at], res.keys[li][:, digits])
        assert torch.equal(store[f"sekv.full.v.{li}"][:, at], res.values[li][:, digits])
    # and the resident memory holds them (keys rotated to their positions as the prefill's are)
    assert torch.equal(mem.res.kv.v[0][0, :, at], res.values[0][:, digits])
    # without the share, the same positions are compressed
    _, _, off, _ = _compressed(digits=digits, share=0.0, store_dtype="model")
    assert not set(digits) & set(off["sekv.full_idx"].tolist())
    with pytest.raises(ValueError, match="token_text"):
        res.scores.pop("token_text")
        methods.get("sekv").compress(res, p)


def test_the_budget_counts_the_number_tokens_hand_computed():
    # equal surprisal: no boundary; [4, 384) in ceil(380 / 16) = 24 spans of 15-16 tokens, 4 sinks + 16 window tokens
    n, b = 400, 0.5
    flat = torch.full((n,), 3.0)
    _, _, store0, mem0 = _compressed(n=n, budget=b, share=0.0, surprisal=flat)
    assert store0["sekv.span_start"].numel() == 24 and store0["sekv.full_idx"].numel() == 20
    # a 3-token number and a 1-token one, each at least two tokens inside a span: 4 full tokens more, each cut one
    # span more (pieces of 2 tokens or more on both sides)
    edges = set(store0["sekv.span_start"].tolist()) | set(store0["sekv.span_end"].tolist())
    assert all(not edges & {a - 1, a, b, b + 1} for a, b in ((105, 108), (200, 201)))
    _, _, store, mem = _compressed(n=n, budget=b, share=0.25, digits=(105, 106, 107, 200), surprisal=flat)
    assert store["sekv.full_idx"].numel() == 24 and store["sekv.span_start"].numel() == 26
    per_token = 2 * 2 * 16 * 4 * 2  # K and V, 2 KV heads, head_dim 16, float32, 2 layers
    budget_bytes = int(b * n * per_token)
    assert mem.ledger.budget_bytes == budget_bytes
    assert mem.ledger.room() == budget_bytes - (24 + 26) * per_token - mem.ledger.router_bytes
    # against the pack without them: 4 tokens and 2 coarse entries more (the router's per-span state aside)
    assert (mem0.ledger.room() + mem0.ledger.router_bytes) - (mem.ledger.room() + mem.ledger.router_bytes) == 6 * per_token
    # the cap: share x b x N = 0.01 x 0.5 x 400 = 2 tokens: only the 1-token number fits
    _, _, capped, _ = _compressed(n=n, budget=b, share=0.01, digits=(105, 106, 107, 200), surprisal=flat)
    assert set(capped["sekv.full_idx"].tolist()) - set(store0["sekv.full_idx"].tolist()) == {200}


def test_ingest_keeps_the_tokens_whose_text_has_a_digit(lm, tmp_path):
    """Through `sekv ingest` with the tiny model's tokenizer: the tokens kept beyond the default's are exactly the
    document's tokens that decode to text with a digit (the cap does not bind here)."""
    from sekv_core.ingest import ingest
    from sekv_core.pack import read_pack

    body = " ".join(f"Item {i} weighs {i * 37 % 1000} kg and costs {i * 7919 % 100000} crowns." if i % 5 == 0 else
                    "The keeper walked the long stair again and wrote nothing of note in the log." for i in range(60))
    doc = tmp_path / "d.txt"
    doc.write_text(body)
    packs = {}
    for share in (0.0, 1.0):
        out = tmp_path / f"d{share}.sekv"
        ingest(doc, out, lm=lm, method="sekv", params=methods.get("sekv").resolve_params({"number_share": share, "budget": 0.5}))
        packs[share] = read_pack(out)
    full0 = set(packs[0.0].get("sekv.full_idx").tolist())
    full1 = set(packs[1.0].get("sekv.full_idx").tolist())
    from sekv_core import prompt

    ids = prompt.encode(lm.tokenizer, prompt.document_prefix(lm.tokenizer, body))
    texts = [lm.tokenizer.decode([t]) for t in ids]
    digit = {i for i, t in enumerate(texts) if any(c in "0123456789" for c in t)}
    assert digit and digit <= full1
    spans = zip(packs[1.0].get("sekv.span_start").tolist(), packs[1.0].get("sekv.span_end").tolist())
    assert not any(a <= t < b for a, b in spans for t in digit)
    # beyond the digits, only one-token pieces left between two numbers join the full-resolution tokens
    for t in full1 - full0 - digit:
        assert t - 1 in full1 and t + 1 in full1


def test_a_pack_made_before_number_tokens_reads_as_made_without_them(tmp_path, monkeypatch):
    from sekv_core.pack import read_pack, write_pack
    from sekv_core.sekv.params import SekvParams
    from sekv_core.session import pack_params, stored_params

    assert SekvParams.absent_in_pack["number_share"] == 0.0
    monkeypatch.setattr(SekvParams, "absent_in_pack", {"number_share": 0.05})  # not the default's value: which one is read

    res, p, store, _ = _compressed(digits=[50, 51], share=0.0)
    before = {k: v for k, v in p.to_dict().items() if k != "number_share"}
    write_pack(tmp_path / "old.sekv", {"method": "sekv", "method_params": before}, dict(store))
    old = read_pack(tmp_path / "old.sekv")
    assert "number_share" not in old.params and pack_params(old)["number_share"] == 0.05
    assert stored_params(old).number_share == 0.05
    write_pack(tmp_path / "new.sekv", {"method": "sekv", "method_params": p.replace(number_share=0.3).to_dict()}, dict(store))
    assert stored_params(read_pack(tmp_path / "new.sekv")).number_share == 0.3
