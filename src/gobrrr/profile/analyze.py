"""From a joined trace to measured ops and per-phase / per-module / per-kind sums.

The measured regime speaks the prediction's vocabulary (`OpTime.regime`: "compute" |
"memory" | "overhead" | "none") and takes its split from the same cost model:

- **overhead**: the device sat idle right before the op for at least as long as the op ran
  (the host, not the GPU, set the pace), or the op ran shorter than one eager launch
  (`Rates.launch`: the calibration's launch overhead, else the spec's).
- **compute** / **memory**: otherwise, whichever of the cost model's compute and memory time
  is the larger: for an op joined to a step-graph node, its `gobrrr.cost.roofline.time_op`
  (`op_cost` at the calibrated `Rates`), as the prediction costs it; for one costed from the
  profiler's shapes, its FLOPs at `Rates.matmul` / `Rates.attention` (tensor-core math) or the
  fp32 peak, and its bytes at `Rates.bandwidth`.
- **none**: no FLOPs or bytes known, no kernel, or no GPU (a CPU run).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from gobrrr.cost.flops import OpCost, op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import MATMUL_MATH, time_op
from gobrrr.graph.ir import StepGraph
from gobrrr.graph.meta import StepMeta
from gobrrr.hardware import Calibration, GpuSpec
from gobrrr.precision import Precision
from gobrrr.profile.join import JoinedTrace, TraceOp, align_graph
from gobrrr.profile.result import GroupTime, MeasuredOp
from gobrrr.profile.shapes import op_kind, shape_cost


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


def analyze(
    joined: JoinedTrace,
    gpu: GpuSpec | None,
    precision: str = "bf16-mixed",
    graph: StepGraph | None = None,
    calibration: Calibration | None = None,
    step: int | None = None,
) -> Analysis:
    """Measured ops (device time, achieved rates, regime) of the trace's profiled step.

    `step` picks one `gobrrr::step` range when the trace holds several (default: the last).
    On a CPU trace an op's "device" time is its host time and the regime is "none".
    """
    keep = _step_filter(joined, step)
    nodes, matched = align_graph(joined.ops, graph) if graph is not None else (None, None)
    rates = Rates(gpu, calibration) if gpu is not None and joined.has_device else None
    tf32 = (
        graph.meta if graph is not None else StepMeta(precision=Precision.parse(precision))
    ).tf32_mode
    ops = []
    for o in joined.ops:
        if not keep(o):
            continue
        m = _measure(o, joined, rates, tf32, graph, nodes[o.index] if nodes else -1)
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
    return Analysis(
        ops=tuple(ops),
        phases=group(ops, lambda o: o.phase),
        modules=group(ops, lambda o: _top_module(o.module)),
        kinds=group(ops, lambda o: o.kind),
        span_s=span,
        busy_s=busy,
        kernels=len(kernels),
        kernels_attributed=sum(k.op >= 0 for k in kernels),
        graph_matched=matched,
    )


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


def measured_regime(
    device_s: float, gap_s: float, compute_s: float, memory_s: float, launch_s: float
) -> str:
    """The regime of a measured op (see the module docstring). Seconds: its summed kernel
    time, the device's idle time right before it, the cost model's compute and memory time
    for it, and one eager launch."""
    if device_s <= 0:
        return "none"
    if gap_s >= device_s or device_s < launch_s:
        return "overhead"
    if not (compute_s or memory_s):
        return "none"
    return "compute" if compute_s >= memory_s else "memory"


def cost_split(
    rates: Rates,
    cost: OpCost | None,
    node,
    flops: float,
    nbytes: float,
    math: str,
    kind: str,
    name: str,
) -> tuple[float, float]:
    """(compute_s, memory_s) the cost model gives an op: `time_op` of its step-graph node
    (`cost`: that node's op_cost), else its shapes' FLOPs and bytes at the calibrated rates."""
    if node is not None and cost is not None:
        t = time_op(node, cost, rates)
        return t.compute_s, t.memory_s
    if kind == "attention" and math in MATMUL_MATH:
        rate = rates.attention(math)
    elif kind == "matmul" and math in MATMUL_MATH:
        rate = rates.matmul(math, flops)
    else:
        rate = rates.gpu.peak("fp32")  # CUDA cores
    return (flops / rate if rate > 0 else 0.0), nbytes / rates.bandwidth(kind, name)


def roofline_fraction(
    device_s: float, flops: float, nbytes: float, math: str, gpu: GpuSpec
) -> float | None:
    """The op's datasheet roofline floor, max(FLOPs / peak[math], bytes / bandwidth), over its
    measured time (1 = at the roof); None without FLOPs or bytes."""
    if not (flops or nbytes) or device_s <= 0:
        return None
    peak = gpu.peak_flops.get(math or "fp32", gpu.peak_flops.get("fp32", 0.0))
    floor = max(flops / peak if peak > 0 else 0.0, nbytes / gpu.bandwidth)
    return floor / device_s


def _measure(o: TraceOp, joined: JoinedTrace, rates: Rates | None, tf32, graph, node):
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
    node_ = graph.nodes[node] if graph is not None and node >= 0 else None
    cost = op_cost(node_, tf32) if node_ is not None else None
    source = "graph" if cost is not None else "shapes"
    flops, nbytes, math = (
        (float(cost.flops), float(cost.bytes), str(cost.math)) if cost else shape_cost(o, tf32)
    )
    regime, frac = "none", None
    if rates is not None:
        split = cost_split(rates, cost, node_, flops, nbytes, math, kind, o.family)
        regime = measured_regime(device_s, gap, *split, rates.launch)
        frac = roofline_fraction(device_s, flops, nbytes, math, rates.gpu)
    return MeasuredOp(
        index=o.index,
        op=o.op,
        family=o.family,
        kind=kind,
        phase=o.phase,
        module=o.module,
        kernels=len(ks),
        kernel=longest[:120],
        device_s=device_s,
        host_s=o.host_s,
        gap_s=gap,
        node=node,
        flops=flops,
        bytes=nbytes,
        math=math,
        cost_source=source,
        flops_per_s=flops / device_s if device_s else 0.0,
        bytes_per_s=nbytes / device_s if device_s else 0.0,
        roofline=frac,
        regime=regime,
        compiled=o.compiled,
    )


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
        out.append(
            GroupTime(
                name=name,
                device_s=t,
                share=t / total,
                ops=len(members),
                flops=fl,
                bytes=by,
                flops_per_s=fl / t if t else 0.0,
                bytes_per_s=by / t if t else 0.0,
                regime=max(regimes, key=regimes.get),
            )
        )
    return tuple(sorted(out, key=lambda g: -g.device_s))
