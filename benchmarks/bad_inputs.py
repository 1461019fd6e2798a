"""The bad-input matrix of docs/reliability.md: every case is a real `sekv` process, as a user runs it.

    PYTHONPATH=. .venv/bin/python -m benchmarks.bad_inputs > /tmp/matrix.md

Uses the embedded smollm2-135m (installed) on the CPU.  For every case it records the exit code, the first line of
stderr, whether a traceback appeared, and the case's own check (nothing overwritten, no temporary file left, no pip
run, ...).  Prints a Markdown table; exit status 1 if any case breaks the rule (traceback, multi-line error, exit code
other than the documented one, or its check failing).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import struct
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODEL = "smollm2-135m"
SEKV = [sys.executable, "-c", "from sekv_cli.app import main; main()"]


def sekv(*args, env=None, input=None, signal_after=None, sig=signal.SIGTERM, wait_for=None, timeout=600):
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    p = subprocess.Popen(SEKV + [str(a) for a in args], stdin=subprocess.PIPE if input is not None else subprocess.DEVNULL,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=e, text=True,
                         preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # as from a terminal (a background job ignores SIGINT)
    if signal_after is not None:
        t0 = time.time()
        while time.time() - t0 < 300 and (wait_for is not None and not wait_for()):
            time.sleep(0.02)
        time.sleep(signal_after)
        p.send_signal(sig)
    out, err = p.communicate(input=input, timeout=timeout)
    return p.returncode, out, err


def crafted(src: Path, dst: Path, edit_manifest=None, edit_tensor=None) -> Path:
    """src's manifest and tensors, edited, written with every checksum recomputed (what anyone can do to a pack)."""
    from sekv_core import pack as packmod

    p = packmod.read_pack(src)
    man = json.loads(json.dumps(p.manifest))
    ten = {k: p.get(k).clone() for k in p.keys()}
    if edit_tensor:
        edit_tensor(ten)
    man.pop("tensors", None)
    packmod.write_pack(dst, man, ten)
    if edit_manifest:  # the manifest exactly as edited (write_pack would set magic / version): header rebuilt, re-hashed
        data = dst.read_bytes()
        (n,) = struct.unpack("<Q", data[:8])
        header = json.loads(data[8 : 8 + n])
        m = json.loads(header["__metadata__"]["sekv"])
        edit_manifest(m)
        header["__metadata__"] = {"sekv": json.dumps(m), "sekv_header_sha256": "0" * 64}
        body = json.dumps(header, separators=(",", ":")).encode()
        body += b" " * (-(8 + len(body)) % 8)
        head = struct.pack("<Q", len(body)) + body
        head = head.replace(b"0" * 64, hashlib.sha256(head).hexdigest().encode(), 1) if head.count(b"0" * 64) == 1 else head
        dst.write_bytes(head + data[8 + n :])
    return dst


def main() -> int:
    d = Path(tempfile.mkdtemp(prefix="sekv_bad_"))
    good = d / "log.md"
    good.write_text((ROOT / "sample_docs" / "lighthouse_keepers_log.md").read_text())
    pack = d / "log.sekv"
    code, _, err = sekv("ingest", good, "-o", pack, "--model", MODEL, "-q")
    assert code == 0, err
    tiny = d / "tiny.md"
    tiny.write_text("The lighthouse has 112 steps. The keeper paints them [red] every spring.\n" * 10)
    (d / "bin.txt").write_bytes(b"\x00\x01\x02binary" * 100)
    (d / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1") * 20)
    (d / "utf16.txt").write_bytes(b"\xff\xfe" + "The keeper counts 112 steps.\n".encode("utf-16-le") * 10)
    (d / "empty.txt").write_text("")
    (d / "bad.pdf").write_bytes(b"%PDF-1.4\n garbage garbage")
    (d / "notes.docx").write_text("x")
    (d / "dir.md").mkdir()
    os.mkfifo(d / "fifo.txt")
    (d / "zero.txt").symlink_to("/dev/zero")
    (d / "long.txt").write_text("word " * 40000)
    victim = d / "notes.txt"
    victim.write_text("my notes, not a pack\n")
    (d / "text.sekv").write_text("hello")
    raw = pack.read_bytes()
    (d / "trunc.sekv").write_bytes(raw[: len(raw) // 2])
    flip = bytearray(raw)
    flip[-5] ^= 0xFF
    (d / "flip_data.sekv").write_bytes(bytes(flip))
    flip = bytearray(raw)
    at = flip.index(b"token_ids") + 16
    flip[at] = ord("9") if flip[at] != ord("9") else ord("8")
    (d / "flip_manifest.sekv").write_bytes(bytes(flip))
    from safetensors.torch import save_file
    import torch

    save_file({"x": torch.zeros(2)}, str(d / "v2.sekv"), metadata={"sekv": json.dumps({"magic": "SEKV-PACK", "format_version": 2, "data_sha256": "0" * 64})})

    def span_end(t):
        t["sekv.span_end"][0] = 10**9

    crafted(pack, d / "span1e9.sekv", edit_tensor=span_end)
    crafted(pack, d / "uninstalled.sekv", edit_manifest=lambda m: m["model"].update(id="qwen2.5-1.5b"))
    crafted(pack, d / "hubid.sekv", edit_manifest=lambda m: m["model"].update(id="evil/model"))
    crafted(pack, d / "vtrue.sekv", edit_manifest=lambda m: m.update(format_version=True))
    crafted(pack, d / "nullparams.sekv", edit_manifest=lambda m: m.update(method_params=None))
    crafted(pack, d / "budget0.sekv", edit_manifest=lambda m: m["method_params"].update(budget=0))
    crafted(pack, d / "routerpath.sekv", edit_manifest=lambda m: m["method_params"].update(router=str(victim)))
    crafted(pack, d / "esc_name.sekv", edit_manifest=lambda m: m["document"].update(name="x\x1b]8;;http://e\x1b\\[red]y\x1b[2J.md"))
    crafted(pack, d / "system5.sekv", edit_manifest=lambda m: m.update(system=5))
    dw = d / "dw.sekv"
    code, _, err = sekv("ingest", good, "-o", dw, "--model", MODEL, "--method", "depthweave", "--budget", "0.5", "-q")
    assert code == 0, err

    def dw_level(t):
        t["depthweave.level"].view(-1)[0] = 200

    def dw_rank(t):
        t["depthweave.config"][5] = 10**6

    crafted(dw, d / "dw_level.sekv", edit_tensor=dw_level)
    crafted(dw, d / "dw_rank.sekv", edit_tensor=dw_rank)
    (d / "system.txt").write_text("You answer in one word.\n")
    ro = Path("/proc/sekv_test.sekv")
    tmps = lambda: sorted(p.name for p in d.glob(".*.tmp"))  # noqa: E731

    rows = []

    def case(name, args, want, check=None, **kw):
        code, out, err = sekv(*args, **kw)
        lines = [ln for ln in err.strip().splitlines() if ln.strip() and "━" not in ln]
        first = lines[-1] if lines else ""
        tb = "Traceback" in err
        ok_check = check() if check else True
        ok = (code == want) and not tb and (want == 0 or len(lines) == 1) and ok_check and not tmps()
        rows.append((name, " ".join(str(a) for a in args).replace(str(d) + "/", "").replace("|", "\\|"), code, want,
                     (first if want else "ok").replace(str(d) + "/", "")[:150].replace("|", "\\|"), "yes" if tb else "no", "ok" if ok else "FAIL"))
        print(f"{'ok  ' if ok else 'FAIL'} {name}: exit {code}: {first[:120]}", file=sys.stderr)

    m = ["--model", MODEL, "-q"]
    # documents
    case("missing document", ["ingest", d / "nope.txt", *m], 2)
    case("directory", ["ingest", d / "dir.md", *m], 2)
    case("unsupported type", ["ingest", d / "notes.docx", *m], 2)
    case("binary .txt", ["ingest", d / "bin.txt", *m], 2)
    case("latin-1 .txt", ["ingest", d / "latin1.txt", *m], 2)
    case("UTF-16 with BOM", ["ingest", d / "utf16.txt", "-o", d / "u16.sekv", *m], 0)
    case("empty .txt", ["ingest", d / "empty.txt", *m], 2)
    case("damaged PDF", ["ingest", d / "bad.pdf", *m], 2)
    case("FIFO named .txt", ["ingest", d / "fifo.txt", *m], 2, timeout=60)
    case(".txt symlink to /dev/zero", ["ingest", d / "zero.txt", *m], 2, timeout=60)
    case("over --max-input-mb", ["ingest", good, "--max-input-mb", "0.001", *m], 2)
    case("longer than the context", ["ingest", d / "long.txt", *m], 2)
    case("stdin without -o", ["ingest", "-", *m], 2, input="text")
    case("stdin with -o", ["ingest", "-", "-o", d / "stdin.sekv", *m], 0, input="The keeper counts 112 steps.\n" * 20)
    # output
    before = victim.read_bytes()
    case("-o onto the input", ["ingest", tiny, "-o", tiny, "--force", *m], 2, check=lambda: tiny.read_text().startswith("The lighthouse"))
    case("-o onto a non-pack file", ["ingest", tiny, "-o", victim, *m], 2, check=lambda: victim.read_bytes() == before)
    case("-o into a missing directory", ["ingest", tiny, "-o", d / "no" / "x.sekv", *m], 2)
    case("-o under /proc", ["ingest", tiny, "-o", ro, *m], 2)
    case("-o is a directory", ["ingest", tiny, "-o", d, *m], 2)
    case("-o onto an existing pack", ["ingest", tiny, "-o", d / "u16.sekv", *m], 0)
    small = d / "small_fs"  # a 3 MB filesystem (root only: skipped where mount is not allowed)
    small.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=3m", "tmpfs", str(small)], capture_output=True).returncode == 0:
        try:
            case("-o on a full (3 MB) filesystem", ["ingest", good, "-o", small / "x.sekv", *m], 2, check=lambda: not list(small.iterdir()))
        finally:
            subprocess.run(["umount", str(small)])
    # options
    case("--device bogus", ["ingest", tiny, "--device", "bogus", *m], 2)
    case("--device cuda without a GPU", ["ingest", tiny, "--device", "cuda", *m], 2)
    case("--budget 0", ["ingest", tiny, "--budget", "0", *m], 2)
    case("--budget 1.5", ["ask", pack, "q", "--budget", "1.5"], 2)
    case("--method bogus (ingest)", ["ingest", tiny, "--method", "bogus", *m], 2)
    case("--method bogus (ask)", ["ask", pack, "q", "--method", "bogus"], 2)
    case("--method streamingllm on a sekv pack", ["ask", pack, "q", "--method", "streamingllm"], 2)
    case("--system and --system-file", ["ingest", tiny, "--system", "x", "--system-file", d / "system.txt", *m], 2)
    case("--system-file a FIFO", ["ingest", tiny, "--system-file", d / "fifo.txt", *m], 2, timeout=60)
    case("--model unknown", ["ingest", tiny, "--model", "nope-7b", "-q"], 2)
    case("unknown option", ["ask", pack, "q", "--bogus"], 2)
    case("--max-new-tokens 0", ["ask", pack, "q", "-n", "0"], 2)
    # packs
    case("missing pack", ["ask", d / "nope.sekv", "q"], 2)
    case("text file as pack", ["ask", d / "text.sekv", "q"], 2)
    case("truncated pack", ["ask", d / "trunc.sekv", "q"], 2)
    case("flipped byte in tensor data", ["ask", d / "flip_data.sekv", "q"], 2)
    case("flipped byte in manifest", ["ask", d / "flip_manifest.sekv", "q"], 2)
    case("format 2 pack", ["ask", d / "v2.sekv", "q"], 2)
    case("crafted: span_end 1e9 (inspect)", ["inspect", d / "span1e9.sekv"], 2)
    case("crafted: span_end 1e9 (ask)", ["ask", d / "span1e9.sekv", "q"], 2)
    case("crafted: model not installed", ["ask", d / "uninstalled.sekv", "q"], 2)
    case("crafted: hub model id, SEKV_ONLINE=1", ["ask", d / "hubid.sekv", "q"], 2, env={"SEKV_ONLINE": "1"})
    case("crafted: format_version true", ["inspect", d / "vtrue.sekv"], 2)
    case("crafted: method_params null", ["inspect", d / "nullparams.sekv"], 2)
    case("crafted: budget 0 in the pack", ["ask", d / "budget0.sekv", "q"], 2)
    case("crafted: router path to another file", ["ask", d / "routerpath.sekv", "q", "-n", "2"], 0, check=lambda: victim.read_bytes() == before)
    case("crafted: escapes in document name (inspect)", ["inspect", d / "esc_name.sekv"], 0)
    case("crafted: system prompt not text", ["inspect", d / "system5.sekv"], 2)
    case("crafted depthweave: a level index of 200", ["ask", d / "dw_level.sekv", "q"], 2)
    case("crafted depthweave: rank 10^6 (inspect)", ["inspect", d / "dw_rank.sekv"], 2)
    case("other model's pack (--model qwen2.5-0.5b)", ["ask", pack, "q", "--model", "qwen2.5-0.5b"], 2)
    # text
    case("markup in question, --show-evidence", ["ask", pack, "What about [note] and [/mnt/x]?", "-n", "4", "--show-evidence"], 0)
    case("chat: /x [/] echo", ["chat", pack, "-n", "2"], 0, input="/x [/]\n/quit\n")
    # signals
    slot = lambda: bool(list(d.glob(".sig.sekv.*.tmp")))  # noqa: E731
    case("SIGTERM during ingest", ["ingest", good, "-o", d / "sig.sekv", *m], 143, signal_after=0.5, wait_for=slot,
         check=lambda: not (d / "sig.sekv").exists())
    case("SIGINT during ingest", ["ingest", good, "-o", d / "sig.sekv", *m], 130, signal_after=0.5, sig=signal.SIGINT, wait_for=slot,
         check=lambda: not (d / "sig.sekv").exists())
    case("SIGINT while importing", ["ask", pack, "q"], 130, signal_after=0.3, sig=signal.SIGINT, wait_for=lambda: True)

    print("| case | command | exit | expected | stderr (last line) | traceback | result |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        print("| " + " | ".join(f"`{x}`" if i == 1 else str(x) for i, x in enumerate(r)) + " |")
    bad = sum(r[-1] != "ok" for r in rows)
    print(f"\n{len(rows)} cases, {len(rows) - bad} as documented, {bad} not.")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
