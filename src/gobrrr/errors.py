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


# -- arguments of the public functions, checked where they enter ------------------------------

#: the largest count (batch, sequence, GPUs) gobrrr accepts: torch's sizes are int64, and a
#: step beyond 2**31 samples or tokens in one dimension is a typo, not a training run
MAX_COUNT = 2**31 - 1


def check_count(name: str, value: object, *, optional: bool = True, most: int = MAX_COUNT) -> None:
    """`value` is a whole number in [1, most] (or None where `optional`); else a GobrrrError
    naming `name=` and the fix."""
    if value is None and optional:
        return
    if isinstance(value, bool) or not isinstance(value, int):
        hint = " (without quotes)" if isinstance(value, str) else ""
        raise GobrrrError(
            f"{name}={value!r} is {_a(value)}",
            hint=f"give a whole number > 0{hint}, e.g. {name}=8",
        )
    if not 1 <= value <= most:
        raise GobrrrError(
            f"{name}={value} is out of range", hint=f"give a whole number from 1 to {most:,}"
        )


def check_flag(name: str, value: object) -> None:
    """`value` is True or False."""
    if not isinstance(value, bool):
        raise GobrrrError(f"{name}={value!r} is {_a(value)}", hint=f"give {name}=True or False")


def check_choice(name: str, value: object, choices: Iterable[str]) -> None:
    """`value` is one of the strings `choices`, with "did you mean" for a misspelling."""
    choices = list(choices)
    if isinstance(value, str) and value in choices:
        return
    near = did_you_mean(value, choices) if isinstance(value, str) else ""
    raise GobrrrError(
        f"{name}={value!r} is unknown{near}",
        hint=f"give one of {', '.join(repr(c) for c in choices)}",
    )


def check_number(name: str, value: object, low: float, high: float, example: str) -> None:
    """`value` is a finite real number in [low, high)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise GobrrrError(f"{name}={value!r} is {_a(value)}", hint=f"give a number, e.g. {example}")
    if not low <= value < high:  # nan fails both comparisons
        raise GobrrrError(
            f"{name}={value!r} is out of range", hint=f"give a number in [{low:g}, {high:g})"
        )


def _a(value: object) -> str:
    """ "a str", "an int": the type of `value` with its article."""
    name = type(value).__name__
    return f"{'an' if name[0] in 'aeiou' else 'a'} {name}"
