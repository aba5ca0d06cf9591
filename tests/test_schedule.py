"""The scheduler (gobrrr.schedule): every op's issue and run times on hand-built steps, each
derived by hand, and the power limit's slowed kernels."""

from dataclasses import replace

import pytest

from gobrrr.cost.roofline import OpTime
from gobrrr.graph.ir import OpNode, StepGraph, TensorInfo
from gobrrr.graph.meta import StepMeta
from gobrrr.schedule.power import slowed
from gobrrr.schedule.scheduler import OpSpan, place, schedule
from gobrrr.schedule.streams import (
    COMM,
    COMPUTE,
    COPY_D2H,
    COPY_H2D,
    HOST,
    Event,
    Wait,
    stream_of,
)


def op(i, host, device=0.0, side=0.0, kind="matmul") -> OpTime:
    return OpTime(i, "x", "", "backward", kind, "bf16", 0, 0, 0, 0, 0, device, host, "none", side)


def spans(t):
    return [(s.index, s.stream, s.issue_start, s.issue_end, s.start, s.end) for s in t.ops]


def test_the_host_waits_for_the_device_at_a_sync():
    ops = (op(0, 1, 5), op(1, 1, 2), op(2, 1), op(3, 1, 1))  # op 2: a view, no kernel
    t = schedule(ops, [COMPUTE] * 4, {1}, None)
    # op 0 runs 1..6; op 1 is issued 1..2 and runs 6..8, and the host waits for it (a sync)
    # until 8; op 2 is issued 8..9; op 3 is issued 9..10 and runs 10..11
    assert spans(t) == [
        (0, COMPUTE, 0, 1, 1, 6),
        (1, COMPUTE, 1, 2, 6, 8),
        (2, COMPUTE, 8, 9, None, None),
        (3, COMPUTE, 9, 10, 10, 11),
    ]
    assert (t.host_end, t.device_end, t.step_s) == (10, 11, 11)
    # without the sync the host runs ahead: op 3 is issued 3..4 and runs 8..9
    free = schedule(ops, [COMPUTE] * 4, set(), None)
    assert free.ops[3] == OpSpan(3, COMPUTE, 3, 4, 8, 9) and free.step_s == 9


def _offload_graph():
    """A gradient's matmul, its copy to the host, the CPU step and the parameter's copy
    back, as CPU offload records them (the parameter: storage 0)."""

    def node(i, name, phase):
        return OpNode(i, name, phase, "", (_param(),), ())

    return StepGraph(
        (
            node(0, "aten.mm.default", "backward"),
            node(1, "gobrrr.offload_grad_d2h.default", "backward"),
            node(2, "gobrrr.offload_cpu_step.default", "optimizer"),
            node(3, "gobrrr.offload_param_h2d.default", "optimizer"),
        ),
        (),
        StepMeta(),
    )


def _param():
    return TensorInfo((4,), (1,), "float32", 0)


def test_an_offloaded_gradient_goes_to_the_host_is_stepped_and_comes_back():
    graph = _offload_graph()
    streams = [stream_of(n) for n in graph.nodes]
    assert streams == [COMPUTE, COPY_D2H, HOST, COPY_H2D]
    ops = (
        op(0, 1, 4),
        op(1, 0.5, side=3, kind="d2h"),
        op(2, 2, kind="cpu_step"),
        op(3, 0.5, side=1, kind="h2d"),
    )
    t = schedule(ops, streams, set(), None, {1: 0, 2: 0, 3: 0})
    # the matmul runs 1..5; its gradient's copy, issued 1..1.5, waits for it: 5..8; the CPU
    # step waits for the copy: 8..10 on the host; the copy back is issued 10..10.5, runs
    # 10.5..11.5; the step returns when it has landed
    assert spans(t) == [
        (0, COMPUTE, 0, 1, 1, 5),
        (1, COPY_D2H, 1, 1.5, 5, 8),
        (2, HOST, 8, 10, None, None),
        (3, COPY_H2D, 10, 10.5, 10.5, 11.5),
    ]
    assert (t.host_end, t.device_end, t.copy_end) == (11.5, 5, 11.5)


def test_the_two_copy_directions_share_the_host_link():
    ops = (op(0, 1, side=4, kind="d2h"), op(1, 1, side=1, kind="h2d"))
    t = schedule(ops, [COPY_D2H, COPY_H2D], set(), None)
    # the H2D copy, issued by 2, waits for the D2H one on the link: 5..6
    assert [(s.start, s.end) for s in t.ops] == [(1, 5), (5, 6)]


def test_a_repeated_segment_runs_twice_and_the_later_runs_move_every_clock_on():
    ops = (op(0, 1, 2), op(1, 1, 3), op(2, 2, 1), op(3, 1, 1))
    t = schedule(ops, [COMPUTE] * 4, set(), (1, 3, 4))
    # first run: op 0 runs 1..3; op 1 issued 1..2, runs 3..6; op 2 issued 2..4, runs 6..7.
    # second run: op 1 issued 4..5, runs 7..10; op 2 issued 5..7, runs 10..11. Two more
    # runs: the host moves on 2 x 3 to 13, the device 2 x 4 to 19; op 3 issued 13..14, runs
    # 19..20
    assert spans(t) == [
        (0, COMPUTE, 0, 1, 1, 3),
        (1, COMPUTE, 1, 2, 3, 6),
        (2, COMPUTE, 2, 4, 6, 7),
        (3, COMPUTE, 13, 14, 19, 20),
    ]
    assert [(s.index, s.issue_start, s.issue_end, s.start, s.end) for s in t.repeat_run] == [
        (1, 4, 5, 7, 10),
        (2, 5, 7, 10, 11),
    ]
    assert t.repeat_shift[HOST] == 6 and t.repeat_shift[COMPUTE] == 8
    assert (t.host_end, t.device_end) == (14, 20)


def test_a_collective_overlaps_compute_between_its_producer_and_its_consumer():
    ops = (op(0, 1, 4), op(1, 0.5, 3), op(2, 1, 2), op(3, 1, 1))
    waits = (Wait(1, COMM, Event(COMPUTE, 0)), Wait(3, COMPUTE, Event(COMM, 1)))
    t = place(ops, [COMPUTE, COMM, COMPUTE, COMPUTE], waits)
    # op 0 runs 1..5; the collective, issued 1..1.5, waits for it: 5..8 on comm; op 2 runs
    # 5..7 beside it; op 3, issued 2.5..3.5, waits for the collective: 8..9
    assert [(s.stream, s.start, s.end) for s in t.ops] == [
        (COMPUTE, 1, 5),
        (COMM, 5, 8),
        (COMPUTE, 5, 7),
        (COMPUTE, 8, 9),
    ]
    assert t.device_end == 9


def test_the_power_limit_slows_the_compute_and_keeps_the_launch_latency():
    o = OpTime(
        0, "mm", "", "forward", "matmul", "bf16", 1.0, 1.0, 1.0, 0.8, 0.1, 0.85, 0.0, "compute"
    )  # 0.8 s of compute, 0.05 s of launch latency
    out = slowed((o,), [0], 0.5)
    assert out[0].compute_s == pytest.approx(1.6) and out[0].device_s == pytest.approx(1.65)
    assert out[0] == replace(o, compute_s=out[0].compute_s, device_s=out[0].device_s)
