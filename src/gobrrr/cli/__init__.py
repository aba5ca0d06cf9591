"""The `gobrrr` command: `app` (the parser and the one error path), `checks` (what is checked
before the work starts), `measure` (profile and calibrate), `interrupt` (Ctrl-C). `main` is
the console script's entry point (`gobrrr = "gobrrr.cli:main"`).

This file imports nothing heavy: `gobrrr/__init__.py` loads `cli.interrupt` before torch, so
a Ctrl-C during the seconds of importing is one line too."""

from __future__ import annotations


def main(argv: list[str] | None = None) -> int:
    """Run `gobrrr ARGV...` (default: sys.argv[1:]); returns the exit code."""
    from gobrrr.cli.app import main as run

    return run(argv)


__all__ = ["main"]
