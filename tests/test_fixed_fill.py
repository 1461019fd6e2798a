"""A fixed set's fill (sekv/fixed_set.py `_fill`) rebuilds only its kept blocks' rows from their spans' factors.

Reference: the previous computation, each fetched span's every row rebuilt ([pairs, 2, n_max, d]) and the kept
blocks' rows picked from it (`FixedSets._rebuild` with a block as long as a span takes that path).  The rows written
to the annex, and the question's logits, must be the same bit for bit."""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.prefill import prefill
from sekv_core.sekv import fixed_set, scout

from test_sekv_method import Store, tiny

QUESTION = [5, 17, 42, 99, 7, 250]


def _pack(kind: str, dtype: torch.dtype, **params):
    model = tiny(kind).to(dtype)
    runtime.install(model)
    ids = torch.randint(0, 300, (600,), generator=torch.Generator().manual_seed(1))
    res = prefill(model, ids, with_surprisal=True, chunk=128, capture=("obs_queries",), obs_window=scout.PROFILE_QUERIES)
    m = methods.get("sekv")
    p = m.resolve_params({"routing": "scout", "budget": 0.5, "min_span": 10, "window": 16, "zoom_tier": "factors", **params})
    return model, res, Store(m.compress(res, p)), p


def _fill(model, res, store, p, whole_spans: bool, monkeypatch):
    """The question's forward on a batched memory -> (logits, every layer's annex K and V)."""
    with monkeypatch.context() as mp:
        if whole_spans:  # the previous computation: every fetched span rebuilt whole
            init = fixed_set.FixedSets.__init__

            def old_init(self, *a, **k):
                init(self, *a, **k)
                self.max_block = 10**9

            mp.setattr(fixed_set.FixedSets, "__init__", old_init)
        mem = methods.get("sekv").open(store, p, res.shape, "cpu")
        mem.batched = True
        ids = torch.tensor([QUESTION])
        mem.prepare_question(lambda: runtime.forward_hidden(model, ids, mem.n_tokens(), mem))
        logits = runtime.forward_logits(model, ids, mem.n_tokens(), mem, last_only=False)
        fixed = mem.step.fixed
        assert fixed.max_block == (10**9 if whole_spans else int(mem.res.block_len.max()))
        annex = [tuple(t.clone() for t in mem.res.kv.annex_kv(layer)) for layer in range(res.shape.n_layers)]
        return logits, annex, fixed


@pytest.mark.parametrize("kind,dtype,unit,params", [
    ("qwen2", torch.float32, 16, {"factors_8bit": False, "factor_dtype": "float32"}),
    ("llama", torch.float32, 4, {"key_space": "post_rope"}),
    ("qwen2", torch.bfloat16, 16, {}),
    ("llama", torch.bfloat16, 4, {"factors_8bit": False}),
])
def test_fill_rebuilds_kept_blocks_as_the_whole_span_rebuild_did(kind, dtype, unit, params, monkeypatch):
    model, res, store, p = _pack(kind, dtype, zoom_unit=unit, **params)
    a, annex_a, fixed = _fill(model, res, store, p, False, monkeypatch)
    b, annex_b, _ = _fill(model, res, store, p, True, monkeypatch)
    assert fixed.max_block < int(fixed.blocks[0].n_max)  # the kept blocks' rows only, not their spans'
    keep = fixed.keep[0]
    assert bool(keep.any()) and not bool(keep.all())
    if unit == 4:  # several blocks of one span kept: each reads its own rows of the span's one fetch
        assert int(torch.bincount(fixed.res.block_span[keep[0].cpu()]).max()) >= 2
    for (ka, va), (kb, vb) in zip(annex_a, annex_b):
        assert bool(ka.abs().sum() > 0)
        assert torch.equal(ka, kb) and torch.equal(va, vb)
    assert torch.equal(a, b)
