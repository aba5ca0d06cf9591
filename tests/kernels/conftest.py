"""Kernel tests run the Triton kernels on CPU through the interpreter (TRITON_INTERPRET=1).

The variable is set here, before any test module imports triton; kernel_for() re-wraps kernels
for the interpreter even when triton was imported earlier. Without triton the directory is skipped.
"""

import importlib.util
import os

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

os.environ["TRITON_INTERPRET"] = "1"

if importlib.util.find_spec("triton") is None:
    collect_ignore_glob = ["test_*.py"]


def assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float, what: str = "") -> None:
    """Max abs error, relative to the reference's max magnitude, within `tol`; shapes equal."""
    assert actual.shape == expected.shape, f"{what}: shape {actual.shape} != {expected.shape}"
    assert torch.isfinite(actual).all(), f"{what}: non-finite values"
    err = (actual.float() - expected.float()).abs().max().item()
    scale = max(expected.float().abs().max().item(), 1e-3)
    assert err <= tol * scale, f"{what}: max error {err:.3g} > {tol} * {scale:.3g}"


@pytest.fixture
def close():
    return assert_close


class Recorder(TorchDispatchMode):
    """Records (op name, output shapes) of every op dispatched below it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        outs = out if isinstance(out, (tuple, list)) else (out,)
        shapes = [tuple(o.shape) for o in outs if isinstance(o, torch.Tensor)]
        self.ops.append((str(func.overloadpacket._qualified_op_name), shapes))
        return out


@pytest.fixture
def recorder():
    return Recorder
