"""Ctrl-C at any moment of a command: one line "gobrrr: error: interrupted", exit code 130
(128 + SIGINT, what a shell reports for a program SIGINT ended), no traceback, and no output
file left half-written.

Two stages. While the package is still importing (torch alone takes seconds) nothing has been
written, so the handler `gobrrr/__init__.py` installs first (`install_early`) says so and ends
the process at once. Once `main` runs, `handling` raises KeyboardInterrupt as Python does, and
also remembers the signal: a KeyboardInterrupt that library code catches and drops (a bare
`except BaseException`, a finalizer) still ends the command as interrupted (`check`), before
any output is printed.

Once the command starts writing its output (`commit`) a Ctrl-C is ignored: the output is
written whole, and the process's own teardown (torch's takes a few hundred milliseconds, with
Python's default SIGINT handler back in place) is not cut short, which would end the process
by the signal after its result was out.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import threading
from collections.abc import Iterator

INTERRUPTED = 130  # 128 + SIGINT
_hit = threading.Event()


def is_command() -> bool:
    """Whether this process runs the `gobrrr` command (the console script, `python -m
    gobrrr`, or torchrun's `-m gobrrr`) rather than a program that imports gobrrr."""
    if sys.argv and os.path.basename(sys.argv[0]) == "gobrrr":
        return True
    argv = getattr(sys, "orig_argv", [])
    return any(a == "-m" and b == "gobrrr" for a, b in zip(argv, argv[1:], strict=False))


def install_early() -> None:
    """In the `gobrrr` command only: a Ctrl-C before `main` starts ends the process quietly."""
    if is_command() and threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, _exit_now)


def _exit_now(signum, frame) -> None:
    # the package is importing: nothing is written yet, and nothing is worth unwinding
    os.write(2, b"gobrrr: error: interrupted\n")
    if "--json" in sys.argv:
        body = {"version": 1, "error": "interrupted", "hint": None}
        os.write(1, (json.dumps(body, indent=2) + "\n").encode())
    os._exit(INTERRUPTED)


def _raise(signum, frame) -> None:
    _hit.set()
    raise KeyboardInterrupt


@contextlib.contextmanager
def handling() -> Iterator[None]:
    """While a command runs: Ctrl-C raises KeyboardInterrupt and is remembered (`check`).
    Outside the main thread (a test calling `main` from a thread) signals are not ours.
    Afterwards the handler before it comes back; in the `gobrrr` command Ctrl-C is ignored
    instead until the process is gone."""
    _hit.clear()
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, _raise)
    try:
        yield
    finally:
        # the command's output (or its one error line) is out: nothing is left to interrupt
        signal.signal(signal.SIGINT, signal.SIG_IGN if is_command() else previous)
        if _hit.is_set():
            forget_unhandled()


def commit() -> None:
    """The command is about to write its output: a Ctrl-C that came during the work ends it
    here (`check`); one that comes from now on is ignored, so the output is written whole."""
    check()
    if threading.current_thread() is threading.main_thread():
        signal.signal(signal.SIGINT, signal.SIG_IGN)


def forget_unhandled() -> None:
    """Clear CPython's record of a KeyboardInterrupt that went through code run from a string
    (`eval` or `exec` of a string: torch evaluates schemas' type annotations so while it
    traces, and dataclasses define their methods so): the record outlives our catching the
    exception, and at exit CPython then ends its own process by SIGINT (a parent sees -2, not
    our 130). Running an empty string down the same path (`PyRun_StringFlags`) clears it: the
    record is reset before every such evaluation."""
    if sys.implementation.name != "cpython":
        return
    with contextlib.suppress(AttributeError, OSError):
        run = ctypes.pythonapi.PyRun_SimpleStringFlags
        run.argtypes, run.restype = [ctypes.c_char_p, ctypes.c_void_p], ctypes.c_int
        run(b"", None)


def check() -> None:
    """Raise KeyboardInterrupt if Ctrl-C came while the command ran, even where library code
    swallowed the exception: called before any output is written."""
    if _hit.is_set():
        raise KeyboardInterrupt


def hit() -> bool:
    """Whether Ctrl-C came while the command ran."""
    return _hit.is_set()
