"""A CUDA graph's replay, for a calibration (`Calibration.cudagraph`).

Replayed, a captured step costs the host one `graph.replay()` instead of an issue per op, and
the GPU runs the captured kernels back to back. Both are measured on chains of N kernels
captured as one graph, N in NODES, of two kinds: "tiny" (an in-place add on one element: the
kernel is all latency) and "matmul" (a small bf16 matmul written into a fixed output, work
beside the latency). Each chain is replayed REPS times:
- host: `time.perf_counter()` around `replay()`, the GPU idle before each (synchronized), so
  the call never waits for room in the launch queue;
- device: CUDA events around `replay()` queued behind a spin kernel (`calibrate.timing`), so
  the host's launch is hidden and the time is the GPU's.
Fitted in N over the tiny chains: host = launch_host_s + node_host_s x N, device =
launch_device_s + node_device_s x N (node_device_s takes the place of the eager kernel
latency for a captured kernel: `cost.cudagraph`). The matmul chains' device time per node,
beside the same matmul timed alone (as the calibration's matmul figures are), says what a
captured matmul node costs beyond it, per size (MATMULS: "matmul_gaps", [FLOPs, s]; the
smallest's also as "matmul_gap_s").
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence

import torch

from gobrrr.calibrate.timing import time_op

NODES = (10, 100, 1000)
REPS = 50
MATMUL = 256  # a (256, 256) x (256, 256) bf16 matmul: ~34 MFLOP, a few microseconds
#: the square bf16 matmuls whose captured chains are set beside the same matmul timed alone
#: (34 MFLOP to 17 GFLOP: a few microseconds to ~30)
MATMULS = (256, 1024, 2048)


def cudagraph_section(dev: torch.device, nodes: Sequence[int] = NODES, reps: int = REPS) -> dict:
    """The `cudagraph` calibration section measured on `dev` (a CUDA device)."""
    points = []
    for kind, size in (("tiny", 0), *(("matmul", m) for m in MATMULS)):
        body, work = _kernels(kind, dev, size)
        mine = []
        for n in nodes:
            graph = _captured(lambda body=body, n=n: [body() for _ in range(n)])
            host = _host_time(graph, reps)
            device = time_op(graph.replay, dev, reps)
            mine.append({"kind": kind, "nodes": n, "host_s": host, "device_s": device})
            del graph
        if kind == "matmul":
            eager = time_op(body, dev, reps)
            for p in mine:
                p.update(size=size, flops=work, eager_kernel_s=eager)
        points += mine
    return {**fit(points), "points": points}


def fit(points: list[dict]) -> dict[str, float]:
    """The section's figures from its measured chains (least squares in N over the "tiny"
    ones; intercepts clamped at 0): launch_host_s, node_host_s, launch_device_s,
    node_device_s, and, where matmul chains were measured with their eager time,
    matmul_gap_s (device seconds a captured matmul node costs beyond the eager kernel)."""
    tiny = [p for p in points if p["kind"] == "tiny"]
    n = [float(p["nodes"]) for p in tiny]
    a_host, b_host = _line(n, [p["host_s"] for p in tiny])
    a_dev, b_dev = _line(n, [p["device_s"] for p in tiny])
    out = {
        "launch_host_s": max(a_host, 0.0),
        "node_host_s": max(b_host, 0.0),
        "launch_device_s": max(a_dev, 0.0),
        "node_device_s": max(b_dev, 0.0),
    }
    gaps = []
    for size in sorted({p.get("size", MATMUL) for p in points if p["kind"] == "matmul"}):
        mm = [
            p
            for p in points
            if p["kind"] == "matmul" and "eager_kernel_s" in p and p.get("size", MATMUL) == size
        ]
        if len(mm) >= 2:
            _, per = _line([float(p["nodes"]) for p in mm], [p["device_s"] for p in mm])
            gaps.append([mm[0].get("flops", 2.0 * size**3), per - mm[0]["eager_kernel_s"]])
    if gaps:
        out["matmul_gap_s"] = gaps[0][1]  # the smallest matmul's
        out["matmul_gaps"] = gaps  # [flops, gap s] by size
    return out


def _line(x: list[float], y: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line through the points."""
    mx, my = statistics.fmean(x), statistics.fmean(y)
    sxx = sum((a - mx) ** 2 for a in x)
    slope = sum((a - mx) * (b - my) for a, b in zip(x, y, strict=True)) / sxx if sxx else 0.0
    return my - slope * mx, slope


def _kernels(
    kind: str, dev: torch.device, size: int = MATMUL
) -> tuple[Callable[[], object], float]:
    """One kernel of a chain, writing in place (a captured chain allocates nothing), and its
    FLOPs: the tiny add, or a (size, size) x (size, size) bf16 matmul."""
    if kind == "tiny":
        x = torch.zeros(1, device=dev)
        return (lambda: x.add_(1.0)), 0.0
    a = torch.randn(size, size, device=dev, dtype=torch.bfloat16)
    b = torch.randn_like(a)
    c = torch.empty_like(a)
    return (lambda: torch.mm(a, b, out=c)), 2.0 * size**3


def _captured(body: Callable[[], object]) -> torch.cuda.CUDAGraph:
    """`body` warmed up on a side stream, then captured (PyTorch's recipe)."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        body()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    torch.cuda.synchronize()
    return graph


def _host_time(graph: torch.cuda.CUDAGraph, reps: int) -> float:
    """Median host seconds of `graph.replay()`, the GPU idle before each."""
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        graph.replay()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    return statistics.median(times)


__all__ = ["NODES", "cudagraph_section", "fit"]
