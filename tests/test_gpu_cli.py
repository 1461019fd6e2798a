"""benchmarks/gpu_cli.py and its probe: stage timers reach names bound by `from x import y`; the table's arithmetic."""

from __future__ import annotations

import sys
import types

from benchmarks import cli_probe, gpu_cli


def test_probe_wrap_times_calls_through_from_imports(monkeypatch):
    a = types.ModuleType("sekv_core._probe_test_a")
    a.f = lambda x: x + 1
    b = types.ModuleType("sekv_cli._probe_test_b")
    b.g = a.f  # as `from sekv_core._probe_test_a import f as g` binds it
    monkeypatch.setitem(sys.modules, a.__name__, a)
    monkeypatch.setitem(sys.modules, b.__name__, b)
    monkeypatch.setattr(cli_probe, "PHASES", {})
    seen = []
    cli_probe.wrap(a, "f", "stage", after=seen.append)
    assert a.f(1) == 2 and b.g(2) == 3
    assert cli_probe.PHASES["stage"]["n"] == 2 and cli_probe.PHASES["stage"]["s"] >= 0
    assert seen == [2, 3]
    cli_probe.wrap(a, "missing", "gone")  # code that moved: skipped and noted, not an error
    assert "gone" in cli_probe.RECORD["not_wrapped"]


def test_summary_row_splits_the_process_time():
    probe = {
        "wall_s": 20.0, "import_s": 3.0, "transformers_import_s": 1.25, "cuda_init_s": 0.5,
        "phases": {"session_open": {"s": 4.0, "n": 1}, "model_load": {"s": 2.5, "n": 1}, "pack_read": {"s": 0.5, "n": 1},
                   "check_model": {"s": 0.0, "n": 1}, "scout": {"s": 1.0, "n": 1}},
        "asks": [{"wall_s": 2.0, "scout_s": 1.0, "captures": 1, "answer": "7", "stats": {"ttft_s": 1.5, "tokens_per_s": 50.0}}],
    }
    rec = {"doc": "d", "tokens": 10, "method": "sekv", "ingest": {"rc": 0, "wall_s": 9.0}, "ask": {"rc": 0, "wall_s": 21.0, "probe": probe, "found": True}}
    row = gpu_cli.summarize(rec)
    assert row["other_s"] == 20.0 - 3.0 - 1.25 - 0.5 - 4.0 - 2.0
    assert row["transformers_import_s"] == 1.25 and row["cuda_init_s"] == 0.5
    assert row["open_s"] == 4.0 - 2.5 - 0.5 - 0.0
    assert row["ttft_s"] == 1.5 and row["scout_s"] == 1.0 and row["found"] is True
    text = gpu_cli.table([row])
    assert "other" in text.splitlines()[0] and "9.25" in text.splitlines()[1]


def test_summary_row_splits_each_questions_ttft():
    """The chat's questions: the scout, the factor blocks' wait, the first forward and the captures of each."""
    asks = [{"wall_s": 2.0, "scout_s": 1.0, "blocks_wait_s": 0.25, "capture_s": 0.5, "captures": 1, "answer": "7",
             "stats": {"ttft_s": 1.5, "scout_s": 0.9, "first_forward_s": 0.5, "tokens_per_s": 50.0, "gpu_peak_bytes": 3 << 30}},
            {"wall_s": 0.5, "scout_s": 0.1, "blocks_wait_s": 0.0, "capture_s": 0.0, "captures": 0, "answer": "8",
             "stats": {"ttft_s": 0.2, "scout_s": 0.1, "first_forward_s": 0.05, "tokens_per_s": 60.0, "gpu_peak_bytes": 2 << 30}}]
    probe = {"wall_s": 9.0, "phases": {}, "asks": asks}
    rec = {"doc": "d", "tokens": 10, "method": "sekv", "ingest": {"rc": 0, "wall_s": 9.0}, "ask": {"rc": None, "skipped": "--no-ask"},
           "chat": {"rc": 0, "wall_s": 9.5, "probe": probe, "found": [True, False]}}
    row = gpu_cli.summarize(rec)
    assert row["first_forward_s"] == 0.5 and row["ttft_s"] == 1.5
    assert row["chat_first_forward_s"] == [0.5, 0.05] and row["chat_wait_s"] == [0.25, 0.0] and row["chat_capture_s"] == [0.5, 0.0]
    assert "chat 1st fwd" in gpu_cli.table([row]).splitlines()[0]
    assert row["ask_gpu_peak_gib"] == 3.0 and row["chat_gpu_peak_gib"] == [3.0, 2.0]  # each question's own peak


def test_compact_table_ranks_operators_and_names_the_ranges():
    """A profiled stretch in a few lines: the operators by time (the largest first), the probe's ranges."""
    import torch
    import torch.profiler as tp

    with tp.profile(activities=[tp.ProfilerActivity.CPU]) as p:
        with cli_probe._label("sekv.scout"):
            x = torch.randn(128, 128)
            for _ in range(4):
                x = torch.mm(x, x)
            torch.zeros(3)
    text = cli_probe.compact_table(p, "question 1", rows=3)
    lines = text.splitlines()
    assert lines[0] == "== question 1" and "kernel launches 0" in lines[1]
    ops = lines[3:6]
    assert len(ops) == 3 and "aten::" in ops[0] and int(ops[0].split()[0]) >= 1
    assert any(ln.split()[0] == "4" and ln.endswith("aten::mm") for ln in ops), ops  # mm: 4 calls, among the costliest
    assert any(ln.endswith("sekv.scout") and ln.split()[0] == "1" for ln in lines[6:])


def test_typed_lines_wait_for_the_chat_to_be_ready(tmp_path):
    """--chat-pause: each line is written ``pause`` seconds after the chat is ready for it (its open line, then one
    answer's statistics per line before it), never before; the pause does not count the start-up."""
    import subprocess
    import sys
    import threading
    import time

    from benchmarks import gpu_cli

    err = tmp_path / "err"
    child = (
        "import sys, time\n"
        "time.sleep(0.6)\n"
        f"sys.stderr.write('x.txt (5 tokens). /help for\\ncommands, Ctrl-D to quit.\\n'); sys.stderr.flush()\n"
        "t0 = time.monotonic()\n"
        "for line in sys.stdin:\n"
        "    print(round(time.monotonic() - t0, 3), line.strip(), flush=True)\n"
        "    time.sleep(0.4)\n"
        f"    sys.stderr.write('{gpu_cli.CHAT_ANSWERED} 1 GiB\\n'); sys.stderr.flush()\n"
        "    t0 = time.monotonic()\n"
    )
    with open(err, "w") as fe:
        p = subprocess.Popen([sys.executable, "-c", child], stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=fe, text=True)
        th = threading.Thread(target=gpu_cli._type_lines, args=(p.stdin, "a\nb\nc\n", 0.3, err))
        th.start()
        out = p.stdout.read()
        p.wait(timeout=30)
        th.join(timeout=30)
    rows = [ln.split() for ln in out.splitlines()]
    assert [r[1] for r in rows] == ["a", "b", "c"]
    assert all(0.3 <= float(r[0]) < 0.3 + 2.0 for r in rows)  # from the ready line / the answer before, not the start
