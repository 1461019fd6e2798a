"""The Python API (`import sekv`), used as a user would: answers against plain transformers (full method), ask_many
against separate asks, streams against whole answers, the CLI's --json against Result.to_dict."""

from __future__ import annotations

import json

import pytest

import sekv
from sekv_core import prompt

from conftest import SAMPLE_MD
from test_full_method import reference_greedy

Q1 = "How many steps does the tower have?"
Q2 = "Who keeps the light?"


@pytest.fixture(scope="module")
def full_pack(lm, tmp_path_factory):
    info = sekv.ingest(SAMPLE_MD, tmp_path_factory.mktemp("api") / "log.sekv", method="full", model=lm)
    assert isinstance(info, sekv.IngestResult) and info.pack_path.is_file() and info.method == "full"
    return sekv.open(info.pack_path, model=lm)


@pytest.fixture(scope="module")
def sekv_pack_path(lm, tmp_path_factory):
    return sekv.ingest(SAMPLE_MD, tmp_path_factory.mktemp("api") / "log-sekv.sekv", model=lm).pack_path


def test_ask_equals_plain_transformers(full_pack, tiny_qwen, lm):
    r = full_pack.ask(Q1, max_new_tokens=16)
    ids = full_pack.session.pack.token_ids + prompt.encode(lm.tokenizer, prompt.question_suffix(lm.tokenizer, Q1))
    expected = reference_greedy(tiny_qwen, ids, 16, full_pack.session.stop_ids)
    assert len(expected) > 3
    assert list(r.tokens.ids) == expected
    assert r.answer == lm.tokenizer.decode(expected, skip_special_tokens=True).strip()
    assert r.question == Q1 and r.tokens.generated == len(expected) and r.tokens.document == full_pack.n_tokens
    assert r.memory.resident_fraction == 1.0 and r.memory.full_kv_bytes > 0  # full keeps everything
    assert r.evidence == [] and r.zoom is None and r.sampling.greedy
    assert r.timings.ttft_s > 0 and r.method == full_pack.method == "full"
    assert "lighthouse_keepers_log.md" in repr(full_pack)


def test_ask_many_equals_separate_asks(full_pack):
    many = full_pack.ask_many([Q1, Q2], max_new_tokens=10)
    assert [r.question for r in many] == [Q1, Q2]
    assert [r.tokens.ids for r in many] == [full_pack.ask(q, max_new_tokens=10).tokens.ids for q in (Q1, Q2)]
    # sampled with a seed: each answer is the one that question gets alone, wherever it stands in the list
    hot = dict(max_new_tokens=10, temperature=2.0, seed=5)
    assert [r.tokens.ids for r in full_pack.ask_many([Q2, Q1], **hot)] == [full_pack.ask(q, **hot).tokens.ids for q in (Q2, Q1)]
    with pytest.raises(sekv.SekvError):
        full_pack.ask_many([Q1, "  "])


def test_stream_pieces_make_the_answer(full_pack):
    whole = full_pack.ask(Q1, max_new_tokens=16)
    stream = full_pack.stream(Q1, max_new_tokens=16)
    with pytest.raises(sekv.SekvError):
        stream.result  # not finished
    pieces = list(stream)
    assert len(pieces) > 1 and "".join(pieces).strip() == whole.answer
    assert stream.result.tokens.ids == whole.tokens.ids
    # leaving a stream early stops it and leaves the pack as it was
    for _piece in full_pack.stream(Q2, max_new_tokens=16):
        break
    assert full_pack.ask(Q1, max_new_tokens=16).tokens.ids == whole.tokens.ids
    with pytest.raises(sekv.SekvError, match="empty"):
        list(full_pack.stream("   "))


def test_sekv_pack_budget_evidence_and_cli_json(sekv_pack_path, lm, tiny_qwen):
    from typer.testing import CliRunner

    from sekv_cli.app import app

    pack = sekv.open(sekv_pack_path, model=lm)
    assert pack.method == "sekv" and pack.budget == 0.1
    r = pack.ask(Q1, max_new_tokens=6)
    assert r.evidence and all(isinstance(e, sekv.Evidence) and e.text and e.zoom_count > 0 for e in r.evidence)
    assert r.zoom["zoom_spans_total"] > 0
    # with_budget rebuilds the memory only; it answers as a pack opened at that budget does
    wider = pack.with_budget(0.3)
    assert wider.budget == 0.3 and pack.budget == 0.1
    assert wider.ask(Q1, max_new_tokens=6).tokens.ids == sekv.open(sekv_pack_path, model=lm, budget=0.3).ask(Q1, max_new_tokens=6).tokens.ids
    # the CLI prints what Result.to_dict gives (both load the model themselves, at this machine's default dtype)
    res = CliRunner().invoke(app, ["ask", str(sekv_pack_path), Q1, "-n", "6", "--json"])
    assert res.exit_code == 0, res.stderr
    cli = json.loads(res.stdout)
    api = sekv.open(sekv_pack_path, device="cpu").ask(Q1, max_new_tokens=6).to_dict()
    for k in ("answer", "question", "method", "budget", "tokens", "evidence", "pack"):
        assert cli[k] == api[k], k
    assert set(cli) == set(api) and set(cli["zoom"]) == set(api["zoom"])


def test_bad_input_raises_sekv_error(tmp_path, lm):
    with pytest.raises(sekv.SekvError, match="no such|not found|does not exist"):
        sekv.open(tmp_path / "missing.sekv", model=lm)
    bad = tmp_path / "x.docx"
    bad.write_bytes(b"PK\x03\x04 not a document sekv reads")
    with pytest.raises(sekv.SekvError):
        sekv.ingest(bad, model="no-such-model")  # the document is checked before any model is loaded
    with pytest.raises(sekv.SekvError):
        sekv.ingest(SAMPLE_MD, tmp_path / "x.sekv", model=lm, budget=0.1, method="no-such-method")


def test_package_surface():
    import sekv_core.api as api

    assert sekv.open is api.open and sekv.ingest is api.ingest and sekv.Pack is api.Pack
    assert sekv.__version__ and set(sekv.__all__) >= {"ingest", "open", "Pack", "Result"}


@pytest.mark.integration
def test_smollm2_api_equals_session(smollm2, tmp_path):
    """The real model through the API: ask_many and a stream give the Session's greedy tokens and text."""
    from sekv_core.session import Session

    doc = tmp_path / "log.md"
    doc.write_text(SAMPLE_MD.read_text()[:2500])  # the opening (the tower's 117 steps): a short prefill keeps this cheap
    path = sekv.ingest(doc, model=smollm2).pack_path
    pack = sekv.open(path, model=smollm2)
    q = "How many steps does the Skarvholm tower have from the door to the lantern room?"
    ref = Session.open(path, lm=smollm2).ask(q, max_new_tokens=16)
    (r,) = pack.ask_many([q], max_new_tokens=16)
    assert list(r.tokens.ids) == ref.token_ids and r.answer == ref.text and r.evidence
    s = pack.stream(q, max_new_tokens=16)
    assert "".join(s).strip() == ref.text and s.result.tokens.ids == r.tokens.ids
