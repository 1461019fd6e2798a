"""The command line through Typer's runner: happy paths and every bad input (one line, non-zero exit)."""

from __future__ import annotations

import json

import pytest
from pypdf import PdfWriter
from typer.testing import CliRunner

from conftest import SAMPLE_MD, SAMPLE_PDF
from sekv_cli.app import app

runner = CliRunner()


def run(*args):
    r = runner.invoke(app, [str(a) for a in args])
    return r.exit_code, r.stdout, r.stderr


def assert_one_line_error(code, stderr, *needles):
    assert code != 0
    lines = [ln for ln in stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1, stderr
    assert lines[0].startswith("sekv: error: ")
    assert "Traceback" not in stderr
    for n in needles:
        assert n in lines[0], lines[0]


@pytest.fixture(scope="module")
def tiny_pack(tiny_qwen, tmp_path_factory):
    pack = tmp_path_factory.mktemp("packs") / "log.sekv"
    code, out, err = run("ingest", SAMPLE_MD, "-o", pack, "--model", tiny_qwen, "--method", "full", "-q")
    assert code == 0, err
    assert out.strip() == str(pack)
    return pack


def test_ask_json_is_exactly_one_object(tiny_pack, tiny_qwen):
    code, out, err = run("ask", tiny_pack, "How many steps?", "--json", "-n", "8")
    assert code == 0, err
    obj = json.loads(out)  # the whole stdout is one JSON document
    assert out.count("\n") == 1
    assert obj["method"] == "full" and obj["tokens"]["generated"] <= 8
    assert obj["memory"]["resident_kv_bytes_peak"] == obj["memory"]["full_kv_bytes"] > 0
    for k in ("ttft_s", "tokens_per_s"):
        assert k in obj["timings"]


def test_ask_plain_streams_answer_and_stats(tiny_pack):
    code, out, err = run("ask", tiny_pack, "How many steps?", "-n", "5")
    assert code == 0, err
    assert out.strip()  # the answer
    assert "time to first token" in err and "resident KV" in err


def test_inspect(tiny_pack):
    code, out, err = run("inspect", tiny_pack, "--json")
    assert code == 0, err
    m = json.loads(out)
    assert m["method"] == "full" and m["n_tokens"] > 100 and m["document"]["name"] == SAMPLE_MD.name
    code, out, _ = run("inspect", tiny_pack)
    assert code == 0 and "tokens" in out


def test_chat_repl(tiny_pack):
    r = runner.invoke(app, ["chat", str(tiny_pack), "-n", "4"], input="/help\nHow many steps?\n/stats\n/bogus\n/quit\n")
    assert r.exit_code == 0, r.stderr
    assert "/history" in r.stderr and "time to first token" in r.stderr and "unknown command" in r.stderr
    r = runner.invoke(app, ["chat", str(tiny_pack)], input="")  # Ctrl-D at the prompt
    assert r.exit_code == 0


def test_default_method_is_sekv_with_zoom_stats_and_evidence(tiny_qwen, tmp_path):
    """No --method: a sekv pack (the default); ask --json reports the zoom and the zoomed passages with their text
    and page, --show-evidence prints them, inspect shows the span statistics."""
    pack = tmp_path / "log.sekv"
    code, out, err = run("ingest", SAMPLE_MD, "-o", pack, "--model", tiny_qwen, "-q")
    assert code == 0, err
    code, out, err = run("ask", pack, "How many steps does the tower have?", "--json", "-n", "6")
    assert code == 0, err
    obj = json.loads(out)
    assert obj["method"] == "sekv" and obj["budget"] == 0.1
    z = obj["zoom"]
    assert z["zoom_spans_total"] > 0 and z["budget_bytes"] > 0 and len(z["zoom_rate_per_layer"]) == 2
    assert obj["memory"]["resident_kv_bytes_peak"] - z["appended_bytes"] <= z["budget_bytes"]
    ev = obj["evidence"]
    assert ev and all(r["text"] and r["page"] == 1 and r["zoom_count"] > 0 for r in ev)  # document passages only
    counts = [r["zoom_count"] for r in ev]
    assert counts == sorted(counts, reverse=True) and [r["rank"] for r in ev] == list(range(1, len(ev) + 1))
    assert sum(r["share"] for r in ev) <= 1.001 and all(abs(r["share"] - c / counts[0] * ev[0]["share"]) < 1e-3 for r, c in zip(ev, counts))
    code, out, err = run("ask", pack, "How many steps does the tower have?", "-n", "4", "--show-evidence")
    assert code == 0, err
    assert "#1 page 1 (" in err and "% of the zoom)" in err
    code, out, err = run("inspect", pack, "--json")
    assert code == 0, err
    m = json.loads(out)
    st = m["method_stats"]
    assert m["method"] == "sekv" and st["spans"] > 0 and st["zoom_blocks"] >= st["spans"] and st["zoom_unit"] == 16
    assert 0 < st["lexical_terms"] <= m["n_tokens"]


def test_pack_made_with_other_model_is_refused(tiny_pack, tiny_llama):
    code, _, err = run("ask", tiny_pack, "q", "--model", tiny_llama)
    assert_one_line_error(code, err, "made with model")


def test_damaged_pack(tiny_pack, tmp_path):
    bad = tmp_path / "bad.sekv"
    raw = bytearray(tiny_pack.read_bytes())
    raw[len(raw) // 2] ^= 0x55
    bad.write_bytes(bytes(raw))
    assert_one_line_error(*run("ask", bad, "q")[::2], "checksum")
    assert_one_line_error(*run("inspect", tmp_path / "none.sekv")[::2], "no such pack")


def test_budget_is_refused_for_full(tiny_pack):
    assert_one_line_error(*run("ask", tiny_pack, "q", "--budget", "0.1")[::2], "budget")


def _bad_documents(tmp_path):
    docs = {}
    docs["missing"] = (tmp_path / "nope.pdf", "not found")
    enc = PdfWriter(clone_from=str(SAMPLE_PDF))
    enc.encrypt("secret")
    p = tmp_path / "enc.pdf"
    enc.write(p)
    docs["encrypted"] = (p, "encrypted")
    blank = PdfWriter()
    blank.add_blank_page(200, 200)
    blank.add_blank_page(200, 200)
    p = tmp_path / "scan.pdf"
    blank.write(p)
    docs["scanned"] = (p, "OCR")
    p = tmp_path / "bin.txt"
    p.write_bytes(bytes(range(256)) * 4)
    docs["binary"] = (p, "binary")
    p = tmp_path / "x.docx"
    p.write_bytes(b"PK\x03\x04")
    docs["unknown"] = (p, ".pdf")
    p = tmp_path / "empty.md"
    p.write_text("  \n\n ")
    docs["empty"] = (p, "empty")
    return docs


@pytest.mark.parametrize("case", ["missing", "encrypted", "scanned", "binary", "unknown", "empty"])
def test_bad_documents(case, tmp_path, tiny_qwen):
    path, needle = _bad_documents(tmp_path)[case]
    code, out, err = run("ingest", path, "--model", tiny_qwen, "--method", "full", "-q")
    assert_one_line_error(code, err, needle)
    assert not list(tmp_path.glob("*.sekv"))


def test_document_longer_than_context(tiny_short, tmp_path):
    code, _, err = run("ingest", SAMPLE_MD, "-o", tmp_path / "x.sekv", "--model", tiny_short, "--method", "full", "-q")
    assert_one_line_error(code, err, "window of 256", "--method sekv")  # past 4x the window: YaRN cannot carry it (rope_scaling.py)
    assert not (tmp_path / "x.sekv").exists()


def test_unknown_model_and_method(tmp_path):
    assert_one_line_error(*run("ingest", SAMPLE_MD, "--model", "no-such-model")[::2], "unknown model")
    assert_one_line_error(*run("ingest", SAMPLE_MD, "--method", "nonsense")[::2], "unknown cache method")
    assert_one_line_error(*run("models", "install", "nope")[::2], "unknown model")


def test_models_list():
    code, out, _ = run("models", "list")
    assert code == 0 and "qwen2.5-0.5b" in out and "smollm2-135m" in out
