"""A convolution on an operand that is not contiguous in the layout it runs in: PyTorch copies
it to a dense one inside the op (Convolution.cpp's `input.contiguous(memory_format)`,
cudnn/ConvShared.cpp's for grad_output), a block the calibration's dense grids never saw.
ShuffleNet-v2 runs a 1x1 convolution on the second half of `x.chunk(2, dim=1)`; its allocator
trace on an H100 (benchmarks/results/zoo_diagnose_far_h100.json) shows the copy at the
slice's dense size in forward and backward."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.cost import conv
from gobrrr.cost.rates import Rates
from gobrrr.cost.shapes import contiguous_in
from gobrrr.graph.ir import TensorInfo
from gobrrr.hardware import get_gpu

N, C, H = 2, 8, 6  # the sliced half: 8 channels of 16, 6 x 6 pixels
HALF_BYTES = N * C * H * H * 2  # its dense bf16 copy: 1152 bytes

pytestmark = pytest.mark.usefixtures("one_thread")


class Split(nn.Module):
    """A ShuffleNet-v2 stride-1 unit's right branch, cut down: a 1x1 convolution on the
    second half of the channels."""

    def __init__(self) -> None:
        super().__init__()
        self.stem = nn.Conv2d(3, 2 * C, 1, bias=False)
        self.branch = nn.Conv2d(C, C, 1, bias=False)

    def forward(self, x):
        _, right = self.stem(x).chunk(2, dim=1)
        return self.branch(right)


def _graph(channels_last: bool, input_channels_last: bool = True):
    def make():
        model = Split()
        x = torch.randn(N, 3, H, H)
        if channels_last:
            model = model.to(memory_format=torch.channels_last)
        if channels_last and input_channels_last:
            x = x.to(memory_format=torch.channels_last)
        return gobrrr.Workload(model=model, batch=(x,), loss=lambda y, b: y.float().pow(2).mean())

    return capture(make, precision="bf16-mixed")


def _nothing_inside(make_cal, layout):
    """A calibration whose dense convolutions of both classes here allocate nothing inside:
    what is left of a convolution's scratch is its copies."""
    keys = [f"inside:{layout}:{c}:{d}" for c in ("1x1", "1x1-expand") for d in DIRECTIONS]
    return make_cal(conv_workspace={"bf16": dict.fromkeys(keys, 0.0)})


DIRECTIONS = ("forward", "backward")


def _conv(g, name, module):
    """The stem's or the branch's convolution (backward runs them in reverse)."""
    nodes = [n for n in g.nodes if n.name == name]
    first = module == ("branch" if name == "convolution_backward" else "stem")
    return nodes[0 if first else 1]


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_channel_slice_is_copied_at_its_dense_size(channels_last, make_cal):
    """The sliced convolution copies its input, forward and (for the weight's gradient)
    backward: N·C·H·W bf16 elements, in the layout it runs in. Its grad_output (the loss's
    gradient, channels-first from the expanded scalar) is copied too where cuDNN runs
    channels-last: `.to()` the input's format, once for both gradients."""
    g = _graph(channels_last)
    fwd = _conv(g, "convolution", "branch")
    bwd = _conv(g, "convolution_backward", "branch")
    layout = "channels_last" if channels_last else "channels_first"
    cal = _nothing_inside(make_cal, layout)
    assert conv.copy_layout(fwd) == conv.copy_layout(bwd) == layout
    assert [name for name, _ in conv.operand_copies(fwd)] == ["input"]
    assert conv.copy_blocks(fwd) == (HALF_BYTES,)
    assert conv.scratch(g, cal)[fwd.index] == (HALF_BYTES,)
    go = ["grad_output"] if channels_last else []
    assert [name for name, _ in conv.operand_copies(bwd)] == ["input", *go]
    assert conv.copy_blocks(bwd) == (HALF_BYTES,) * (1 + len(go))
    assert conv.scratch(g, cal)[bwd.index] == (HALF_BYTES,) * (1 + len(go))
    # a slice keeps the copy's fastest dim (channels-last: channels; else: columns)
    ((_, x),) = conv.operand_copies(fwd)
    assert conv.copy_path(x, layout) == "strided"


@pytest.mark.parametrize("channels_last", [True, False])
def test_a_dense_input_is_not_copied(channels_last, make_cal):
    """The stem's input is dense in its layout: its forward copies nothing and has no
    scratch, its backward does not copy the input."""
    g = _graph(channels_last)
    cal = _nothing_inside(make_cal, "channels_last" if channels_last else "channels_first")
    fwd = _conv(g, "convolution", "stem")
    assert conv.operand_copies(fwd) == ()
    assert conv.copy_blocks(fwd) == ()
    assert fwd.index not in conv.scratch(g, cal)
    bwd = _conv(g, "convolution_backward", "stem")
    assert "input" not in [name for name, _ in conv.operand_copies(bwd)]


def test_a_dense_channels_first_input_beside_a_channels_last_weight_is_transposed():
    """ShuffleNet's channel shuffle ends in `.contiguous()` (channels-first) before
    convolutions whose weights are channels-last: cuDNN runs channels-last and the dense
    input is copied across layouts, a transposing copy (N·3·H·W bf16 elements here)."""
    g = _graph(True, input_channels_last=False)
    fwd = _conv(g, "convolution", "stem")
    assert conv.copy_layout(fwd) == "channels_last"
    ((name, x),) = conv.operand_copies(fwd)
    assert name == "input" and x.is_contiguous()
    assert conv.copy_blocks(fwd) == (N * 3 * H * H * 2,)
    assert conv.copy_path(x, "channels_last") == "transposed"


def test_the_copy_is_timed_at_its_paths_measured_rate(make_cal):
    """The copy reads and writes the slice once, at the calibration's rate for its path,
    plus a kernel's latency; a dense convolution adds nothing."""
    rate = 1e12
    cal = make_cal(path_bandwidth={"copy:strided:bf16": [[1e3, rate], [1e9, rate]]})
    rates = Rates(get_gpu("h100"), cal)
    g = _graph(True)
    fwd = _conv(g, "convolution", "branch")
    assert rates.conv_copies(fwd) == pytest.approx(2 * HALF_BYTES / rate + 1e-6)
    assert rates.conv_copies(_conv(g, "convolution", "stem")) == 0.0
    # without a measured path: the calibration's copy bandwidth
    plain = Rates(get_gpu("h100"), make_cal())
    assert plain.conv_copies(fwd) == pytest.approx(2 * HALF_BYTES / 3e12 + 1e-6)


@pytest.mark.parametrize(
    "make",
    [
        lambda: torch.empty(4, 16, 5, 5).to(memory_format=torch.channels_last)[:, 8:],
        lambda: torch.empty(4, 16, 5, 5)[:, 8:],
        lambda: torch.empty(4, 16, 5, 5).to(memory_format=torch.channels_last),
        lambda: torch.empty(4, 16, 5, 5),
        lambda: torch.empty(32, 16, 1, 1),  # a 1x1 weight: contiguous in both
        lambda: torch.empty(32, 1, 3, 3).to(memory_format=torch.channels_last),  # depthwise
        lambda: torch.empty(1, 16, 1, 1),
        lambda: torch.empty(4, 5, 5, 16).permute(0, 3, 1, 2)[:, :, 1:],
        lambda: torch.empty(4, 16, 40),  # 1-D
    ],
)
def test_contiguous_in_is_torchs(make):
    """`contiguous_in` answers as torch's is_contiguous(memory_format)."""
    t = make()
    info = TensorInfo(tuple(t.shape), tuple(t.stride()), "float32", 0)
    assert contiguous_in(info, "channels_first") == t.is_contiguous()
    if t.dim() == 4:
        got = contiguous_in(info, "channels_last")
        assert got == t.is_contiguous(memory_format=torch.channels_last)
