"""torchao's 8-bit AdamW step measured on a GPU, for a calibration (`Calibration.optim8`).

torchao's AdamW8bit updates one parameter at a time through a torch.compile'd
`single_param_adam` (Inductor's kernels for that shape, behind dynamo's guards). What a
training step pays for it, per parameter update:
  device: seconds of the update's kernels, over the bytes the update must move
    (`cost._ops_optim.adam8bit_bytes`), measured on a GPU kept busy (the host queues the
    updates behind a spin kernel, `timing.time_op`);
  host: seconds the host spends per update (the optimizer's Python, dynamo's guards, the
    compiled wrapper and its launches), timed with the host's clock;
  kernels: CUDA kernels (and copies) per update, counted by the profiler;
  transient: bytes the update allocates and frees again (Inductor's buffers), the peak over
    the step's allocated bytes before it.
Over a grid of parameter sizes x parameters per step, fp32 parameters and gradients (what a
bf16-mixed step holds); sizes under 4096 elements keep fp32 moments (torchao's rule).

The layout matters. torchao quantises its moments in blocks of 256 consecutive elements; for a
parameter whose rows are one block wide ((n, 256)) Inductor makes the update one fused kernel
that allocates nothing, but for any other row width (a (50257, 768) embedding, a (4096, 4096)
projection) it splits it and keeps the new moments in fp32 in global memory between the
kernels: two fp32 buffers of the parameter's size and two of its block count, allocated and
freed inside the update (`benchmarks/results/optim8_transient_h100.json`), and more bytes
moved. So the grid is measured twice: rows of one block (`BLOCK`) and rows of `ROW_WIDTH`
(a model's hidden size); `row_widths` checks the rule at other widths.
"""

from __future__ import annotations

import statistics
import time

import torch

from gobrrr.calibrate.timing import time_op
from gobrrr.cost._ops_optim import BLOCK, adam8bit_bytes, quantized

SIZES = (1024, 4096, 65536, 2**20, 2**22, 2**24, 2**26)  # elements per parameter
COUNTS = (1, 8, 64)  # parameters per step
MAX_STEP_ELEMENTS = 2**28  # skip grid points holding more (1 GiB of fp32 parameters)
DISTINCT = 8  # parameters of as many distinct shapes: one compiled entry each behind the guards
REPS = 10
ROW_WIDTH = 4096  # the rows of the second layout: a hidden size, not one 256-element block
WIDTHS = (128, 512, 768, 1024, 4096)  # row widths `row_widths` measures at WIDTH_NUMEL
WIDTH_NUMEL = 2**22


def optim8_section(dev: torch.device) -> dict:
    """{"optim8": {...}}: the measured grid ("points") and what the cost model reads from it
    (`summarize`). {"optim8": {}} without torchao (a full calibration goes on; the planner
    then says the section is missing)."""
    try:
        import torchao.optim as ao
    except ImportError:
        return {"optim8": {}}
    points = [_point(ao, dev, n, k) for n in SIZES for k in COUNTS if n * k <= MAX_STEP_ELEMENTS]
    points += [_point(ao, dev, n, 1, ROW_WIDTH) for n in SIZES if quantized(n) and n >= ROW_WIDTH]
    return {"optim8": summarize(points, _distinct_host(ao, dev), row_widths(ao, dev))}


def row_widths(ao, dev: torch.device) -> list[list[int]]:
    """[[row width, bytes the update allocates inside]] for a parameter of WIDTH_NUMEL
    elements in rows of each of WIDTHS (and of one block)."""
    return [
        [w, _point(ao, dev, WIDTH_NUMEL, 1, w, timed=False)["transient"]] for w in (256, *WIDTHS)
    ]


def summarize(
    points: list[dict], host_distinct: float, widths: list[list[int]] | None = None
) -> dict:
    """What the cost model reads from the grid: "device" [[bytes per update, seconds], ...]
    for quantised moments ("device_small": the fp32-moment path), from the one-parameter
    points — with more, the host is what the timed loop waits on (measured on an H100 it
    spends ~0.4 ms per update, so 8 updates outlast the ~1 ms spin kernel that lets
    `time_op` time the GPU alone); "host" (the median seconds per update over the
    64-parameter points, one shape), "host_distinct" (per update when the parameters have
    DISTINCT shapes, as a model's do); "kernels" per update (the profiler's GPU events less
    the optimizer's own annotation); "transient" [[elements, bytes], ...]; the same device
    curve and transient bytes for parameters whose rows are not one block ("device_rows",
    "transient_rows"); "row_widths" [[width, transient bytes]]; and the points."""
    one = [p for p in points if p["count"] == 1 and p.get("width", BLOCK) == BLOCK]
    rows = [p for p in points if p["count"] == 1 and p.get("width", BLOCK) != BLOCK]

    def kernels(p):
        return p["kernels"] - sum("#" in n for n in p["kernel_names"]) / p["count"]

    return {
        "device": [[p["bytes"], p["device_s"]] for p in one if p["quantized"]],
        "device_small": [[p["bytes"], p["device_s"]] for p in one if not p["quantized"]],
        "host": statistics.median(p["host_s"] for p in points if p["count"] == max(COUNTS)),
        "host_distinct": host_distinct,
        "kernels": statistics.median(kernels(p) for p in points if p.get("width", BLOCK) == BLOCK),
        "transient": [[p["numel"], p["transient"]] for p in one],
        "device_rows": [[p["bytes"], p["device_s"]] for p in rows],
        "transient_rows": [[p["numel"], p["transient"]] for p in rows],
        "row_widths": widths or [],
        "points": points,
    }


def _params(dev: torch.device, shapes) -> list[torch.nn.Parameter]:
    out = []
    for s in shapes:
        p = torch.nn.Parameter(torch.randn(s, device=dev))
        p.grad = torch.randn_like(p) * 1e-3
        out.append(p)
    return out


def _point(
    ao, dev: torch.device, numel: int, count: int, width: int = BLOCK, timed: bool = True
) -> dict:
    """One grid point: `count` parameters of (numel/width, width) elements."""
    params = _params(dev, [(numel // width, width)] * count)
    opt = ao.AdamW8bit(params, lr=1e-3)
    for _ in range(3):  # the first compiles this shape
        opt.step()
    torch.cuda.synchronize(dev)
    device_s = time_op(opt.step, dev, REPS) / count if timed else 0.0
    host_s = _host_per_update(opt.step, dev, count) if timed else 0.0
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    opt.step()
    torch.cuda.synchronize(dev)
    transient = torch.cuda.max_memory_allocated(dev) - before
    kernels, names = _kernels(opt.step)
    del opt, params
    torch.cuda.empty_cache()
    return {
        "numel": numel,
        "count": count,
        "width": width,
        "quantized": quantized(numel),
        "bytes": adam8bit_bytes(numel, 4, 4),
        "device_s": device_s,
        "host_s": host_s,
        "transient": transient,
        "kernels": kernels / count,
        "kernel_names": names,
    }


def _host_per_update(step, dev: torch.device, count: int, rounds: int = 5) -> float:
    """Least over `rounds` of the host's wall seconds per update, the GPU synchronised
    outside the timed call."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        step()
        best = min(best, (time.perf_counter() - t0) / count)
    torch.cuda.synchronize(dev)
    return best


def _kernels(step) -> tuple[int, list[str]]:
    """(device activities of one step: kernels, copies and fills, their distinct names)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    gpu = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    return len(gpu), sorted({e.name for e in gpu})[:20]


def _distinct_host(ao, dev: torch.device) -> float:
    """Host seconds per update when the step's DISTINCT parameters each have their own
    shape: each call's guards are checked against every compiled entry before its own."""
    params = _params(dev, [(16 + i, 256) for i in range(DISTINCT)])
    opt = ao.AdamW8bit(params, lr=1e-3)
    for _ in range(3):
        opt.step()
    out = _host_per_update(opt.step, dev, DISTINCT)
    del opt, params
    torch.cuda.empty_cache()
    return out


__all__ = ["optim8_section"]
