"""benchmarks/plain_prefill.py, the reference `sekv ingest` is divided by: it prefills the ingest's own tokens, and
its chunked fallback is the same prefill as its one forward; gpu_cli's ratio over it."""

from __future__ import annotations

import torch

from benchmarks import gpu_cli
from benchmarks import plain_prefill as pp
from sekv_core import ingest, models


def test_the_reference_prefills_the_ingests_tokens(tiny_qwen, tmp_path):
    doc = tmp_path / "doc.txt"
    doc.write_text("The harbour ledger lists 42 crates of grain.\n\n" * 40)
    lm = models.load(str(tiny_qwen), device="cpu", dtype=torch.float32)
    r = ingest.ingest(doc, tmp_path / "d.sekv", lm=lm, method="full")
    from sekv_core.pack import read_pack

    manifest = read_pack(r.pack_path).manifest
    model, tok, dev, dtype = pp.load_plain(str(tiny_qwen), "cpu", torch.float32)
    assert pp.document_ids(tok, doc) == manifest["token_ids"]
    assert getattr(model.config, "_attn_implementation", None) == "sdpa"  # transformers' attention, not sekv's hook


def test_chunked_reference_is_the_one_forward(tiny_qwen):
    model, tok, dev, _ = pp.load_plain(str(tiny_qwen), "cpu", torch.float32)
    ids = torch.randint(3, len(tok), (1, 700), generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        one = pp.one_forward(model, ids)
        chunked = pp.chunked(model, ids, 256)
    torch.testing.assert_close(chunked.logits, one.logits, atol=2e-4, rtol=2e-4)
    k1 = one.past_key_values.layers[-1].keys
    k2 = chunked.past_key_values.layers[-1].keys
    assert k1.shape[-2] == k2.shape[-2] == 700
    torch.testing.assert_close(k2, k1, atol=2e-4, rtol=2e-4)
    t = pp.timed_prefill(model, ids[0].tolist(), dev)
    assert t["mode"] == "one forward" and t["tokens"] == 700 and t["plain_prefill_s"] > 0
    assert pp.timed_prefill(model, ids[0].tolist(), dev, chunk=256)["mode"] == "chunked 256"


def test_ingest_over_plain_divides_by_the_reference():
    probe = {"wall_s": 9.0, "phases": {}, "asks": [],
             "ingest": {"prefill_s": 3.0, "compress_s": 1.5, "write_s": 0.5},
             "ingest_stream": {"on_chunk_s": 0.25, "submit_wait_s": 0.125, "chunks": 4},
             "compress_events": [["window_start", 0.0], ["window", 0.25], ["profile", 0.5], ["layers", 0.75], ["layers", 1.0],
                                 ["window_done", 1.125], ["merge", 1.2], ["merge_done", 1.375], ["end", 1.5]]}
    rec = {"doc": "d", "tokens": 10, "method": "sekv", "ingest": {"rc": 0, "wall_s": 9.0, "probe": probe},
           "plain": {"rc": 0, "plain_prefill_s": 2.5, "mode": "one forward"}}
    row = gpu_cli.summarize(rec)
    assert row["ingest_over_plain"] == (3.0 + 1.5 + 0.5) / 2.5
    assert row["ingest_over_own_prefill"] == (3.0 + 1.5 + 0.5) / 3.0
    assert row["plain_prefill_s"] == 2.5 and row["plain_prefill_mode"] == "one forward"
    assert row["prefill_writer_wait_s"] == 0.125 and row["prefill_stream_s"] == 0.25
    assert row["compress_split"] == {"segment_plan_s": 0.25, "profile_s": 0.25, "layers_s": 0.5, "window_rest_s": 0.125,
                                     "merge_s": 0.25, "end_s": 0.125, "layer_groups": 2}
    head = gpu_cli.table([row]).splitlines()
    assert "ingest/plain" in head[0] and "2.00" in head[1]
    no_ref = gpu_cli.summarize(dict(rec, plain={"rc": 1}))
    assert no_ref["ingest_over_plain"] is None and no_ref["ingest_over_own_prefill"] == row["ingest_over_own_prefill"]
