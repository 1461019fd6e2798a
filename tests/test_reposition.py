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
from sekv_core.methods.full import FullMemory
from sekv_core.methods.base import GrowingKV
from sekv_core.sekv import rope
from sekv_core.sekv.positions import Layout

from test_sekv_method import EXACT, _setup


def _logits(model, mem, q):
    return runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)


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
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    a, b = _logits(model, mem, q), _logits(model, full, q)
    with torch.inference_mode():
        c = ref(torch.cat([ids.view(1, -1), q], 1)).logits[:, -q.shape[1]:].float()
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    assert torch.allclose(a, c, atol=2e-4, rtol=1e-4), (a - c).abs().max()
    for _ in range(3):  # decode steps
        nxt = b[:, -1:].argmax(-1)
        a, b = runtime.forward_logits(model, nxt, mem.n_tokens(), mem), runtime.forward_logits(model, nxt, full.n_tokens(), full)
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()


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
