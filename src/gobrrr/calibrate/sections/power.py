"""Calibration of the power limit's hold on compute-bound kernels.

A GPU keeps its board power under a limit (700 W on an H100 SXM) by lowering its clocks.
Tensor-core matmuls at full rate draw more than the limit allows, so a stream of them runs at
a lower clock than a short burst: on an H100, back-to-back bf16 matmuls ran at 660-710 TFLOP/s
with the SM clock at 1200-1500 MHz, against 770-823 TFLOP/s when each ran alone after an idle
gap (benchmarks/results/matmul_sustained_h100.json). The calibration's compute rates are
measured as such bursts (`timing.time_op`), so they hold for a step only as far as the step
leaves the board room.

`power_duty` measures how far: the rate of bf16 matmuls run in a steady pattern with
memory-bound copies, over the share of the time the matmuls take (their duty). The cost model
reads the step's own duty off its compute-bound ops and takes their rate at that duty
(`cost.roofline`).
"""

from __future__ import annotations

import statistics
import time

import torch

from gobrrr.calibrate.timing import time_op
from gobrrr.profile.timing import sync, time_parts

#: (matmuls, copies) per repeat of the pattern: duties from about 0.2 to 1
PATTERNS = ((1, 4), (1, 2), (1, 1), (2, 1), (4, 1), (8, 1), (1, 0))
MM = 4096  # an (MM x MM) @ (MM x MM) bf16 matmul: ~0.17 ms at full rate on an H100
COPY_ELEMENTS = 2**26  # a 256 MiB fp32 copy: ~0.17 ms at an H100's bandwidth


def power_duty(
    dev: torch.device,
    heat_s: float = 1.5,
    reps: int = 20,
    settle_s: float = 1.0,
    mm: int = MM,
    copy_elements: int = COPY_ELEMENTS,
) -> dict[str, list[list[float]]]:
    """{"bf16": [[duty, fraction], ...], "copy": [[duty, fraction], ...]}, by duty: the
    matmuls' (and the copies') achieved share of their rate in a burst, in a steady pattern of
    `i` matmuls then `j` copies, once the pattern has run for `heat_s` seconds; duty is the
    matmuls' share of the pattern's time, as it ran. The burst rate: `timing.time_op` (each run
    behind a spin kernel) after `settle_s` idle, as the calibration's matmul grid measures.
    Each pattern starts after `settle_s` idle too; its times are medians over `reps` repeats,
    each group timed with CUDA events. `mm`, `copy_elements`: the kernels' sizes."""
    matmul, copy = kernels(dev, mm, copy_elements)
    settle(dev, settle_s)
    burst_mm = time_op(matmul, dev, 5)
    settle(dev, settle_s)
    burst_copy = time_op(copy, dev, 5)
    out: dict[str, list[list[float]]] = {"bf16": [], "copy": []}
    for i, j in PATTERNS:
        mm_t, copy_t = steady(matmul, copy, i, j, dev, heat_s, reps, settle_s)
        duty = i * mm_t / (i * mm_t + j * copy_t)
        out["bf16"].append([duty, burst_mm / mm_t])
        if j:
            out["copy"].append([duty, burst_copy / copy_t])
    return out


def kernels(dev: torch.device, mm: int = MM, copy_elements: int = COPY_ELEMENTS):
    """(matmul, copy): zero-argument functions running an (mm x mm) @ (mm x mm) bf16 matmul
    and a copy of `copy_elements` fp32 values, on random normal inputs made here."""
    a = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)
    b = torch.randn(mm, mm, device=dev, dtype=torch.bfloat16)
    c = torch.empty(mm, mm, device=dev, dtype=torch.bfloat16)
    x = torch.randn(copy_elements, device=dev)
    y = torch.empty_like(x)

    def matmul() -> None:
        torch.mm(a, b, out=c)

    def copy() -> None:
        y.copy_(x)

    return matmul, copy


def steady(
    matmul, copy, i: int, j: int, dev: torch.device, heat_s: float, reps: int, settle_s: float
) -> tuple[float, float]:
    """(seconds per matmul, per copy) in the steady pattern of `i` matmuls then `j` copies:
    after `settle_s` idle and `heat_s` seconds of the pattern, `_groups` over `reps`."""
    settle(dev, settle_s)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < heat_s:
        for _ in range(8):
            for _ in range(i):
                matmul()
            for _ in range(j):
                copy()
        sync(dev)
    return _groups(matmul, copy, i, j, reps, dev)


def _groups(mm, copy, i: int, j: int, reps: int, dev: torch.device) -> tuple[float, float]:
    """(seconds per matmul, per copy): medians over `reps` repeats of the pattern, each
    group between CUDA events, every repeat queued before one wait so the GPU never idles
    (on a CPU: the host's clock around each group)."""

    def mms() -> None:
        for _ in range(i):
            mm()

    def copies() -> None:
        for _ in range(j):
            copy()

    runs = time_parts([mms, copies], reps, dev, sync_each=False)
    mm_t = statistics.median(r[0] for r in runs) / i
    copy_t = statistics.median(r[1] for r in runs) / j if j else 0.0
    return mm_t, copy_t


def settle(dev: torch.device, seconds: float) -> None:
    sync(dev)
    time.sleep(seconds)
