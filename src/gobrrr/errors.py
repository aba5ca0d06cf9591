"""The one exception type users see. The CLI turns it into one line and exit code 2."""

from __future__ import annotations


class GobrrrError(Exception):
    """Bad input or an environment gobrrr cannot work in; the message names the value and
    the fix."""
