"""The collectives' time model against hand-derived values and NCCL measured on H100s.

Fixtures: `gobrrr.calibrate.sections.collectives` run under torchrun on one host of four
H100 80GB HBM3 (NVLink 4 through NVSwitch, NCCL 2.28.9, NVLink multicast off), once on all
four GPUs (`collectives_h100_x4.json`) and once on two of them (`collectives_h100_x2of4.json`).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import pytest

from gobrrr.cost.collectives import (
    LINKS,
    Curve,
    bus_factor,
    collective_time,
    curves_from_measurement,
)

FIXTURES = Path(__file__).parent / "fixtures"
MiB, GiB = 2**20, 2**30


def _points(name: str) -> list[dict]:
    return json.loads((FIXTURES / name).read_text())["points"]


def test_bus_factors_are_nccls():
    # nccl-tests PERFORMANCE.md: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n
    assert bus_factor("all_reduce", 4) == 1.5
    assert bus_factor("all_reduce", 2) == 1.0
    assert bus_factor("all_gather", 8) == 7 / 8
    assert bus_factor("reduce_scatter", 2) == 0.5
    assert bus_factor("all_reduce", 1) == 0.0
    with pytest.raises(ValueError, match="all_to_all"):
        bus_factor("all_to_all", 4)


def test_datasheet_time_is_latency_plus_bus_bytes():
    link = LINKS["nvlink4"]
    # 1 GiB all-reduce on 8 ranks: 1.75 GiB through each link at 0.8 x 450 GB/s, plus 30 us
    expected = 30e-6 + GiB * 1.75 / (450e9 * 0.8)
    assert collective_time("all_reduce", GiB, 8, link) == pytest.approx(expected, rel=1e-12)
    assert collective_time("all_gather", GiB, 1, link) == 0.0


def test_curve_interpolates_in_log_log():
    c = Curve.from_points("all_gather", 4, [(16384, 80e-6), (1024, 40e-6), (4096, 30e-6)])
    assert [b for b, _ in c.points] == [1024, 4096, 16384]
    # halfway in log(bytes) between 4096 and 16384 is the geometric mean of their times
    assert c.seconds(8192) == pytest.approx((30e-6 * 80e-6) ** 0.5)
    assert c.seconds(4096) == pytest.approx(30e-6)
    assert c.seconds(10) == pytest.approx(40e-6)  # below the grid: the latency
    assert c.seconds(32768) == pytest.approx(160e-6)  # above it: the last bandwidth held


@pytest.mark.parametrize("fixture", ["collectives_h100_x4.json", "collectives_h100_x2of4.json"])
@pytest.mark.parametrize("op", ["all_reduce", "all_gather", "reduce_scatter"])
def test_held_out_sizes_predicted(fixture, op):
    """Built from the sizes 3 x 2^k only, the curve predicts every measured power of two from
    1 MiB to 1 GiB, none of which it saw: median within 3%, each within 15%. (64 of the 66
    within 5%; the two past 10% are two ranks' reduce-scatter at 4 and 8 MiB, -14% and +14%,
    where the measured time is itself bimodal, 25 or 41 us a call, as NCCL's protocol for the
    size changes.)"""
    points = [p for p in _points(fixture) if p["op"] == op and p["dtype"] == "bf16"]
    grid = [p for p in points if p["bytes"] & (p["bytes"] - 1)]
    held = [p for p in points if not p["bytes"] & (p["bytes"] - 1) and MiB <= p["bytes"] <= GiB]
    curves = curves_from_measurement(grid)
    ranks = points[0]["ranks"]
    errors = {
        p["bytes"] // MiB: collective_time(op, p["bytes"], ranks, LINKS["nvlink4"], curves)
        / p["seconds"]
        - 1
        for p in held
    }
    assert len(errors) == 11
    worst = max(errors.items(), key=lambda kv: abs(kv[1]))
    assert abs(worst[1]) <= 0.15, f"{op} on {ranks} ranks: {worst[0]} MiB off by {worst[1]:+.1%}"
    assert statistics.median(abs(e) for e in errors.values()) <= 0.03


def test_other_rank_count_through_the_bus_factor():
    """From four ranks' curve to two ranks: the large messages within 25% of what two of the
    same GPUs measured (NCCL's bus bandwidth on two ranks is 6-20% lower than on four here, so
    the conversion is an estimate; the calibration measures the ranks a job uses)."""
    curves = curves_from_measurement(_points("collectives_h100_x4.json"))
    for p in _points("collectives_h100_x2of4.json"):
        if p["dtype"] == "bf16" and p["bytes"] in (256 * MiB, GiB):
            t = collective_time(p["op"], p["bytes"], 2, LINKS["nvlink4"], curves)
            assert t / p["seconds"] - 1 == pytest.approx(0, abs=0.25), p["op"]
