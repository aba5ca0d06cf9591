"""The `gobrrr` command: `app` (the parser and the one error path), `checks` (what is checked
before the work starts), `measure` (profile and calibrate). `main` is the console script's
entry point (`gobrrr = "gobrrr.cli:main"`)."""

from gobrrr.cli.app import main

__all__ = ["main"]
