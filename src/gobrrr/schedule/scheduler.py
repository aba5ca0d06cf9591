"""The step as a timeline: when the host issues each op, and when and on which stream the GPU
runs it.

The host issues the ops in program order, each taking its host time (`OpTime.host_s`). A
device stream runs an op once the host has issued it, the previous op on its resource is done
and its waits (`streams.Wait`) are met, for its time on that stream: `device_s` on the compute
stream, `side_s` on a copy stream. When the host is slower than the device, the device idles
and the step is overhead-bound.

A repeated segment (`StepGraph.repeat`: the later micro-batches of an accumulated step) runs
twice; its second run, the steady state, stands for the runs after it: every clock moves on by
(times - 2) x what the second run added to it. In the `Timeline`, an op of the segment has the
times of its first run (`ops`) and of its second (`repeat_run`); ops after the segment have
their own times, after every run.
"""

from __future__ import annotations

import bisect
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gobrrr.cost.roofline import OpTime
from gobrrr.schedule.streams import (
    COMM,
    COMPUTE,
    COPY_D2H,
    COPY_STREAMS,
    HOST,
    RESOURCE,
    Event,
    Wait,
)


@dataclass(frozen=True)
class OpSpan:
    """One op on the timeline (s from the step's start). `issue_start`/`issue_end`: the host
    issuing it (for an op of the host stream, e.g. offload's CPU step: running it). `start`/
    `end`: it running on `stream`; None where it runs on no device stream (a host op, a view
    or an op fused into another: no kernel)."""

    index: int
    stream: str
    issue_start: float
    issue_end: float
    start: float | None = None
    end: float | None = None


@dataclass(frozen=True)
class Timeline:
    """The step as scheduled (s). `host_end`: the host is done, the last copy landed included
    (the optimizer's step returns once it has); `device_end`: the compute stream has run its
    last kernel; `copy_end`: the host link's last copy has landed. `repeat_run`: the second
    run of the repeated segment, `repeat_shift`: what each later run adds to each clock
    (by stream or resource; see the module's docstring)."""

    ops: tuple[OpSpan, ...]
    host_end: float
    device_end: float
    copy_end: float = 0.0
    waits: tuple[Wait, ...] = field(default=(), repr=False)
    repeat_run: tuple[OpSpan, ...] = field(default=(), repr=False)
    repeat_shift: dict[str, float] = field(default_factory=dict)

    @property
    def step_s(self) -> float:
        """The step's time: the later of the host and the compute stream."""
        return max(self.host_end, self.device_end)


def offload_waits(streams: Sequence[str], param_of: dict[int, int]) -> list[Wait]:
    """CPU offload's waits (gobrrr.training.offload). A gradient's copy to the host waits for
    the compute stream's work issued before it (the gradient is among it); the CPU step
    (on the host) for the latest copy of its parameter's gradient before it (`param_of`: op
    index -> its parameter's storage). The copy back needs no event: the host queues it after
    the CPU step."""
    out, last = [], {}
    for i, s in enumerate(streams):
        if s == COPY_D2H:
            out.append(Wait(i, COPY_D2H, Event(COMPUTE)))
            last[param_of.get(i)] = i
        elif s == HOST and (k := last.get(param_of.get(i))) is not None:
            out.append(Wait(i, HOST, Event(COPY_D2H, k)))
    return out


def sync_waits(syncs: set[int]) -> list[Wait]:
    """The host waits for the compute stream once it has issued a sync op (it reads a GPU
    value, e.g. GradScaler's found_inf)."""
    return [Wait(i, HOST, Event(COMPUTE), after=True) for i in sorted(syncs)]


def comm_waits(streams: Sequence[str], touches: Sequence[frozenset[int]]) -> list[Wait]:
    """A collective's waits (`touches[i]`: the storages op i reads or writes). The comm
    stream waits for the last compute op before the collective that touched its buffers (it
    produced the input), and the first compute op after it that touches them (it consumes the
    output) waits for the collective's end. Found by bisecting, per storage, the sorted
    compute ops that touch it (a step of 512 ranks' FSDP2 has thousands of collectives)."""
    colls = [i for i, s in enumerate(streams) if s == COMM]
    wanted = frozenset().union(*(touches[i] for i in colls)) if colls else frozenset()
    uses: dict[int, list[int]] = defaultdict(list)  # storage -> compute ops touching it
    for j, s in enumerate(streams):
        if s == COMPUTE:
            for sid in touches[j] & wanted:
                uses[sid].append(j)
    out = []
    for i in colls:
        before, after = -1, len(streams)
        for sid in touches[i]:
            js = uses.get(sid)
            if not js:
                continue
            k = bisect.bisect_left(js, i)
            if k > 0:
                before = max(before, js[k - 1])
            if k < len(js):
                after = min(after, js[k])  # i is a comm op: never in js
        if before >= 0:
            out.append(Wait(i, COMM, Event(COMPUTE, before)))
        if after < len(streams):
            out.append(Wait(after, COMPUTE, Event(COMM, i)))
    return out


def schedule(
    ops: tuple[OpTime, ...],
    streams: Sequence[str],
    syncs: set[int],
    repeat: tuple[int, int, int] | None,
    param_of: dict[int, int] | None = None,
    touches: Sequence[frozenset[int]] | None = None,
) -> Timeline:
    """Every op of the step on its stream (`streams[i]`, see `streams.stream_of`), with the
    waits of `syncs` (op indices), of CPU offload (`param_of`, see `offload_waits`) and of
    the collectives (`touches`, see `comm_waits`; only where the step has some), the
    segment `repeat` (start, end, times) repeated."""
    return scheduler(streams, syncs, repeat, param_of, touches)(ops)


def scheduler(
    streams: Sequence[str],
    syncs: set[int],
    repeat: tuple[int, int, int] | None,
    param_of: dict[int, int] | None = None,
    touches: Sequence[frozenset[int]] | None = None,
) -> Callable[[tuple[OpTime, ...]], Timeline]:
    """`schedule` of the step's ops given their times, its waits worked out once: they
    depend on the streams and storages alone, and the power limit and the contention model
    schedule one step several times with other times (a 64-rank FSDP2 step's collective
    waits took a tenth of each schedule)."""
    waits = (*sync_waits(syncs), *offload_waits(streams, param_of or {}))
    if touches is not None:
        waits = (*waits, *comm_waits(streams, touches))
    plan = _Plan(streams, tuple(waits))
    return lambda ops: _Run(ops, plan).timeline(repeat)


def exposed_comm(
    timeline: Timeline, kinds: dict[int, str]
) -> tuple[tuple[float, float], dict[str, dict[str, float]]]:
    """Communication in seconds: ((busy, exposed), {collective: {"busy_s", "exposed_s"}}) of
    the collective ops (`kinds`: op index -> its collective, "all_gather", ...), all together
    and each apart, in one pass over the timeline (the repeated segment's first and second
    runs counted as scheduled). Busy: the time they run; exposed: the part of it no other
    kernel runs. Every other op on a device stream counts as another kernel, the comm
    stream's copies (FSDP2's all-gather copy-in, its casts) included, as a profile of NCCL
    kernels against every other kernel counts them (`gobrrr.profile.comm`)."""
    comm: dict[str, list[tuple[float, float]]] = {}
    other = []
    for o in (*timeline.ops, *timeline.repeat_run):
        if o.start is None:
            continue
        k = kinds.get(o.index)
        if k is not None:
            comm.setdefault(k, []).append((o.start, o.end))
        elif o.stream != HOST:
            other.append((o.start, o.end))
    compute = _union(other)

    def busy_exposed(spans: list[tuple[float, float]]) -> tuple[float, float]:
        u = _union(spans)
        busy = sum(e - s for s, e in u)
        return busy, busy - _overlap(u, compute)

    total = busy_exposed([iv for ivs in comm.values() for iv in ivs])
    by = {
        k: dict(zip(("busy_s", "exposed_s"), busy_exposed(v), strict=True))
        for k, v in sorted(comm.items())
    }
    return total, by


def _union(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for s, e in sorted(spans):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        elif e > s:
            out.append([s, e])
    return [(s, e) for s, e in out]


def _overlap(a: list[tuple[float, float]], b: list[tuple[float, float]]) -> float:
    """Length of the intersection of two sorted disjoint unions."""
    total, i, j = 0.0, 0, 0
    while i < len(a) and j < len(b):
        lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        total += max(hi - lo, 0.0)
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return total


def place(
    ops: tuple[OpTime, ...],
    streams: Sequence[str],
    waits: Sequence[Wait],
    repeat: tuple[int, int, int] | None = None,
) -> Timeline:
    """Every op on its stream (`streams[i]`) with the waits given (e.g. a collective on the
    comm stream waiting for the op producing its input, the op consuming its output waiting
    for the collective), the segment `repeat` (start, end, times) repeated."""
    return _Run(ops, _Plan(streams, tuple(waits))).timeline(repeat)


class _Plan:
    """What a schedule of the step reads besides its ops' times, the same for every
    schedule of it: each op's stream, the resource it occupies (None: the host's op, or a
    copy's `True` flag below), and its waits by where they hold."""

    def __init__(self, streams: Sequence[str], waits: tuple[Wait, ...]) -> None:
        self.streams, self.waits = streams, waits
        # op -> its waits (most ops have none: looked up with .get, no empty list each)
        self.before: dict[int, list[Wait]] = {}  # the host's, before issuing
        self.on_device: dict[int, list[Wait]] = {}
        self.after: dict[int, list[Wait]] = {}
        for w in waits:
            where = self.after if w.after else self.before if w.stream == HOST else self.on_device
            where.setdefault(w.op, []).append(w)
        # per op: (its resource or None on the host, whether it is a copy)
        kinds = {s: (RESOURCE.get(s), s in COPY_STREAMS) for s in set(streams)}
        self.kinds = [kinds[s] for s in streams]


class _Run:
    """The clocks as the ops run: the host's, each device resource's, each stream's tail (its
    last op's end) and each op's latest end."""

    def __init__(self, ops: tuple[OpTime, ...], plan: _Plan) -> None:
        self.ops, self.plan = ops, plan
        self.streams, self.waits = plan.streams, plan.waits
        self.before, self.on_device, self.after = plan.before, plan.on_device, plan.after
        self.host = 0.0
        self.free: dict[str, float] = defaultdict(float)  # resource -> when it is free
        self.tail: dict[str, float] = defaultdict(float)  # stream -> its last op's end
        self.ended: dict[int, float] = {}  # op -> its latest run's end
        self.clock: dict[int, str] = {}  # op -> the clock it ended on (a resource, the host)

    def _at(self, event: Event) -> float | None:
        """When `event` has happened; None: never recorded (nothing to wait for)."""
        if event.op is None:
            return self.host if event.stream == HOST else self.tail[event.stream]
        return self.ended.get(event.op)

    def _wait(self, t: float, waits: list[Wait] | None) -> float:
        if not waits:
            return t
        for w in waits:
            if (at := self._at(w.event)) is not None:
                t = max(t, at)
        return t

    def part(self, lo: int, hi: int) -> list[OpSpan]:
        """Issue ops lo..hi-1 in turn, each run on its stream once issued: the host's clock
        moves on by its host time (after the waits before it), a device op starts when its
        resource is free and its waits are met. The hot loop of every evaluation (several
        schedules of every op, for the power limit): the clocks are kept in locals, waits
        looked up only for the few ops that have them (`_at` reads `self.host`: set first),
        each op's resource read off the plan, its span made without the frozen dataclass's
        `__init__` (half its cost: every schedule makes one per op)."""
        ops, streams, kinds, wait = self.ops, self.streams, self.plan.kinds, self._wait
        before, on_device, after = self.before, self.on_device, self.after
        free, tail, ended, clock = self.free, self.tail, self.ended, self.clock
        out: list[OpSpan] = []
        append, new = out.append, object.__new__
        host = self.host
        for i in range(lo, hi):
            o, stream = ops[i], streams[i]
            if (w := before.get(i)) is not None:
                self.host = host
                host = wait(host, w)
            issue_start = host
            host += o.host_s
            issue_end, start, end = host, None, None
            resource, copy = kinds[i]
            # a copy always occupies the link (its time is never 0: a copy's latency); a
            # compute op without device time is no kernel (a view, an op fused into another)
            if copy or (resource is not None and o.device_s > 0):
                w = on_device.get(i)
                start = max(free[resource], host)
                if w is not None:
                    self.host = host
                    start = wait(start, w)
                end = start + (o.side_s if copy else o.device_s)
                if o.streamed_s > 0:  # its kernels run as they are issued (cuDNN's RNN)
                    start = max(free[resource], issue_start)
                    if w is not None:
                        self.host = host
                        start = wait(start, w)
                    end = max(start + o.device_s, issue_end + o.streamed_s)
                free[resource] = tail[stream] = ended[i] = end
                clock[i] = resource
            else:
                ended[i], clock[i] = issue_end, HOST
            if (w := after.get(i)) is not None:
                self.host = host
                host = wait(host, w)
            span = new(OpSpan)
            span.__dict__.update(
                index=i,
                stream=stream,
                issue_start=issue_start,
                issue_end=issue_end,
                start=start,
                end=end,
            )
            append(span)
        self.host = host
        return out

    def shift(self, before: dict[str, float], times: int) -> dict[str, float]:
        """Move every clock on by (times - 2) x what the last run added to it: the runs of the
        segment after its second. Returns each clock's shift (s)."""
        by = {k: (times - 2) * (self._clocks()[k] - v) for k, v in before.items()}
        self.host += by[HOST]
        for r in list(self.free):
            self.free[r] += by[r]
        for s in list(self.tail):
            self.tail[s] += by[RESOURCE[s]]
        for i, t in self.ended.items():
            self.ended[i] = t + by[self.clock[i]]
        return by

    def _clocks(self) -> dict[str, float]:
        return {HOST: self.host, **{r: self.free[r] for r in set(RESOURCE.values())}}

    def timeline(self, repeat: tuple[int, int, int] | None) -> Timeline:
        n, again, shift = len(self.ops), [], {}
        if repeat is None:
            spans = self.part(0, n)
        else:
            start, end, times = repeat
            spans = self.part(0, end)
            if times > 1:
                before = self._clocks()
                again = self.part(start, end)
                shift = self.shift(before, times)
            spans += self.part(end, n)
        link = RESOURCE[COPY_D2H]
        # the optimizer's step returns when the last copy has landed: the host waits for the
        # link at the end
        return Timeline(
            tuple(spans),
            host_end=max(self.host, self.free[link]),
            device_end=self.tail[COMPUTE],
            copy_end=self.free[link],
            waits=self.waits,
            repeat_run=tuple(again),
            repeat_shift=shift,
        )
