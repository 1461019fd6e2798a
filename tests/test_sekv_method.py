"""The `sekv` cache method end to end: exactness at full expansion, stats, pack v2 round trip, a real model."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pytest
import torch
import transformers

from sekv_core import methods, runtime
from sekv_core.errors import SekvError
from sekv_core.methods.base import GrowingKV
from sekv_core.methods.full import FullMemory
from sekv_core.pack import FORMAT_VERSION, read_pack, write_pack
from sekv_core.prefill import prefill

ROOT = Path(__file__).resolve().parent.parent
EXACT = {
    "zoom": "all",
    "budget": 1.0,
    "energy_k": 1.0,
    "energy_v": 1.0,
    "rank_max": 64,
    "factors_8bit": False,
    "factor_dtype": "float32",
    "store_dtype": "model",  # the full-resolution tokens at the model's float32, not float16
    "min_span": 8,
    "window": 16,
    "router": "untrained",  # a trained rank gate would drop components: exactness needs every one
    "zoom_tier": "factors",  # the factors' own exactness (the zoom tier's: tests/test_zoom_tier.py)
}
STAT_KEYS = {"zoom_spans_step", "zoom_spans_total", "h2d_bytes_step", "h2d_bytes_total", "zoom_rate_per_layer", "span_zoom_counts", "budget_bytes", "appended_bytes", "span_order",
             "blocks_on_device_bytes", "first_token_parts", "hidden_tokens"}


class Store(dict):
    def get(self, name):
        return self[name]


def tiny(kind: str, attn: str | None = None):
    common = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128, vocab_size=300, max_position_embeddings=4096)
    cfg = transformers.Qwen2Config(**common) if kind == "qwen2" else transformers.LlamaConfig(**common, rope_theta=50000.0)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation=attn or "sdpa").eval()
    return model


def _setup(kind: str, n: int = 400, **params):
    model = tiny(kind)
    ref = tiny(kind)  # plain transformers (SDPA), same weights
    ref.load_state_dict(model.state_dict())
    runtime.install(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(0, 300, (n,), generator=g)
    res = prefill(model, ids, with_surprisal=True, chunk=128)
    m = methods.get("sekv")
    p = m.resolve_params(params)
    store = Store(m.compress(res, p))
    mem = m.open(store, p, res.shape, "cpu")
    full = FullMemory(GrowingKV.from_tensors(res.keys, res.values, "cpu"), res.shape)
    return model, ref, ids, res, store, p, mem, full


def _logits(model, mem, q):
    return runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)


def assert_full_kv(model, ref, ids, mem, full, steps: int = 3) -> torch.Tensor:
    """mem's logits for a 9-token question equal full KV's and plain transformers SDPA's over the document, and so
    do `steps` greedy decode steps after it (against full KV).  Returns the question."""
    q = torch.randint(0, 300, (1, 9), generator=torch.Generator().manual_seed(2))
    a, b = _logits(model, mem, q), _logits(model, full, q)
    with torch.inference_mode():
        c = ref(torch.cat([ids.view(1, -1), q], 1)).logits[:, -q.shape[1] :].float()
    assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    assert torch.allclose(a, c, atol=2e-4, rtol=1e-4), (a - c).abs().max()
    for _ in range(steps):
        nxt = b[:, -1:].argmax(-1)
        a, b = runtime.forward_logits(model, nxt, mem.n_tokens(), mem), runtime.forward_logits(model, nxt, full.n_tokens(), full)
        assert torch.allclose(a, b, atol=2e-4, rtol=1e-4), (a - b).abs().max()
    return q


@pytest.mark.parametrize("kind", ["qwen2", "llama"])
@pytest.mark.parametrize("key_space", ["pre_rope", "post_rope"])
def test_full_expansion_equals_full_kv(kind, key_space):
    model, ref, ids, res, store, p, mem, full = _setup(kind, key_space=key_space, **EXACT)
    assert mem.res.n_spans > 5 and mem.res.pre_rope == (key_space == "pre_rope")
    assert_full_kv(model, ref, ids, mem, full)
    st = mem.step_stats()
    assert st.extra["zoom_spans_step"] == mem.res.n_spans
    assert st.extra["zoom_rate_per_layer"] == [1.0, 1.0]


def test_router_path_stats_truncate_and_spans():
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, budget=0.2, min_span=10)
    n0 = mem.n_tokens()
    assert n0 == 600
    q = torch.randint(0, 300, (1, 6))
    for step in range(3):
        runtime.forward_logits(model, q if step == 0 else q[:, :1], mem.n_tokens(), mem)
    st = mem.step_stats()
    assert set(st.extra) == STAT_KEYS
    x = st.extra
    assert x["zoom_spans_total"] >= x["zoom_spans_step"] >= 0
    assert x["h2d_bytes_total"] >= x["h2d_bytes_step"] >= 0
    assert len(x["zoom_rate_per_layer"]) == 2 and all(0 <= r <= 1 for r in x["zoom_rate_per_layer"])
    assert all(0 <= int(k) < mem.res.n_spans and v > 0 for k, v in x["span_zoom_counts"].items())
    # the budget is b x the document's full KV; the 8 appended tokens are resident on top, reported apart
    assert x["budget_bytes"] == int(0.2 * n0 * mem.shape.kv_bytes_per_token())
    assert x["appended_bytes"] == 8 * mem.shape.kv_bytes_per_token()
    assert st.resident_bytes - x["appended_bytes"] <= x["budget_bytes"] or st.resident_bytes == mem.resident_bytes()
    assert mem.n_tokens() == n0 + 8
    spans = mem.spans()
    assert len(spans) == mem.res.n_spans and all(0 <= a < b <= 600 for a, b in spans)
    # truncate drops appended tokens; this ask's stats stay readable until the next forward
    mem.truncate(n0)
    assert mem.n_tokens() == n0
    assert mem.step_stats().extra["zoom_spans_total"] == x["zoom_spans_total"]
    runtime.forward_logits(model, q[:, :1], mem.n_tokens(), mem)  # a new ask: its stats start from zero
    y = mem.step_stats().extra
    assert y["zoom_spans_total"] == y["zoom_spans_step"]
    assert sum(y["span_zoom_counts"].values()) <= 2 * 4 * mem.res.n_spans  # one step: at most every (layer, head, span)
    # after truncation the answer is reproducible: same logits for the same tokens
    mem.truncate(n0)
    l1 = runtime.forward_logits(model, q, mem.n_tokens(), mem)
    mem.truncate(n0)
    l2 = runtime.forward_logits(model, q, mem.n_tokens(), mem)
    assert torch.equal(l1, l2)


def test_no_zoom_is_close_to_but_not_full_kv():
    model, ref, ids, res, store, p, mem, full = _setup("llama", zoom="none", min_span=8, window=16)
    q = torch.randint(0, 300, (1, 4))
    a = runtime.forward_logits(model, q, mem.n_tokens(), mem)
    b = runtime.forward_logits(model, q, full.n_tokens(), full)
    assert torch.isfinite(a).all()
    assert not torch.allclose(a, b, atol=1e-4)
    assert mem.step_stats().extra["zoom_spans_step"] == 0


def test_packs_of_an_older_format_are_refused_in_one_line(tmp_path, monkeypatch):
    from sekv_core import pack as packmod
    from sekv_core.errors import PackError

    *_, store, p, _, _ = _setup("qwen2", n=300, min_span=10)
    monkeypatch.setattr(packmod, "FORMAT_VERSION", 3)  # the integrity format with the untyped parameters of before
    write_pack(tmp_path / "old.sekv", {"method": "sekv", "method_params": p.to_dict()}, dict(store))
    monkeypatch.undo()
    with pytest.raises(PackError, match=r"format version 3 is older than this sekv reads \(4\); re-ingest the document") as e:
        read_pack(tmp_path / "old.sekv")
    assert "\n" not in str(e.value)


def test_params_round_trip_through_the_manifest_and_are_checked():
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.2, "routing": "per_layer", "zoom_unit": 4})
    assert m.resolve_params(json.loads(json.dumps(p.to_dict()))) == p and m.resolve_params(p) == p  # ingest resolves again
    assert set(m.ask_time_params) == {"budget", "router", "routing", "profile_weight", "zoom_unit", "lexical_weight", "lookalikes", "reposition", "coarse_mass", "prior_weight", "read_zoom_tier",
                                      "prior_pool"}
    with pytest.raises(SekvError, match="routing must be one of"):
        m.resolve_params({"routing": "both"})
    with pytest.raises(SekvError, match="has no parameter 'profile_clip'"):
        m.resolve_params({"profile_clip": 2.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.budget = 0.5


def test_pack_round_trip(tmp_path):
    model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=500, budget=0.15, min_span=10)
    path = write_pack(tmp_path / "t.sekv", {"method": "sekv", "method_params": p.to_dict()}, dict(store))
    pack = read_pack(tmp_path / "t.sekv")
    assert pack.manifest["format_version"] == FORMAT_VERSION == 4
    assert set(pack.keys()) == set(store)
    for k, v in store.items():
        got = pack.get(k)
        assert got.dtype == v.dtype and torch.equal(got, v), k
    mem2 = methods.get("sekv").open(pack, methods.get("sekv").resolve_params(pack.params), res.shape, "cpu")
    q = torch.randint(0, 300, (1, 5))
    a = runtime.forward_logits(model, q, mem.n_tokens(), mem)
    b = runtime.forward_logits(model, q, mem2.n_tokens(), mem2)
    assert torch.equal(a, b)
    d = methods.get("sekv").describe(pack, p)
    assert d["spans"] == mem.res.n_spans and d["pack_tensor_bytes"] > 0
    assert set(d["effective_rank_histogram"]["keys"]) >= {"0-4", "5-8", "9-16", "17-32"}
    assert sum(d["effective_rank_histogram"]["keys"].values()) == 2 * 2 * mem.res.n_spans
    assert path > 0


def test_describe_and_compress_budget_accounting():
    _, _, _, res, store, p, mem, _ = _setup("llama", n=800, budget=0.1)
    d = methods.get("sekv").describe(store, p)
    assert 0 < d["full_resolution_share"] < 1
    assert d["raw_kv_fp16_bytes"] == 800 * 2 * 2 * 2 * 16 * 2
    assert d["key_space"] == "pre_rope"


# --------------------------------------------------------------------------------------------------------------
# a real model


@pytest.mark.integration
def test_smollm_full_expansion_and_session(tmp_path):
    from sekv_core import models
    from sekv_core.documents import load_document
    from sekv_core.ingest import ingest, tokenize_document
    from sekv_core.session import Session

    lm = models.load("smollm2-135m", device="cpu", dtype=torch.float32)
    doc = ROOT / "sample_docs" / "lighthouse_keepers_log.md"
    ids, _ = tokenize_document(lm, load_document(doc))
    res = prefill(lm.model, torch.tensor(ids[:700]), with_surprisal=True)  # the exactness check needs no more
    m = methods.get("sekv")
    p = m.resolve_params({**EXACT, "min_span": 20, "window": -1})
    mem = m.open(Store(m.compress(res, p)), p, res.shape, "cpu")
    full = FullMemory(GrowingKV.from_tensors(res.keys, res.values, "cpu"), res.shape)
    q = torch.tensor([lm.tokenizer("Question: how many steps?", add_special_tokens=False)["input_ids"]])
    a = runtime.forward_logits(lm.model, q, mem.n_tokens(), mem, last_only=False)
    b = runtime.forward_logits(lm.model, q, full.n_tokens(), full, last_only=False)
    assert mem.res.n_spans > 10
    assert torch.allclose(a, b, atol=5e-4, rtol=1e-4), (a - b).abs().max()

    r = ingest(doc, tmp_path / "log.sekv", lm=lm, method="sekv")
    pack = read_pack(r.pack_path)
    assert pack.manifest["format_version"] == FORMAT_VERSION == 4 and pack.method == "sekv"
    s = Session.open(r.pack_path, lm=lm)
    ans = s.ask("How many steps does the Skarvholm tower have from the door to the lantern room?", max_new_tokens=12)
    assert ans.text and set(ans.stats.extra) == STAT_KEYS
    # the question's and answer's tokens are resident on top of the document's budget (their peak is the last step's)
    assert ans.stats.resident_kv_bytes_peak <= ans.stats.extra["budget_bytes"] + ans.stats.extra["appended_bytes"]
    s2 = Session.open(r.pack_path, lm=lm, params={"budget": 0.2})
    assert s2.params.budget == 0.2


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_path_matches_cpu():
    """Pinned staging + side-stream copies: CUDA gives the CPU's zoom decisions and (nearly) its logits."""
    for params in (EXACT, {"budget": 0.2, "min_span": 10}):
        model, ref, ids, res, store, p, mem, full = _setup("qwen2", n=600, **params)
        gpu_model = tiny("qwen2").cuda()
        gpu_model.load_state_dict(model.state_dict())
        runtime.install(gpu_model)
        gmem = methods.get("sekv").open(store, p, res.shape, "cuda")
        gmem.batched = False  # the reference step (the batched step: tests/test_sekv_decode.py)
        q = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(3))
        a = runtime.forward_logits(model, q, mem.n_tokens(), mem, last_only=False)
        b = runtime.forward_logits(gpu_model, q.cuda(), gmem.n_tokens(), gmem, last_only=False).cpu()
        assert torch.allclose(a, b, atol=1e-3, rtol=1e-3), (a - b).abs().max()
        for _ in range(4):
            nxt = a[:, -1:].argmax(-1)
            a = runtime.forward_logits(model, nxt, mem.n_tokens(), mem)
            b = runtime.forward_logits(gpu_model, nxt.cuda(), gmem.n_tokens(), gmem).cpu()
            assert torch.allclose(a, b, atol=1e-3, rtol=1e-3)
        x, y = mem.step_stats().extra, gmem.step_stats().extra
        assert x["zoom_spans_total"] == y["zoom_spans_total"] and x["h2d_bytes_total"] == y["h2d_bytes_total"]


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_host_copies_with_every_arena():
    """compress() moves its GPU results to the host four ways (worker-thread copies into fresh memory, DMA into
    a page-locked arena, DMA into page-locked staging memory then a host copy into a pre-faulted arena, worker-thread
    copies into a pre-faulted arena when a layer's results do not fit half the staging; what does not fit an arena
    falls back to fresh memory): each gives exactly `.cpu()` of the tensors, submitted layer by layer."""
    from sekv_core.sekv.host_copies import HostCopies as _HostCopies

    g = torch.Generator(device="cuda").manual_seed(0)
    dev = torch.device("cuda")
    pin = lambda n: torch.empty(n, dtype=torch.uint8, pin_memory=True)  # noqa: E731
    arenas = {"none": (None, None), "pinned": (pin(1 << 20), None), "prefault, staged": (torch.zeros(1 << 20, dtype=torch.uint8), pin(1 << 16)),
              "prefault, staging too small": (torch.zeros(1 << 20, dtype=torch.uint8), pin(1 << 12)),
              "prefault, the default staging": (torch.zeros(1 << 20, dtype=torch.uint8), None),
              "too small": (torch.zeros(3000, dtype=torch.uint8), pin(1 << 16))}
    for name, (arena, staging) in arenas.items():
        copies, out, ref = _HostCopies(dev, arena, staging), {}, {}
        for layer in range(4):
            copies.submit(out)
            x = torch.randn(300, 7, device=dev, generator=g)
            out[f"a.{layer}"] = x.to(torch.bfloat16)
            out[f"b.{layer}"] = (x * 50).to(torch.int8)
            out[f"c.{layer}"] = x.t()  # not contiguous
            out[f"d.{layer}"] = torch.arange(layer * 5, dtype=torch.long)  # already on the host
            ref.update({k: out[k].cpu() for k in (f"a.{layer}", f"b.{layer}", f"c.{layer}", f"d.{layer}")})
        host = copies.finish(out)
        assert set(host) == set(ref), name
        assert all(host[k].device.type == "cpu" and host[k].dtype == ref[k].dtype and torch.equal(host[k], ref[k]) for k in ref), name


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_compress_with_a_prefaulted_arena():
    model = tiny("qwen2").cuda()
    runtime.install(model)
    ids = torch.randint(0, 300, (700,), generator=torch.Generator().manual_seed(1))
    res = prefill(model, ids, with_surprisal=True, chunk=256)
    m = methods.get("sekv")
    p = m.resolve_params({"budget": 0.2, "min_span": 10})
    ref = m.compress(res, p)
    m.reserve_host(res.n_tokens, res.shape, p)
    got = m.compress(res, p)
    assert set(got) == set(ref)
    assert all(got[k].device.type == "cpu" and got[k].shape == ref[k].shape and got[k].dtype == ref[k].dtype for k in ref)
    assert all(torch.equal(got[k], ref[k]) for k in ref if k.startswith(("sekv.full.", "sekv.span_", "sekv.anchor")))


def test_trained_router_is_read_from_its_file_not_the_pack(tmp_path, monkeypatch):
    """Packs do not copy the trained router's W (1.38 MB for qwen2.5-0.5b): the pack records the router file's sha256
    and W is read from that file (rounded through float16). A changed file at the recorded path is a swapped-in router (router.load's rule); a missing one is found among the
    shipped routers by its sha256, else the pack does not open (PackError, one line)."""
    from sekv_core.errors import PackError
    from sekv_core.sekv import router_file
    from sekv_core.sekv.rank_gate import RankGate

    L, H, d = 2, 4, 16
    torch.manual_seed(3)
    rf = router_file.RouterFile(torch.randn(L, H, 32, d), torch.full((L, H), 0.1), RankGate(32, d), {})
    rpath = router_file.save(tmp_path / "r.safetensors", rf)
    model, _, ids, res, store, p, mem, _ = _setup("qwen2", n=600, budget=0.2, min_span=10, router=str(rpath))
    sha = router_file.file_sha256(rpath)
    assert bytes(store["sekv.router.sha256"].tolist()).hex() == sha and "sekv.router.ttau" in store
    assert mem.res.router_source == "trained" and torch.equal(mem.res.w, rf.w.half().float())
    assert methods.get("sekv").describe(store, p)["router"] == f"trained (sha256 {sha[:12]})"
    # the file moved away: a shipped router with the same sha256 serves; none -> PackError naming the file
    moved = tmp_path / "shipped"
    moved.mkdir()
    rpath.rename(moved / "qwen.safetensors")
    monkeypatch.setattr(router_file, "BUILTIN_DIR", moved)
    m2 = methods.get("sekv").open(store, p, res.shape, "cpu")
    assert m2.res.router_source == "trained" and torch.equal(m2.res.w, mem.res.w)
    monkeypatch.setattr(router_file, "BUILTIN_DIR", tmp_path / "nowhere")
    with pytest.raises(PackError, match=r"trained router \(sha256 .*--router untrained"):
        methods.get("sekv").open(store, p, res.shape, "cpu")
    assert methods.get("sekv").open(store, p.replace(router="untrained"), res.shape, "cpu").res.router_source == "pack"
    # a different file at the recorded path (e.g. retrained): used as a swapped-in router, its own W and tau
    other = router_file.RouterFile(torch.randn(L, H, 32, d), torch.full((L, H), 0.3), RankGate(32, d), {})
    router_file.save(rpath, other)
    m3 = methods.get("sekv").open(store, p, res.shape, "cpu")
    assert m3.res.router_source == "file" and not torch.equal(m3.res.w, mem.res.w)
    assert torch.allclose(m3.res.logit_tau, torch.full((L, H), float(torch.logit(torch.tensor(0.3)))), atol=1e-5)


def test_pca_router_w_is_stored_in_the_model_dtype():
    """The per-document PCA W and the resident tensors are stored 16-bit: a float32 model's in float16 (the
    memory casts them back), a 16-bit model's in its own dtype; store_dtype="model" keeps float32."""
    *_, res, store, p, mem, _ = _setup("qwen2", n=300, min_span=8, router="untrained")
    assert mem.shape.dtype == torch.float32
    for name in ("sekv.router.w.0", "sekv.full.k.0", "sekv.full.v.1", "sekv.coarse.k.0", "sekv.coarse.v.1"):
        assert store[name].dtype == torch.float16, name
    assert torch.equal(mem.res.w[0], store["sekv.router.w.0"].to(mem.shape.dtype))
    # the resident keys are the prefill's, rounded to float16 once
    assert torch.equal(mem.res.kv.k[0][0, :, : mem.res.n_full], res.keys[0][:, store["sekv.full_idx"]].half().float())
    m = methods.get("sekv")
    kept = m.compress(res, p.replace(store_dtype="model"))
    assert kept["sekv.full.k.0"].dtype == torch.float32 and torch.equal(kept["sekv.full.k.0"], res.keys[0][:, kept["sekv.full_idx"]])
    half = dataclasses.replace(res, keys=[k.bfloat16() for k in res.keys], values=[v.bfloat16() for v in res.values])
    assert m.compress(half, p)["sekv.full.k.0"].dtype == torch.bfloat16
