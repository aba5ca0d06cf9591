"""A step replayed as captured CUDA graphs: what the host and the GPU spend on it.

Eagerly, the host issues every op (dispatch, then a launch per kernel: `Rates.host`) and the
GPU runs each kernel for its work plus the kernel latency (`Rates.latency`). Replayed, the
host issues one `graph.replay()` per captured graph, which costs a launch plus a little per
kernel node (the driver submits the nodes), and the GPU runs the captured kernels back to
back, each for its work plus the gap between graph nodes; a matmul as a captured chain of
matmuls ran it (`matmul_gaps`: the node against the same matmul timed alone, as the
calibration's matmul figures are). The four figures come from the
calibration's `cudagraph` section (`gobrrr.calibrate.sections.cudagraph`: chains of N
captured kernels, host time around replay and device time between events, fitted in N);
without it nothing here guesses them: the step is not costed replayed.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gobrrr.cost.flops import OpCost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import OpTime
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph, evolve

NOT_CALIBRATED = (
    "{what} has no measured cudagraph section (a CUDA graph's launch and per-node costs): "
    "measure it with benchmarks/calibration/calibrate_sections.py --sections cudagraph_grid"
)


@dataclass(frozen=True)
class GraphRates:
    """One GPU's CUDA graph replay, measured (seconds): the host's `replay()` takes
    launch_host_s + node_host_s x kernels; each captured kernel costs the GPU its work plus
    node_device_s (in place of the eager kernel latency), each replay launch_device_s more."""

    launch_host_s: float
    node_host_s: float
    node_device_s: float
    launch_device_s: float = 0.0
    #: what a captured matmul node costs the GPU beyond the same matmul timed alone, as the
    #: calibration's matmul figures are (negative: a chain of captured matmuls runs each
    #: faster than one matmul timed between events), by size: ((FLOPs, gap s), ...)
    #: ascending; none measured: 0
    matmul_gaps: tuple[tuple[float, float], ...] = ()

    @staticmethod
    def of(section: dict | None) -> GraphRates | None:
        """The rates of a calibration's `cudagraph` section; None where it was not measured."""
        keys = ("launch_host_s", "node_host_s", "node_device_s")
        if not section or any(not isinstance(section.get(k), (int, float)) for k in keys):
            return None
        # a section measured at one size has its gap alone ("matmul_gap_s"): held at any size
        gaps = section.get("matmul_gaps") or (
            [[0.0, section["matmul_gap_s"]]] if "matmul_gap_s" in section else []
        )
        return GraphRates(
            *(float(section[k]) for k in keys),
            section.get("launch_device_s", 0.0),
            tuple(sorted((float(f), float(g)) for f, g in gaps)),
        )

    def matmul_gap(self, flops: float) -> float:
        """What a captured matmul of `flops` costs the GPU beyond the same matmul timed alone
        (s): the measured gaps interpolated in log FLOPs, the end ones held past the grid."""
        pts = self.matmul_gaps
        if not pts:
            return 0.0
        if flops <= pts[0][0]:
            return pts[0][1]
        for (f0, g0), (f1, g1) in zip(pts, pts[1:], strict=False):
            if flops <= f1:
                t = (math.log(flops) - math.log(f0)) / (math.log(f1) - math.log(f0))
                return g0 + t * (g1 - g0)
        return pts[-1][1]

    def host_s(self, kernels: int, graphs: int = 1) -> float:
        """Host seconds to replay `graphs` graphs holding `kernels` kernel nodes in all."""
        return graphs * self.launch_host_s + kernels * self.node_host_s


def graphed_times(
    graph: StepGraph, costs: list[OpCost], ops: tuple[OpTime, ...], rates: Rates
) -> tuple[OpTime, ...]:
    """The ops' times with nodes[meta.cuda_graph.start:] replayed as captured graphs: those
    ops cost the host nothing but the replay, charged to the first of them (kernels counted
    as often as they run, `StepGraph.weights`); on the GPU each kernel's latency becomes the
    graph node's. Ops before the captured ones (the batch's copies into the static inputs)
    stay eager. A GobrrrError where the calibration has no cudagraph section."""
    captured = graph.meta.cuda_graph
    g = GraphRates.of(rates.cal.cudagraph if rates.cal else None)
    if g is None:
        name = (
            f"{rates.gpu.name}'s calibration" if rates.cal else f"{rates.gpu.name} (no calibration)"
        )
        raise GobrrrError(NOT_CALIBRATED.format(what=name))
    weights = graph.weights()
    out = list(ops)
    kernels = 0
    for o in ops[captured.start :]:
        launches = costs[o.index].launches if o.device_s > 0 else 0
        kernels += launches * weights[o.index]
        if o.kind == "matmul" and launches:
            # the node as measured in a captured chain of matmuls, not the eager kernel
            # (the node's gap is in the measured figure: no second one)
            gap = g.matmul_gap(o.flops / launches)
            device = max(o.device_s + gap * launches, g.node_device_s * launches)
        else:  # the eager kernel's latency becomes the node's
            device = o.device_s + (g.node_device_s - rates.latency) * launches
        out[o.index] = evolve(o, host_s=0.0, device_s=max(device, 0.0), streamed_s=0.0)
    if captured.start < len(out):
        first = out[captured.start]
        out[captured.start] = evolve(
            first,
            host_s=g.host_s(kernels, captured.graphs),
            device_s=first.device_s + g.launch_device_s * captured.graphs,
        )
    return tuple(out)


__all__ = ["NOT_CALIBRATED", "GraphRates", "graphed_times"]
