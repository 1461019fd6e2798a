"""sekv segmentation: every token exactly once, merge/split guards, budget-driven defaults."""

from __future__ import annotations

import random

import pytest
import torch

from sekv_core.sekv.segment import Segmentation, auto_lengths, segment, span_token_index


def _check_cover(seg: Segmentation, n: int) -> None:
    pos, sid = seg.span_tokens()
    allpos = torch.cat([seg.full_idx, pos])
    assert allpos.numel() == n, "full_idx and spans must cover every token exactly once"
    assert torch.equal(torch.sort(allpos).values, torch.arange(n))
    assert torch.all(seg.span_end > seg.span_start)
    if seg.n_spans > 1:
        assert torch.all(seg.span_start[1:] >= seg.span_end[:-1])
    assert set(seg.anchor_idx.tolist()) <= set(seg.full_idx.tolist())
    if seg.n_spans:
        assert torch.equal(sid, torch.repeat_interleave(torch.arange(seg.n_spans), seg.span_len))


def test_random_surprisal_covers_every_token_once():
    for seed in range(60):
        rng = random.Random(seed)
        n = rng.randint(1, 3000)
        s = torch.tensor([rng.expovariate(0.4) for _ in range(n)])
        if rng.random() < 0.3:  # bursts of high surprisal
            s[torch.randint(0, n, (n // 10 + 1,))] += 15
        mn = rng.randint(1, 60)
        mx = rng.randint(mn, 4 * mn)
        w = rng.randint(0, 600)
        sink = rng.randint(0, 6)
        seg = segment(s, alpha=rng.choice([0.5, 1.0, 2.0]), min_span=mn, max_span=mx, n_sink=sink, window=w)
        _check_cover(seg, n)
        lens = seg.span_len
        if seg.n_spans:
            assert int(lens.max()) <= mx
            assert int(lens.min()) >= min(mn, mx // 2)  # even splits of spans > max_span stay >= max_span / 2
        # sinks and window at full resolution
        full = set(seg.full_idx.tolist())
        assert set(range(min(sink, n))) <= full
        assert set(range(max(0, n - w), n)) <= full


def test_edge_cases():
    # N < window: everything full resolution
    seg = segment(torch.rand(100), min_span=8, max_span=16, window=512)
    _check_cover(seg, 100)
    assert seg.n_spans == 0 and seg.full_idx.numel() == 100
    # all-equal surprisal: no boundary; the region is split evenly by max_span only
    seg = segment(torch.full((1000,), 3.0), min_span=10, max_span=50, n_sink=4, window=100)
    _check_cover(seg, 1000)
    assert seg.anchor_idx.numel() == 0
    assert seg.n_spans == 18 and int(seg.span_len.max()) <= 50  # 896 tokens -> ceil(896 / 50) pieces
    # empty and tiny documents
    for n in (0, 1, 2, 5):
        seg = segment(torch.rand(n), min_span=4, max_span=8, window=0)
        _check_cover(seg, n)


def test_boundaries_are_anchors_and_merge_respects_min_span():
    s = torch.zeros(400)
    peaks = [20, 23, 60, 61, 62, 150, 300]
    s[peaks] = 10.0
    seg = segment(s, min_span=30, max_span=1000, n_sink=4, window=20)
    _check_cover(seg, 400)
    a = seg.anchor_idx.tolist()
    assert a == [60, 150, 300] or a == [60, 150]  # 20/23 too close to the sinks, 61/62 too close to 60
    assert all(int(x) >= 30 for x in seg.span_len)
    # an anchor is never inside a span
    pos, _ = seg.span_tokens()
    assert not set(a) & set(pos.tolist())


def test_split_has_no_anchor():
    s = torch.zeros(1000)
    seg = segment(s, min_span=10, max_span=100, n_sink=0, window=0)
    _check_cover(seg, 1000)
    assert seg.full_idx.numel() == 0 and seg.n_spans == 10


def test_span_token_index():
    pos, sid = span_token_index(torch.tensor([2, 10]), torch.tensor([5, 12]))
    assert pos.tolist() == [2, 3, 4, 10, 11]
    assert sid.tolist() == [0, 0, 0, 1, 1]


@pytest.mark.parametrize("budget", [0.05, 0.10, 0.15, 0.20])
def test_auto_lengths(budget):
    mn, mx, w = auto_lengths(8000, budget)
    assert mn >= 4 and mx == 2 * mn
    assert w == min(512, int(0.1 * budget * 8000))
    # two persistent entries per span: at most a quarter of the budget
    assert 2 / mn <= 0.25 * budget + 1e-9
