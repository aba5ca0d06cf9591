"""gobrrr's predictions, recomputed here on the CPU, against real H100 measurements.

`benchmarks/results/estimate_suite_h100.json` was written by benchmarks/bench_estimate_suite.py
on an H100: for each built-in workload, the real max_memory_allocated of a steady-state step
and its median time. Each test run traces every case again and requires the peak-memory
prediction within 5% of the measurement on each case and 2% in the median (eager cases;
compiled graphs save fewer activations and are not modelled for memory), and the step time
predicted with the shipped H100 calibration within 30% on each case and 15% in the median.
"""

import json
import statistics
from pathlib import Path

import pytest

from gobrrr.cost.roofline import predict
from gobrrr.estimate import blas_workspace, estimate
from gobrrr.hardware import Calibration
from gobrrr.memory import simulate

ROOT = Path(__file__).resolve().parents[1]
DATA = json.loads((ROOT / "benchmarks" / "results" / "estimate_suite_h100.json").read_text())
# the H100 calibration gobrrr ships, written by `gobrrr calibrate` on the same kind of GPU
CAL = Calibration.load(ROOT / "src" / "gobrrr" / "data" / "calibration" / "h100-sxm.json")
CASES = [c for c in DATA["cases"] if "peak_allocated" in c.get("measured", {})]


def _id(c):
    return (f"{c['model']}-b{c['batch']}-s{c['seq']}-{c['precision']}-{c['checkpoint']}"
            + ("-compile" if c["compile"] else ""))


@pytest.fixture(scope="module")
def predictions():
    out = {}
    for c in CASES:
        est = estimate(c["model"], "h100", batch=c["batch"], seq=c["seq"],
                       precision=c["precision"], checkpoint=c["checkpoint"], calibration=False,
                       compile=c["compile"])
        cal = CAL
        peak = simulate(est.graph, blas_workspace(est.graph, est.gpu, cal)).peak
        step = predict(est.graph, est.gpu, cal, compiled=c["compile"]).step_s
        out[_id(c)] = (peak, step)
    return out


def test_the_recorded_suite_is_large_enough():
    assert len(CASES) >= 16
    assert DATA["environment"]["device"].startswith("NVIDIA H100")


def test_peak_memory_within_5_percent_each_and_2_percent_median(predictions):
    errors = {}
    for c in CASES:
        if c["compile"]:
            continue
        peak, _ = predictions[_id(c)]
        errors[_id(c)] = peak / c["measured"]["peak_allocated"] - 1
    print("\npeak-memory error per case:")
    for k, e in errors.items():
        print(f"  {k:55s} {e:+.2%}")
    assert all(abs(e) <= 0.05 for e in errors.values()), errors
    assert statistics.median(abs(e) for e in errors.values()) <= 0.02


def test_calibrated_step_time_within_30_percent_each_and_15_percent_median(predictions):
    errors = {}
    for c in CASES:
        _, step = predictions[_id(c)]
        errors[_id(c)] = step / c["measured"]["step_s"] - 1
    print("\nstep-time error per case (calibrated):")
    for k, e in errors.items():
        print(f"  {k:55s} {e:+.1%}")
    assert statistics.median(abs(e) for e in errors.values()) <= 0.15, errors
    assert all(abs(e) <= 0.30 for e in errors.values()), errors
