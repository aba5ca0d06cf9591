"""Timing a GPU op as the calibration's microbenchmarks do: queued behind a spin kernel, L2
flushed on request, the median of CUDA-event-timed runs."""

from __future__ import annotations

import statistics

import torch

from gobrrr.profile.timing import sync, time_steps

FLUSH_BYTES = 256 * 2**20  # over an H100's 50 MB of L2


def flush_buffer(dev: torch.device) -> torch.Tensor | None:
    """A buffer `time_op` zeroes before each run to evict L2 (None off the GPU)."""
    if dev.type != "cuda":
        return None
    return torch.empty(FLUSH_BYTES // 4, dtype=torch.int32, device=dev)


SPIN_CYCLES = 2_000_000  # ~1 ms of GPU clock: longer than the host takes to queue a timed op


def time_op(fn, dev: torch.device, reps: int, flush: torch.Tensor | None = None) -> float:
    """Median GPU seconds of fn() over `reps` runs after 2 warm-ups. On a GPU each run starts
    behind a ~1 ms spin kernel, so the host has queued fn() before the timed region begins:
    the time is the GPU's, without the host's launch latency, as in a training step where the
    host runs ahead (timed from an idle GPU, a 100 µs matmul measured 13-30% slower on the
    H100 host). `flush` is zeroed before each run (outside the timed region) to evict L2."""
    for _ in range(2):
        fn()
    sync(dev)
    spin = getattr(torch.cuda, "_sleep", None) if dev.type == "cuda" else None

    def before():
        if flush is not None:
            flush.zero_()
        if spin is not None:
            spin(SPIN_CYCLES)

    return statistics.median(time_steps(fn, reps, dev.type, before=before))
