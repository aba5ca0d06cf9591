"""What CPU offload of the optimizer costs on this machine, for a calibration
(`Calibration.offload`): the host link and the host's CPU, as torchao's CPUOffloadOptimizer
uses them (see gobrrr.training.offload).

Measured:
- "d2h", "h2d": bytes/s of a copy between a pinned host buffer and the GPU over sizes,
  [[bytes, bytes/s], ...] (one copy each, queued behind a ~1 ms spin kernel so the host's
  launch is not timed; CUDA events; median);
- "adamw:fp32", "adamw:bf16": seconds of one `torch.optim.AdamW(fused=True).step()` on the CPU
  over one parameter of a size, [[elements, seconds], ...] (the parameter and its gradient in
  pinned memory, the moments in ordinary memory, as the offloaded optimizer keeps them; the
  call's own overhead included, as each offloaded parameter has its own optimizer; stepped in
  turn with others of its size, so that its memory is not in the CPU's caches, as in a real
  step where each parameter is touched once);
- "d2h_issue_s", "h2d_issue_s": host seconds to queue one copy on a side stream as the
  offloaded optimizer does (its gradient hook: wait for the compute stream, copy, record an
  event; its step: copy back);
- "threads": the CPU threads torch used (torch.get_num_threads()).
"""

from __future__ import annotations

import statistics
import time

import torch

from gobrrr.calibrate.timing import time_op

#: bytes of the host-link copies measured: 64 KiB .. 1 GiB
LINK_SIZES = tuple(2**k for k in range(16, 31, 2))
#: elements of the CPU AdamW steps measured: 4096 (the smallest offloaded parameter) .. 256 Mi
ADAM_SIZES = tuple(2**k for k in range(12, 29, 2))
#: bytes of parameters, gradients and moments stepped in turn: beyond the CPU's caches
WORKING_SET = 2**29
ADAM_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


def offload_section(dev: torch.device) -> dict:
    """{"offload": {...}}: every measurement above, for `Calibration.offload`."""
    return {
        "offload": {
            **link_bandwidths(dev),
            **cpu_adamw_times(),
            **issue_costs(dev),
            "threads": torch.get_num_threads(),
        }
    }


def link_bandwidths(dev: torch.device, reps: int = 7) -> dict[str, list[list[float]]]:
    """{"d2h": [[bytes, bytes/s], ...], "h2d": [...]} over LINK_SIZES (pinned host memory)."""
    out: dict[str, list[list[float]]] = {"d2h": [], "h2d": []}
    for nbytes in LINK_SIZES:
        host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        gpu = torch.empty(nbytes, dtype=torch.uint8, device=dev)
        d2h = time_op(lambda h=host, g=gpu: h.copy_(g, non_blocking=True), dev, reps)
        h2d = time_op(lambda h=host, g=gpu: g.copy_(h, non_blocking=True), dev, reps)
        out["d2h"].append([float(nbytes), nbytes / d2h])
        out["h2d"].append([float(nbytes), nbytes / h2d])
        del host, gpu
    return out


def cpu_adamw_times(reps: int = 3, dtypes=tuple(ADAM_DTYPES)) -> dict[str, list[list[float]]]:
    """{"adamw:fp32": [[elements, seconds per step], ...], "adamw:bf16": ...}: one
    parameter's step as the offloaded step runs them, one parameter after another, each
    touched once per optimizer step: the parameters of a size are stepped in turn, as many as
    make WORKING_SET bytes (more than the CPU's caches hold), the median per step over `reps`
    passes after one (which creates the moments)."""
    out: dict[str, list[list[float]]] = {}
    pin = torch.cuda.is_available()
    for key in dtypes:
        dtype = ADAM_DTYPES[key]
        points = []
        for n in ADAM_SIZES:
            per = 4 * n * dtype.itemsize  # parameter, gradient and two moments
            opts = [_one_param_adamw(n, dtype, pin) for _ in range(max(1, WORKING_SET // per))]
            points.append([float(n), _median_pass(opts, reps)])
            del opts
        out[f"adamw:{key}"] = points
    return out


def _one_param_adamw(n: int, dtype: torch.dtype, pin: bool) -> torch.optim.Optimizer:
    p = torch.rand(n, dtype=dtype, pin_memory=pin)
    p.grad = torch.rand(n, dtype=dtype, pin_memory=pin)
    return torch.optim.AdamW([p], lr=3e-4, weight_decay=0.01, fused=True)


def _median_pass(opts: list, reps: int) -> float:
    """Median seconds of one opt.step() over `reps` passes through `opts` (after one)."""
    times = []
    for r in range(reps + 1):
        for opt in opts:
            t0 = time.perf_counter()
            opt.step()
            if r:
                times.append(time.perf_counter() - t0)
    return statistics.median(times)


def issue_costs(dev: torch.device, calls: int = 200) -> dict[str, float]:
    """Host seconds to queue one gradient copy (as CPUOffloadOptimizer's hook does) and one
    parameter copy back (as its step does), on 4096-element fp32 tensors."""
    side = torch.cuda.Stream(dev)
    main = torch.cuda.current_stream(dev)
    g = torch.zeros(4096, device=dev)
    h = torch.zeros(4096, pin_memory=True)

    def d2h():
        side.wait_stream(main)
        with torch.cuda.stream(side):
            h.copy_(g, non_blocking=True)
        side.record_event()

    def h2d():
        with torch.cuda.stream(side):
            g.copy_(h, non_blocking=True)

    return {"d2h_issue_s": _per_call(d2h, dev, calls), "h2d_issue_s": _per_call(h2d, dev, calls)}


def _per_call(fn, dev: torch.device, calls: int, rounds: int = 5) -> float:
    """Least over rounds of the mean host seconds per call (the GPU idle: copies this small
    queue faster than they run only for a few hundred calls)."""
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
    torch.cuda.synchronize(dev)
    return best
