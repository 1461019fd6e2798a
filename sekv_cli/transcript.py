"""`/save FILE` in `sekv chat`: the conversation as Markdown, written whole or not at all.

A saved transcript starts with MARKER, so saving again over one's own transcript is safe; any other
existing file is overwritten only when the user confirms (the caller asks).
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

MARKER = "<!-- sekv chat transcript -->"


@dataclass
class Exchange:
    question: str
    answer: str
    method: str
    budget: float | None
    generated_tokens: int


def render(document: str, pack: str, model: str, exchanges: list[Exchange]) -> str:
    lines = [MARKER, f"# Questions about {document}", "", f"Pack `{pack}`, model `{model}`.", ""]
    for i, e in enumerate(exchanges, 1):
        budget = f", budget {e.budget:.0%}" if isinstance(e.budget, float) else ""
        lines += [f"## Question {i}", ""]
        lines += [f"> {ln}" if ln else ">" for ln in e.question.splitlines()]
        lines += ["", e.answer, "", f"*{e.method}{budget}, {e.generated_tokens} tokens*", ""]
    return "\n".join(lines)


def is_transcript(path: Path) -> bool:
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.readline().rstrip("\r\n") == MARKER
    except OSError:
        return False


def needs_confirmation(path: Path) -> bool:
    """True when writing would replace a file that is not a sekv transcript."""
    return path.exists() and not is_transcript(path)


def write(path: Path, text: str) -> None:
    """Atomically: a temporary file beside the target, then a rename (an existing file is never half-written)."""
    if path.is_dir():
        raise IsADirectoryError(21, "is a directory", str(path))
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(text)
        os.chmod(tmp, path.stat().st_mode & 0o777 if path.exists() else 0o666 & ~_umask())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
