"""The `sekv` command: a thin Typer app. Commands live one per module; logic lives in sekv_core."""

from __future__ import annotations

import os
import signal
import sys


def _interrupted_while_importing(signum, frame):  # torch & co. take seconds to import: Ctrl-C there is a clean exit
    os.write(2, b"sekv: interrupted\n")
    os._exit(130)


try:
    _SIGINT = signal.signal(signal.SIGINT, _interrupted_while_importing)
except ValueError:  # not the main thread (imported by a test runner's worker)
    _SIGINT = None

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


@app.callback()
def _options(verbose: bool = typer.Option(False, "--verbose", "-v", help="on an error, print its traceback too (also SEKV_DEBUG=1)")) -> None:
    if verbose:
        os.environ["SEKV_DEBUG"] = "1"


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
if _SIGINT is not None:
    signal.signal(signal.SIGINT, _SIGINT)


def _terminated(signum, frame):
    """SIGTERM unwinds like Ctrl-C (temporary files are removed on the way out), exit code 143."""
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    print("sekv: terminated", file=sys.stderr, flush=True)
    raise SystemExit(143)


def main() -> None:
    """Entry point: the error rule of sekv_core/errors.py for command-line usage errors too (one line, exit 2)."""
    try:  # typer bundles its own copy of click
        from typer._click import exceptions as click
    except ImportError:
        from click import exceptions as click

    _quiet_libraries()
    signal.signal(signal.SIGTERM, _terminated)
    try:
        rc = app(standalone_mode=False)
    except click.NoArgsIsHelpError as e:
        print(e.ctx.get_help())
        rc = 2
    except click.ClickException as e:
        from .display import safe_line

        sub = " ".join(e.ctx.command_path.split()[1:]) if getattr(e, "ctx", None) is not None else ""
        hint = f" (see `sekv {sub + ' ' if sub else ''}--help`)"
        print(f"sekv: error: {safe_line(e.format_message())}{hint}", file=sys.stderr)
        rc = e.exit_code
    except KeyboardInterrupt:
        print("sekv: interrupted", file=sys.stderr)
        rc = 130
    except BrokenPipeError:  # `sekv ... | head`
        rc = 0
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
