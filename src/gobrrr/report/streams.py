"""What reaches the terminal while a command runs.

stdout carries gobrrr's own output only (tables, or JSON under `--json`): whatever else is
printed meanwhile (a `print()` in the user's model, a library's progress) goes to stderr, so
`--json` stays JSON. Library messages that are not the user's business (the fake-tensor
logger's traceback before gobrrr's own error line, FakeTensor data-pointer warnings,
transformers' loss_type notice) are dropped; other warnings are kept. gobrrr's own warnings
are one line each, "gobrrr: warning: ...".
"""

from __future__ import annotations

import contextlib
import io
import logging
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TextIO

from gobrrr.errors import GobrrrWarning

_PACKAGE = str(Path(__file__).resolve().parents[1])  # .../gobrrr
_OURS = ("rich.", "argparse")  # modules that print gobrrr's own output for it

# (logger, start of the message) of log records that are not the user's business
QUIET_LOGS = (
    # logged with its traceback when an op fails on fake tensors; gobrrr reports the error
    ("torch._subclasses.fake_tensor", "failed while attempting to run meta for"),
    # transformers picks its default loss for a model built from a config
    ("transformers.modeling_utils", "`loss_type=None` was set in the config"),
)
# warnings (message regexes) that are not the user's business
QUIET_WARNINGS = (r"Accessing the data pointer of FakeTensor is deprecated",)


class _Router(io.TextIOBase):
    """A stdout that passes gobrrr's writes to the real stdout and everyone else's to
    stderr, deciding by the code that wrote (print() writes from its caller's frame)."""

    def __init__(self, out: TextIO, err: TextIO) -> None:
        self.out, self.err = out, err

    def write(self, s: str) -> int:
        frame = sys._getframe(1)
        ours = frame.f_code.co_filename.startswith(_PACKAGE) or str(
            frame.f_globals.get("__name__", "")
        ).startswith(_OURS)
        return (self.out if ours else self.err).write(s)

    def flush(self) -> None:
        self.out.flush()
        self.err.flush()

    @property
    def buffer(self):  # bytes written raw (sys.stdout.buffer) are never gobrrr's: stderr's
        return self.err.buffer

    def reconfigure(self, **kwargs) -> None:  # the user's settings apply where their text goes
        getattr(self.err, "reconfigure", lambda **_: None)(**kwargs)

    def isatty(self) -> bool:
        return self.out.isatty()

    def fileno(self) -> int:
        return self.out.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self.out, "encoding", "utf-8")


class _DropMessages(logging.Filter):
    def __init__(self, start: str) -> None:
        super().__init__()
        self.start = start

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(self.start)


@contextlib.contextmanager
def command_streams() -> Iterator[list[str]]:
    """Route stdout, quiet library noise and show gobrrr's warnings as one line each, for the
    duration of one command. Yields the list the warnings' texts are collected in (for
    `--json`)."""
    said: list[str] = []
    real_out = sys.stdout
    filters = [(logging.getLogger(name), _DropMessages(start)) for name, start in QUIET_LOGS]
    with warnings.catch_warnings():
        for pattern in QUIET_WARNINGS:
            warnings.filterwarnings("ignore", message=pattern)
        warnings.simplefilter("always", GobrrrWarning)
        original = warnings.showwarning
        warnings.showwarning = _shower(said, original)
        for logger, f in filters:
            logger.addFilter(f)
        sys.stdout = _Router(real_out, sys.stderr)
        try:
            yield said
        finally:
            sys.stdout = real_out
            for logger, f in filters:
                logger.removeFilter(f)


def _shower(said: list[str], original):
    def show(message, category, filename, lineno, file=None, line=None):
        if issubclass(category, GobrrrWarning):
            text = " ".join(str(message).split())
            said.append(text)
            print(f"gobrrr: warning: {text}", file=sys.stderr)
        else:
            original(message, category, filename, lineno, file, line)

    return show


def one_line(text: str) -> str:
    """A message as one line: newlines and runs of spaces collapsed."""
    return " ".join(str(text).split())
