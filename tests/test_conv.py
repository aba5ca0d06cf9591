"""Convolutions and batch norm: what cuDNN allocates inside a convolution (hand-derived and
against the transients recorded on an H100), the calibrated rates and host costs the roofline
reads, and the memory simulation's op-internal scratch."""

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn

import gobrrr
from gobrrr.capture import capture
from gobrrr.cost import conv
from gobrrr.cost.flops import op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.cost.shapes import conv_class, gemm_dims
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo
from gobrrr.graph.meta import StepMeta, Tf32
from gobrrr.hardware import get_gpu
from gobrrr.memory.replay import simulate
from gobrrr.models.registry import get_workload

ROOT = Path(__file__).resolve().parents[1]
H100 = get_gpu("h100")
MiB = 2**20


def _convnet_graph(precision="bf16-mixed", batch=4, channels_last=False):
    def make():
        model = nn.Sequential(
            nn.Conv2d(3, 16, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(16),
            nn.ReLU(),
            nn.Flatten(),
            nn.Linear(16 * 16 * 16, 10),
        )
        x = torch.randn(batch, 3, 32, 32)
        if channels_last:  # an NHWC input makes cuDNN run channels-last
            x = x.to(memory_format=torch.channels_last)
        labels = torch.randint(0, 10, (batch,))
        return gobrrr.Workload(
            model=model, batch=(x,), loss=lambda y, b: nn.functional.cross_entropy(y, labels)
        )

    return capture(make, precision=precision)


def _convs(g, name):
    return [n for n in g.nodes if n.name == name]


def test_16bit_layout_copies_pad_the_rgb_stem_to_8_channels():
    g = _convnet_graph()
    (fwd,) = _convs(g, "convolution")
    # NHWC copies: input (4, 3 -> 8, 32, 32), weight (16, 3 -> 8, 7, 7), output (4, 16, 16, 16)
    assert (
        conv.layout_scratch(fwd) == 4 * 8 * 32 * 32 * 2 + 16 * 8 * 7 * 7 * 2 + 4 * 16 * 16 * 16 * 2
    )
    (bwd,) = _convs(g, "convolution_backward")
    # grad_output, input and weight (both padded)
    assert (
        conv.layout_scratch(bwd) == 4 * 16 * 16 * 16 * 2 + 4 * 8 * 32 * 32 * 2 + 16 * 8 * 7 * 7 * 2
    )


def test_no_layout_copies_in_fp32_or_channels_last():
    for g in (_convnet_graph("fp32"), _convnet_graph(channels_last=True)):
        for n in _convs(g, "convolution") + _convs(g, "convolution_backward"):
            assert conv.layout_scratch(n) == 0


def test_layout_copies_match_the_transients_recorded_on_an_h100():
    """cnn_diagnostics_h100.json: every op's allocator peak inside the call, bf16 convnet b64.
    The 3x3 forward convolutions allocate exactly their NHWC copies; backward ones up to a
    quarter more (cuDNN's own workspace)."""
    data = json.loads((ROOT / "tests/fixtures/cnn_diagnostics_h100.json").read_text())
    case = next(m for m in data["memory"] if m["precision"] == "bf16-mixed")
    measured = [
        r[2] - max(r[1], r[3])
        for r in case["ops"]
        if r[0] in ("convolution", "convolution_backward")
    ]
    g = capture(lambda: get_workload("convnet", batch_size=case["batch"]), precision="bf16-mixed")
    ours = [n for n in g.nodes if n.name in ("convolution", "convolution_backward")]
    assert len(ours) == len(measured) == 40
    fwd3 = [
        (conv.layout_scratch(n), m)
        for n, m in zip(ours, measured, strict=True)
        if n.name == "convolution" and n.inputs[1].shape[-1] == 3
    ]
    assert len(fwd3) == 16
    for pred, meas in fwd3:
        assert pred == pytest.approx(meas, rel=0.01)
    bwd = [
        (conv.layout_scratch(n), m)
        for n, m in zip(ours, measured, strict=True)
        if n.name == "convolution_backward"
    ]
    for pred, meas in bwd:
        assert 0.75 * meas <= pred <= meas * 1.01


def test_memory_counts_scratch_while_the_op_runs():
    storages = [
        StorageInfo(0, 1024, "parameter", -1, None),
        StorageInfo(1, 4096, "activation", 0, None),
        StorageInfo(2, 2048, "temporary", 1, 2),
    ]
    nodes = [
        OpNode(
            index=i,
            op="aten.add.Tensor",
            phase="forward",
            module="m",
            inputs=(),
            outputs=(),
            allocs=a,
            frees=f,
        )
        for i, (a, f) in enumerate([((1,), ()), ((2,), ()), ((), (2,))])
    ]
    g = StepGraph(nodes=tuple(nodes), storages=tuple(storages), meta=StepMeta())
    m = simulate(g, scratch={0: 10_000})
    # op 0: 1024 + 4096 + 10240 (rounded scratch) > op 1: 1024 + 4096 + 2048
    assert m.peak == 1024 + 4096 + 10240 and m.peak_index == 0
    assert m.at_peak["workspace"] == 10240
    assert m.timeline == (1024 + 4096 + 10240, 1024 + 4096 + 2048, 1024 + 4096 + 2048)


def test_calibrated_workspace_fraction_and_estimate_memory_include_scratch(make_cal):
    g = _convnet_graph("fp32")  # fp32 convolutions run in TF32 by PyTorch's default
    cal = make_cal(
        conv_workspace={
            "fp32": {"forward": 0.0, "backward": 9.0},
            "tf32": {"forward": 0.0, "backward": 1.5},
        }
    )
    sc = conv.scratch(g, cal)
    (bwd,) = _convs(g, "convolution_backward")
    assert sc == {bwd.index: int(1.5 * conv.io_bytes(bwd))}
    assert conv.scratch(g, None) == {}


def test_a_class_fraction_of_everything_inside_replaces_copies_and_workspace(make_cal):
    """Where the calibration measured what convolutions of a shape class allocate inside the
    call (copies and workspace together), that fraction of the op's bytes is its scratch (a
    stem falls back to the 3x3-s2 class); a class it did not measure keeps the layout copies +
    typical workspace."""
    g = _convnet_graph("bf16-mixed")
    convs = [n for n in g.nodes if n.name in conv.FORWARD + conv.BACKWARD]
    assert {conv_class(n) for n in convs} == {"stem"}

    def cal(cls):
        return make_cal(
            conv_workspace={
                "bf16": {
                    "forward": 0.0,
                    "backward": 0.0,
                    f"inside:channels_first:{cls}:forward": 2.0,
                    f"inside:channels_first:{cls}:backward": 0.0,
                }
            }
        )

    sc = conv.scratch(g, cal("3x3-s2"))
    assert {n.index: 2 * conv.io_bytes(n) for n in convs if n.name in conv.FORWARD} == sc
    sc = conv.scratch(g, cal("1x1"))
    assert sc == {n.index: conv.layout_scratch(n) for n in convs if conv.layout_scratch(n)}
    assert sc


def test_conv_time_uses_the_measured_grid_for_its_direction(make_cal):
    g = _convnet_graph()
    (fwd,) = _convs(g, "convolution")
    (bwd,) = _convs(g, "convolution_backward")
    grid = {
        "forward": [[1e3, 10, 1e12], [1e3, 1e3, 2e12], [1e9, 10, 3e12], [1e9, 1e3, 4e12]],
        "backward": [[1e3, 10, 5e11], [1e3, 1e3, 5e11], [1e9, 10, 5e11], [1e9, 1e3, 5e11]],
    }
    rates = Rates(H100, make_cal(conv_grid={"bf16": grid}))
    mn, k = gemm_dims(fwd)
    assert (mn, k) == (4 * 16 * 16 * 16, 3 * 7 * 7)
    # linear in log k then log mn between the four corners
    fk = (math.log(k) - math.log(10)) / (math.log(1e3) - math.log(10))
    fm = (math.log(mn) - math.log(1e3)) / (math.log(1e9) - math.log(1e3))
    lo, hi = 1e12 + fk * 1e12, 3e12 + fk * 1e12
    rate = lo + fm * (hi - lo)
    c = op_cost(fwd)
    t = time_op(fwd, c, rates)
    assert t.device_s == pytest.approx(max(c.flops / rate, c.bytes / 3e12) + 1e-6)
    cb = op_cost(bwd)
    assert time_op(bwd, cb, rates).device_s == pytest.approx(
        max(cb.flops / 5e11, cb.bytes / 3e12) + cb.launches * 1e-6
    )


def test_conv_gemm_dims_take_the_weight_by_position_not_size():
    """A late-stage 3x3 weight (512 x 512 x 9) is larger than a small batch's activations."""

    def make():
        m = nn.Conv2d(512, 512, 3, padding=1, bias=False)
        x = torch.randn(1, 512, 7, 7)
        return gobrrr.Workload(model=m, batch=(x,), loss=lambda y, b: y.sum())

    g = capture(make, precision="fp32")
    (fwd,) = _convs(g, "convolution")
    (bwd,) = _convs(g, "convolution_backward")
    assert gemm_dims(fwd) == (512 * 49, 512 * 9)
    assert gemm_dims(bwd) == (512 * 49, 512 * 9)


def test_batch_norm_bandwidth_follows_channels_and_dtype(make_cal):
    g = _convnet_graph()
    bn = next(n for n in g.nodes if n.name == "native_batch_norm")
    bnb = next(n for n in g.nodes if n.name == "native_batch_norm_backward")
    curve = {
        "forward:bf16": [[8, 1e11], [32, 3e11]],
        "backward:bf16": [[8, 2e11], [32, 2e11]],
        "forward:fp32": [[8, 9e11], [32, 9e11]],
    }
    rates = Rates(H100, make_cal(batch_norm_bandwidth=curve))
    # 16 channels: halfway between 8 and 32 in log
    assert rates.batch_norm(bn) == pytest.approx(2e11)
    assert rates.batch_norm(bnb) == pytest.approx(2e11)
    c = op_cost(bn)
    assert time_op(bn, c, rates).device_s == pytest.approx(c.bytes / 2e11 + c.launches * 1e-6)
    fp32_bn = next(n for n in _convnet_graph("fp32").nodes if n.name == "native_batch_norm")
    assert rates.batch_norm(fp32_bn) == pytest.approx(9e11)


def test_cudnn_ops_add_their_measured_host_cost(make_cal):
    g = _convnet_graph()
    (fwd,) = _convs(g, "convolution")
    cal = make_cal(
        op_overhead={"forward": 10e-6, "backward": 10e-6, "optimizer": 10e-6},
        op_host={"convolution:bf16": 7e-6, "convolution:fp32": 3e-6},
    )
    rates = Rates(H100, cal)
    assert time_op(fwd, op_cost(fwd), rates).host_s == pytest.approx(17e-6)
    relu = next(n for n in g.nodes if n.name == "relu")
    assert time_op(relu, op_cost(relu), rates).host_s == pytest.approx(10e-6)


def test_estimate_is_the_package_level_api():
    def workload(batch_size: int = 2, seq_len: int = 8) -> gobrrr.Workload:
        model = nn.Sequential(nn.Embedding(64, 16), nn.Linear(16, 64))
        toks = torch.randint(0, 64, (batch_size, seq_len))
        return gobrrr.Workload(
            model=model,
            batch=(toks,),
            loss=lambda y, b: nn.functional.cross_entropy(y.flatten(0, 1), b[0].flatten()),
            optimizer=lambda p: torch.optim.AdamW(p, lr=1e-3),
        )

    est = gobrrr.estimate(workload, gpu="a100-80gb", batch=4, seq=16, precision="fp32")
    assert isinstance(est, gobrrr.Estimate)
    emb, lin = 64 * 16 * 4, (16 * 64 + 64) * 4
    assert est.memory.persistent["parameter"] >= emb + lin
    assert est.time.tokens == 4 * 16


def test_depthwise_convolution_is_costed_from_its_measured_bandwidth(make_cal):
    def make():
        model = nn.Sequential(
            nn.Conv2d(16, 16, 3, padding=1, groups=16, bias=False), nn.Conv2d(16, 32, 1, bias=False)
        )
        return gobrrr.Workload(
            model=model, batch=(torch.randn(2, 16, 8, 8),), loss=lambda y, b: y.sum()
        )

    g = capture(make, precision="fp32")
    dw, pw = _convs(g, "convolution")
    dw_b = _convs(g, "convolution_backward")[-1]  # backward runs the depthwise one last
    curve = {
        "forward:fp32": [[1e3, 1e11], [1e5, 1e12]],
        "backward:fp32": [[1e3, 2e11], [1e5, 2e11]],
    }
    rates = Rates(H100, make_cal(depthwise_bandwidth=curve))
    c = op_cost(dw)
    frac = (math.log(c.bytes) - math.log(1e3)) / (math.log(1e5) - math.log(1e3))
    bw = 1e11 + frac * (1e12 - 1e11)
    t = time_op(dw, c, rates)
    assert t.device_s == pytest.approx(c.bytes / bw + 1e-6) and t.compute_s == 0.0
    cb = op_cost(dw_b)
    assert time_op(dw_b, cb, rates).device_s == pytest.approx(cb.bytes / 2e11 + cb.launches * 1e-6)
    assert rates.depthwise(pw, op_cost(pw).bytes) is None  # a dense 1x1: the conv grid's


def test_fp32_convolutions_follow_cudnns_tf32_setting_at_trace_time():
    """PyTorch runs fp32 cuDNN convolutions in TF32 by default (torch.backends.cudnn.allow_tf32)
    while fp32 matmuls stay fp32: the trace records the setting and the cost model follows."""
    from gobrrr.cost.flops import graph_costs

    old = torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cudnn.allow_tf32 = True
        on = _convnet_graph("fp32")
        torch.backends.cudnn.allow_tf32 = False
        off = _convnet_graph("fp32")
    finally:
        torch.backends.cudnn.allow_tf32 = old
    assert on.meta.tf32 == Tf32(matmul=False, conv=True)
    assert off.meta.tf32 == Tf32(matmul=False, conv=False)
    maths = lambda g: {(c.kind, c.math) for c in graph_costs(g) if c.kind in ("conv", "matmul")}
    assert maths(on) == {("conv", "tf32"), ("matmul", "fp32")}
    assert maths(off) == {("conv", "fp32"), ("matmul", "fp32")}


def test_a_convolutions_bias_runs_a_kernel_of_its_own(make_cal):
    """ATen adds a cuDNN convolution's bias in place after the convolution and sums
    grad_output for the bias's gradient; PyTorch's own channels-first depthwise kernels add
    the bias themselves. Hand-derived: the add moves the output twice at the calibrated
    broadcast rate, the sum reads grad_output once at the outer-sum grid's rate (channels
    last) or the reduction bandwidth (channels first)."""

    def make(channels_last, groups, bias=True):
        def wl():
            model = nn.Sequential(nn.Conv2d(16, 16, 3, padding=1, groups=groups, bias=bias))
            x = torch.randn(2, 16, 8, 8)
            if channels_last:
                x = x.to(memory_format=torch.channels_last)
            # a loss whose gradient has y's layout (y.sum()'s is an expanded scalar)
            return gobrrr.Workload(
                model=model, batch=(x,), loss=lambda y, b: (y.float() ** 2).sum()
            )

        g = capture(wl, precision="bf16-mixed")
        return _convs(g, "convolution")[0], _convs(g, "convolution_backward")[0]

    rates = Rates(
        H100,
        make_cal(
            path_bandwidth={"pointwise:bcast:bf16": [[1e3, 1e11], [1e9, 1e11]]},
            outer_sum_bandwidth={
                "sum:bf16": [[8, 16, 5e10], [64, 16, 5e10], [8, 1024, 5e10], [64, 1024, 5e10]]
            },
            reduction_bandwidth=2e10,
        ),
    )
    out_bytes = 2 * 16 * 8 * 8 * 2
    for cl in (False, True):  # a dense convolution runs on cuDNN in either layout
        fwd, bwd = make(cl, groups=1)
        assert conv.bias_kernel(fwd)[0] == "add"
        assert rates.conv_bias(fwd) == pytest.approx((2 * out_bytes + 32) / 1e11 + 1e-6)
        assert rates.conv_bias(bwd) == pytest.approx(
            (out_bytes + 32) / (5e10 if cl else 2e10) + 1e-6
        )
    fwd, bwd = make(False, groups=16)  # channels-first depthwise: PyTorch's kernels add it
    assert conv.bias_kernel(fwd) is None and conv.bias_kernel(bwd)[0] == "sum"
    fwd, _ = make(True, groups=16)  # channels-last depthwise: cuDNN's
    assert conv.bias_kernel(fwd)[0] == "add"
    fwd, bwd = make(True, groups=1, bias=False)
    assert rates.conv_bias(fwd) == rates.conv_bias(bwd) == 0.0
