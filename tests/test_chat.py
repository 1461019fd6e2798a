"""`sekv chat`: terminal input (prompt_toolkit on a pipe: editing keys, history kept across sessions), plain piped
input, /sources, /budget, /save (never clobbering a file that is not a transcript), text never read as markup."""

from __future__ import annotations

import json

import pytest
from prompt_toolkit.input import create_pipe_input
from prompt_toolkit.output import DummyOutput
from typer.testing import CliRunner

from conftest import SAMPLE_MD
from sekv_cli import transcript
from sekv_cli.app import app
from sekv_cli.chat_input import LineReader

runner = CliRunner()
Q = "How many steps does the tower have?"


def chat(pack, script: str, *args):
    r = runner.invoke(app, ["chat", str(pack), "-n", "4", *args], input=script)
    assert r.exit_code == 0, r.stderr
    return r.stdout, r.stderr


@pytest.fixture(scope="module")
def packs(tiny_qwen, tmp_path_factory):
    d = tmp_path_factory.mktemp("chat")
    out = {}
    for method in ("sekv", "full"):
        p = d / f"{method}.sekv"
        r = runner.invoke(app, ["ingest", str(SAMPLE_MD), "-o", str(p), "--model", str(tiny_qwen), "--method", method, "-q"])
        assert r.exit_code == 0, r.stderr
        out[method] = p
    return out


def test_terminal_reader_edits_and_keeps_history(tmp_path):
    hist = tmp_path / "home" / "chat_history"
    with create_pipe_input() as inp:
        r = LineReader(True, hist, pt_input=inp, pt_output=DummyOutput())
        inp.send_text("first question\r")
        assert r.read() == "first question"
        inp.send_text("two\x1b\rlines\r")  # Esc+Enter: a new line inside the question
        assert r.read() == "two\nlines"
        inp.send_text("go on\\\rhere\r")  # a trailing backslash continues on the next line
        assert r.read() == "go on\nhere"
        inp.send_text("ab\x1b[Dx\r")  # the left arrow moves the cursor: the x goes before the b
        assert r.read() == "axb"
    assert "first question" in hist.read_text()
    with create_pipe_input() as inp:  # a new session finds the earlier questions with the up arrow
        r = LineReader(True, hist, pt_input=inp, pt_output=DummyOutput())
        inp.send_text("\x1b[A\x1b[A\r")
        assert r.read() == "here"  # newest first: axb, here


def test_unwritable_history_still_reads(tmp_path):
    blocker = tmp_path / "file"
    blocker.write_text("x")
    with create_pipe_input() as inp:
        r = LineReader(True, blocker / "chat_history", pt_input=inp, pt_output=DummyOutput())
        assert "history not kept" in r.note
        inp.send_text("still works\r")
        assert r.read() == "still works"


def test_sources_budget_and_multiline_question(packs, tmp_path):
    saved = tmp_path / "t.md"
    out, err = chat(packs["sekv"], f"/sources\nHow many\\\nsteps?\n/sources\n/budget 20%\n/budget\n/stats\n{Q}\n/stats\n/save {saved}\n/quit\n", "-q")
    assert "no answer yet" in err
    assert "page 1" in err and "zoomed" in err  # /sources after an answer
    assert "budget 20% from the next question on" in err
    stats = err.split("budget 20% from the next question on")[1]
    assert stats.index("sekv, budget 10%") < stats.index("sekv, budget 20%")  # /stats: the answer before, then the one after
    text = saved.read_text()
    assert text.startswith(transcript.MARKER) and "> How many\n> steps?" in text and f"> {Q}" in text
    assert "budget 20%" in text and "budget 10%" in text


def test_budget_errors_do_not_end_the_chat(packs):
    _, err = chat(packs["sekv"], "/budget lots\n/budget 1.5\n/quit\n")
    assert "/budget takes a fraction" in err and "in (0, 1]" in err
    out, err = chat(packs["full"], f"/budget 0.2\n/sources\n{Q}\n/sources\n/quit\n")
    assert "cannot be changed at ask time" in err and "no zoomed passages" in err and out.strip()


def test_save_never_clobbers_silently(packs, tmp_path):
    mine = tmp_path / "notes.md"
    mine.write_text("my own notes\n")
    _, err = chat(packs["full"], f"/save {mine}\n{Q}\n/save {mine}\nn\n/quit\n")
    assert "nothing to save yet" in err and "not saved" in err
    assert mine.read_text() == "my own notes\n"
    _, err = chat(packs["full"], f"{Q}\n/save {mine}\ny\n/quit\n")
    assert transcript.is_transcript(mine)
    _, err = chat(packs["full"], f"{Q}\n{Q}\n/save {mine}\n/quit\n")  # our own transcript: replaced without asking
    assert "saved 2 answer(s)" in err and "overwrite" not in err
    assert mine.read_text().count("## Question") == 2
    _, err = chat(packs["full"], f"{Q}\n/save {tmp_path / 'no' / 'dir.md'}\n/save {tmp_path}\n/quit\n")
    assert err.count("error: cannot write") == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.md"]  # no temporary files left behind


def test_text_is_never_markup(packs, tmp_path):
    _, err = chat(packs["full"], "/[bold]x[/bold]\n/quit\n")
    assert "'/[bold]x[/bold]'" in err


def test_chat_sampling_and_quiet(packs):
    out1, err = chat(packs["full"], f"{Q}\n", "--temperature", "2", "--seed", "3", "-q")
    out2, _ = chat(packs["full"], f"{Q}\n", "--temperature", "2", "--seed", "3", "-q")
    assert out1 == out2 and out1.strip() and err.strip() == ""
    r = runner.invoke(app, ["ask", str(packs["full"]), Q, "-n", "4", "--json", "--temperature", "2", "--seed", "3"])
    assert json.loads(r.stdout)["answer"] == out1.strip()  # chat and ask sample the same answer for a seed
