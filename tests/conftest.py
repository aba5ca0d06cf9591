"""Shared test helpers."""

import pytest
import torch

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


@pytest.fixture(scope="module")
def one_thread():
    """Tiny steps: torch's intra-op threads cost more than they share (10x on 2 busy cores).
    A module takes it with `pytestmark = pytest.mark.usefixtures("one_thread")`."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
