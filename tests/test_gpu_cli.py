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
