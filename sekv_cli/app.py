"""The `sekv` command: a thin Typer app. Commands live one per module; logic lives in sekv_core."""

from __future__ import annotations

import os
import sys

# tqdm reads this when it is imported (the commands' imports pull it in): third-party bars such as the
# GGUF conversion's stay off; sekv's own progress is Rich
os.environ.setdefault("TQDM_DISABLE", "1")

import typer

app = typer.Typer(
    name="sekv",
    help="Ask questions about long documents from reloadable context packs (SeKV resolution-adaptive KV cache).",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("SEKV_ONLINE") != "1":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")


def _register() -> None:
    from . import cmd_ask, cmd_chat, cmd_ingest, cmd_inspect, cmd_models

    app.command("ingest")(cmd_ingest.ingest)
    app.command("ask")(cmd_ask.ask)
    app.command("chat")(cmd_chat.chat)
    app.command("inspect")(cmd_inspect.inspect)
    app.add_typer(cmd_models.app, name="models")
    from . import cmd_bench

    app.command("bench")(cmd_bench.bench)
    from . import cmd_train

    app.command("train")(cmd_train.train)


_register()


def main() -> None:
    """Entry point. User errors are handled per command (common.user_errors): one line, exit 2."""
    _quiet_libraries()
    app()


if __name__ == "__main__":
    main()
