"""Collectives and compute slowing each other: the grid's reading (`cost.contention`) and the
step rescheduled with it (`schedule.contention`), against hand-derived values."""

from __future__ import annotations

import math

import pytest
import torch
from torch import nn

from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.cost.contention import Contention
from gobrrr.cost.roofline import OpTime
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target
from gobrrr.passes.ddp import ALL_REDUCE, ddp
from gobrrr.schedule.contention import contended
from gobrrr.schedule.scheduler import place
from gobrrr.schedule.streams import COMM, COMPUTE

MIB = 2**20


def _point(op, nbytes, klass, alone, beside, c_alone, c_beside):
    return {
        "op": op, "dtype": "fp32", "bytes": nbytes, "ranks": 4, "kernel": klass,
        "class": klass, "kernel_alone_s": alone, "kernel_beside_s": beside,
        "collective_alone_s": c_alone, "collective_beside_s": c_beside,
    }  # fmt: skip


def _grid() -> Contention:
    """all-reduce at 32 MiB: matmuls slowed 10%, 30%, 80% (median 30%), memory 20%,
    collective 1.5-3x (median 2x); at 128 MiB everything doubled (60%, 40%, 4x)."""
    pts = [
        _point("all_reduce", 32 * MIB, "matmul", 1.0, 1.1, 1.0, 1.5),
        _point("all_reduce", 32 * MIB, "matmul", 1.0, 1.3, 1.0, 2.0),
        _point("all_reduce", 32 * MIB, "matmul", 1.0, 1.8, 1.0, 3.0),
        _point("all_reduce", 32 * MIB, "memory", 1.0, 1.2, 1.0, 2.0),
        _point("all_reduce", 128 * MIB, "matmul", 1.0, 1.6, 1.0, 4.0),
        _point("all_reduce", 128 * MIB, "memory", 1.0, 1.4, 1.0, 4.0),
    ]
    return Contention.from_points(pts)


def test_the_grid_is_read_per_class_at_the_median_and_between_sizes_in_log_space():
    c = _grid()
    assert c.compute_slowdown("all_reduce", 32 * MIB, "matmul") == pytest.approx(0.3)
    assert c.compute_slowdown("all_reduce", 32 * MIB, "memory") == pytest.approx(0.2)
    assert c.collective_stretch("all_reduce", 32 * MIB) == pytest.approx(2.0)
    # 64 MiB is half-way between 32 and 128 in log space
    assert c.compute_slowdown("all_reduce", 64 * MIB, "matmul") == pytest.approx(0.45)
    assert c.collective_stretch("all_reduce", 64 * MIB) == pytest.approx(3.0)
    # held beyond the grid; a class or collective it lacks: no contention
    assert c.compute_slowdown("all_reduce", 1 * MIB, "matmul") == pytest.approx(0.3)
    assert c.compute_slowdown("all_reduce", 1024 * MIB, "memory") == pytest.approx(0.4)
    assert c.compute_slowdown("all_reduce", 32 * MIB, "attention") == 0.0
    assert c.compute_slowdown("all_gather", 32 * MIB, "matmul") == 0.0
    assert c.collective_stretch("all_gather", 32 * MIB) == 1.0
    assert c.compute_only().collective_stretch("all_reduce", 32 * MIB) == 1.0


def _op(i: int, device: float, kind: str = "matmul") -> OpTime:
    return OpTime(i, "x", "", "backward", kind, "bf16", 1, 1, 1, device, 0, device, 0, "compute")


def test_a_matmul_and_an_all_reduce_side_by_side_settle_where_hand_algebra_says():
    """A 1 s matmul beside a 1 s all-reduce of 32 MiB, both from t=0: the matmul is beside
    the all-reduce all its time, so it runs 1.3 s; the all-reduce, overlapped for 1.3 s of
    its length C, takes C = 1 + (1.3 / C) x (2 - 1): C^2 - C - 1.3 = 0."""
    ops = (_op(0, 1.0), _op(1, 1.0, "comm"))
    streams = [COMPUTE, COMM]

    def sched(times):
        return place(times, streams, ())

    out, t = contended(ops, sched(ops), sched, {1: ("all_reduce", 32 * MIB)}, _grid(), rounds=60)
    assert out[0].device_s == pytest.approx(1.3)
    assert out[1].device_s == pytest.approx((1 + math.sqrt(1 + 4 * 1.3)) / 2, rel=1e-3)
    assert t.step_s == pytest.approx(1.3)
    # nothing beside: nothing changes
    apart = place(ops, streams, ())
    assert contended(ops, apart, sched, {}, _grid())[0] == ops


def _ddp_graph():
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2048, 2048) for _ in range(6)))
    w = Workload(
        model,
        torch.randn(1024, 2048),
        optimizer=lambda p: torch.optim.SGD(p, lr=0.1),
        loss=lambda out, batch: out.square().sum(),
    )
    return ddp(capture(w, precision="fp32"), 4, bucket_cap_mb=25)


def test_with_the_shipped_grid_a_ddp_backward_beside_its_all_reduces_runs_slower():
    """On the shipped H100 calibration (whose grid was measured on 4 H100s) the DDP step's
    compute beside the all-reduces is slower and the step longer than the same step costed
    without the grid; a step without collectives is not touched."""
    g = _ddp_graph()
    target = Target.resolve("h100")
    assert target.cal.contention, "the shipped H100 calibration carries the contention grid"
    without = Target(target.gpu, evolve_cal(target.cal, contention=[]))
    with_, alone = evaluate(g, target).time, evaluate(g, without).time
    assert any(n.op == ALL_REDUCE for n in g.nodes)
    assert with_.step_s > alone.step_s
    assert with_.device_s > alone.device_s
    slowed = [
        (a, b) for a, b in zip(with_.ops, alone.ops, strict=True) if a.device_s > b.device_s * 1.001
    ]
    assert slowed and all(a.kind != "comm" or a.regime == "comm" for a, _ in slowed)


def evolve_cal(cal, **changes):
    from dataclasses import replace

    return replace(cal, **changes)
