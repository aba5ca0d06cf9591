"""FSDP2's per-unit host time: the pass puts one hook op per unit and phase, and `evaluate`
charges it what the calibration's `dp_host` section measured, less the host time of the ops
the pass already put in that unit's phase."""

from __future__ import annotations

import dataclasses

import pytest

from gobrrr.calibrate.sections.dp_host import section, skew
from gobrrr.cost.dp_host import hook_host_s, rank_skew
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.fsdp import HOOKS, fsdp
from tests.test_fsdp import graph  # noqa: F401  (the module's fixture)

MS = 1e-3
FSDP_COMPUTE_OPS = ("aten.split_with_sizes_copy.out", "aten._chunk_cat.default")


def _points(ranks: int, phase: str, reshard: bool, by_params: dict[int, float]) -> list[dict]:
    return [
        dict(ranks=ranks, reshard=reshard, phase=phase, params=n, seconds=s)
        for n, s in by_params.items()
    ]


def test_the_line_through_the_points_at_the_units_parameter_count():
    # points on the line 1 ms + 0.1 ms per tensor: the line through them, read at 10 tensors
    sec = {"points": _points(4, "forward", True, {2: 1.2 * MS, 4: 1.4 * MS, 8: 1.8 * MS})}
    assert hook_host_s(sec, "forward", 10, True, 4) == pytest.approx(2.0 * MS)
    # nothing measured for that phase or reshard: no hook time; one rank: no FSDP2 hooks run
    assert hook_host_s(sec, "backward", 10, True, 4) == 0.0
    assert hook_host_s(sec, "forward", 10, False, 4) == 0.0
    assert hook_host_s(sec, "forward", 10, True, 1) == 0.0
    assert hook_host_s(None, "forward", 10, True, 4) == 0.0


def test_the_nearest_rank_count_is_read_and_the_line_never_falls_under_the_points():
    sec = {
        "points": _points(2, "backward", True, {2: 1.0 * MS, 8: 1.0 * MS})
        + _points(4, "backward", True, {2: 3.0 * MS, 8: 1.0 * MS})
    }
    assert hook_host_s(sec, "backward", 2, True, 2) == pytest.approx(1.0 * MS)  # measured there
    assert hook_host_s(sec, "backward", 2, True, 3) == pytest.approx(3.0 * MS)  # 4: nearer by ratio
    # the 4-rank line falls with the parameters; past the points it holds at the smallest one
    assert hook_host_s(sec, "backward", 100, True, 4) == pytest.approx(1.0 * MS)


def test_section_is_the_slowest_ranks_time_per_unit_beyond_the_plain_model():
    def rows(fw_plain, fw_fsdp):
        return [
            dict(layers=layers, kind=k, forward_s=f, backward_s=f)
            for layers in (1, 2, 4, 8, 12)
            for k, f in (("plain", fw_plain), ("fsdp", fw_fsdp), ("fsdp_noreshard", fw_plain))
        ]

    pts = section([rows(1 * MS, 18 * MS), rows(1 * MS, 35 * MS)], world=2, units=17)
    fwd = [p for p in pts if p["phase"] == "forward" and p["reshard"]]
    assert [p["params"] for p in fwd] == [2, 4, 8, 16, 24]
    assert all(p["seconds"] == pytest.approx(2 * MS) for p in fwd)  # (35 - 1) / 17, rank 1's
    assert all(p["seconds"] == 0.0 for p in pts if not p["reshard"])


def _target(points: list[dict]) -> Target:
    t = Target.resolve("h100", True)
    return dataclasses.replace(t, cal=dataclasses.replace(t.cal, dp_host={"points": points}))


def test_the_pass_puts_one_hook_per_unit_and_phase(graph):  # noqa: F811
    g = fsdp(graph, 4)
    hooks = [(n.module, n.args[0]) for n in g.nodes if n.op == HOOKS]
    units = ["", "blocks.0", "blocks.1", "blocks.2"]
    assert sorted(hooks) == sorted((u, p) for u in units for p in ("forward", "backward"))
    # each unit's forward hook comes before its all-gather is issued
    first = {}
    for n in g.nodes:
        first.setdefault((n.module, n.op), n.index)
    for u in units:
        assert first[(u, HOOKS)] < first[(u, "c10d._allgather_base_.default")]
    # with accumulation, every micro-batch runs the hooks
    acc = fsdp(accumulate(graph, 2), 4)
    assert sum(n.op == HOOKS for n in acc.nodes) == 2 * len(hooks)


def test_evaluate_charges_the_measured_time_less_the_ops_the_pass_put_there(graph):  # noqa: F811
    g = fsdp(graph, 4)
    measured = 5 * MS  # far above what the pass's own ops cost the host
    pts = [
        dict(ranks=4, reshard=True, phase=ph, params=n, seconds=measured)
        for ph in ("forward", "backward")
        for n in (2, 8)
    ]
    with_hooks = evaluate(g, _target(pts)).time
    without = evaluate(g, _target([])).time
    for o, n in zip(with_hooks.ops, g.nodes, strict=True):
        if n.op != HOOKS:
            continue
        phase = n.args[0]
        inserted = sum(
            x.host_s
            for x, m in zip(with_hooks.ops, g.nodes, strict=True)
            if m.module == n.module
            and m.op != HOOKS
            and ("forward" if m.phase == "forward" else "backward") == phase
            and (m.stream == "comm" or m.op in FSDP_COMPUTE_OPS)
        )
        assert 0 < inserted < measured
        assert o.host_s == pytest.approx(measured - inserted)
    # the tiny model's step is host-bound: the hooks' time is on its critical path
    units = 4
    assert with_hooks.host_s - without.host_s == pytest.approx(
        sum(o.host_s for o, n in zip(with_hooks.ops, g.nodes, strict=True) if n.op == HOOKS)
        - sum(o.host_s for o, n in zip(without.ops, g.nodes, strict=True) if n.op == HOOKS),
        rel=1e-9,
    )
    assert with_hooks.step_s > without.step_s + units * measured


def test_skew_is_the_median_over_steps_of_the_slowest_rank_over_the_mean():
    def rows(steps):
        return [
            dict(layers=layers, kind="plain", forward_steps=steps, backward_steps=steps)
            for layers in (1, 2, 4, 8, 12)
        ]

    # per step: max / mean = 1/1, 2/1.5, 3/2 -> median 4/3
    pts = skew([rows([1 * MS, 1 * MS, 1 * MS]), rows([1 * MS, 2 * MS, 3 * MS])], world=2)
    assert len(pts) == 2 * 5 and {p["ranks"] for p in pts} == {2}
    assert all(p["factor"] == pytest.approx(4 / 3) for p in pts)
    assert all(p["host_s"] == pytest.approx(1.5 * MS) for p in pts)


def test_rank_skew_reads_the_nearest_rank_count_at_its_longest_host_time():
    sec = {
        "skew": [
            dict(ranks=2, phase="forward", host_s=1 * MS, factor=1.5),
            dict(ranks=2, phase="forward", host_s=9 * MS, factor=1.1),
            dict(ranks=4, phase="forward", host_s=9 * MS, factor=1.3),
            dict(ranks=4, phase="backward", host_s=9 * MS, factor=0.9),
        ]
    }
    assert rank_skew(sec, "forward", 2) == pytest.approx(1.1)  # the longest of the 2-rank ones
    assert rank_skew(sec, "forward", 64) == pytest.approx(1.3)  # nearest measured: 4 ranks
    assert rank_skew(sec, "backward", 4) == 1.0  # never faster than one rank
    assert rank_skew(sec, "forward", 1) == 1.0 and rank_skew(None, "forward", 4) == 1.0


def test_evaluate_charges_every_op_but_the_hooks_the_slowest_ranks_host(graph):  # noqa: F811
    g = fsdp(graph, 4)
    pts = [
        dict(ranks=4, reshard=True, phase=ph, params=n, seconds=5 * MS)
        for ph in ("forward", "backward")
        for n in (2, 8)
    ]
    t = _target(pts)
    slow = {
        "forward": 1.25,
        "backward": 1.1,
    }
    sk = [dict(ranks=4, phase=ph, host_s=MS, factor=f) for ph, f in slow.items()]
    skewed = dataclasses.replace(
        t, cal=dataclasses.replace(t.cal, dp_host={"points": pts, "skew": sk})
    )
    a, b = evaluate(g, t).time, evaluate(g, skewed).time
    scaled = 0
    for x, y, n in zip(a.ops, b.ops, g.nodes, strict=True):
        if n.op == HOOKS or n.phase not in slow:
            assert y.host_s == pytest.approx(x.host_s)
        else:
            assert y.host_s == pytest.approx(x.host_s * slow[n.phase])
            scaled += x.host_s > 0
    assert scaled > 10 and b.step_s > a.step_s
