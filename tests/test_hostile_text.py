"""Text from documents, packs, the user and the model is printed as text: Rich markup is not interpreted and control
characters (escape sequences, bidi overrides) come out escaped, through every command that prints."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from sekv_cli.app import app

runner = CliRunner()
ESC = "\x1b"
HOSTILE = "Keeper's note [note] on [a-z] stairs [/mnt/x] and [bold red]paint[/] " + ESC + "[2J " + ESC + "]8;;http://evil.example" + ESC + "\\link" + ESC + "]8;;" + ESC + "\\ \x9b31m \u202eevil\u202c end."
NAME = "log [red]" + ESC + "[5m[x].md"


def run(*args, input=None):
    r = runner.invoke(app, [str(a) for a in args], input=input)
    return r.exit_code, r.stdout, r.stderr


def no_raw_controls(*texts: str) -> None:
    for t in texts:
        assert ESC not in t and "\x9b" not in t and "\u202e" not in t, repr(t[:400])
        assert "Traceback" not in t and "MarkupError" not in t


@pytest.fixture(scope="module")
def hostile_pack(tiny_qwen, tmp_path_factory):
    d = tmp_path_factory.mktemp("hostile")
    doc = d / NAME
    doc.write_text(("The lighthouse has 112 steps. " + HOSTILE + "\n") * 6)
    pack = d / "h.sekv"
    code, out, err = run("ingest", doc, "-o", pack, "--model", tiny_qwen, "--budget", "0.5")
    assert code == 0, err
    no_raw_controls(out, err)
    return pack


def test_ask_show_evidence_prints_document_text_as_text(hostile_pack):
    code, out, err = run("ask", hostile_pack, "What about [note] and the " + ESC + "[2J stairs?", "-n", "3", "--show-evidence")
    assert code == 0, err
    no_raw_controls(out, err)
    assert "#1 page 1 (" in err
    if "Keeper's note" in err:  # a passage of the hostile line was shown: its brackets survive as text
        assert "Keeper's note [note]" in err
    # the same passages through --json: the document's text, brackets included (load_document drops control
    # characters from the text itself; a crafted pack can still carry them, and then they print escaped)
    code, out, err = run("ask", hostile_pack, "What about [note] and the " + ESC + "[2J stairs?", "-n", "3", "--json")
    texts = " ".join(e["text"] for e in json.loads(out)["evidence"])
    assert "[note]" in texts and "[/mnt/x]" in texts


def test_ask_json_escapes_everything(hostile_pack):
    code, out, err = run("ask", hostile_pack, "[bold]q" + ESC + "[31m?", "-n", "3", "--json")
    assert code == 0, err
    no_raw_controls(out, err)
    payload = json.loads(out)
    assert payload["question"] == "[bold]q" + ESC + "[31m?"  # JSON carries the text exactly, escaped as \u001b
    assert all("text" in e for e in payload.get("evidence", []))


def test_inspect_and_chat_show_the_document_name_as_text(hostile_pack):
    code, out, err = run("inspect", hostile_pack)
    assert code == 0, err
    no_raw_controls(out, err)
    assert "log [red]\\x1b[5m[x].md" in out
    code, out, err = run("inspect", hostile_pack, "--json")
    assert json.loads(out)["document"]["name"] == NAME
    code, out, err = run("chat", hostile_pack, "-n", "2", input="/x [/]\n/y " + ESC + "[2J\nwhy [/mnt/x]?\n/quit\n")
    assert code == 0, err
    no_raw_controls(out, err)
    assert "log [red]\\x1b[5m[x].md" in err and "unknown command '/x [/]'" in err and "\\x1b[2J" in err


def test_model_output_is_escaped(monkeypatch, capsys):
    """A document can make the model copy an escape sequence: the streamed answer shows it escaped."""
    from sekv_cli import cmd_ask

    class FakeStats:
        extra = {}

        def as_dict(self):
            return {"ttft_s": 0.1, "question_tokens": 1, "tokens_per_s": 1.0, "generated_tokens": 1, "stop_reason": "eos",
                    "resident_kv_bytes_peak": 1, "full_kv_bytes": 1, "extra": {}}

    class FakeAnswer:
        text, stats = "x", FakeStats()

    class FakeSession:
        method, params = "full", {}

        def ask(self, question, history=(), max_new_tokens=1, on_text=None, on_step=None, sampling=None):
            on_text("[red]boom[/] " + ESC + "[2J" + "\x07 \u202e")
            return FakeAnswer()

    cmd_ask.run_question(FakeSession(), "q", 4, False, False)
    cap = capsys.readouterr()
    no_raw_controls(cap.out, cap.err)
    assert "[red]boom[/] \\x1b[2J\\x07 \\u202e" in cap.out


def test_safe_keeps_text_and_escapes_controls():
    from sekv_cli.display import safe, safe_line

    assert safe("a\tb\nc [x] ü 東") == "a\tb\nc [x] ü 東"
    assert safe("\x1b[1m\x00\x7f\x85\u2066") == "\\x1b[1m\\x00\\x7f\\x85\\u2066"
    assert safe_line("a\nb\rc") == "a\\x0ab\\x0dc"
