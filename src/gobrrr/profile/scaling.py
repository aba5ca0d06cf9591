"""The batch-scaling test: is the step overhead-bound?

Time the step at batch B, 2B and 4B. If doubling the work barely changes the step time, the
GPU was not the bottleneck at B (the host's launches and Python were): overhead-bound.

Verdict thresholds on r = t(2B) / t(B): r < 1.3 overhead-bound; r > 1.8 GPU-bound (time grows
with the work); in between, partly overhead-bound.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from gobrrr.errors import GobrrrError
from gobrrr.precision import check_precision
from gobrrr.profile.runner import check_device, median, time_workload
from gobrrr.workload import Workload, iter_tensors

OVERHEAD_RATIO = 1.3
BOUND_RATIO = 1.8


@dataclass(frozen=True)
class ScalingPoint:
    """One batch size: median step seconds (None when it did not fit) and throughput in the
    workload's unit per second ("tokens" for sequences, "samples" otherwise)."""

    batch: int
    step_s: float | None
    per_s: float | None
    unit: str = "samples"


@dataclass(frozen=True)
class ScalingResult:
    points: tuple[ScalingPoint, ...]
    ratio: float | None  # t(2B) / t(B)
    verdict: str  # "overhead-bound" | "partly overhead-bound" | "gpu-bound" | "unknown"
    summary: str

    def to_dict(self) -> dict:
        return asdict(self)


def scaling(
    factory: Callable[[int], Workload],
    batch: int,
    device: str = "cuda",
    precision: str = "bf16-mixed",
    steps: int = 10,
    warmup: int = 3,
    factors: Sequence[int] = (1, 2, 4),
    compile: bool = False,
) -> ScalingResult:
    """Time the step at batch `batch` x each factor; `factory(b)` builds the workload at
    batch b (on the CPU, as `get_workload` does). A batch that runs out of memory ends the
    series (its point has step_s None)."""
    check_device(device)
    check_precision(precision)
    if batch < 1:
        raise GobrrrError(f"batch {batch}: give a positive batch size for the scaling test")
    points: list[ScalingPoint] = []
    for f in factors:
        wl = factory(batch * f)
        try:
            t = median(time_workload(wl, device, precision, steps, warmup, compile=compile))
        except torch.cuda.OutOfMemoryError:
            points.append(ScalingPoint(batch * f, None, None))
            break
        finally:
            del wl
            if device.startswith("cuda"):
                torch.cuda.empty_cache()
        units, unit = factory_units(factory, batch * f)
        points.append(ScalingPoint(batch * f, t, units / t, unit))
    return verdict(points)


def factory_units(factory: Callable[[int], Workload], b: int) -> tuple[int, str]:
    """(units per step, "tokens" | "samples") of the workload at batch b: tokens when it has a
    sequence length or its count comes from a (batch, sequence) integer input."""
    with torch.device("meta"):
        wl = factory(b)
        n = wl.token_count()
    seq = wl.seq_len or any(
        not t.is_floating_point() and t.dim() >= 2 and t.numel() == n
        for t in iter_tensors(wl.batch)
    )
    return n, "tokens" if seq else "samples"


def verdict(points: Sequence[ScalingPoint]) -> ScalingResult:
    """Judge a series of points (the first two decide; see the module docstring)."""
    ok = [p for p in points if p.step_s]
    if len(ok) < 2 or ok[1].batch != 2 * ok[0].batch:
        return ScalingResult(
            tuple(points), None, "unknown", "needs timings at B and 2B to judge (2B did not fit?)"
        )
    r = ok[1].step_s / ok[0].step_s
    if r < OVERHEAD_RATIO:
        v = "overhead-bound"
    elif r > BOUND_RATIO:
        v = "gpu-bound"
    else:
        v = "partly overhead-bound"
    times = ", ".join(f"batch {p.batch} -> {p.step_s * 1e3:.3g} ms" for p in ok)
    summary = (
        f"{times}: doubling the batch multiplied the step time by {r:.2f}, so at batch "
        f"{ok[0].batch} the step is {v}"
    )
    if v != "gpu-bound":
        summary += " (a larger batch is almost free; torch.compile / CUDA graphs cut launches)"
    return ScalingResult(tuple(points), r, v, summary)
