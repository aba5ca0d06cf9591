"""The power limit's hold on compute-bound kernels (`schedule.power.power_limited`, calibrated
by `profile.calibrate_power.power_duty`): hand-derived fixed points on synthetic ops, what is
left alone, and the shipped H100 curve against the in-step matmul rate a GPU run recorded."""

import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from gobrrr.calibrate.sections.power import PATTERNS, power_duty
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import OpTime
from gobrrr.hardware import find_calibration, get_gpu
from gobrrr.report.estimate import estimate_dict
from gobrrr.schedule.power import power_limited as _power_limited
from gobrrr.schedule.scheduler import Timeline

ROOT = Path(__file__).resolve().parents[1]
CURVE = [[0.5, 1.0], [1.0, 0.8]]  # full rate up to half the time, 80% at all of it


def _op(i, math, compute, memory, host=0.0):
    device = max(compute, memory)
    return OpTime(
        i,
        "x",
        "",
        "forward",
        "matmul",
        math,
        1.0,
        1.0,
        1.0,
        compute,
        memory,
        device,
        host,
        "compute" if compute >= memory else "memory",
    )


def _rates(curve):
    cal = find_calibration(get_gpu("h100"))
    return Rates(get_gpu("h100"), replace(cal, power_duty={"bf16": curve} if curve else {}))


def _ends(host, device):
    """A timeline that only ends: the host at `host`, the device at `device` (s)."""
    return Timeline((), host_end=host, device_end=device)


def _serial(ops):
    """The device runs every op back to back; the host never waits."""
    return _ends(0.0, sum(o.device_s for o in ops))


def _fixed_point(hot, other):
    """f = curve(d), d = (hot / f) / (hot / f + other), solved by bisection on f."""
    lo, hi = 0.5, 1.0
    for _ in range(100):
        f = (lo + hi) / 2
        d = (hot / f) / (hot / f + other)
        g = 1.0 if d <= 0.5 else 1.0 - 0.4 * (d - 0.5)
        lo, hi = (f, hi) if g > f else (lo, f)
    return (lo + hi) / 2


def test_compute_bound_tensor_core_ops_slow_to_the_curves_fixed_point():
    ops = (_op(0, "bf16", 0.9, 0.1), _op(1, "vector", 0.0, 0.1))
    out, fraction, timeline = _power_limited(ops, [1, 1], _rates(CURVE), _serial)
    device_t = timeline.device_end
    f = _fixed_point(0.9, 0.1)
    assert fraction == pytest.approx(f, abs=1e-3)
    assert 0.8 < f < 0.9
    assert out[0].compute_s == pytest.approx(0.9 / fraction)
    assert out[0].device_s == pytest.approx(0.9 / fraction)
    assert out[1] == ops[1]  # memory-bound: the limit leaves its bandwidth alone
    assert device_t == pytest.approx(0.9 / fraction + 0.1)


def test_a_duty_under_the_curves_knee_keeps_the_burst_rate():
    ops = (_op(0, "bf16", 0.3, 0.01), _op(1, "vector", 0.0, 0.7))
    out, fraction, _ = _power_limited(ops, [1, 1], _rates(CURVE), _serial)
    assert fraction == 1.0 and out == ops


def test_idle_time_counts_against_the_duty():
    """A host-bound step leaves the GPU idle: the same kernels, a lower duty."""
    ops = (_op(0, "bf16", 0.9, 0.1, host=1.0), _op(1, "vector", 0.0, 0.1, host=1.0))

    def host_bound(ops):
        return _ends(sum(o.host_s for o in ops), sum(o.device_s for o in ops))

    _, fraction, _ = _power_limited(ops, [1, 1], _rates(CURVE), host_bound)
    assert fraction == 1.0  # 0.9 s of matmul in a 2 s step: duty 0.45


def test_fp32_cuda_core_ops_and_repeats():
    ops = (_op(0, "fp32", 0.9, 0.1), _op(1, "bf16", 0.45, 0.0), _op(2, "vector", 0.0, 0.05))
    # op 1 runs twice (a repeated micro-batch): 0.9 s of tensor-core time against 0.1 s other

    def weighted(ops):
        w = [1, 2, 2]
        return _ends(0.0, sum(o.device_s * k for o, k in zip(ops, w, strict=True)))

    out, fraction, _ = _power_limited(ops, [1, 2, 2], _rates(CURVE), weighted)
    assert out[0] == ops[0]  # CUDA cores: not what the curve measured
    d = (0.9 / fraction) / (0.9 / fraction + 0.9 + 0.1)  # the fp32 op's time is "other"
    assert fraction == pytest.approx(1.0 if d <= 0.5 else 1 - 0.4 * (d - 0.5), abs=1e-3)


def test_without_the_section_nothing_changes():
    ops = (_op(0, "bf16", 0.9, 0.1),)
    out, fraction, _ = _power_limited(ops, [1], _rates(None), _serial)
    assert out == ops and fraction == 1.0


@pytest.fixture(scope="module")
def llama5b_plan3():
    """The planner's graph of a Llama-shaped 5B model's applied plan (micro-batch 8, every
    block checkpointed, fused loss, 8-bit states), and its GPU run's kernel times by class
    (plan_step_kernels_llama5b_h100.json: matmul 1.61 s, busy 2.88 s of a 2.88 s step)."""
    from gobrrr.passes.checkpoint import checkpoint
    from gobrrr.plan.knobs import Knobs
    from gobrrr.plan.search import Planner
    from zoo.scenarios import SCENARIOS

    rec = json.loads((ROOT / "tests/fixtures/plan_step_kernels_llama5b_h100.json").read_text())
    row = next(r for r in rec["rows"] if r["role"] == "plan#3")
    source, seq, g, precision, allow, _ = SCENARIOS[row["scenario"]]
    planner = Planner(source, "h100", global_batch=g, seq=seq, precision=precision, allow=allow)
    knobs = Knobs.from_dict(row["knobs"])
    graph = checkpoint(planner.search.graph(knobs), dict(knobs.checkpoint))
    return graph, planner.target, row["measured"]


def _matmul_seconds(graph, target):
    from gobrrr.evaluate import evaluate

    return sum(
        o.device_s for o in evaluate(graph, target).time.ops if o.kind in ("matmul", "loss")
    )  # the fused loss: its matmuls, nearly all


def test_the_shipped_curve_gives_the_in_step_matmul_time_recorded_on_an_h100(
    llama5b_plan3, monkeypatch
):
    """At burst rates the plan's matmuls are predicted 9% short of what the GPU took; the
    power limit, at the step's own duty, brings them within 5%."""
    import importlib

    evaluate = importlib.import_module("gobrrr.evaluate")  # the module, not gobrrr.evaluate()

    graph, target, measured = llama5b_plan3
    got = measured["by_class"]["matmul"]["s"]
    assert _matmul_seconds(graph, target) == pytest.approx(got, rel=0.05)
    monkeypatch.setattr(
        evaluate, "power_limited", lambda ops, weights, rates, schedule: (ops, 1.0, schedule(ops))
    )
    assert _matmul_seconds(graph, target) < 0.92 * got


def test_power_duty_measures_a_curve_on_any_device():
    out = power_duty(
        torch.device("cpu"), heat_s=0.0, reps=2, settle_s=0.0, mm=64, copy_elements=4096
    )
    assert len(out["bf16"]) == len(PATTERNS)
    assert len(out["copy"]) == sum(1 for _, j in PATTERNS if j)
    duties = [d for d, _ in out["bf16"]]
    assert duties[-1] == 1.0 and all(0.0 < d <= 1.0 for d in duties)
    assert all(f > 0 for _, f in out["bf16"] + out["copy"])


def test_the_estimate_says_when_compute_is_power_limited(llama5b_plan3):
    from gobrrr.evaluate import evaluate
    from gobrrr.report.terminal import summary_lines

    graph, target, _ = llama5b_plan3
    est = evaluate(graph, target)
    fraction = estimate_dict(est)["time"]["clock_fraction"]
    assert 0.85 < fraction < 0.99
    assert f"compute at {fraction:.0%} of its burst rate" in str(summary_lines(est)[2])
