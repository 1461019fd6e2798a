"""Time to first token: the rehearsal (Session.rehearse) changes no answer and leaves every first use of a kernel
behind it (CUDA); the scout's scoring is the same masses with fewer launches."""

from __future__ import annotations

import pytest
import torch

from conftest import SAMPLE_MD
from sekv_core import api as sekv
from sekv_core import session as session_mod
from sekv_core.session import Session

QUESTIONS = ["How many steps does the tower have?", "Who kept the log?"]


@pytest.fixture(scope="module")
def packs(lm, tmp_path_factory):
    d = tmp_path_factory.mktemp("ttft")
    return {m: sekv.ingest(SAMPLE_MD, d / f"{m}.sekv", model=lm, method=m).pack_path for m in ("sekv", "full")}


def _answers(s: Session) -> list[tuple]:
    out = []
    for q in QUESTIONS:
        a = s.ask(q, max_new_tokens=6)
        out.append((a.token_ids, a.stats.extra.get("span_order")))
    return out


def _open(pack, lm, batched: bool) -> Session:
    s = Session.open(pack, lm=lm)
    if batched:
        s.memory.batched = True  # the accelerators' step (sekv/gpu_step.py), on the CPU
    return s


@pytest.mark.parametrize("method,batched", [("sekv", False), ("sekv", True), ("full", False)])
def test_rehearsal_changes_no_answer(packs, lm, method, batched):
    """Questions asked after a rehearsal (run to its end on its thread, here on the CPU) give the tokens and the
    evidence order of the same questions in a session that had none; its wait is counted in the first answer's TTFT."""
    plain = _answers(_open(packs[method], lm, batched))
    s = _open(packs[method], lm, batched)
    assert s.rehearse(force=True)
    assert not s.rehearse(force=True)  # one at a time
    first = s.ask(QUESTIONS[0], max_new_tokens=6)
    assert s.rehearsal_error is None and s.rehearsal_s is not None
    waited = first.stats.extra.get("rehearsal_wait_s", 0.0)
    assert 0.0 <= waited <= first.stats.ttft_s
    rest = s.ask(QUESTIONS[1], max_new_tokens=6)
    assert "rehearsal_wait_s" not in rest.stats.extra
    assert [(first.token_ids, first.stats.extra.get("span_order")), (rest.token_ids, rest.stats.extra.get("span_order"))] == plain
    assert not s.rehearse(force=True)  # once per session


def test_rehearsal_only_on_cuda_and_its_error_is_left_to_the_question(packs, lm, monkeypatch):
    s = Session.open(packs["sekv"], lm=lm)
    assert not s.rehearse()  # the CPU: nothing to load
    assert s.settle() == 0.0
    monkeypatch.setattr(session_mod, "REHEARSAL_QUESTION", "")  # an empty question: SekvError inside the rehearsal
    assert s.rehearse(force=True)
    s.settle()
    assert s.rehearsal_error is not None and s.rehearsal_s is None
    assert s.ask(QUESTIONS[0], max_new_tokens=4).token_ids == Session.open(packs["sekv"], lm=lm).ask(QUESTIONS[0], max_new_tokens=4).token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_first_question_after_the_rehearsal_loads_no_kernel(packs, tiny_qwen):
    """On CUDA, after the rehearsal, the first real question (another length, another text) makes no lazy CUDA
    function load: every kernel of its way (scout pass, fills, first forward, decode steps) ran in the rehearsal."""
    from torch.profiler import ProfilerActivity, profile

    from sekv_core import models

    lm = models.load(str(tiny_qwen), device="cuda")
    for method in ("sekv", "full"):
        s = Session.open(packs[method], lm=lm)
        assert s.rehearse()
        s.settle()
        assert s.rehearsal_error is None, s.rehearsal_error
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            s.ask("Which lamp was lit last, and by whom, in the keeper's own words?", max_new_tokens=6)
        loads = [e for e in prof.events() if e.name == "Lazy Function Loading"]
        assert not loads, (method, len(loads))
