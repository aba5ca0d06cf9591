"""Calibration.load: tolerant of sections it does not know, one clear error for a damaged
file (naming the file, the field and the fix)."""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import pytest

from gobrrr.errors import GobrrrError
from gobrrr.hardware import Calibration, Target, get_gpu

SHIPPED = Path(__file__).parents[1] / "src" / "gobrrr" / "data" / "calibration" / "h100-sxm.json"

TINY = {
    "gpu": "h100-sxm",
    "device_name": "NVIDIA H100 80GB HBM3",
    "matmul_flops": {"bf16": 7.8e14},
    "copy_bandwidth": 3.0e12,
    "pointwise_bandwidth": 2.9e12,
    "reduction_bandwidth": 3.1e12,
    "launch_overhead": 1e-5,
    "kernel_latency": 2.5e-6,
    "version": 1,
}


def _write(tmp_path: Path, data, name: str = "cal.json") -> Path:
    p = tmp_path / name
    p.write_text(data if isinstance(data, str) else json.dumps(data))
    return p


def test_an_unknown_section_is_kept_and_written_back(tmp_path, caplog):
    newer = {**TINY, "tea_bandwidth": {"green": [[1, 2.5]]}, "flux": 3}
    with caplog.at_level(logging.DEBUG, logger="gobrrr.hardware"):
        cal = Calibration.load(_write(tmp_path, newer))
    assert cal.matmul_flops == {"bf16": 7.8e14}
    assert cal.unknown_sections == {"tea_bandwidth": {"green": [[1, 2.5]]}, "flux": 3}
    assert "tea_bandwidth" in caplog.text  # a debug note, not a warning
    assert all(r.levelno == logging.DEBUG for r in caplog.records)
    out = tmp_path / "again.json"
    cal.save(out)
    saved = json.loads(out.read_text())
    assert saved["tea_bandwidth"] == newer["tea_bandwidth"] and saved["flux"] == 3
    assert "unknown_sections" not in saved
    assert Calibration.load(out) == cal


def test_a_truncated_file_names_the_file_and_the_fix(tmp_path):
    text = json.dumps(TINY)
    p = _write(tmp_path, text[: len(text) // 2])
    with pytest.raises(GobrrrError) as e:
        Calibration.load(p)
    assert str(p) in str(e.value) and "not valid JSON" in str(e.value)
    assert "gobrrr calibrate" in str(e.value) and "restore" in str(e.value)


@pytest.mark.parametrize(
    "field, value",
    [
        ("copy_bandwidth", "fast"),
        ("matmul_flops", {"bf16": "lots"}),
        ("matmul_grid", [[1, 2, 3]]),
        ("launch_overhead", True),
    ],
)
def test_a_known_field_of_the_wrong_type_names_the_field(tmp_path, field, value):
    p = _write(tmp_path, {**TINY, field: value})
    with pytest.raises(GobrrrError) as e:
        Calibration.load(p)
    assert str(p) in str(e.value) and field in str(e.value)
    assert "gobrrr calibrate" in str(e.value)


def test_a_missing_field_and_a_non_object(tmp_path):
    p = _write(tmp_path, {k: v for k, v in TINY.items() if k != "copy_bandwidth"})
    with pytest.raises(GobrrrError, match="lacks copy_bandwidth"):
        Calibration.load(p)
    with pytest.raises(GobrrrError, match="not a JSON object"):
        Calibration.load(_write(tmp_path, "[1, 2]", "list.json"))
    with pytest.raises(GobrrrError, match="cannot read calibration"):
        Calibration.load(tmp_path / "absent.json")


def test_the_shipped_calibration_loads_to_the_same_object():
    data = json.loads(SHIPPED.read_text())
    before = Calibration(**data)  # what the loader built before it checked anything
    after = Calibration.load(SHIPPED)
    assert after == before and after.unknown_sections == {}
    assert asdict(after) == asdict(before)
    assert after.to_dict() == data


def test_target_resolves_names_files_and_cuda_device_names():
    by_name = Target.resolve("h100")
    assert Target.resolve("NVIDIA H100 80GB HBM3") == by_name
    assert Target.resolve("nvidia h100 80gb hbm3", calibration=False).cal is None
    assert get_gpu("NVIDIA H200").name == "h200"
    with pytest.raises(GobrrrError, match="unknown GPU 'NVIDIA A10G'"):
        Target.resolve("NVIDIA A10G")
