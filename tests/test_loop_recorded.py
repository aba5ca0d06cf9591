"""The loops users run, held to their recorded measurement (tests/fixtures/loops_zoo_h200.json,
written by benchmarks/zoo/loops.py on an H200): cases predicted again with the code as it
is, as the file's plain and timm rows were (the shipped H100 calibration; allocated and
reserved bytes do not depend on which Hopper card runs them)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import gobrrr
from zoo.cases import get_case
from zoo.common import available

FIXTURE = Path(__file__).parent / "fixtures" / "loops_zoo_h200.json"
RECORDED = json.loads(FIXTURE.read_text())["cases"]


def _predict(name: str, loop: str, gpu: str = "h100"):
    case, row = get_case(name), RECORDED[name]
    if not available(case.library):
        pytest.skip(f"{case.library} is not installed: pip install 'gobrrr[zoo]'")
    return gobrrr.estimate(
        case.factory(),
        gpu,
        batch=row["batch"] or case.batch,
        seq=row["seq"] or case.seq,
        precision=case.precision,
        compile=case.compile,
        loop=loop,
    ).memory


# Two steps whose reserved peak was 8-10% over while the replay's first step held a previous
# output that a process's first step does not have (`StorageInfo.carried`): that step maps
# the segments the later ones reuse.
@pytest.mark.parametrize(
    ("name", "loop", "recorded"),
    [
        ("distilbert-mlm", "keeps-output", "plain"),
        ("convnext_tiny-timm-gc", "zero-grad-first", "timm"),
    ],
)
def test_reserved_peak_of_the_loop_is_the_gpus(name, loop, recorded):
    measured = RECORDED[name][recorded]["measured"]
    mem = _predict(name, loop)
    assert abs(mem.peak / measured["peak_allocated"] - 1) < 0.005
    assert abs(mem.reserved / measured["peak_reserved"] - 1) < 0.01


def test_a_gpu_without_a_calibration_reads_the_tables_of_its_chip():
    """No calibration ships for the H200; its cuDNN and cuBLAS workspaces are the H100 SXM's
    (one GH100 die, 132 SMs: `hardware.memory_calibration`); an H100 PCIe (114 SMs) reads
    none, and a GPU with its own keeps it."""
    from gobrrr.hardware import find_calibration, get_gpu, memory_calibration

    h100, h200, pcie = get_gpu("h100"), get_gpu("h200"), get_gpu("h100-pcie")
    shipped = find_calibration(h100)
    assert find_calibration(h200) is None
    assert memory_calibration(h200, None) == shipped
    assert memory_calibration(pcie, None) is None
    assert memory_calibration(h100, shipped) is shipped


def test_an_h200_is_predicted_with_the_h100_sxms_workspaces():
    """ConvNeXt-T's convolution workspaces on the H200: with the uncalibrated model's they
    were +1.7% over the allocated peak measured there."""
    measured = RECORDED["convnext_tiny-timm-gc"]["plain"]["measured"]
    mem = _predict("convnext_tiny-timm-gc", "keeps-output", "h200")
    assert abs(mem.peak / measured["peak_allocated"] - 1) < 0.005


NAME = "NVIDIA H100 80GB HBM3"


def test_the_output_says_whose_workspaces_an_uncalibrated_gpu_reads():
    from gobrrr.report.estimate import estimate_dict
    from gobrrr.report.terminal import summary_lines

    est = gobrrr.estimate("mlp", "h200")
    assert est.calibration is None and est.memory_calibration == NAME
    assert estimate_dict(est)["gpu"]["memory_calibration"] == NAME
    assert f"workspaces as measured on the {NAME}" in " ".join(str(t) for t in summary_lines(est))
    own = gobrrr.estimate("mlp", "h100")  # a GPU with its own calibration says nothing more
    assert own.memory_calibration is None
    assert estimate_dict(own)["gpu"]["memory_calibration"] is None


def test_the_html_report_says_it_too():
    pytest.importorskip("plotly")
    from gobrrr.report.estimate import estimate_dict
    from gobrrr.report.pages import estimate_summary

    d = estimate_dict(gobrrr.estimate("mlp", "h200"))
    assert f"workspaces as measured on the {NAME}" in str(estimate_summary(d).body)
