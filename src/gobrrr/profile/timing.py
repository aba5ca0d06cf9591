"""Timing real work on a device: the one synchronisation and the one CUDA-event timer that
profile (steps) and calibrate (microbenchmarks) share.

It lives here, below both: calibrate already imports profile (it runs real steps with
`profile.runner.prepare`), so profile may not import calibrate; this module needs only torch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import torch


def sync(device: str | torch.device) -> None:
    """Wait for every kernel queued on `device` ("cuda", "cuda:N", a torch.device; the CPU
    has nothing to wait for)."""
    dev = torch.device(device)
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def time_parts(
    parts: Sequence[Callable[[], object]],
    reps: int,
    device: str | torch.device,
    before: Callable[[], object] | None = None,
    sync_each: bool = True,
) -> list[list[float]]:
    """Seconds of each of `parts`, run back to back, over `reps` repeats: [[s of part 0, s of
    part 1, ...] per repeat]. On a GPU the parts sit between CUDA events (device time); on the
    CPU between perf_counter readings. `before()` runs ahead of each repeat, outside the timed
    region (an L2 flush, a spin kernel). `sync_each`: wait for each repeat before the next is
    queued; False queues every repeat and waits once (no idle between them, as a steady
    pattern needs)."""
    if torch.device(device).type != "cuda":
        return [_host_parts(parts, before) for _ in range(reps)]
    runs = []
    for _ in range(reps):
        if before is not None:
            before()
        events = [torch.cuda.Event(enable_timing=True) for _ in range(len(parts) + 1)]
        events[0].record()
        for part, end in zip(parts, events[1:], strict=True):
            part()
            end.record()
        if sync_each:
            events[-1].synchronize()
        runs.append(events)
    if not sync_each:
        sync(device)
    return [[a.elapsed_time(b) * 1e-3 for a, b in zip(ev, ev[1:], strict=False)] for ev in runs]


def _host_parts(
    parts: Sequence[Callable[[], object]], before: Callable[[], object] | None
) -> list[float]:
    if before is not None:
        before()
    out, t0 = [], time.perf_counter()
    for part in parts:
        part()
        t1 = time.perf_counter()
        out.append(t1 - t0)
        t0 = t1
    return out


def time_steps(
    step: Callable[[], object],
    n: int,
    device: str | torch.device,
    before: Callable[[], object] | None = None,
) -> list[float]:
    """Seconds per call of `step()`, n calls, each waited for: CUDA events on a GPU,
    perf_counter on the CPU. `before()` runs ahead of each call, outside the timed region."""
    return [t for (t,) in time_parts([step], n, device, before)]
