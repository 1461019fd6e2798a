"""sekv's KVzip prior (sekv/prior.py, ``prior="kvzip"``): KVzip's reconstruction scores as a question-independent
term of the scout's ranking.

References: kvzip's own pair-level selection (methods/kvzip.py select_kept) for the per-token kept share; hand
computed pools and z-scores; properties of the ranking (a planted block moves up, nothing moves without a prior);
a pack written to disk and read back; the default pack and answers unchanged.
"""

from __future__ import annotations

import pytest
import torch

from sekv_core import methods, runtime
from sekv_core.errors import SekvError
from sekv_core.ingest import WINDOW_ENV, ingest, model_shape
from sekv_core.methods.base import DictStore
from sekv_core.methods.kvzip import select_kept
from sekv_core.methods.scores import kept_tokens
from sekv_core.pack import read_pack
from sekv_core.sekv import prior
from sekv_core.session import Session

from conftest import SAMPLE_MD
from test_kvzip import QUESTION, doc  # noqa: F401  (doc: the module-scoped sample log, a fixture)


# ---------------------------------------------------------------------------- the token and block priors


def test_token_prior_is_the_share_of_pairs_kvzip_keeps():
    g = torch.Generator().manual_seed(3)
    scores = [torch.rand(2, 50, generator=g) for _ in range(3)]
    scores[0][:, :4] = float("inf")  # sinks
    for budget in (0.1, 0.2, 0.5):
        kept = select_kept(scores, kept_tokens(budget, 50), "pair")
        ref = torch.zeros(50)
        for layer in kept:
            for ix in layer:
                ref[ix] += 1
        ref /= 3 * 2
        assert torch.equal(prior.token_prior(scores, budget), ref)
    assert torch.equal(prior.token_prior(scores, 0.0), torch.zeros(50))


@pytest.mark.parametrize("pool", ["mean", "max"])
def test_block_prior_pools_each_block_then_zscores(pool):
    tokens = torch.tensor([0.0, 0.0, 1.0, 0.5, 0.0, 0.25, 0.25, 0.75, 1.0, 0.0])
    start, length = torch.tensor([1, 4, 7]), torch.tensor([3, 3, 2])  # tokens 1-3, 4-6, 7-8 (0 and 9: not in blocks)
    pooled = {"mean": [0.5, 1 / 6, 0.875], "max": [1.0, 0.25, 1.0]}[pool]
    ref = torch.tensor(pooled, dtype=torch.float64)
    ref = (ref - ref.mean()) / ref.std()
    assert torch.allclose(prior.block_prior(tokens, start, length, pool).double(), ref, atol=1e-6)


def test_the_prior_moves_a_planted_block_up_and_nothing_without_it():
    prio = torch.tensor([3.0, 2.0, 1.0, 0.0, -1.0])
    planted = torch.tensor([0.0, 0.0, 0.0, 1.0, 0.0])  # block 3: KVzip keeps much of it
    z = (planted - planted.mean()) / planted.std()
    before = prio.clone()
    prior.add_to(prio, None, 1.0)
    assert torch.equal(prio, before)
    prior.add_to(prio, z, 0.0)
    assert torch.equal(prio, before)
    up = before.clone()
    prior.add_to(up, z, 1.0)
    rank = lambda v: int((torch.argsort(v, descending=True) == 3).nonzero())  # noqa: E731
    assert rank(up) < rank(before)
    # the other blocks keep their order among themselves
    others = [0, 1, 2, 4]
    assert torch.argsort(up[others], descending=True).tolist() == torch.argsort(before[others], descending=True).tolist()


def test_prior_parameters_are_checked():
    m = methods.get("sekv")
    with pytest.raises(SekvError, match="prior must be one of"):
        m.resolve_params({"prior": "snapkv"})
    with pytest.raises(SekvError, match="prior_pool must be one of"):
        m.resolve_params({"prior_pool": "sum"})
    assert m.resolve_params({}).prior == "none"
    assert "kvzip_prompts" not in m.needs(m.resolve_params({}))
    assert "kvzip_prompts" in m.needs(m.resolve_params({"prior": "kvzip"}))


# ---------------------------------------------------------------------------- through a pack on disk


@pytest.fixture(scope="module")
def packs(lm, doc, tmp_path_factory):
    d = tmp_path_factory.mktemp("packs")
    plain = ingest(doc, d / "plain.sekv", lm=lm)
    with_prior = ingest(doc, d / "prior.sekv", lm=lm, params={"prior": "kvzip"})
    return plain.pack_path, with_prior.pack_path


def test_the_prior_is_stored_only_when_asked_and_the_rest_of_the_pack_is_unchanged(packs):
    plain, with_prior = (read_pack(p) for p in packs)
    assert prior.TENSOR not in plain.keys()
    t = with_prior.get(prior.TENSOR)
    assert t.dtype == torch.float32 and t.shape == (with_prior.n_tokens(),)
    assert float(t.min()) >= 0 and float(t.max()) <= 1 and float(t.max()) > 0
    assert set(with_prior.keys()) - set(plain.keys()) == {prior.TENSOR}
    for name in plain.keys():
        assert torch.equal(plain.get(name), with_prior.get(name)), name
    assert with_prior.manifest["method_params"]["prior"] == "kvzip"


def test_without_weight_the_prior_pack_answers_as_the_default_one(lm, packs):
    plain, with_prior = packs
    sa, sb = Session.open(plain, lm=lm), Session.open(with_prior, lm=lm, params={"prior_weight": 0.0})
    a, b = sa.ask(QUESTION, max_new_tokens=12), sb.ask(QUESTION, max_new_tokens=12)
    assert a.token_ids == b.token_ids
    assert torch.equal(sa.memory.ranking.prio, sb.memory.ranking.prio)
    assert sa.memory.prior is None and sb.memory.prior is not None


def test_a_planted_span_with_a_high_prior_moves_up_in_the_scout_ranking(lm, packs):
    """The pack's prior replaced by one that marks a single zoom block: after the scout pass that block ranks higher
    than with the prior off (same pack, same question)."""
    p = read_pack(packs[1])
    m = methods.get("sekv")
    params = m.resolve_params(p.manifest["method_params"])
    shape = model_shape(lm)
    runtime.install(lm.model)
    tensors = {k: p.get(k) for k in p.keys()}
    base = m.open(DictStore(tensors), params.replace(prior_weight=0.0), shape, "cpu")
    q = torch.tensor([lm.tokenizer(QUESTION, add_special_tokens=False)["input_ids"]])
    base.prepare_question(lambda: runtime.forward_hidden(lm.model, q, base.n_tokens(), base), QUESTION)
    order = torch.argsort(base.ranking.prio, descending=True)
    target = int(order[len(order) // 2])  # a block in the middle of the question's ranking
    b0, bl = int(base.res.block_start[target]), int(base.res.block_len[target])
    planted = torch.zeros_like(tensors[prior.TENSOR])
    planted[b0 : b0 + bl] = 1.0
    tensors[prior.TENSOR] = planted
    mem = m.open(DictStore(tensors), params.replace(prior_weight=1.0), shape, "cpu")
    mem.prepare_question(lambda: runtime.forward_hidden(lm.model, q, mem.n_tokens(), mem), QUESTION)
    place = lambda prio: int((torch.argsort(prio, descending=True) == target).nonzero())  # noqa: E731
    assert place(mem.ranking.prio) < place(base.ranking.prio)
    assert place(mem.ranking.prio) == 0  # weight 1 x a z-score of ~sqrt(B) puts a lone planted block first


def test_a_windowed_document_gets_a_prior_for_every_token(lm, tmp_path, monkeypatch):
    monkeypatch.setenv(WINDOW_ENV, "700")
    doc = tmp_path / "long.md"
    doc.write_text(SAMPLE_MD.read_text()[:5000])
    r = ingest(doc, tmp_path / "w.sekv", lm=lm, params={"prior": "kvzip"})
    p = read_pack(r.pack_path)
    assert len(p.manifest["windows"]) > 1
    t = p.get(prior.TENSOR)
    assert t.shape == (r.n_tokens,)
    # every window's own tokens got scores (KVzip keeps some of each window at the budget)
    for a, b in p.manifest["windows"]:
        assert float(t[a:b].max()) > 0
    assert Session.open(r.pack_path, lm=lm).ask(QUESTION, max_new_tokens=4).token_ids


def test_the_bench_runs_the_prior_as_a_variant_and_the_default_without_its_prompts(lm, haystack, tmp_path):
    from sekv_core.bench import runner

    def run(methods_, out):
        cfg = runner.BenchConfig(tasks=["niah"], methods=methods_, budgets=[0.5], lengths=[300], depths=[50], seed=0,
                                 haystack=haystack, max_new_tokens=4)
        o = runner.run(lm, cfg, out)
        assert not o.errors, o.errors
        return runner.read_results(out / runner.RESULTS_FILE)

    plain = run(["sekv"], tmp_path / "plain")
    assert "kvzip_prompts" not in plain[0]["prefill_with"]
    both = run(["sekv", "sekv:prior=kvzip"], tmp_path / "both")
    variant = [r for r in both if r["method"] == "sekv:prior=kvzip"]
    assert len(variant) == 1 and variant[0]["params"]["prior"] == "kvzip" and "kvzip_prompts" in variant[0]["prefill_with"]
