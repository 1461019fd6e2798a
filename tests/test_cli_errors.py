"""The one error rule (sekv_core/errors.py) as users meet it: one line, the documented exit code, nothing lost or
half-written; -v / SEKV_DEBUG=1 add the traceback."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from conftest import ROOT, SAMPLE_MD
from sekv_cli.app import app

runner = CliRunner()


def run(*args, env=None):
    r = runner.invoke(app, [str(a) for a in args], env=env)
    return r.exit_code, r.stdout, r.stderr


def one_line(code, err, want_code, *needles):
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == want_code, (code, err)
    assert len(lines) == 1 and lines[0].startswith("sekv: error: ") and "Traceback" not in err, err
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def doc(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("docs") / "log.md"
    d.write_text(SAMPLE_MD.read_text()[:2000])
    return d


def test_output_onto_a_non_pack_is_refused_before_any_work(doc, tiny_qwen, tmp_path):
    victim = tmp_path / "notes.txt"
    victim.write_text("precious")
    code, out, err = run("ingest", doc, "-o", victim, "--model", tiny_qwen, "-q")
    one_line(code, err, 2, "not a sekv pack; refusing")
    code, out, err = run("ingest", doc, "-o", doc, "--model", tiny_qwen, "-q", "--force")
    one_line(code, err, 2, "overwrite the input")
    assert victim.read_text() == "precious" and doc.read_text().startswith("#") or doc.stat().st_size > 0
    code, out, err = run("ingest", doc, "-o", victim, "--model", tiny_qwen, "-q", "--force", "--method", "full")
    assert code == 0, err
    assert victim.read_bytes()[8:40].startswith(b"{")


def test_output_dir_problems_are_one_line(doc, tiny_qwen, tmp_path):
    code, out, err = run("ingest", doc, "-o", tmp_path / "missing" / "x.sekv", "--model", tiny_qwen, "-q")
    one_line(code, err, 2, "does not exist")
    code, out, err = run("ingest", doc, "-o", "/proc/x.sekv", "--model", tiny_qwen, "-q")
    one_line(code, err, 2, "/proc/x.sekv")
    assert not list(tmp_path.glob(".*.tmp"))


def test_devices_and_choices(doc, tiny_qwen):
    code, out, err = run("ingest", doc, "--model", tiny_qwen, "--device", "bogus", "-q")
    one_line(code, err, 2, "--device 'bogus'", "cpu, cuda or cuda:N")
    import torch

    if not torch.cuda.is_available():
        code, out, err = run("ingest", doc, "--model", tiny_qwen, "--device", "cuda", "-q")
        one_line(code, err, 2, "no CUDA GPU", "--device cpu")
    # usage errors go through the entry point's one-line rule (main(); the test runner calls the app directly)
    proc = subprocess.run([sys.executable, "-c", "from sekv_cli.app import main; main()", "ingest", str(doc), "--budget", "0"],
                          capture_output=True, text=True, env=dict(os.environ, PYTHONPATH=str(ROOT)))
    one_line(proc.returncode, proc.stderr, 2, "--budget", "0 is not in (0, 1]")
    code, out, err = run("ingest", doc, "--model", tiny_qwen, "--method", "bogus", "-q")
    one_line(code, err, 2, "unknown cache method 'bogus'", "sekv", "full")


def test_ask_with_unknown_method_names_the_choices(doc, tiny_qwen, tmp_path):
    pack = tmp_path / "p.sekv"
    assert run("ingest", doc, "-o", pack, "--model", tiny_qwen, "-q", "--method", "full")[0] == 0
    code, out, err = run("ask", pack, "q", "--method", "bogus")
    one_line(code, err, 2, "unknown cache method 'bogus'", "available: full, sekv")
    assert "re-ingest with --method bogus" not in err


def test_internal_error_names_the_stage_and_v_shows_the_traceback(doc, tiny_qwen, tmp_path, monkeypatch):
    from sekv_core.methods.full import FullMethod

    def broken(self, prefill, params):
        raise ZeroDivisionError("a bug")

    monkeypatch.setattr(FullMethod, "compress", broken)
    monkeypatch.setenv("SEKV_DEBUG", "0")  # -v below sets it for the process; restored afterwards
    out_path = tmp_path / "x.sekv"
    code, out, err = run("ingest", doc, "-o", out_path, "--model", tiny_qwen, "-q", "--method", "full")
    one_line(code, err, 1, "internal error during compress: ZeroDivisionError (a bug)")
    assert not out_path.exists() and not list(tmp_path.glob(".*"))
    code, out, err = run("-v", "ingest", doc, "-o", out_path, "--model", tiny_qwen, "-q", "--method", "full")
    assert code == 1 and "Traceback" in err and "ZeroDivisionError: a bug" in err and err.strip().splitlines()[-1].startswith("sekv: error:")


def test_a_pack_never_installs_a_model(doc, tiny_qwen, tmp_path, monkeypatch):
    """A pack naming an embedded model that is not installed, or a hub id: one line saying what to run; no pip."""
    from sekv_core import models, pack as packmod

    monkeypatch.setattr(models, "_pip_install", lambda *a, **k: pytest.fail("a pack made sekv run pip"))
    monkeypatch.setenv("SEKV_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SEKV_ONLINE", "1")
    src = tmp_path / "p.sekv"
    assert run("ingest", doc, "-o", src, "--model", tiny_qwen, "-q", "--method", "full")[0] == 0
    p = packmod.read_pack(src)
    tensors = {k: p.get(k) for k in p.keys()}
    for model_id, needle in (("qwen2.5-1.5b", "run `sekv models install qwen2.5-1.5b`"), ("evil/model", "neither an installed"),
                             ("../" + "x" * 3, "neither an installed")):
        man = json.loads(json.dumps(p.manifest))
        man["model"]["id"] = model_id
        bad = tmp_path / "bad.sekv"
        packmod.write_pack(bad, man, tensors)
        code, out, err = run("ask", bad, "q")
        one_line(code, err, 2, needle)


def test_fifo_input_is_refused(tmp_path, tiny_qwen):
    fifo = tmp_path / "pipe.txt"
    os.mkfifo(fifo)
    code, out, err = run("ingest", fifo, "--model", tiny_qwen, "-q")
    one_line(code, err, 2, "not a regular file")


def test_stdin_needs_output_and_works(tmp_path, tiny_qwen):
    code, out, err = run("ingest", "-", "--model", tiny_qwen, "-q")
    one_line(code, err, 2, "needs -o")
    r = runner.invoke(app, ["ingest", "-", "-o", str(tmp_path / "s.sekv"), "--model", str(tiny_qwen), "-q", "--method", "full"],
                      input="The lighthouse has 112 steps.\n" * 20)
    assert r.exit_code == 0, r.stderr
    code, out, err = run("inspect", tmp_path / "s.sekv", "--json")
    assert json.loads(out)["document"]["name"] == "stdin"


def test_sigterm_during_ingest_leaves_nothing(tmp_path, tiny_qwen):
    """A real process: SIGTERM while it works -> exit 143, one line, no pack and no temporary file."""
    big = tmp_path / "big.md"
    big.write_text(SAMPLE_MD.read_text() * 2)
    out_path = tmp_path / "big.sekv"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.Popen([sys.executable, "-c", "from sekv_cli.app import main; main()", "ingest", str(big), "-o", str(out_path),
                             "--model", str(tiny_qwen), "--method", "sekv"], stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
    deadline = time.time() + 60
    while time.time() < deadline and not list(tmp_path.glob(".big.sekv.*.tmp")):  # the output is reserved before the prefill
        time.sleep(0.05)
    assert list(tmp_path.glob(".big.sekv.*.tmp")), "the output slot was never reserved"
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 143, err
    assert "Traceback" not in err and "sekv: terminated" in err
    assert not out_path.exists() and not list(tmp_path.glob(".big*"))


# SIGTERM sent to the process itself the moment the output slot is reserved, before the ingest's own try/discard
_TERM_AT_RESERVE = """
import os, signal, time
import sekv_core.ingest as ingest
real = ingest.prepare_output
def reserve_then_term(*a, **k):
    slot = real(*a, **k)
    os.kill(os.getpid(), signal.SIGTERM)
    time.sleep(30)
    return slot
ingest.prepare_output = reserve_then_term
from sekv_cli.app import main
main()
"""


def test_sigterm_right_after_the_slot_is_reserved_leaves_nothing(tmp_path, tiny_qwen):
    """The interrupt lands between the temporary file's making and the code that would remove it (the race the
    test above can hit): the entry point still removes it."""
    doc = tmp_path / "doc.md"
    doc.write_text(SAMPLE_MD.read_text()[:2000])
    out_path = tmp_path / "doc.sekv"
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    proc = subprocess.run([sys.executable, "-c", _TERM_AT_RESERVE, "ingest", str(doc), "-o", str(out_path), "--model", str(tiny_qwen),
                           "--method", "sekv"], capture_output=True, env=env, text=True, timeout=120)
    assert proc.returncode == 143, proc.stderr
    assert "Traceback" not in proc.stderr and "sekv: terminated" in proc.stderr
    assert not out_path.exists() and not list(tmp_path.glob(".doc*"))
