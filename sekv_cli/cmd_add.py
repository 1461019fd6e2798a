"""`sekv add PACK DOC...`: append documents to a pack without reading its documents again."""

from __future__ import annotations

from pathlib import Path

import typer
from rich.text import Text

from sekv_core import models
from sekv_core.errors import SekvError

from .common import DeviceOpt, ModelOpt, user_errors
from .display import err, human_bytes, safe_line
from .ingest_display import ingest_progress


@user_errors
def add(
    pack: Path = typer.Argument(..., help="the pack to extend (rewritten in place, atomically)", metavar="PACK"),
    documents: list[Path] = typer.Argument(..., help="files (.pdf, .txt, .md), folders, or - for standard input", metavar="DOC..."),
    model: str = ModelOpt,
    device: str = DeviceOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
    max_input_mb: float = typer.Option(256, "--max-input-mb", help="the largest document read, in MiB (each file, and their text joined)"),
    glob: str = typer.Option(None, "--glob", help="the files read in a folder, comma-separated patterns (default: *.pdf,*.txt,*.md)"),
) -> None:
    """Add documents to PACK: they are prefilled on their own and joined to its memory (docs/long-documents.md)."""
    from sekv_core.add import add as run_add
    from sekv_core.documents import DEFAULT_GLOB, load_corpus
    from sekv_core.errors import stage
    from sekv_core.pack import check_manifest, read_pack

    if max_input_mb <= 0:
        raise SekvError(f"--max-input-mb must be positive, not {max_input_mb:g}")
    p = read_pack(pack)  # a missing or damaged pack fails before the documents are read or the model loads
    try:
        check_manifest(p)
        model_id = p.manifest["model"]["id"]
    finally:
        p.close()
    with stage("load"):
        doc = load_corpus(documents, glob or DEFAULT_GLOB, max_bytes=int(max_input_mb * 2**20), headings=True)
    with ingest_progress(not quiet) as view:
        with stage("model load"):
            lm = models.load(model, device=device, progress=view.model if view else None) if model else models.load_named_by_pack(model_id, device=device)
        r = run_add(pack, doc, lm=lm, progress=view)
    if not quiet:
        if r.note:
            err.print(Text(r.note))
        err.print(
            Text.assemble(
                ("added", "green"),
                f" {r.documents} document{'s' if r.documents != 1 else ''} ({r.added_tokens} tokens) to {safe_line(str(r.pack_path))}: "
                f"{r.n_tokens} tokens, method {r.method}, {human_bytes(r.pack_bytes)}; prefill {r.prefill_s:.1f} s"
                + (f", {r.windows} windows" if r.windows > 1 else ""),
            )
        )
    print(safe_line(str(r.pack_path)))
