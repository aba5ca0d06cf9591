"""`gobrrr plan --verify`: apply the best plans on this machine's GPU and measure each beside
its prediction."""

from __future__ import annotations

import gc
import statistics
from dataclasses import dataclass
from typing import Any

from gobrrr.errors import GobrrrError
from gobrrr.plan.result import Plan


@dataclass(frozen=True)
class Verified:
    """One plan, run: median step time over `steps` CUDA-event-timed optimizer steps after
    the warm-up, and the allocator's peaks over them (bytes); `error` when it failed
    (out of memory included)."""

    plan: Plan
    step_s: float | None
    peak_allocated: int | None
    peak_reserved: int | None
    error: str | None = None

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "knobs": self.plan.knobs.to_dict(),
            "predicted_step_s": self.plan.step_s,
            "measured_step_s": self.step_s,
            "predicted_peak_bytes": self.plan.peak_bytes,
            "measured_peak_bytes": self.peak_allocated,
            "predicted_reserved_bytes": self.plan.reserved_bytes,
            "measured_reserved_bytes": self.peak_reserved,
            "error": self.error,
        }
        if self.step_s:
            out["step_error"] = self.plan.step_s / self.step_s - 1
            out["peak_error"] = self.plan.peak_bytes / self.peak_allocated - 1
        return out


def verify(
    make_workload, plans: list[Plan], precision: str, *, warmup: int = 2, steps: int = 5
) -> list[Verified]:
    """Run each plan on the GPU: `make_workload(global_batch)` builds a fresh workload (on
    the current device) for each, so every plan starts from an empty allocator."""
    import torch

    if not torch.cuda.is_available():
        raise GobrrrError(
            "--verify runs the plans on a GPU, and torch sees none here",
            hint="run it on a machine with a CUDA GPU, or drop --verify",
        )
    out = []
    for p in plans:
        out.append(_one(make_workload, p, precision, warmup, steps))
        gc.collect()
        torch.cuda.empty_cache()
    return out


def _one(make_workload, p: Plan, precision: str, warmup: int, steps: int) -> Verified:
    import torch

    from gobrrr.plan.apply import apply
    from gobrrr.profile.runner import time_steps

    try:
        with torch.device("cuda"):
            wl = make_workload(p.knobs.global_batch)
        step = apply(wl, p.knobs, precision=precision)
        for _ in range(warmup):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        times = time_steps(step, steps, "cuda")
        return Verified(
            p,
            statistics.median(times),
            torch.cuda.max_memory_allocated(),
            torch.cuda.max_memory_reserved(),
        )
    except torch.cuda.OutOfMemoryError as e:
        return Verified(p, None, None, None, f"out of memory: {str(e).splitlines()[0]}")
