"""Named passes over the step graph: each takes a StepGraph and returns a new one."""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator


@contextlib.contextmanager
def gc_paused() -> Iterator[None]:
    """Python's cycle collector off for the block. A pass makes tens of thousands of small
    objects and no reference cycles; the collector would walk the whole heap (the traced
    model's too) again and again, more than doubling the time."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()
