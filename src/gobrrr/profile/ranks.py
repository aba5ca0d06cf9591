"""One command on every rank of a torchrun job, and no rank left hanging when another fails.

    group = join(300, "profile --parallel")
    dog = Watchdog(group.rank, 300, on_timeout)
    workload = agreed(build)                 # every rank builds; the first failure is reported
    with dog.waiting("the timed steps"):     # a rank waiting longer ends with one line
        ...
    leave(2)                                 # after reporting an error: exit now

- `agreed`: work every rank does on its own (checks, building the workload) followed by one
  exchange of outcomes, so a failure on one rank (or on all) is reported once, by the first
  rank that failed, and every other rank stops quietly (`OtherRankFailed`) instead of waiting
  in the next collective.
- `Watchdog`: a failure inside collective work (the step itself) leaves the other ranks
  waiting in a collective: past `timeout_s` in one phase, a rank writes "rank R timed out after
  T s waiting for the others in <phase>" and exits (code 2). torch.distributed's own timeout is
  set `BACKEND_MARGIN_S` longer, so this line comes first; under torchrun the agent usually
  stops the other ranks first anyway, as soon as the failing one exits.
- `leave`: flush, tear the process group down (best effort, bounded: NCCL can block there)
  and `os._exit`, so no atexit hook or non-daemon thread waits on a peer that is gone.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import shlex
import sys
import threading
import time
from collections.abc import Callable, Iterator
from typing import NoReturn, TypeVar

import torch.distributed as dist

from gobrrr.errors import GobrrrError
from gobrrr.training.distributed import Group, process_group, under_torchrun

#: seconds a rank waits for the others in one phase (a step, a collective's measurement)
DEFAULT_TIMEOUT_S = 300.0
#: torch.distributed's own timeout is this much longer, so the watchdog's line comes first
BACKEND_MARGIN_S = 60.0
#: seconds `leave` gives destroy_process_group before exiting anyway
TEARDOWN_S = 10.0

T = TypeVar("T")


class OtherRankFailed(GobrrrError):
    """Another rank failed first and reports it; this one stops without a word."""


def join(timeout_s: float, command: str, device: str = "cuda") -> Group:
    """This process's place in the torchrun job (NCCL on GPUs, gloo for `device` "cpu" or
    where no GPU is visible). Not under torchrun: a GobrrrError saying how to start it."""
    if timeout_s <= 0:
        raise GobrrrError(f"--timeout {timeout_s:g}: give a positive number of seconds")
    if not under_torchrun():
        raise GobrrrError(
            f"{command} runs on every rank of a torchrun job, and this process was not "
            "started by torchrun",
            hint=f"start it as `torchrun --nproc-per-node N -m gobrrr {shlex.join(sys.argv[1:])}` "
            "(N: the GPUs to use)",
        )
    backend = "gloo" if device == "cpu" else None
    return process_group(timeout_s + BACKEND_MARGIN_S, backend=backend)


def agreed(work: Callable[[], T]) -> T:
    """`work()` on this rank, then every rank's outcome exchanged: its result when every rank
    succeeded; this rank's exception when it is the first (lowest rank) that failed, so that
    one line reports it; `OtherRankFailed` on every other rank."""
    try:
        result, failed = work(), None
    except Exception as e:  # reported below by the first rank that failed
        result, failed = None, e
    outcomes: list[bool | None] = [None] * dist.get_world_size()
    dist.all_gather_object(outcomes, failed is None)
    first = next((r for r, ok in enumerate(outcomes) if not ok), None)
    if first is None:
        return result  # type: ignore[return-value]
    if first == dist.get_rank() and failed is not None:
        raise failed
    raise OtherRankFailed(f"rank {first} failed")


class Watchdog:
    """Ends this process with one line when a phase (`waiting`) lasts longer than
    `timeout_s` seconds: `on_timeout(GobrrrError)` reports it, then `leave(2)`."""

    def __init__(
        self, rank: int, timeout_s: float, on_timeout: Callable[[GobrrrError], object]
    ) -> None:
        self.rank, self.timeout_s, self.on_timeout = rank, timeout_s, on_timeout
        self._what: str | None = None
        #: the phase entered last (kept after it ends): where a failure happened
        self.last = "joining the job"
        self._deadline = float("inf")
        self._lock = threading.Lock()
        threading.Thread(target=self._watch, name="gobrrr-watchdog", daemon=True).start()

    @contextlib.contextmanager
    def waiting(self, what: str) -> Iterator[None]:
        """Within the block this rank may wait for the others up to `timeout_s` seconds."""
        with self._lock:
            self._what, self._deadline = what, time.monotonic() + self.timeout_s
            self.last = what
        try:
            yield
        finally:
            with self._lock:
                self._what, self._deadline = None, float("inf")

    def _watch(self) -> None:
        while True:
            time.sleep(min(0.5, self.timeout_s / 4))
            with self._lock:
                what, late = self._what, time.monotonic() > self._deadline
            if what is not None and late:
                if os.environ.get("GOBRRR_DEBUG") == "1":
                    faulthandler.dump_traceback(all_threads=True)  # where it waits
                self.on_timeout(timed_out(self.rank, self.timeout_s, what))
                leave(2)


def timed_out(rank: int, timeout_s: float, what: str, detail: str = "") -> GobrrrError:
    """The one line of a rank that waited too long for the others."""
    return GobrrrError(
        f"rank {rank} timed out after {timeout_s:g} s waiting for the others in {what}"
        + (f": {detail}" if detail else ""),
        hint="another rank failed (its error is above) or hangs; if a step is just that "
        "slow, raise --timeout",
    )


def is_timeout(e: BaseException) -> bool:
    """Whether torch.distributed gave up waiting for a peer (gloo and NCCL word it so)."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and ("timed out" in text or "timeout" in text)


def lost_peer(e: BaseException) -> bool:
    """Whether a collective failed because another rank's process went away."""
    text = str(e).lower()
    return isinstance(e, RuntimeError) and any(
        w in text for w in ("connection closed by peer", "connection reset by peer", "broken pipe")
    )


def leave(code: int) -> NoReturn:
    """Exit this rank now with `code`: output flushed, the process group torn down where that
    finishes within `TEARDOWN_S` seconds."""
    for stream in (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__):
        with contextlib.suppress(Exception):
            stream.flush()
    if dist.is_available() and dist.is_initialized():
        t = threading.Thread(target=_destroy, daemon=True)
        t.start()
        t.join(TEARDOWN_S)
    os._exit(code)


def _destroy() -> None:
    with contextlib.suppress(Exception):
        dist.destroy_process_group()


__all__ = [
    "BACKEND_MARGIN_S",
    "DEFAULT_TIMEOUT_S",
    "OtherRankFailed",
    "Watchdog",
    "agreed",
    "is_timeout",
    "join",
    "leave",
    "lost_peer",
    "timed_out",
]
