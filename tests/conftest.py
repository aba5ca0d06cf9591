"""Shared test helpers."""

import pytest

from gobrrr.hardware import Calibration


@pytest.fixture
def make_cal():
    """A Calibration with round numbers; keyword arguments override or add fields."""

    def make(**kw) -> Calibration:
        base = dict(
            gpu="h100-sxm",
            device_name="H100",
            matmul_flops={"bf16": 800e12},
            copy_bandwidth=3e12,
            pointwise_bandwidth=3e12,
            reduction_bandwidth=3e12,
            launch_overhead=8e-6,
            kernel_latency=1e-6,
        )
        base.update(kw)
        return Calibration(**base)

    return make
