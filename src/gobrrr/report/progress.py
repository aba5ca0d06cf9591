"""How far a long command is, on stderr (never stdout, and the CLI passes none under --json).

On a terminal one line is rewritten in place; elsewhere (a log, a pipe) a line is written at
most every `every` seconds, and the last one always.
"""

from __future__ import annotations

import sys
import time
from typing import TextIO


class Progress:
    """A callback `(done, total)` for a loop: "gobrrr: <what> 12/30" on stderr."""

    def __init__(self, what: str, stream: TextIO | None = None, every: float = 2.0) -> None:
        self.what, self.every = what, every
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty()
        self.last = -float("inf")
        self.open = False

    def note(self, text: str) -> None:
        """One line of what is happening now (e.g. "tracing the step")."""
        self._end_line()
        print(f"gobrrr: {text}", file=self.stream, flush=True)

    def __call__(self, done: int, total: int) -> None:
        now = time.monotonic()
        last = done >= total
        if not self.tty and not last and now - self.last < self.every:
            return
        self.last = now
        line = f"gobrrr: {self.what} {done}/{total}"
        if self.tty:
            self.stream.write(f"\r\033[K{line}")
            self.open = not last
            if last:
                self.stream.write("\n")
            self.stream.flush()
        else:
            print(line, file=self.stream, flush=True)

    def close(self) -> None:
        """End a line left open on a terminal."""
        self._end_line()

    def _end_line(self) -> None:
        if self.open:
            self.stream.write("\n")
            self.stream.flush()
            self.open = False
