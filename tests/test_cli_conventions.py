"""CLI conventions: --version, -h, shell completion, -q/-v on every command, several questions per `ask` (JSON Lines),
--questions FILE, and sampling options (reproducible with a seed)."""

from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from conftest import SAMPLE_MD
from sekv_cli.app import app
from sekv_core import __version__

runner = CliRunner()
Q1, Q2, Q3 = "How many steps?", "Who keeps the light?", "What is the dog called?"


def run(*args, input=None, **kw):
    r = runner.invoke(app, [str(a) for a in args], input=input, **kw)
    return r.exit_code, r.stdout, r.stderr


def one_line_error(code, stderr, needle):
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert code != 0 and len(lines) == 1 and lines[0].startswith("sekv: error: ") and needle in lines[0], stderr


@pytest.fixture(scope="module")
def pack(tiny_qwen, tmp_path_factory):
    p = tmp_path_factory.mktemp("conv") / "log.sekv"
    code, out, err = run("ingest", SAMPLE_MD, "-o", p, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    return p


def test_version_and_short_help():
    code, out, _ = run("--version")
    assert code == 0 and out.strip() == f"sekv {__version__}"
    for args in (["-h"], ["ask", "-h"], ["chat", "-h"], ["models", "list", "-h"], ["bench", "-h"]):
        code, out, _ = run(*args)
        assert code == 0 and "Usage:" in out and "--help" in out, args


def test_shell_completion_is_offered_and_completes(monkeypatch):
    # typer detects the shell from the parent processes (shellingham); under `timeout`, `flock` or a bare CI runner
    # there may be none, so the test names it
    import typer.completion
    monkeypatch.setattr(typer.completion, "_get_shell_name", lambda: "bash")
    code, out, _ = run("-h")
    assert "--install-completion" in out and "--show-completion" in out
    code, out, _ = run("--show-completion", "bash", prog_name="sekv")
    assert code == 0 and "_SEKV_COMPLETE" in out and "complete" in out
    env = {"_SEKV_COMPLETE": "complete_bash", "COMP_WORDS": "sekv ask x --te", "COMP_CWORD": "3"}
    code, out, _ = run(env=env, prog_name="sekv")
    assert out.split() == ["--temperature"]
    code, out, _ = run(env=env | {"COMP_WORDS": "sekv ch", "COMP_CWORD": "1"}, prog_name="sekv")
    assert out.split() == ["chat"]


@pytest.mark.parametrize("cmd", [["ingest"], ["ask"], ["chat"], ["inspect"], ["models", "list"], ["models", "install"], ["bench"], ["train"]])
def test_every_command_has_quiet_and_verbose(cmd):
    code, out, _ = run(*cmd, "-h")
    assert code == 0
    for flag in ("-q", "--quiet", "-v", "--verbose"):
        assert flag in out, (cmd, flag)


def test_quiet_and_verbose(pack):
    code, out, err = run("ask", pack, Q1, "-n", "3", "-q")
    assert code == 0 and out.strip() and err.strip() == ""  # only the answer
    code, out, err = run("ask", pack, Q1, "-n", "3", "-v")
    assert code == 0 and "opened in" in err and "time to first token" in err
    assert "SEKV_DEBUG" not in os.environ  # -v holds only while its command runs
    code, out, err = run("models", "list", "-q")
    assert code == 0 and "qwen2.5-0.5b" in out
    code, out, err = run("inspect", pack, "-q", "-v")
    assert code == 0 and "tokens" in out


def test_several_questions_print_json_lines_equal_to_single_runs(pack):
    code, out, err = run("ask", pack, Q1, Q2, "-n", "6", "--json")
    assert code == 0, err
    lines = out.splitlines()
    assert len(lines) == 2 and out.endswith("\n")
    objs = [json.loads(ln) for ln in lines]
    assert [o["question"] for o in objs] == [Q1, Q2]
    for o, q in zip(objs, (Q1, Q2)):
        code, single, _ = run("ask", pack, q, "-n", "6", "--json")
        assert code == 0 and single.count("\n") == 1  # one question: exactly one object, as before
        ref = json.loads(single)
        assert (o["answer"], o["tokens"]) == (ref["answer"], ref["tokens"])
    assert objs[0]["timings"]["load_s"] == objs[1]["timings"]["load_s"]  # one load for both


def test_questions_file_and_stdin(pack, tmp_path):
    qf = tmp_path / "q.txt"
    qf.write_text(f"{Q2}\n\n   \n{Q3}\n")
    code, out, err = run("ask", pack, Q1, "--questions", qf, "-n", "4", "--json")
    assert code == 0, err
    assert [json.loads(ln)["question"] for ln in out.splitlines()] == [Q1, Q2, Q3]
    code, out, err = run("ask", pack, "--questions", "-", "-n", "4", "--json", input=f"{Q3}\n{Q1}\n")
    assert code == 0, err
    assert [json.loads(ln)["question"] for ln in out.splitlines()] == [Q3, Q1]
    code, out, err = run("ask", pack, Q1, Q2, "-n", "3")  # plain: each answer under its question
    assert code == 0 and f"Q: {Q1}" in out and f"Q: {Q2}" in out and out.index(f"Q: {Q1}") < out.index(f"Q: {Q2}")


def test_bad_questions_input(pack, tmp_path):
    one_line_error(*run("ask", pack)[::2], "no question")
    one_line_error(*run("ask", pack, "--questions", tmp_path / "none.txt")[::2], "no such questions file")
    one_line_error(*run("ask", pack, "--questions", tmp_path)[::2], "is a directory")
    bad = tmp_path / "bin.txt"
    bad.write_bytes(b"\xff\xfe\x00bad")
    one_line_error(*run("ask", pack, "--questions", bad)[::2], "not UTF-8")
    one_line_error(*run("ask", pack, Q1, "")[::2], "empty")
    import os

    os.mkfifo(tmp_path / "fifo.txt")
    one_line_error(*run("ask", pack, "--questions", tmp_path / "fifo.txt")[::2], "not a regular file")  # would block
    (tmp_path / "zero.txt").symlink_to("/dev/zero")
    one_line_error(*run("ask", pack, "--questions", tmp_path / "zero.txt")[::2], "not a regular file")  # would never end


def test_questions_file_is_read_with_a_limit(pack, tmp_path, monkeypatch):
    from sekv_cli import cmd_ask

    monkeypatch.setattr(cmd_ask, "MAX_QUESTIONS_CHARS", 1 << 20)
    big = tmp_path / "big.txt"
    big.write_text("What?\n" * 200_000)
    one_line_error(*run("ask", pack, "--questions", big)[::2], "more than 1 Mi characters")


def test_sampling_options(pack):
    def answer(*extra):
        code, out, err = run("ask", pack, Q1, "-n", "12", "--json", *extra)
        assert code == 0, err
        return json.loads(out)

    greedy = answer()
    assert "sampling" not in greedy
    a, b = answer("--temperature", "2", "--seed", "4"), answer("--temperature", "2", "--seed", "4")
    assert a["answer"] == b["answer"] and a["sampling"] == {"temperature": 2.0, "top_p": 1.0, "seed": 4}
    assert answer("--temperature", "1e-5", "--seed", "1")["answer"] == greedy["answer"]
    assert answer("--temperature", "1", "--top-p", "1e-6")["answer"] == greedy["answer"]
    drawn = answer("--temperature", "2")["sampling"]["seed"]  # no seed: one is drawn and reported
    assert isinstance(drawn, int)
    code, _, err = run("ask", pack, Q1, "-n", "2", "--temperature", "0.5", "--seed", "9")
    assert code == 0 and "seed 9" in err
    one_line_error(*run("ask", pack, Q1, "--top-p", "0")[::2], "--top-p")
    one_line_error(*run("ask", pack, Q1, "--temperature", "-1")[::2], "--temperature")
