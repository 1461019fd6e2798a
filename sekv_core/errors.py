"""Errors and exit codes: one rule for every command.

Every failure is one line on stderr, ``sekv: error: ...``, and an exit code:

====  ==========================================================================================
0     success
1     an internal error: sekv failed on valid input (a bug, or the machine ran out of memory); the
      line names the stage (load / prefill / compress / write / ...)
2     the input or the environment is wrong: document, pack, model, option, output path, disk
      (``SekvError``: DocumentError, PackError, ModelError), command-line usage included
130   interrupted (Ctrl-C); 143 terminated (SIGTERM).  Nothing half-written is left behind.
====  ==========================================================================================

``-v`` (``sekv -v COMMAND ...``) or ``SEKV_DEBUG=1`` adds the traceback after the line.
"""

from __future__ import annotations

import contextlib
import os

EXIT_OK = 0
EXIT_INTERNAL = 1
EXIT_USER = 2
EXIT_INTERRUPTED = 130
EXIT_TERMINATED = 143


class SekvError(Exception):
    """An error caused by user input or environment, shown as one line."""

    exit_code = EXIT_USER


class DocumentError(SekvError):
    """The document cannot be read or used."""


class PackError(SekvError):
    """The context pack is missing, damaged, or does not match the model."""


class ModelError(SekvError):
    """The model cannot be found, installed or loaded."""


class InternalError(Exception):
    """sekv failed at a named stage on input it accepted (its cause, with the traceback, is ``__cause__``)."""

    exit_code = EXIT_INTERNAL

    def __init__(self, stage: str, cause: BaseException):
        self.stage = stage
        detail = " ".join(str(cause).split())
        if len(detail) > 160:
            detail = detail[:157] + "..."
        what = "out of memory" if isinstance(cause, MemoryError) or "out of memory" in detail.lower() else type(cause).__name__
        super().__init__(f"internal error during {stage}: {what}" + (f" ({detail})" if detail and what != "out of memory" else ""))


def debug() -> bool:
    return os.environ.get("SEKV_DEBUG", "") not in ("", "0")


@contextlib.contextmanager
def stage(name: str):
    """Run one stage of a command: a SekvError passes as it is; an OSError becomes one SekvError line naming the
    stage; anything else an InternalError naming it."""
    try:
        yield
    except (SekvError, InternalError):
        raise
    except OSError as e:
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        raise SekvError(f"{name}: {e.strerror or type(e).__name__}{where}") from e
    except Exception as e:
        raise InternalError(name, e) from e
