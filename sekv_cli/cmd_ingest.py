"""`sekv ingest DOC`: prefill a document once and save its context pack."""

from __future__ import annotations

from pathlib import Path

import typer

from sekv_core import methods, models
from sekv_core.ingest import ingest as run_ingest

from .common import user_errors, BudgetOpt, DeviceOpt, MethodOpt, ModelOpt, RouterOpt, RoutingOpt, method_overrides
from .display import err, human_bytes, model_progress, token_progress


@user_errors
def ingest(
    document: Path = typer.Argument(..., help="a .pdf, .txt or .md file"),
    output: Path = typer.Option(None, "--output", "-o", help="pack path (default: DOC with suffix .sekv, beside it)"),
    model: str = ModelOpt,
    method: str = MethodOpt,
    budget: float = BudgetOpt,
    router: str = RouterOpt,
    routing: str = RoutingOpt,
    factor_bits: int = typer.Option(
        None, "--factor-bits", help="sekv: factor storage in the pack, 4 (default: 4-bit keys and 3-bit values at rest, int8 again in memory) or 8 (int8, as before)"
    ),
    device: str = DeviceOpt,
    quiet: bool = typer.Option(False, "--quiet", "-q", help="no progress output"),
) -> None:
    """Read DOCUMENT once with the model and save its KV memory as a context pack."""
    method = method or methods.DEFAULT_METHOD
    overrides = method_overrides(budget, router, routing) | ({"factor_bits": factor_bits} if factor_bits is not None else {})
    params = methods.get(method).resolve_params(overrides)
    from sekv_core.documents import load_document

    load_document(document)  # fail on a bad document before loading the model
    with model_progress(not quiet) as cb:
        lm = models.load(model or models.DEFAULT_MODEL, device=device, progress=cb)
    with token_progress("prefill", not quiet) as cb:
        r = run_ingest(document, output, lm=lm, method=method, params=params, progress=cb)
    if not quiet:
        err.print(
            f"[green]saved[/] {r.pack_path}  {r.n_tokens} tokens, method {r.method}, "
            f"{human_bytes(r.pack_bytes)} ({100 * r.pack_bytes / r.raw_kv_fp16_bytes:.1f}% of the raw fp16 KV "
            f"{human_bytes(r.raw_kv_fp16_bytes)}); prefill {r.prefill_s:.1f} s "
            f"({r.n_tokens / max(r.prefill_s, 1e-9):.0f} tok/s), compress {r.compress_s:.1f} s"
        )
    print(r.pack_path)
