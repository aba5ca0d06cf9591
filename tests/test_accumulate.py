"""The autograd engine's gradient sums (gobrrr.capture.accumulate) against PyTorch's engine
itself, and LayerNorm backward's partial-sum buffers (gobrrr.memory.scratch.norm) against the
sizes the H100 allocator trace shows."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.graph.ir import OpNode, TensorInfo
from gobrrr.memory.scratch import norm as norm_scratch


class Residual(nn.Module):
    """x = a(input); y = relu(f(x)) + shortcut(x): backward sums two gradients for x.
    `permuted`: the shortcut's gradient reaches the sum first as a transposed view."""

    def __init__(self, permuted: bool) -> None:
        super().__init__()
        self.a, self.f = nn.Linear(16, 16), nn.Linear(16, 16)
        self.permuted = permuted

    def forward(self, inp: torch.Tensor) -> torch.Tensor:
        x = self.a(inp)
        y = torch.relu(self.f(x))
        shortcut = (x.transpose(0, 1) * 2).transpose(0, 1) if self.permuted else x
        return (y + shortcut).square().sum()


def _real_sums(permuted: bool) -> tuple[int, int]:
    """Backward on real CPU tensors under the profiler (which, unlike a dispatch mode or
    Python hooks on the nodes, leaves the engine's choice alone): the engine's sums made in
    place (aten::add_) and allocating (aten::add)."""
    torch.manual_seed(0)
    loss = Residual(permuted)(torch.randn(8, 16))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        loss.backward()
    names = [e.name for e in prof.events()]
    return names.count("aten::add_"), names.count("aten::add")


def _traced(permuted: bool):
    torch.manual_seed(0)
    w = Workload(
        Residual(permuted), torch.randn(8, 16), optimizer=lambda p: torch.optim.SGD(p, lr=0.1)
    )
    g = capture(w, precision="fp32")
    sums = [
        n
        for n in g.nodes
        if n.phase == "backward"
        and n.name == "add"
        and len(n.inputs) == 2
        and n.inputs[0].shape == (8, 16)
        and n.inputs[1].shape == (8, 16)
    ]
    return g, sums


@pytest.mark.parametrize("permuted", [False, True])
def test_gradient_sums_as_pytorchs_engine_makes_them(permuted):
    real = _real_sums(permuted)
    assert real == ((0, 1) if permuted else (1, 0))  # PyTorch's own engine, real tensors
    in_place = real[0] == 1
    g, sums = _traced(permuted)
    assert len(sums) == 1
    s = sums[0]
    out = g.storages[s.outputs[0].storage]
    first = g.storages[s.inputs[0].storage]
    if in_place:  # written into the first gradient's block: made where it was, once
        assert first.nbytes == 0 and out.nbytes == 8 * 16 * 4
        assert out.created == first.created < s.index
        assert out.id not in s.allocs and out.id in g.nodes[out.created].allocs
        assert g.meta.gradient_sums_in_place == 1
    else:
        assert first.nbytes == out.nbytes == 8 * 16 * 4 and out.id in s.allocs
        assert g.meta.gradient_sums_in_place == 0


def _ln_backward(
    rows: tuple[int, ...], n: int, mask=(True, True, True), dtype: str = "float32"
) -> OpNode:
    shape = (*rows, n)
    stride = tuple(int(torch.empty(shape, device="meta").stride()[i]) for i in range(len(shape)))
    x = TensorInfo(shape, stride, dtype, 0)
    stats = TensorInfo((*rows, 1), (1,) * (len(rows) + 1), "float32", 2)
    w = TensorInfo((n,), (1,), dtype, 4)
    b = TensorInfo((n,), (1,), dtype, 5)
    inputs = (x, TensorInfo(shape, stride, dtype, 1), stats, stats, w, b)
    return OpNode(
        index=0,
        op="aten.native_layer_norm_backward.default",
        phase="backward",
        module="",
        inputs=inputs,
        outputs=(),
        args=({"t": 0}, {"t": 1}, [n], {"t": 2}, {"t": 3}, {"t": 4}, {"t": 5}, list(mask)),
        kwargs={},
        allocs=(),
    )


def test_layer_norm_backward_partial_sums_as_the_h100_trace_shows():
    # ConvNeXt-T's first stage at batch 64: 96 channels over 64 x 56 x 56 rows. The H100's
    # allocator trace (zoo_diagnose_plain_h100.json) shows, per LayerNorm backward, two
    # 2408448-byte partial tensors and a 1204224-byte staging buffer with 8 bytes of
    # semaphores: ceil(200704 / 32) = 6272 blocks x 96 columns x 4 bytes.
    node = _ln_backward((64, 56, 56), 96)
    assert norm_scratch.partial_sums(node) == (2408448, 2408448, 1204224, 8)
    # only the gradients asked for get a partial tensor
    assert norm_scratch.partial_sums(_ln_backward((64, 56, 56), 96, (True, True, False)))[:2] == (
        2408448,
        1204224,
    )
    # at most 32Ki / ceil(N / 32) blocks: 384 columns -> 12 per row of blocks -> 2730 rows
    assert norm_scratch.partial_sums(_ln_backward((64, 56, 56), 384))[0] == 2730 * 384 * 4


@pytest.mark.parametrize(
    "rows,n",
    [
        ((64, 1024), 768 * 3),  # wide rows: one-pass kernel
        ((64, 1024), 96),
    ],
)  # 65536 rows: not more than 64Ki
def test_layer_norm_backward_one_pass_has_no_partials(rows, n):
    assert norm_scratch.partial_sums(_ln_backward(rows, n)) == ()
