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


def test_a_gpu_prefills_the_whole_document_in_one_forward_when_it_fits(monkeypatch):
    from sekv_core.prefill import CHUNK_ENV

    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(CHUNK_ENV, raising=False)
    assert default_chunk(cuda, 131072, lambda n: True) == 131072
    assert default_chunk(cuda, 131072, lambda n: False) == CUDA_CHUNK
    assert default_chunk(cuda, 1000, lambda n: True) == CUDA_CHUNK  # shorter than a chunk: as before
    assert default_chunk(cpu, 131072, lambda n: True) == DEFAULT_CHUNK
    monkeypatch.setenv(CHUNK_ENV, "2048")  # the measurement knob wins everywhere
    assert default_chunk(cuda, 131072, lambda n: True) == default_chunk(cpu) == 2048


def test_the_8b_shape_at_128k_is_one_forward_on_an_h200():
    """The estimate (prefill.activation_bytes) for Llama-3-8B's shape at 128K tokens, by hand: per token 2 bytes x
    (4 x 14,336 MLP + 8 x 4,096 hidden + 2 x (32 + 2 x 8) x 128 attention) + 4 x 6 x 8 x 128 float32 stream work =
    229,376 bytes; within half of an H200 (139 GiB) less the weights (15 GiB) and the KV (16 GiB)."""
    from types import SimpleNamespace

    from sekv_core.methods.base import ModelShape
    from sekv_core.prefill import WHOLE_SHARE, activation_bytes

    cfg = SimpleNamespace(hidden_size=4096, intermediate_size=14336)
    shape = ModelShape(n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128, dtype=torch.bfloat16)
    assert activation_bytes(cfg, shape, 131072) == 229376 * 131072
    assert activation_bytes(cfg, shape, 131072) <= WHOLE_SHARE * (139 - 15 - 16) * 2**30


def test_each_layers_rows_are_handed_on_final_as_soon_as_it_has_them(tiny_qwen):
    """on_rows(layer, a, b, rows): every layer's tokens in order, a chunk's layers one after the other inside its
    forward; the rows given then are the prefill's final KV (compared after it); progress a layer at a time, to n."""
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    n, c = 700, 256
    ids = torch.randint(3, len(lm.tokenizer), (n,), generator=torch.Generator().manual_seed(2))
    seen, done = [], []

    def on_rows(li, a, b, rows):
        k, v = rows()
        seen.append((li, a, b, k.clone(), v.clone()))

    r = prefill(lm.model, ids, with_surprisal=True, chunk=c, on_rows=on_rows, progress=lambda d, t: done.append((d, t)))
    L = len(r.keys)
    want = [(li, a, min(a + c, n)) for a in range(0, n, c) for li in range(L)]
    assert [s[:3] for s in seen] == want
    for li, a, b, k, v in seen:
        assert torch.equal(k, r.keys[li][:, a:b]) and torch.equal(v, r.values[li][:, a:b])
    assert [d for d, _ in done] == sorted(d for d, _ in done) and done[-1] == (n, n) and len(done) == len(want)
    whole = []
    prefill(lm.model, ids, with_surprisal=True, chunk=n, on_rows=lambda li, a, b, rows: whole.append((li, a, b)))
    assert whole == [(li, 0, n) for li in range(L)]  # one forward: each layer's rows while the next layers compute
