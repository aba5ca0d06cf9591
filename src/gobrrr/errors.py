"""The one exception type users see, the one warning type, and the wording they share.

The CLI turns a GobrrrError into one line on stderr and exit code 2 (and, under `--json`, a
JSON object on stdout); a GobrrrWarning into one line on stderr while the run goes on.
"""

from __future__ import annotations

import difflib
from collections.abc import Iterable


class GobrrrError(Exception):
    """Bad input or an environment gobrrr cannot work in; the message names the value and
    the fix.

    `GobrrrError(message)` carries both in one sentence; `GobrrrError(problem, hint=fix)`
    keeps them apart, so `--json` can report {"error": problem, "hint": fix}. `str(e)` is
    always the whole line."""

    def __init__(self, message: str, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.hint = hint

    def __str__(self) -> str:
        return f"{self.message}: {self.hint}" if self.hint else self.message


class GobrrrWarning(UserWarning):
    """Something gobrrr did not use or had to assume; the run goes on (e.g. `--seq` given to
    a model that takes no sequence length)."""


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """ " (did you mean 'x'?)" when `word` is a close misspelling of one of `choices` (case
    and separators ignored), else ""."""
    choices = list(choices)
    if word in choices:
        return ""
    folded: dict[str, str] = {}
    for c in choices:  # the first spelling of a folded name wins (a name before its aliases)
        folded.setdefault(_fold(c), c)
    if _fold(word) in folded and folded[_fold(word)] != word:
        return f" (did you mean {folded[_fold(word)]!r}?)"
    close = difflib.get_close_matches(word.lower(), [c.lower() for c in choices], n=1, cutoff=0.75)
    if not close:
        return ""
    original = next(c for c in choices if c.lower() == close[0])
    return f" (did you mean {original!r}?)"


def _fold(s: str) -> str:
    return s.lower().replace("-", "").replace("_", "").replace(" ", "")
