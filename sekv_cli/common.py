"""Options shared by several commands."""

from __future__ import annotations

import functools
import sys

import typer

from sekv_core.methods import DEFAULT_METHOD

MODEL_HELP = "embedded model name (see `sekv models list`), a local HF model directory, or a hub id with SEKV_ONLINE=1"
ModelOpt = typer.Option(None, "--model", "-m", help=MODEL_HELP)
DeviceOpt = typer.Option(None, "--device", help="cpu, cuda or cuda:N (default: cuda when available)")
MethodOpt = typer.Option(None, "--method", help=f"cache method (default at ingest: {DEFAULT_METHOD})")
CompileOpt = typer.Option(
    False, "--compile", help="fuse the model's small kernels in decode steps with torch.compile (CUDA only, ignored on the CPU; "
    "a one-time compile of seconds to a minute, so it pays in chat sessions and long answers)"
)
BudgetOpt = typer.Option(None, "--budget", min=0.0, max=1.0, help="resident KV budget as a fraction of the full KV cache (sekv)")


RouterOpt = typer.Option(
    None, "--router", help="sekv zoom-in router: auto (the trained one shipped for the model), untrained, or a router file from `sekv train`"
)


RoutingOpt = typer.Option(
    None, "--routing", help="sekv span ranking: scout (one ranking per question for every layer, from a scout pass) or per_layer (each layer's own gates)"
)


QuietOpt = typer.Option(False, "--quiet", "-q", help="nothing on stderr but errors (no progress, banners or statistics)")
VerboseOpt = typer.Option(False, "--verbose", "-v", help="more detail on stderr, and a traceback with any error (as SEKV_DEBUG=1)")


def method_overrides(budget: float | None, router: str | None = None, routing: str | None = None) -> dict:
    out = {"budget": budget} if budget is not None else {}
    if router is not None:
        out["router"] = router
    if routing is not None:
        out["routing"] = routing
    return out


def user_errors(fn):
    """Turn SekvError into one line on stderr and a non-zero exit (also under Typer's test runner)."""

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        from sekv_core.errors import SekvError

        try:
            return fn(*args, **kwargs)
        except SekvError as e:
            print(f"sekv: error: {e}", file=sys.stderr)
            raise typer.Exit(e.exit_code) from None

    return wrapper
