"""The prefill's chunk (tokens a forward; longer on a GPU: prefill.default_chunk) changes none of its outputs beyond
rounding: the KV, the surprisal and the captured queries of a GPU-sized chunk against 1,024-token chunks and the
reference model's own forward of the whole sequence."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM

from sekv_core import models
from sekv_core.prefill import CUDA_CHUNK, DEFAULT_CHUNK, default_chunk, prefill


def test_default_chunk_is_longer_on_a_gpu():
    assert default_chunk(torch.device("cpu")) == DEFAULT_CHUNK
    assert default_chunk(torch.device("cuda")) == CUDA_CHUNK > DEFAULT_CHUNK


def test_a_gpu_sized_chunk_gives_the_same_prefill(tiny_qwen):
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    n = CUDA_CHUNK + 700  # two GPU chunks, five CPU ones
    ids = torch.randint(3, len(lm.tokenizer), (n,), generator=torch.Generator().manual_seed(0))
    kw = dict(with_surprisal=True, capture=("obs_queries",), obs_window=64)
    small = prefill(lm.model, ids, chunk=DEFAULT_CHUNK, **kw)
    big = prefill(lm.model, ids, chunk=CUDA_CHUNK, **kw)
    tol = dict(atol=2e-4, rtol=2e-4)
    for a, b in zip(small.keys + small.values, big.keys + big.values):
        torch.testing.assert_close(a, b, **tol)
    torch.testing.assert_close(small.surprisal, big.surprisal, **tol)
    for a, b in zip(small.scores["obs_queries"], big.scores["obs_queries"]):
        torch.testing.assert_close(a, b, **tol)
    # the reference: the model's own forward of the whole sequence (its surprisal from its logits)
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32, attn_implementation="sdpa").eval()
    with torch.no_grad():
        out = ref(ids.view(1, -1), use_cache=True)
    ref_s = -torch.log_softmax(out.logits[0, :-1].float(), -1).gather(1, ids[1:].view(-1, 1)).squeeze(1)
    torch.testing.assert_close(big.surprisal[1:], ref_s, **tol)
    k_last = out.past_key_values.layers[-1].keys[0] if hasattr(out.past_key_values, "layers") else out.past_key_values[-1][0][0]
    torch.testing.assert_close(big.keys[-1], k_last, **tol)
