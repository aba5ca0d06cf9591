"""Collectives and compute sharing the GPU: the step rescheduled with each compute kernel slowed
for the time a collective is resident beside it, and each collective stretched for the time
compute runs beside it (`cost.contention`, from the calibration's contention grid).

The scheduler first places every op at its time alone. Then, from that timeline, a compute op
that overlaps collectives for a share of its span runs (1 + share x slowdown) x its time,
the slowdown that of its class beside that collective; a collective overlapped by compute for
a share of its span takes (1 + share x (stretch - 1)) x its time. The step is scheduled again
with those times, and the overlaps read again from the new timeline, a few rounds until no
op's time moves (each round starts from the times alone, so it converges rather than compounds).
"""

from __future__ import annotations

from collections.abc import Callable

from gobrrr.cost.contention import Contention
from gobrrr.cost.roofline import OpTime
from gobrrr.graph.ir import evolve
from gobrrr.schedule.scheduler import Timeline
from gobrrr.schedule.streams import COMM, COMPUTE

#: op kinds whose compute-bound kernels are tensor-core GEMMs (their waves lose SMs)
MATMUL_KINDS = ("matmul", "conv", "loss", "rnn")


def klass(o: OpTime) -> str:
    """The contention grid's class of a compute op."""
    if o.kind == "attention":
        return "attention"
    if o.kind in MATMUL_KINDS and o.compute_s >= o.memory_s:
        return "matmul"
    return "memory"


def contended(
    ops: tuple[OpTime, ...],
    timeline: Timeline,
    schedule: Callable[[tuple[OpTime, ...]], Timeline],
    collectives: dict[int, tuple[str, float]],
    contention: Contention,
    rounds: int = 4,
    tol: float = 1e-4,
) -> tuple[tuple[OpTime, ...], Timeline]:
    """The ops with their contended times and the timeline they make (see the module's
    docstring). `timeline`: `ops` scheduled alone; `collectives`: op index -> (collective,
    whole buffer bytes) of every collective; `rounds`: at most this many reschedules, stopping
    once no op's time moves by more than `tol` (relative) from one round to the next."""
    if not collectives:
        return ops, timeline
    out = ops
    for _ in range(rounds):
        new = _stretched(ops, timeline, collectives, contention)
        settled = all(
            abs(a.device_s - b.device_s) <= tol * b.device_s for a, b in zip(new, out, strict=True)
        )
        out, timeline = new, schedule(new)
        if settled:
            break
    return out, timeline


def _stretched(
    ops: tuple[OpTime, ...],
    timeline: Timeline,
    collectives: dict[int, tuple[str, float]],
    contention: Contention,
) -> tuple[OpTime, ...]:
    """`ops` (times alone) slowed by the overlaps `timeline` shows (its first run of a
    repeated segment stands for every run)."""
    spans = timeline.ops
    comm = [
        (s.start, s.end, s.index)
        for s in spans
        if s.stream == COMM and s.start is not None and s.index in collectives
    ]
    compute = [
        (s.start, s.end, s.index) for s in spans if s.stream == COMPUTE and s.start is not None
    ]
    comm.sort()
    compute.sort()
    slow: dict[int, float] = {}
    busy: dict[int, float] = {}  # collective -> its time beside compute (s)
    j = 0
    for start, end, i in compute:
        if end <= start:
            continue
        while j < len(comm) and comm[j][1] <= start:
            j += 1
        k, extra = j, 0.0
        while k < len(comm) and comm[k][0] < end:
            cs, ce, c = comm[k]
            both = min(end, ce) - max(start, cs)
            if both > 0:
                op, nbytes = collectives[c]
                extra += both * contention.compute_slowdown(op, nbytes, klass(ops[i]))
                busy[c] = busy.get(c, 0.0) + both
            k += 1
        if extra > 0:
            slow[i] = 1.0 + extra / (end - start)
    out = list(ops)
    for i, f in slow.items():
        o = ops[i]
        out[i] = evolve(
            o, compute_s=o.compute_s * f, memory_s=o.memory_s * f, device_s=o.device_s * f
        )
    length = {c: ce - cs for cs, ce, c in comm}
    for c, (op, nbytes) in collectives.items():
        o = ops[c]
        if length.get(c, 0.0) > 0 and busy.get(c):
            share = min(busy[c] / length[c], 1.0)
            f = 1.0 + share * (contention.collective_stretch(op, nbytes) - 1.0)
            out[c] = evolve(o, device_s=o.device_s * f)
    return tuple(out)
