"""User-facing errors.

Every failure a user can cause (bad document, bad pack, unknown model, ...) is
raised as a :class:`SekvError` whose message is one line that says what went
wrong and, where possible, what to do.  The CLI prints it and exits non-zero;
it never shows a traceback for these.
"""


class SekvError(Exception):
    """An error caused by user input or environment, shown as one line."""

    exit_code = 2


class DocumentError(SekvError):
    """The document cannot be read or used."""


class PackError(SekvError):
    """The context pack is missing, damaged, or does not match the model."""


class ModelError(SekvError):
    """The model cannot be found, installed or loaded."""
