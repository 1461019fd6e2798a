"""What compress takes from the prefill's time (sekv/compress.py Prepared): RoPE's tables of every position, made
before the segmentation, give the pack compress made without them, tensor for tensor; the kernels' warm-up keeps
nothing."""

from __future__ import annotations

import pytest
import torch
import transformers

from sekv_core import methods, runtime
from sekv_core.prefill import prefill
from sekv_core.sekv import compress as sc
from sekv_core.sekv import rope


def _prefill(kind: str, n: int, device: str = "cpu", dtype=torch.float32):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, intermediate_size=128,
                  vocab_size=300, max_position_embeddings=4096)
    cfg = transformers.Qwen2Config(**common) if kind == "qwen2" else transformers.LlamaConfig(**common, rope_theta=50000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="sdpa", dtype=dtype).eval().to(device)
    runtime.install(model)
    ids = torch.randint(0, 300, (n,), generator=torch.Generator().manual_seed(1))
    return prefill(model, ids, with_surprisal=True, chunk=256)


def _same(a: dict, b: dict) -> None:
    assert set(a) == set(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and a[k].shape == b[k].shape, k
        assert torch.equal(a[k].cpu(), b[k].cpu()), k


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("scaling", [1.0, 1.25])
def test_tables_indexed_are_the_positions_own(dtype, scaling):
    """cos_sin of 0..n-1, rows picked afterwards, is cos_sin of the picked positions: every value (what lets the
    tables be made before the segmentation decides the positions)."""
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2).float() / 128))
    n = 20000
    c, s = rope.cos_sin(torch.arange(n), inv, scaling, dtype=dtype)
    g = torch.Generator().manual_seed(0)
    for k in (1, 7, 17, 1000, 12345):
        idx = torch.sort(torch.randperm(n, generator=g)[:k]).values
        c2, s2 = rope.cos_sin(idx, inv, scaling, dtype=dtype)
        assert torch.equal(c[idx], c2) and torch.equal(s[idx], s2)


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
def test_pack_with_prepared_is_the_same(kind):
    res = _prefill(kind, 700)
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.2, "min_span": 10})
    ref = sc.compress(res, p)
    prep = sc.Prepared(res.n_tokens, res.shape, p, torch.device("cpu"), warm=True)
    assert prep.result().error is None and prep.tables is not None
    _same(sc.compress(res, p, prepared=prep), ref)


def test_pack_with_prepared_in_span_chunks_is_the_same(monkeypatch):
    """A layer in span chunks (little device memory): each chunk's rows from the tables, the same pack."""
    res = _prefill("qwen2", 700)
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.2, "min_span": 10})
    monkeypatch.setattr(sc, "free_bytes", lambda device: 400_000)
    chunks = []
    real = sc.plan
    monkeypatch.setattr(sc, "plan", lambda *a: chunks.append(len((q := real(*a)).chunks)) or q)
    ref = sc.compress(res, p)
    got = sc.compress(res, p, prepared=sc.Prepared(res.n_tokens, res.shape, p))
    assert max(chunks) > 1
    _same(got, ref)


def test_tables_that_do_not_fit_are_not_used():
    res = _prefill("qwen2", 300)
    p = methods.get("sekv").resolve_params({"budget": 0.2, "min_span": 10})
    inv = rope.inv_freq_of(res.shape)
    prep = sc.Prepared(res.n_tokens, res.shape, p).result()
    assert prep.rot_tables(inv, res.shape.rope_attention_scaling, res.shape.dtype, res.n_tokens) is not None
    assert prep.rot_tables(inv, res.shape.rope_attention_scaling, res.shape.dtype, res.n_tokens + 1) is None  # a position past them
    assert prep.rot_tables(inv, res.shape.rope_attention_scaling, torch.float16, res.n_tokens) is None  # another rounding
    assert prep.rot_tables(inv * 2, res.shape.rope_attention_scaling, res.shape.dtype, res.n_tokens) is None
    assert prep.rot_tables(inv, 2.0, res.shape.dtype, res.n_tokens) is None


def test_reserve_host_hands_its_tables_to_compress(monkeypatch):
    res = _prefill("qwen2", 500)
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.2, "min_span": 10})
    ref = m.compress(res, p)
    used = []
    real = sc._rot_tables
    monkeypatch.setattr(sc, "_rot_tables", lambda *a: used.append(1) or real(*a))
    m.reserve_host(res.n_tokens, res.shape, p)
    _same(m.compress(res, p), ref)
    assert used == [1]
    assert getattr(m, "_prepared", None) is None  # taken once: a later ingest makes its own


def test_a_failed_preparation_leaves_compress_as_it_was(monkeypatch):
    res = _prefill("qwen2", 300)
    p = methods.get("sekv").resolve_params({"budget": 0.2, "min_span": 10})
    monkeypatch.setattr(sc, "warm_compress", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no")))
    monkeypatch.setattr(rope, "cos_sin", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("no tables")))
    prep = sc.Prepared(res.n_tokens, res.shape, p, torch.device("cpu"), warm=True).result()
    monkeypatch.undo()
    assert prep.tables is None and isinstance(prep.error, RuntimeError)
    _same(sc.compress(res, p, prepared=prep), sc.compress(res, p))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_pack_with_prepared_is_the_same():
    """On CUDA: page-locked tables indexed on the device, the warm-up's kernels on a stream of their own."""
    res = _prefill("qwen2", 900, "cuda", torch.bfloat16)
    p = methods.get("sekv").resolve_params({"budget": 0.2, "min_span": 10})
    ref = sc.compress(res, p)
    prep = sc.Prepared(res.n_tokens, res.shape, p, torch.device("cuda"))
    assert prep.warm and prep.result().error is None and prep.tables[0].is_pinned()
    _same(sc.compress(res, p, prepared=prep), ref)


def test_compress_layer_benchmark_reports_each_group_and_stage(tmp_path):
    """benchmarks/compress_layer.py: one time per layer group (the groups counted against the plan) and the stages'
    seconds, nested ones within the ones around them."""
    import json

    from benchmarks import compress_layer

    out = tmp_path / "layer.json"
    assert compress_layer.main(["--tokens", "700", "--layers", "2", "--kv-heads", "2", "--head-dim", "64", "--repeat", "1", "--prepared",
                                "--stages", "--cuda-path", "--out", str(out)]) == 0
    rec = json.loads(out.read_text())
    run = rec["runs"][0]
    assert rec["spans"] > 0 and run["first_group_s"] > 0 and run["later_groups_s"] == []  # --cuda-path: both layers one group
    st = rec["stages_s"]
    assert 0 < st["    top_eigh"] <= st["  decompose_spans"] <= st["factors (inputs, decompose, pack)"] <= rec["stages_run"]["wall_s"]
    assert rec["stage_calls"]["codes (codec.encode_factors)"] == 1
