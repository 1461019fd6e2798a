"""sekv's ingest after the prefill, stage by stage, on a random model with a real model's KV geometry (CPU proxy).

A random-weight Qwen2 with the KV shape asked for (default the 8B shape's: 8 KV heads of 128; a few layers, a small
hidden and MLP and a 1,024-token vocabulary, so the prefill is quick) prefills --tokens random tokens; then, each
timed on its own: ``compress`` (sekv/compress.py, with the merge and its factor codec apart), and the pack's write
(pack.write_pack: its sha256s and the file, fsync included), and the bytes that would cross the bus on CUDA
(``to_host_bytes``: compress's results to the host; ``merge_upload_bytes``: factors the merge takes back to the
device for its codec).  ``tensors_sha256`` is a digest of every pack tensor
(names, dtypes, shapes, bytes): two versions of the code that make the same pack print the same one.  ``--ops``
also counts the torch calls of compress (benchmarks/compress_ops.py's counting: calls that are not views, calls that
wait for the device on CUDA) and ``--cprofile N`` prints compress + write's N costliest functions (cumulative).

    python -m benchmarks.ingest_stages --tokens 16384 --layers 4 --kv-heads 8 --head-dim 128
    python -m benchmarks.ingest_stages --tokens 16384 --layers 4 --cuda-path --ops   # the grouping CUDA takes
    python -m benchmarks.ingest_stages --write-only 1000 --dir /var/tmp                # the pack write alone
    python -m benchmarks.ingest_stages --ingest --tokens 4096 --dir /var/tmp          # sekv_core.ingest, both ways

``--ingest`` runs the product's ingest (sekv_core/ingest.py, a pack on disk) on a random-weight model of the 8B's KV
geometry in 4 small layers (benchmarks/gpu_cli.py SHAPES["kv8b"], bfloat16, qwen2.5-0.5b's tokenizer) over a text of
--tokens random words, sequential (SEKV_INGEST_PIPELINE=0) and pipelined, and prints for each: prefill, compress
and write seconds, the time after the prefill, ingest / its own prefill, ingest / a plain transformers prefill of the
same tokens (benchmarks/plain_prefill.py, timed once before the ingests, its line printed first), the pack bytes
written before the prefill ended, and a timeline of the pack writer's writes (seconds from the prefill's start, in
tenths of the ingest).
"""

from __future__ import annotations

import argparse
import cProfile
import hashlib
import io
import json
import pstats
import tempfile
import time
from pathlib import Path

import torch


def tensors_digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for k in sorted(tensors):
        t = tensors[k].detach().cpu().contiguous()
        h.update(json.dumps([k, str(t.dtype), list(t.shape)]).encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def write_only(mib: int, where: str | None) -> int:
    from sekv_core import pack

    g = torch.Generator().manual_seed(0)
    size = (mib << 20) // 640
    tensors = {f"t.{i}": torch.randint(-128, 127, (size,), dtype=torch.int8, generator=g) for i in range(640)}
    best = float("inf")
    with tempfile.TemporaryDirectory(dir=where) as td:
        for _ in range(3):
            t = time.perf_counter()
            pack.write_pack(Path(td) / "x.sekv", {"method": "x", "method_params": {}, "token_ids": [1]}, tensors)
            best = min(best, time.perf_counter() - t)
    print(json.dumps({"write_mib": mib, "write_s": best, "mb_per_s": size * 640 / best / 1e6}))
    return 0


def ingest_both(tokens: int, where: str | None, repeat: int, device: str = "cpu") -> int:
    import os
    import random

    from benchmarks.gpu_cli import random_model
    from sekv_core import ingest as ing
    from sekv_core import models

    with tempfile.TemporaryDirectory(dir=where) as td:
        d = Path(td)
        random_model("kv8b", d / "model", "qwen2.5-0.5b", device, 0)
        lm = models.load(str(d / "model"), device=device, dtype=torch.bfloat16)
        rng = random.Random(0)
        words = [w for w in "harbour ledger pump valve ship dawn tide crane cargo north river stone grain mill bell".split()]
        text, n = [], 0
        while n < tokens:
            line = " ".join(rng.choice(words) + str(rng.randrange(100)) for _ in range(200))
            text.append(line)
            n += len(lm.tokenizer(line)["input_ids"])
        (d / "doc.txt").write_text("\n".join(text))
        from benchmarks import plain_prefill as pp

        plain_model, plain_tok, plain_dev, _ = pp.load_plain(str(d / "model"), device, torch.bfloat16)
        plain = pp.timed_prefill(plain_model, pp.document_ids(plain_tok, d / "doc.txt"), plain_dev)
        del plain_model
        print(json.dumps(plain), flush=True)
        rows = []
        for mode in ("0", "1") * max(1, repeat):
            os.environ[ing.PIPELINE_ENV] = mode
            r = ing.ingest(d / "doc.txt", d / f"p{mode}.sekv", lm=lm, method="sekv", force=True)
            tl = r.write_timeline
            end = r.prefill_s + r.compress_s + r.write_s
            bins = [0] * 10  # bytes written in each tenth of the ingest (from the prefill's start)
            for a, b, nb in tl:
                bins[min(9, int(10 * a / max(end, 1e-9)))] += nb
            rows.append({"pipelined": r.pipelined, "tokens": r.n_tokens, "prefill_s": round(r.prefill_s, 3), "compress_s": round(r.compress_s, 3),
                         "write_s": round(r.write_s, 3), "after_prefill_s": round(r.after_prefill_s, 3),
                         "ingest_over_own_prefill": round(end / r.prefill_s, 3), "plain_prefill_s": round(plain["plain_prefill_s"], 3),
                         "ingest_over_plain": round(end / plain["plain_prefill_s"], 3), "pack_mib": round(r.pack_bytes / 2**20, 1),
                         "written_in_prefill_mib": round(r.written_in_prefill / 2**20, 1),
                         "writes_by_tenth_mib": [round(b / 2**20, 1) for b in bins], "prefill_end_tenth": round(10 * r.prefill_s / end, 2)})
            print(json.dumps(rows[-1]), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks.ingest_stages", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=16384)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--kv-heads", type=int, default=8)
    ap.add_argument("--head-dim", type=int, default=128)
    ap.add_argument("--cuda-path", action="store_true", help="the grouping and decompositions CUDA takes, run on the CPU")
    ap.add_argument("--ops", action="store_true", help="count compress's torch calls (a second compress, under torch.profiler)")
    ap.add_argument("--cprofile", type=int, default=0, help="print the N costliest functions of compress + write")
    ap.add_argument("--repeat", type=int, default=1, help="compress + write this many times (the best is reported)")
    ap.add_argument("--write-only", type=int, default=0, metavar="MIB",
                    help="only pack.write_pack of MIB of random int8 tensors in 640 tensors (a pack's count), best of 3")
    ap.add_argument("--dir", default=None, help="where --write-only / --ingest write (default: a temporary folder)")
    ap.add_argument("--ingest", action="store_true", help="sekv_core.ingest on a random kv8b model, sequential and pipelined")
    ap.add_argument("--device", default="cpu", help="--ingest's device (cuda: the GPU path's overlap)")
    ap.add_argument("--out", default=None)
    a = ap.parse_args(argv)
    if a.write_only:
        return write_only(a.write_only, a.dir)
    if a.ingest:
        return ingest_both(a.tokens, a.dir, a.repeat, a.device)
    from benchmarks.compress_ops import random_prefill
    from sekv_core import pack
    from sekv_core.sekv import compress as sc
    from sekv_core.sekv import linalg as la
    from sekv_core.sekv import merge as sm

    m, p, ids, res, prefill_s = random_prefill(a.tokens, a.layers, a.kv_heads, a.head_dim, hidden=256)
    if a.cuda_path:
        sc.GROUP_ON_CPU = True
        la.SUBSPACE_ON_CPU = True
    merge_s = [0.0]
    real_merge = sm.merge

    def merge(*args, **kw):
        t0 = time.perf_counter()
        try:
            return real_merge(*args, **kw)
        finally:
            merge_s[0] += time.perf_counter() - t0

    sm.merge = merge
    # bytes that cross the bus on CUDA: compress's results to the host (a window's piece), and the factors the merge
    # takes back to the device to code them (merge.encode_factors)
    moved = {"to_host_bytes": 0, "merge_upload_bytes": 0}
    real_window, real_encode = sc.compress_window, sm.encode_factors

    def window(*args, **kw):
        piece = real_window(*args, **kw)
        moved["to_host_bytes"] += sum(t.numel() * t.element_size() for t in piece.tensors.values())
        return piece

    def encode(f, *args, **kw):
        moved["merge_upload_bytes"] += f.us.numel() * f.us.element_size() + f.vt.numel() * f.vt.element_size()
        return real_encode(f, *args, **kw)

    sc.compress_window, sm.encode_factors = window, encode
    best: dict = {}
    prof = cProfile.Profile() if a.cprofile else None
    with tempfile.TemporaryDirectory() as td:
        for _ in range(max(1, a.repeat)):
            merge_s[0] = 0.0
            moved.update(to_host_bytes=0, merge_upload_bytes=0)
            if prof:
                prof.enable()
            t0 = time.perf_counter()
            tensors = m.compress(res, p)
            t1 = time.perf_counter()
            manifest = {"method": "sekv", "method_params": p.to_dict(), "n_tokens": a.tokens, "token_ids": ids.tolist()}
            size = pack.write_pack(Path(td) / "x.sekv", manifest, tensors)
            t2 = time.perf_counter()
            if prof:
                prof.disable()
            rec = {"compress_s": t1 - t0, "merge_s": merge_s[0], "write_s": t2 - t1, "pack_bytes": size, **moved}
            if not best or rec["compress_s"] + rec["write_s"] < best["compress_s"] + best["write_s"]:
                best = rec
    out = {"tokens": a.tokens, "layers": a.layers, "kv_heads": a.kv_heads, "head_dim": a.head_dim, "cuda_path": a.cuda_path,
           "prefill_s": prefill_s, **best, "tensors_sha256": tensors_digest(tensors), "torch_threads": torch.get_num_threads()}
    if a.ops:
        from benchmarks.compress_ops import SYNCS, _aten_parent
        from benchmarks.ttft_ops import VIEWS

        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as tp:
            m.compress(res, p)
        evs = [e for e in tp.events() if e.name.startswith("aten::")]
        idset = {id(e) for e in evs}
        top = [e for e in evs if not (e.cpu_parent is not None and _aten_parent(e, idset))]
        out["ops_not_views"] = sum(1 for e in top if e.name not in VIEWS)
        out["ops_syncs"] = sum(1 for e in evs if e.name in SYNCS)
    print(json.dumps(out))
    if prof:
        s = io.StringIO()
        pstats.Stats(prof, stream=s).sort_stats("cumulative").print_stats(a.cprofile)
        print(s.getvalue())
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
