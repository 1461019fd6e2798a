"""Reading `sekv chat` input: prompt_toolkit on a terminal, plain lines from a pipe.

On a terminal (stdin and stderr both TTYs): line editing, the up/down arrows through a history kept in
``$SEKV_HOME/chat_history`` across sessions, and Esc+Enter for a new line inside the question; the prompt
is drawn on stderr, so stdout holds only answers.  Anywhere else (a pipe, a test, CI) lines are read from
stdin as they are, with no prompt and no history.  In both, a line ending in a backslash continues on the
next line.
"""

from __future__ import annotations

import sys
from pathlib import Path

from sekv_core.models import sekv_home

PROMPT = "you> "
CONTINUATION = "...> "


def history_path() -> Path:
    return sekv_home() / "chat_history"


class LineReader:
    """read(prompt) -> one question or command (possibly several lines); EOFError at the end of input,
    KeyboardInterrupt on Ctrl-C."""

    def __init__(self, interactive: bool | None = None, history_file: Path | None = None, pt_input=None, pt_output=None):
        if interactive is None:
            interactive = sys.stdin.isatty() and sys.stderr.isatty()
        self.interactive = interactive
        self.note = ""  # a line for the user about the history (when it could not be kept)
        self._session = self._prompt_session(history_file or history_path(), pt_input, pt_output) if interactive else None

    def _prompt_session(self, path: Path, pt_input, pt_output):
        from prompt_toolkit import PromptSession
        from prompt_toolkit.history import FileHistory, InMemoryHistory
        from prompt_toolkit.key_binding import KeyBindings
        from prompt_toolkit.output import create_output

        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "a", encoding="utf-8"):
                pass
            history = FileHistory(str(path))
        except OSError as e:
            self.note = f"history not kept: cannot write {path} ({e.strerror})"
            history = InMemoryHistory()
        keys = KeyBindings()

        @keys.add("escape", "enter")
        def _newline(event):  # Esc+Enter (Alt+Enter): a new line inside the question
            event.current_buffer.insert_text("\n")

        output = pt_output if pt_output is not None else create_output(stdout=sys.stderr)
        return PromptSession(
            history=history, key_bindings=keys, input=pt_input, output=output,
            prompt_continuation=lambda width, line_number, wrap_count: CONTINUATION.rjust(width),
        )

    def _line(self, prompt: str) -> str:
        if self._session is not None:
            return self._session.prompt(prompt)
        line = sys.stdin.readline()
        if not line:
            raise EOFError
        return line.rstrip("\r\n")

    def read(self, prompt: str = PROMPT) -> str:
        lines = [self._line(prompt)]
        while lines[-1].endswith("\\"):
            lines[-1] = lines[-1][:-1]
            try:
                lines.append(self._line(CONTINUATION))
            except EOFError:
                break
        return "\n".join(lines)
