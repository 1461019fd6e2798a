"""The `sekv` command: a thin Typer app. Commands live one per module; logic lives in sekv_core."""

from __future__ import annotations

import functools
import inspect
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
    no_args_is_help=True,
    add_completion=True,  # --install-completion / --show-completion [bash|zsh|fish|powershell]
    pretty_exceptions_enable=False,
    context_settings={"help_option_names": ["-h", "--help"]},  # inherited by every command
)


def _version(value: bool) -> None:
    if value:
        from sekv_core import __version__

        print(f"sekv {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="print the version and exit"),
    verbose: bool = typer.Option(False, "--verbose", "-v", help="on an error, print its traceback too (also SEKV_DEBUG=1)"),
) -> None:
    """Ask questions about long documents from reloadable context packs (SeKV resolution-adaptive KV cache)."""
    if verbose:
        os.environ["SEKV_DEBUG"] = "1"


def with_verbosity(fn):
    """Give a command -q/--quiet and -v/--verbose (those it does not declare itself).  -q: nothing on stderr but
    errors (a command without its own quiet silences the shared stderr console); -v: SEKV_DEBUG=1 while it runs
    (tracebacks on errors), and the command's own verbose output where it has one."""
    from .common import QuietOpt, VerboseOpt
    from .display import err

    sig = inspect.signature(fn)
    own = {name for name in ("quiet", "verbose") if name in sig.parameters}
    extra = [
        inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=bool)
        for name, opt in (("quiet", QuietOpt), ("verbose", VerboseOpt)) if name not in own
    ]

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        quiet, verbose = kwargs.get("quiet", False), kwargs.get("verbose", False)
        for name in ("quiet", "verbose"):
            if name not in own:
                kwargs.pop(name, None)
        was_quiet, was_debug = err.quiet, os.environ.get("SEKV_DEBUG")
        if quiet and "quiet" not in own:
            err.quiet = True
        if verbose:
            os.environ["SEKV_DEBUG"] = "1"
        try:
            return fn(*args, **kwargs)
        finally:
            err.quiet = was_quiet
            if verbose:
                if was_debug is None:
                    os.environ.pop("SEKV_DEBUG", None)
                else:
                    os.environ["SEKV_DEBUG"] = was_debug

    wrapper.__signature__ = sig.replace(parameters=[*sig.parameters.values(), *extra])
    wrapper.__annotations__ = {**getattr(fn, "__annotations__", {}), **{p.name: bool for p in extra}}
    return wrapper


def _quiet_libraries() -> None:
    os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    if os.environ.get("SEKV_ONLINE") != "1":
        os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import warnings

    warnings.filterwarnings("ignore")


def _register() -> None:
    from . import cmd_add, cmd_ask, cmd_chat, cmd_ingest, cmd_inspect, cmd_models

    app.command("ingest")(with_verbosity(cmd_ingest.ingest))
    app.command("add")(with_verbosity(cmd_add.add))
    app.command("ask")(with_verbosity(cmd_ask.ask))
    app.command("chat")(with_verbosity(cmd_chat.chat))
    app.command("inspect")(with_verbosity(cmd_inspect.inspect))
    for info in cmd_models.app.registered_commands:
        info.callback = with_verbosity(info.callback)
    app.add_typer(cmd_models.app, name="models")
    from . import cmd_bench

    app.command("bench")(with_verbosity(cmd_bench.bench))
    from . import cmd_train

    app.command("train")(with_verbosity(cmd_train.train))


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
    finally:  # a pack's temporary file an interrupt left (one landing before the code that would remove it)
        pack = sys.modules.get("sekv_core.pack")
        if pack is not None:
            pack.discard_unfinished()
    sys.exit(rc if isinstance(rc, int) else 0)


if __name__ == "__main__":
    main()
