"""Router training (issue 5): frozen model, gradients, straight-through estimator, losses, a short run, router files."""

from __future__ import annotations

import random
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from sekv_core.errors import SekvError
from sekv_core.pack import read_pack
from sekv_core.sekv import factorize as fz
from sekv_core.sekv import router_file
from sekv_core.sekv.rank_gate import RankGate
from sekv_core.train import corpus, losses
from sekv_core.train.memory import StudentMemory, TeacherMemory
from sekv_core.train.trainer import Sample, TrainConfig, Trainer, _decoder_forward

WORDS = ("amber basalt cedar dune ember fjord garnet harbor iris juniper kelp lagoon meadow nickel orchid prairie quartz "
         "reef sierra tundra umber valley willow xenon yarrow zephyr").split()


def write_corpus(root: Path, n_docs: int = 3, seed: int = 0) -> Path:
    rng = random.Random(seed)
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n_docs):
        paras = ["\n".join(" ".join(rng.choice(WORDS) for _ in range(12)) + "." for _ in range(4)) for _ in range(40)]
        (root / f"doc{i}.txt").write_text("\n\n".join(paras))
    (root / "page.html").write_text("<html><head><style>x{}</style><script>var a=1;</script></head><body><p>"
                                    + " ".join(WORDS * 100) + "</p></body></html>")
    return root


@pytest.fixture(scope="module")
def setup(lm, tmp_path_factory):
    root = write_corpus(tmp_path_factory.mktemp("text"))
    docs = corpus.read_documents(root)
    cfg = TrainConfig(steps=6, contexts=(600,), per_context=3, candidates=3, save_every=3, warm_contexts=0)
    tr = Trainer(lm, cfg, tmp_path_factory.mktemp("out") / "r.safetensors", docs, {"source": "test"}, log=lambda s: None)
    c = tr.contexts_for(0)[0]
    ctx = tr.prepare(c)
    tr.start(ctx)
    ids = c.doc_ids[40:90]
    sample = Sample(ids, list(range(10, len(ids) - 1)))
    return tr, ctx, sample


def test_corpus_html_and_contexts(lm, tmp_path):
    docs = corpus.read_documents(write_corpus(tmp_path))
    html = dict(docs)["page.html"]
    assert "var a" not in html and "x{}" not in html and "amber basalt" in html
    cs = corpus.contexts(lm.tokenizer, docs, 500, 3, seed=1)
    assert len(cs) == 3 and all(400 <= len(c.doc_ids) <= 600 for c in cs)
    assert cs[0].doc_ids != cs[1].doc_ids


def test_gradients_reach_router_not_model(setup):
    tr, ctx, s = setup
    t_logits, t_mass, _ = tr.teacher(ctx, s)
    tr.opt.zero_grad(set_to_none=True)
    total, _ = tr.loss(ctx, s, t_logits, t_mass)
    total.backward()
    r = tr.router
    assert r.w.grad is not None and r.w.grad.abs().sum() > 0
    assert r.tau_logit.grad is not None and r.tau_logit.grad.abs().sum() > 0  # only through the STE: hard decisions have none
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in r.gate.parameters() if p.dim() == 2)
    assert all(p.grad is None for p in tr.model.parameters())
    assert not any(p.requires_grad for p in tr.model.parameters())


def test_ste_tau_gradient_is_the_surrogate_derivative():
    p = torch.tensor([0.3, 0.6])
    tau = torch.tensor(0.5, requires_grad=True)
    soft = torch.sigmoid((p - tau) / 0.1)
    z = (p > tau).float() + soft - soft.detach()
    assert torch.equal(z.detach(), torch.tensor([0.0, 1.0]))  # forward: the hard decision
    z.sum().backward()
    expect = -(soft * (1 - soft) / 0.1).sum()
    assert tau.grad is not None and torch.allclose(tau.grad, expect.detach()) and tau.grad != 0


def test_reconstruction_loss_is_the_gated_frobenius_error():
    torch.manual_seed(0)
    x = torch.randn(2, 30, 16)  # 2 heads, spans of 10/12/8 rows
    lens = torch.tensor([10, 12, 8])
    us, sig, vt = fz.decompose_spans(x, lens, rank_max=32)
    g = torch.rand_like(sig)
    rec = torch.einsum("hsnr,hsrd->hsnd", us * g.unsqueeze(2), vt)
    first = torch.cumsum(lens, 0) - lens
    err = sum(((x[:, a : a + n] - rec[:, i, :n]) ** 2).sum() for i, (a, n) in enumerate(zip(first.tolist(), lens.tolist())))
    assert torch.allclose(losses.reconstruction(sig, g), err, rtol=1e-4)


def test_warm_start_ranks_spans_by_teacher_mass():
    """The listwise loss is minimised by gate logits equal to log mass (+ a constant), and top_mass sees it."""
    mass = torch.tensor([[0.6, 0.3, 0.1, 0.0001]])
    assert losses.listwise(mass.log() + 3.0, mass) < 1e-4 < losses.listwise(torch.zeros(1, 4), mass)
    got, best = losses.top_mass(torch.tensor([[0.0, 5.0, 1.0, 9.0]]), mass, k=2)
    assert abs(got - 0.3001 / 1.0001) < 1e-5 and abs(best - 0.9 / 1.0001) < 1e-5


def test_rho_targets_smallest_set():
    mass = torch.tensor([[0.5, 0.05, 0.3, 0.15], [0.95, 0.02, 0.02, 0.01]])
    y = losses.rho_targets(mass, 0.9)
    assert y.tolist() == [[1.0, 0.0, 1.0, 1.0], [1.0, 0.0, 0.0, 0.0]]


def test_student_at_full_zoom_equals_full_kv(setup):
    """All spans zoomed, every component kept, no cap: the training attention is exactly full attention."""
    tr, ctx, s = setup
    r = tr.router
    saved = r.tau_logit.data.clone(), r.gate.net[2].bias.data.clone()
    try:
        r.tau_logit.data.fill_(-30.0)
        r.gate.net[2].bias.data.fill_(30.0)
        stu = StudentMemory(ctx, r, budget=None)
        with torch.no_grad():
            hs = _decoder_forward(tr.model, s.ids, ctx.n_tokens, stu, grad=False)
            ht = _decoder_forward(tr.model, s.ids, ctx.n_tokens, TeacherMemory(ctx), grad=False)
        assert all(bool((z > 0.5).all()) for z in stu.rec.z)
        assert torch.allclose(hs, ht, atol=2e-3, rtol=1e-3), float((hs - ht).abs().max())
    finally:
        r.tau_logit.data.copy_(saved[0])
        r.gate.net[2].bias.data.copy_(saved[1])


def test_short_run_lowers_the_loss(setup):
    tr, ctx, s = setup
    t_logits, t_mass, _ = tr.teacher(ctx, s)
    with torch.no_grad():
        before = float(tr.loss(ctx, s, t_logits, t_mass)[0])
    for _ in range(15):
        tr.optimise(ctx, s, t_logits, t_mass)
        tr.step += 1
    with torch.no_grad():
        after = float(tr.loss(ctx, s, t_logits, t_mass)[0])
    assert after < before


def test_cli_train_resume_and_router_file(tiny_qwen, tmp_path):
    from sekv_cli.app import app

    data = write_corpus(tmp_path / "text")
    out = tmp_path / "r.safetensors"
    runner = CliRunner()
    args = ["train", "--model", str(tiny_qwen), "--data", str(data), "--steps", "4", "--contexts", "512,600",
            "--per-context", "2", "--save-every", "2", "--warm-contexts", "2", "--warm-steps", "20", "--out", str(out)]
    res = runner.invoke(app, args)
    assert res.exit_code == 0, res.output
    assert "trainable parameters" in res.output and "step 4/4" in res.output and "warm start: teacher span mass" in res.output
    rf = router_file.load(out)
    assert rf.meta["warm_start"]["samples"] >= 2
    assert rf.meta["steps_done"] == 4 and rf.meta["data"]["source"] == str(data.resolve())
    assert rf.w.shape == (2, 4, 32, 16) and rf.tau.shape == (2, 4)
    lines = (tmp_path / "r.safetensors.log.jsonl").read_text().splitlines()
    assert len(lines) == 4
    # resume: 2 more steps continue from step 4
    res = runner.invoke(app, [*args[:6], "6", *args[7:]])
    assert res.exit_code == 0, res.output
    assert "resumed from" in res.output and "step 6/6" in res.output and "step 1/6" not in res.output
    assert router_file.load(out).meta["steps_done"] == 6
    bad = runner.invoke(app, ["train", "--model", str(tiny_qwen), "--data", str(tmp_path / "nope"), "--out", str(out)])
    assert bad.exit_code == 2 and "not a directory" in bad.output


def test_router_file_checks(tmp_path, lm):
    gate = RankGate(32, 16)
    rf = router_file.RouterFile(torch.randn(2, 4, 32, 16), torch.full((2, 4), 0.05), gate,
                                {"model": {"id": "x", "fingerprint": "abc", "shape": {"layers": 2, "heads": 4, "head_dim": 16}}})
    p = router_file.save(tmp_path / "r.safetensors", rf)
    back = router_file.load(p)
    assert torch.equal(back.w, rf.w) and back.fingerprint == "abc"
    shape = type("S", (), {"n_layers": 2, "n_heads": 4, "head_dim": 16})()
    with pytest.raises(SekvError, match="trained for model"):
        router_file.resolve(str(p), "other", shape)
    assert router_file.resolve(str(p), "abc", shape) == str(p.resolve())
    assert router_file.resolve("auto", "no-such-model", shape) == "untrained"
    # a shipped router for an embedded model matches another install of it (fingerprints differ by config.json)
    qwen = type("S", (), {"n_layers": 24, "n_heads": 14, "head_dim": 64})()
    assert router_file.resolve("auto", "another-install", qwen, "qwen2.5-0.5b").endswith("qwen2.5-0.5b.safetensors")
    assert router_file.resolve("auto", "another-install", shape, "qwen2.5-0.5b") == "untrained"  # shape differs
    assert router_file.resolve("auto", "another-install", qwen, "/some/dir") == "untrained"  # not embedded
    (tmp_path / "junk.safetensors").write_bytes(b"not a file")
    with pytest.raises(SekvError, match="router"):
        router_file.resolve(str(tmp_path / "junk.safetensors"), "abc", shape)


def test_ingest_with_trained_router_uses_it(tmp_path, lm, tiny_qwen):
    """A router file at ingest: the pack stores its W/tau, G picks the ranks; `--router untrained` at ask switches back."""
    from sekv_core.ingest import ingest
    from sekv_core.session import Session

    L, H, d = 2, 4, 16
    gate = RankGate(32, d)
    with torch.no_grad():
        gate.net[2].bias.fill_(-30.0)
        gate.net[2].bias[:2] = 30.0  # keep exactly the two leading components
    meta = {"model": {"id": lm.model_id, "fingerprint": lm.fingerprint, "shape": {"layers": L, "heads": H, "head_dim": d}}}
    w = torch.randn(L, H, 32, d)
    rpath = router_file.save(tmp_path / "r.safetensors", router_file.RouterFile(w, torch.full((L, H), 0.2), gate, meta))
    doc = tmp_path / "doc.txt"
    doc.write_text(" ".join(random.Random(0).choice(WORDS) for _ in range(700)))
    r = ingest(doc, tmp_path / "doc.sekv", lm=lm, method="sekv", params={"router": str(rpath)})
    assert r.params.router == str(rpath.resolve()) and read_pack(r.pack_path).get("sekv.router.sha256").numel() == 32
    sess = Session.open(r.pack_path, lm=lm)
    assert sess.memory.res.router_source == "trained"
    from sekv_core import methods

    assert methods.get("sekv").describe(sess.pack, sess.params)["router"].startswith("trained (sha256 ")
    ranks = sess.pack.get("sekv.fk.0.rank")
    lens = (sess.pack.get("sekv.span_end") - sess.pack.get("sekv.span_start")).view(1, -1)
    assert torch.equal(ranks.long(), torch.minimum(torch.full_like(ranks.long(), 2), lens))
    assert torch.allclose(sess.memory.res.logit_tau, torch.full((L, H), float(torch.logit(torch.tensor(0.2)))), atol=1e-5)
    un = Session.open(r.pack_path, lm=lm, params={"router": "untrained"})
    assert un.memory.res.router_source == "pack"
    ans = un.ask("amber?", max_new_tokens=3)
    assert ans.stats.generated_tokens >= 1


def test_very_short_document_has_no_spans_and_still_answers(tmp_path, lm):
    from sekv_core.ingest import ingest
    from sekv_core.session import Session

    doc = tmp_path / "short.txt"
    doc.write_text("amber basalt cedar.")
    r = ingest(doc, tmp_path / "short.sekv", lm=lm, method="sekv", params={"min_span": 4000})  # shorter than one span
    sess = Session.open(r.pack_path, lm=lm)
    assert sess.memory.res.n_spans == 0
    assert sess.ask("cedar?", max_new_tokens=2).stats.generated_tokens >= 1


def test_rank_gate_beyond_its_rank_keeps_components():
    gate = RankGate(4, 8)
    with torch.no_grad():
        gate.net[2].bias.fill_(-30.0)  # drop everything it has an opinion on
    sig = torch.rand(2, 3, 6).sort(-1, descending=True).values
    g = gate(sig, torch.randn(2, 3, 8), torch.tensor([8, 9, 10]), False, 0.5)
    assert g.shape == (2, 3, 6) and bool((g[..., :4] < 1e-6).all()) and bool((g[..., 4:] == 1).all())
