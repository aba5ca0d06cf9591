"""The planner's predictions against its H100 runs (tests/fixtures/plan_h100_*.json, written
by benchmarks/plan/bench_plan.py): every configuration that ran in two scenarios, costed again
here with the shipped calibration as `Planner.cost` costs it (zoo.scenarios.repredict):
throughput within 10% and the allocated peak within 1% of what was measured."""

from pathlib import Path

import pytest

from zoo.scenarios import repredict

RESULTS = Path(__file__).resolve().parent / "fixtures"
NEEDS = {"resnet50-cl-b2048": "torchvision"}  # scenarios built from a zoo library


@pytest.mark.parametrize(
    "file, scenario",
    [
        ("plan_h100_llama1b.json", "llama3-1b-seq16k"),
        ("plan_h100_resnet50.json", "resnet50-cl-b2048"),
    ],
)
def test_every_configuration_that_ran_is_predicted_within_bounds(file, scenario):
    if scenario in NEEDS:
        pytest.importorskip(NEEDS[scenario], exc_type=ImportError)
    rows = repredict(RESULTS / file, [scenario])
    assert len(rows) >= 5  # the grid's points that ran and the plans
    bad = [
        f"{r['role']} {'; '.join(r['changes'])}: tokens/s {r['units_per_s_err']:+.1%}, "
        f"allocated {r['alloc_err']:+.2%}"
        for r in rows
        if abs(r["units_per_s_err"]) > 0.10 or abs(r["alloc_err"]) > 0.01
    ]
    assert not bad, "\n".join(bad)
