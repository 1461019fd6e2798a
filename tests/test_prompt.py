"""The prompt around the document: one instruction, one closed <document> tag, the system prompt from --system; and the
evidence: document passages only, with their share of the zoom."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from typer.testing import CliRunner

from conftest import CHATML, SAMPLE_MD
from sekv_core import models, prompt
from sekv_core.documents import load_document
from sekv_core.evidence import evidence_rows
from sekv_core.pack import read_pack
from sekv_core.session import Session
from sekv_cli.app import app

DOC = "The keeper lit the lamp at dusk.\n\nIt burned [red] until <dawn>."
QWEN = Path.home() / ".cache" / "sekv" / "models" / "qwen2.5-0.5b"


def tokenizers(tiny_qwen):
    from transformers import AutoTokenizer

    out = [AutoTokenizer.from_pretrained(tiny_qwen)]
    if (QWEN / "tokenizer_config.json").exists():  # the real template (Qwen2.5's: a default system prompt of its own)
        out.append(AutoTokenizer.from_pretrained(QWEN))
    return out


def test_prefix_has_one_instruction_and_one_closed_document_tag(tiny_qwen):
    for tok in tokenizers(tiny_qwen):
        text = prompt.document_prefix(tok, DOC)
        assert text.count("<document>") == 1 and text.count("</document>") == 1, text
        assert text.count(prompt.INSTRUCTION) == 1 and text.count(prompt.SYSTEM) == 1, text
        assert text.index(prompt.SYSTEM) < text.index(prompt.INSTRUCTION) < text.index("<document>")
        assert text.split("<document>\n", 1)[1].split("\n</document>", 1)[0] == DOC
        assert text == prompt.document_header(tok) + DOC + prompt.document_footer()
        assert prompt.document_header(tok).endswith("<document>\n") and text.endswith("</document>\n\n")


def test_prefix_and_suffix_are_the_template_rendered_whole(tiny_qwen):
    """Independent reference: the chat template rendered on the whole conversation, written out by hand."""
    for tok in tokenizers(tiny_qwen):
        for system in (None, "Answer like a pirate. [b]bold[/b]"):
            user = f"{prompt.INSTRUCTION}\n\n<document>\n{DOC}\n</document>\n\nQuestion: When?"
            msgs = [{"role": "system", "content": prompt.SYSTEM if system is None else system}, {"role": "user", "content": user}]
            whole = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            assert prompt.document_prefix(tok, DOC, system) + prompt.question_suffix(tok, "When?", system=system) == whole


def test_without_chat_template_the_prefix_is_still_closed(tiny_qwen):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_qwen)
    tok.chat_template = None
    text = prompt.document_prefix(tok, DOC)
    assert text.count("<document>") == 1 and text.count("</document>") == 1 and text.count(prompt.INSTRUCTION) == 1


def run(*args):
    r = CliRunner().invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def test_system_is_stored_in_the_pack_and_used_at_ask(tiny_qwen, tmp_path):
    """--system at ingest: the manifest records it, the pack's prefilled tokens are the template rendered with it, and
    ask's answer is what plain transformers generates over the whole prompt rendered with it."""
    system = "You answer in one word. Never mention [lamps]."
    pack = tmp_path / "s.sekv"
    code, _, err = run("ingest", SAMPLE_MD, "-o", pack, "--model", tiny_qwen, "--method", "full", "--system", system, "-q")
    assert code == 0, err
    p = read_pack(pack)
    assert p.manifest["system"] == system
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    text = lm.tokenizer.decode(p.token_ids)
    assert text.count(system) == 1 and prompt.SYSTEM not in text
    p.close()

    from test_full_method import reference_greedy

    q = "How many steps does the tower have?"
    msgs = [{"role": "system", "content": system},
            {"role": "user", "content": f"{prompt.INSTRUCTION}\n\n<document>\n{load_document(SAMPLE_MD).text}\n</document>\n\nQuestion: {q}"}]
    ids = prompt.encode(lm.tokenizer, lm.tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True))
    session = Session.open(pack, lm=lm)
    assert session.pack.token_ids == ids[: len(session.pack.token_ids)]
    answer = session.ask(q, max_new_tokens=12)
    assert answer.token_ids == reference_greedy(tiny_qwen, ids, 12, session.stop_ids)
    session.pack.close()

    code, out, err = run("inspect", pack)
    assert code == 0 and "system prompt" in out and "[lamps]" in out, err
    assert json.loads(run("inspect", pack, "--json")[1])["system"] == system

    # the default is unchanged, and --system-file reads the same text
    (tmp_path / "sys.txt").write_text(system + "\n")
    code, _, err = run("ingest", SAMPLE_MD, "-o", tmp_path / "f.sekv", "--model", tiny_qwen, "--method", "full", "--system-file", tmp_path / "sys.txt", "-q")
    assert code == 0, err
    assert read_pack(tmp_path / "f.sekv").manifest["system"] == system
    code, _, err = run("ingest", SAMPLE_MD, "-o", tmp_path / "d.sekv", "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0 and read_pack(tmp_path / "d.sekv").manifest["system"] == prompt.SYSTEM
    code, _, err = run("ingest", SAMPLE_MD, "-o", tmp_path / "x.sekv", "--model", tiny_qwen, "--system", "a", "--system-file", tmp_path / "sys.txt")
    assert code != 0 and "not both" in err and "Traceback" not in err


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(f"t{i}" for i in ids)


def test_evidence_lists_document_tokens_only_with_shares():
    """Tokens 0-9 are the prompt's head (page 0), 10-39 the document (pages 1, 2), 40-43 the footer.  A span inside
    the head is left out, one straddling it is cut to its document tokens, and the shares are of document reads."""
    pages = [[0, 0, 10], [1, 10, 25], [2, 25, 40], [0, 40, 44]]
    spans = [(0, 8), (8, 14), (14, 30), (30, 44)]
    session = SimpleNamespace(memory=SimpleNamespace(spans=lambda: spans), lm=SimpleNamespace(tokenizer=_Tok()),
                              pack=SimpleNamespace(token_ids=list(range(44)), manifest={"document": {"token_pages": pages}}))
    rows = evidence_rows(session, {0: 900, 1: 100, 2: 300, 3: 100}, span_order=[3, 2, 1, 0])
    assert [r["span"] for r in rows] == [2, 3, 1]  # 0 (head only) left out; equal counts in the ranking's order
    assert [r["tokens"] for r in rows] == [[14, 30], [30, 40], [10, 14]]
    assert [r["page"] for r in rows] == [1, 2, 1] and [r["rank"] for r in rows] == [1, 2, 3]
    assert [r["share"] for r in rows] == [0.6, 0.2, 0.2]
    assert rows[2]["text"] == "t10 t11 t12 t13"
    assert json.dumps(rows)  # what --json prints
