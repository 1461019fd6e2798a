"""`sekv ingest DOC`: prefill a document once and save its context pack."""

from __future__ import annotations

from pathlib import Path

import typer

from sekv_core import methods, models
from sekv_core.ingest import ingest as run_ingest

from .common import user_errors, BudgetOpt, DeviceMapOpt, DeviceOpt, MaxMemoryOpt, MethodOpt, ModelOpt, RouterOpt, RoutingOpt, method_overrides, placement
from rich.text import Text

from sekv_core.errors import SekvError

from .display import err, human_bytes, safe_line
from .ingest_display import ingest_progress


@user_errors
def ingest(
    documents: list[Path] = typer.Argument(..., help="a .pdf, .txt or .md file, or - to read standard input (needs -o); "
                                           "several files or folders make one pack (needs -o)", metavar="DOC..."),
    output: Path = typer.Option(None, "--output", "-o", help="pack path (default: DOC with suffix .sekv, beside it)"),
    model: str = ModelOpt,
    method: str = MethodOpt,
    budget: float = BudgetOpt,
    router: str = RouterOpt,
    routing: str = RoutingOpt,
    factor_bits: int = typer.Option(
        None, "--factor-bits", help="sekv: factor storage in the pack, 4 (default: 4-bit keys and 3-bit values at rest, int8 again in memory) or 8 (int8, as before)"
    ),
    zoom_tier: str = typer.Option(
        None, "--zoom-tier", help="sekv: what a zoomed block is read from: int8 / exact (the span tokens' own K and V stored in the "
        "pack, int8 or the model's 16-bit; larger packs) or factors (the low-rank factors alone, the smallest pack); default: the "
        "method's (docs/long-documents.md)"
    ),
    rope_scaling: str = typer.Option(
        "auto", "--rope-scaling", help="positions past the model's window: auto (native when the document fits; full and the eviction "
        "methods get YaRN x2-x4 past it), none, or yarn:F"
    ),
    device: str = DeviceOpt,
    device_map: str = DeviceMapOpt,
    max_memory: str = MaxMemoryOpt,
    offload_kv: bool = typer.Option(None, "--offload-kv/--no-offload-kv", help="keep the prefill's KV in host memory, chunk by chunk "
                                    "(default: when the document's full KV would not fit the GPU)"),
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
    force: bool = typer.Option(False, "--force", help="let -o replace an existing file that is not a sekv pack"),
    max_input_mb: float = typer.Option(256, "--max-input-mb", help="the largest document read, in MiB (several: each file, and their text joined)"),
    glob: str = typer.Option(None, "--glob", help="the files read in a folder, comma-separated patterns (default: *.pdf,*.txt,*.md)"),
    system: str = typer.Option(None, "--system", help="system prompt, prefilled into the pack with the document and used by every ask (default: answer from the document only); --system-file FILE reads it from a file"),
    system_file: Path = typer.Option(None, "--system-file", help="read the --system prompt from a UTF-8 text file"),
) -> None:
    """Read DOCUMENT once with the model and save its KV memory as a context pack."""
    place = placement(device, device_map, max_memory)
    method = method or methods.DEFAULT_METHOD
    overrides = method_overrides(budget, router, routing) | ({"factor_bits": factor_bits} if factor_bits is not None else {})
    overrides |= {"zoom_tier": zoom_tier} if zoom_tier is not None else {}
    params = methods.get(method).resolve_params(overrides)
    from sekv_core.documents import DEFAULT_GLOB, load_corpus
    from sekv_core.errors import stage
    from sekv_core.ingest import default_pack_path
    from sekv_core.pack import prepare_output

    system = system_prompt(system, system_file)
    from sekv_core import rope_scaling as rope_scale

    rope_scale.parse(rope_scaling)  # a bad value fails before the model loads
    if max_input_mb <= 0:
        raise SekvError(f"--max-input-mb must be positive, not {max_input_mb:g}")
    if len(documents) > 1 and output is None:
        raise SekvError("several documents make one pack: name it with -o PACK")
    if str(documents[0]) == "-" and output is None:
        raise SekvError("reading the document from standard input (-) needs -o PACK")
    with stage("load"):  # a bad document fails before the model loads
        doc = load_corpus(documents, glob or DEFAULT_GLOB, max_bytes=int(max_input_mb * 2**20))
    if output is None and doc.path is None:
        raise SekvError("reading a folder or standard input (-) needs -o PACK")
    inputs = [p.path for p in doc.parts if p.path] or ([doc.path] if doc.path else [])
    prepare_output(output or default_pack_path(doc.path), force=force, inputs=inputs).discard()  # before the model loads
    with ingest_progress(not quiet) as view:
        with stage("model load"):
            lm = models.load(model or models.DEFAULT_MODEL, progress=view.model if view else None, **place)
        r = run_ingest(doc, output, lm=lm, method=method, params=params, force=force, progress=view, system=system, rope_scaling=rope_scaling,
                       offload_kv=offload_kv)
    if not quiet:
        err.print(
            Text.assemble(
                ("saved", "green"),
                f" {safe_line(str(r.pack_path))}  {r.n_tokens} tokens, method {r.method}, "
                f"{human_bytes(r.pack_bytes)} ({100 * r.pack_bytes / r.raw_kv_fp16_bytes:.1f}% of the raw fp16 KV "
                f"{human_bytes(r.raw_kv_fp16_bytes)}); prefill {r.prefill_s:.1f} s "
                f"({r.n_tokens / max(r.prefill_s, 1e-9):.0f} tok/s), compress {r.compress_s:.1f} s"
                + (f", {r.windows} windows" if r.windows > 1 else ""),
            )
        )
    print(safe_line(str(r.pack_path)))


def system_prompt(text: str | None, path: Path | None) -> str | None:
    """--system / --system-file: the system prompt to prefill (None: the default), checked."""
    from sekv_core.prompt import MAX_SYSTEM_CHARS

    if text is not None and path is not None:
        raise SekvError("give --system or --system-file, not both")
    if path is not None:
        if not path.is_file():
            raise SekvError(f"--system-file {path}: not a regular file")
        try:
            with open(path, "rb") as f:
                raw = f.read(4 * MAX_SYSTEM_CHARS + 1)
            text = raw.decode("utf-8-sig")
        except OSError as e:
            raise SekvError(f"--system-file {path}: cannot read it ({e.strerror or type(e).__name__})") from None
        except UnicodeDecodeError:
            raise SekvError(f"--system-file {path}: not UTF-8 text") from None
        text = text.strip()
    if text is not None and (len(text) > MAX_SYSTEM_CHARS or "\x00" in text):
        raise SekvError(f"the system prompt must be text of at most {MAX_SYSTEM_CHARS} characters without NUL characters")
    return text
