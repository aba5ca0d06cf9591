"""From a joined trace to measured ops and per-phase / per-module / per-kind sums."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from gobrrr.graph.ir import StepGraph
from gobrrr.graph.meta import StepMeta
from gobrrr.hardware import Calibration, GpuSpec
from gobrrr.precision import Precision
from gobrrr.profile.join import JoinedTrace, TraceOp, align_graph
from gobrrr.profile.regimes import classify, op_kind, shape_cost
from gobrrr.profile.result import GroupTime, MeasuredOp


@dataclass(frozen=True)
class Analysis:
    """Measured ops of one profiled step and their sums. Seconds, FLOPs, bytes."""

    ops: tuple[MeasuredOp, ...]
    phases: tuple[GroupTime, ...]
    modules: tuple[GroupTime, ...]
    kinds: tuple[GroupTime, ...]
    span_s: float  # device span of the step (first kernel start to last kernel end)
    busy_s: float
    kernels: int
    kernels_attributed: int
    graph_matched: float | None


def analyze(joined: JoinedTrace, gpu: GpuSpec | None, precision: str = "bf16-mixed",
            graph: StepGraph | None = None, calibration: Calibration | None = None,
            step: int | None = None) -> Analysis:
    """Measured ops (device time, achieved rates, regime) of the trace's profiled step.

    `step` picks one `gobrrr::step` range when the trace holds several (default: the last).
    On a CPU trace an op's "device" time is its host time and the regime is "unknown".
    """
    keep = _step_filter(joined, step)
    nodes, matched = (align_graph(joined.ops, graph) if graph is not None else (None, None))
    launch = calibration.launch_overhead if calibration is not None else None
    tf32 = (graph.meta if graph is not None else StepMeta(precision=Precision.parse(precision))
            ).tf32_mode
    ops = []
    for o in joined.ops:
        if not keep(o):
            continue
        m = _measure(o, joined, gpu, tf32, graph, nodes[o.index] if nodes else -1, launch)
        if m is not None:
            ops.append(m)
    kernels = [k for k in joined.kernels if k.op < 0 or keep(joined.ops[k.op])]
    span = 0.0
    busy = _busy(kernels)
    if kernels:
        span = max(k.ts + k.dur for k in kernels) - min(k.ts for k in kernels)
    elif ops:
        span = sum(o.device_s for o in ops)
        busy = span
    return Analysis(ops=tuple(ops), phases=group(ops, lambda o: o.phase),
                    modules=group(ops, lambda o: _top_module(o.module)),
                    kinds=group(ops, lambda o: o.kind), span_s=span, busy_s=busy,
                    kernels=len(kernels), kernels_attributed=sum(k.op >= 0 for k in kernels),
                    graph_matched=matched)


def _step_filter(joined: JoinedTrace, step: int | None):
    if len(joined.steps) <= 1:
        return lambda o: True
    want = len(joined.steps) - 1 if step is None else step
    return lambda o: o.step == want


def _busy(kernels) -> float:
    busy, end = 0.0, float("-inf")
    for k in sorted(kernels, key=lambda k: k.ts):
        start, stop = max(k.ts, end), k.ts + k.dur
        busy += max(0.0, stop - start)
        end = max(end, stop)
    return busy


def _graph_cost(graph: StepGraph, node: int, tf32: bool) -> tuple[float, float, str] | None:
    try:
        from gobrrr.cost.flops import op_cost
    except ImportError:
        return None
    c = op_cost(graph.nodes[node], tf32)
    return float(c.flops), float(c.bytes), str(c.math)


def _measure(o: TraceOp, joined: JoinedTrace, gpu, tf32, graph, node, launch):
    ks = [joined.kernels[i] for i in o.kernels]
    kind = op_kind(o.family)
    if joined.has_device:
        if not ks:
            return None  # views, allocations: no device work
        device_s = sum(k.dur for k in ks)
        gap = ks[0].gap_before
        longest = max(ks, key=lambda k: k.dur).name
    else:
        if kind == "view" or o.host_s <= 0:
            return None
        device_s, gap, longest = o.host_s, 0.0, ""
    cost = _graph_cost(graph, node, tf32) if graph is not None and node >= 0 else None
    source = "graph" if cost else "shapes"
    flops, nbytes, math = cost or shape_cost(o, tf32)
    regime, frac = classify(device_s, gap, flops, nbytes, math,
                            gpu if joined.has_device else None, launch)
    return MeasuredOp(
        index=o.index, op=o.op, family=o.family, kind=kind, phase=o.phase, module=o.module,
        kernels=len(ks), kernel=longest[:120], device_s=device_s, host_s=o.host_s, gap_s=gap,
        node=node, flops=flops, bytes=nbytes, math=math, cost_source=source,
        flops_per_s=flops / device_s if device_s else 0.0,
        bytes_per_s=nbytes / device_s if device_s else 0.0, roofline=frac, regime=regime,
        compiled=o.compiled)


def _top_module(fqn: str, depth: int = 3) -> str:
    """Group modules a few levels deep: "transformer.h.0.attn.c_attn" -> "transformer.h.0"."""
    if not fqn:
        return "(top level)"
    return ".".join(fqn.split(".")[:depth])


def group(ops, key) -> tuple[GroupTime, ...]:
    """Sum ops by key, largest device time first."""
    total = sum(o.device_s for o in ops) or 1.0
    buckets: dict[str, list[MeasuredOp]] = defaultdict(list)
    for o in ops:
        buckets[key(o)].append(o)
    out = []
    for name, members in buckets.items():
        t = sum(o.device_s for o in members)
        fl = sum(o.flops for o in members)
        by = sum(o.bytes for o in members)
        regimes: dict[str, float] = defaultdict(float)
        for o in members:
            regimes[o.regime] += o.device_s
        out.append(GroupTime(name=name, device_s=t, share=t / total, ops=len(members),
                             flops=fl, bytes=by, flops_per_s=fl / t if t else 0.0,
                             bytes_per_s=by / t if t else 0.0,
                             regime=max(regimes, key=regimes.get)))
    return tuple(sorted(out, key=lambda g: -g.device_s))
