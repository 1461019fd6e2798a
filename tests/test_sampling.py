"""Sampling (sekv_core/sampling.py): the nucleus by hand, the draw frequencies against the softmax, seeds, and answers
from a pack against greedy decoding and against a step-by-step plain-transformers reference."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoModelForCausalLM

from sekv_core import models, prompt
from sekv_core.errors import SekvError
from sekv_core.ingest import ingest
from sekv_core.sampling import Sampler, Sampling, draw, nucleus
from sekv_core.session import Session

from conftest import SAMPLE_MD

QUESTION = "How many steps does the tower have?"


def test_nucleus_by_hand():
    p = torch.tensor([0.15, 0.5, 0.05, 0.3])  # by rank: 1 (0.5), 3 (0.3), 0 (0.15), 2 (0.05)
    assert nucleus(p, 0.7).tolist() == [False, True, False, True]  # 0.5 < 0.7, so the 0.3 token is needed too
    assert nucleus(p, 0.5).tolist() == [False, True, False, False]  # 0.5 reaches 0.5
    assert nucleus(p, 0.81).tolist() == [True, True, False, True]
    assert nucleus(p, 1.0).tolist() == [True, True, True, True]
    assert nucleus(p, 1e-9).tolist() == [False, True, False, False]  # the most likely token is always kept
    flat = torch.full((4,), 0.25)
    assert nucleus(flat, 0.3).tolist() == [True, True, False, False]  # ties: lower ids first


def test_draw_frequencies_follow_the_softmax_and_the_nucleus():
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0])
    gen = torch.Generator().manual_seed(0)
    n = 20000
    counts = torch.bincount(torch.tensor([draw(logits, 2.0, 1.0, gen) for _ in range(n)]), minlength=5).float() / n
    expected = torch.softmax(logits / 2.0, -1)
    assert torch.allclose(counts, expected, atol=0.015), (counts, expected)
    # top-p 0.6 at temperature 1: softmax = .53 .20 .12 .07 .03 -> the nucleus is the first two tokens
    p = torch.softmax(logits, -1)
    counts = torch.bincount(torch.tensor([draw(logits, 1.0, 0.6, gen) for _ in range(n)]), minlength=5).float() / n
    assert counts[2:].sum() == 0
    assert abs(counts[0].item() - (p[0] / (p[0] + p[1])).item()) < 0.015


def test_seeds_reproduce_and_differ():
    logits = torch.zeros(50)
    a = [Sampler(Sampling(1.0, 1.0, 7))(logits) for _ in range(1)]
    s1, s2, s3 = Sampler(Sampling(1.0, 1.0, 7)), Sampler(Sampling(1.0, 1.0, 7)), Sampler(Sampling(1.0, 1.0, 8))
    seq1, seq2, seq3 = ([s(logits) for _ in range(20)] for s in (s1, s2, s3))
    assert seq1 == seq2 and seq1[0] == a[0]
    assert seq1 != seq3
    assert Sampling(1.0).resolved().seed is not None  # a drawn seed is reported, so the answer can be reproduced
    assert Sampling().resolved().seed is None  # greedy needs none


def test_near_zero_temperature_is_greedy():
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        logits = torch.randn(300, generator=g)
        top = int(logits.argmax())
        assert Sampler(Sampling(1e-5, 1.0, 1))(logits) == top
        assert Sampler(Sampling(1e-40, 1.0, 1))(logits) == top  # overflowing temperatures: the limit
        assert Sampler(Sampling(1.5, 1e-6, 1))(logits) == top  # a tiny nucleus is the top token
        assert Sampler(Sampling())(logits) == top


@pytest.mark.parametrize("kw", [dict(temperature=-0.1), dict(temperature=float("nan")), dict(top_p=0.0), dict(top_p=1.5), dict(seed=-1)])
def test_bad_settings_are_refused(kw):
    with pytest.raises(SekvError):
        Sampling(**kw)


@pytest.fixture(scope="module")
def full_session(tiny_qwen, tmp_path_factory):
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    pack = tmp_path_factory.mktemp("sampling") / "log.sekv"
    ingest(SAMPLE_MD, pack, lm=lm, method="full")
    return Session.open(pack, lm=lm)


def test_answers_from_a_pack(full_session):
    s = full_session
    greedy = s.ask(QUESTION, max_new_tokens=16).token_ids
    assert len(greedy) > 3
    assert s.ask(QUESTION, max_new_tokens=16, sampling=Sampling(1e-5, 1.0, 3)).token_ids == greedy
    assert s.ask(QUESTION, max_new_tokens=16, sampling=Sampling(1.0, 1e-6, 3)).token_ids == greedy
    hot = [s.ask(QUESTION, max_new_tokens=16, sampling=Sampling(3.0, 1.0, seed)).token_ids for seed in (0, 0, 1, 2)]
    assert hot[0] == hot[1]  # same seed, same tokens
    assert len({tuple(h) for h in hot}) > 1  # other seeds, other answers at a high temperature


def test_sampled_answer_equals_a_step_by_step_reference(full_session, tiny_qwen):
    """Plain transformers (SDPA, the whole prompt re-run each step) with the same rule and seed picks the same tokens:
    the sampler gets the right logits and its generator advances once per token."""
    s = full_session
    sampling = Sampling(1.5, 0.9, 11)
    got = s.ask(QUESTION, max_new_tokens=12, sampling=sampling).token_ids
    ref = AutoModelForCausalLM.from_pretrained(tiny_qwen, dtype=torch.float32, attn_implementation="sdpa").eval()
    ids = s.pack.token_ids + prompt.encode(s.lm.tokenizer, prompt.question_suffix(s.lm.tokenizer, QUESTION))
    gen = torch.Generator().manual_seed(11)
    expected = []
    with torch.inference_mode():
        for _ in range(12):
            logits = ref(torch.tensor([ids + expected])).logits[0, -1].float()
            nxt = draw(logits, 1.5, 0.9, gen)
            if nxt in s.stop_ids:
                break
            expected.append(nxt)
    assert got == expected
