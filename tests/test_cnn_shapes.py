"""The shipped H100 calibration at the shapes a ConvNeXt runs, against kernels an H100 ran in
a real step on other leases (zoo_diagnose_*_h100.json, ConvNeXt-V2-Tiny at batch 64,
stage 0: 56x56 maps, 96 channels, a 384-wide MLP): a bf16 activation times an fp32
per-channel scale (the global response norm), a layer norm 96 wide over 200k pixels and its
backward, a bias gradient summed over those pixels, a weight gradient 200k deep, and the
7x7 depthwise convolution with its bias, forward and backward. The first five were off by
1.5-2.4x before the calibration's grids covered these shapes, the convolutions by 16-33%
before their bias's kernels were costed; each is now within 20%."""

import json
from pathlib import Path

import pytest
from fake_tensors import contiguous as t

from gobrrr.cost.flops import op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import time_op
from gobrrr.graph.ir import OpNode, TensorInfo
from gobrrr.hardware import find_calibration, get_gpu

RESULTS = Path(__file__).resolve().parent / "fixtures"
H100 = get_gpu("h100")
PIXELS = 64 * 56 * 56
# the step profiled on three leases; each keeps its 40 ops furthest from the prediction
RECORDED = (
    "zoo_diagnose_holdout_h100.json",
    "zoo_diagnose_convnextv2_grids_h100.json",
    "zoo_diagnose_depthwise_h100.json",
)


def _node(op, inputs, outputs, args=(), phase="forward"):
    """An op as the capture records it ({"t": i}: the i-th input tensor)."""
    return OpNode(
        index=0,
        op=op,
        phase=phase,
        module="stages.0.blocks.0",
        inputs=inputs,
        outputs=outputs,
        args=args,
    )


def _cases():
    x = t((64, 56, 56, 384), "bfloat16", 0)
    scale = t((64, 1, 1, 384), "float32", 1)
    grn = _node(
        "aten.mul.Tensor", (x, scale), (t((64, 56, 56, 384), "float32", 2),), ({"t": 0}, {"t": 1})
    )
    h = t((64, 56, 56, 96), "float32", 3)
    w, b = t((96,), "float32", 4), t((96,), "float32", 5)
    stats = t((64, 56, 56, 1), "float32", 6), t((64, 56, 56, 1), "float32", 7)
    ln = _node(
        "aten.native_layer_norm.default",
        (h, w, b),
        (t((64, 56, 56, 96), "float32", 8), *stats),
        ({"t": 0}, [96], {"t": 1}, {"t": 2}, 1e-6),
    )
    g = t((64, 56, 56, 96), "float32", 9)
    ln_bwd = _node(
        "aten.native_layer_norm_backward.default",
        (g, h, *stats, w, b),
        (t((64, 56, 56, 96), "float32", 10), t((96,), "float32", 11), t((96,), "float32", 12)),
        ({"t": 0}, {"t": 1}, [96], {"t": 2}, {"t": 3}, {"t": 4}, {"t": 5}, [True, True, True]),
        phase="backward",
    )
    gy = t((64, 56, 56, 384), "float32", 13)
    bias_grad = _node(
        "aten.sum.dim_IntList",
        (gy,),
        (t((384,), "float32", 14),),
        ({"t": 0}, [0, 1, 2]),
        phase="backward",
    )
    gy16 = TensorInfo((384, PIXELS), (1, 384), "bfloat16", 15)
    x16 = t((PIXELS, 96), "bfloat16", 16)
    weight_grad = _node(
        "aten.mm.default",
        (gy16, x16),
        (t((384, 96), "bfloat16", 17),),
        ({"t": 0}, {"t": 1}),
        phase="backward",
    )
    # the 7x7 depthwise convolution with its bias, on the channels-last view the previous
    # block's MLP leaves (cuDNN's kernel, then the bias's add; backward, the bias's sum)
    cl = (PIXELS * 96 // 64, 1, 56 * 96, 96)
    xd, wd, bd = (
        TensorInfo((64, 96, 56, 56), cl, "bfloat16", 18),
        t((96, 1, 7, 7), "bfloat16", 19),
        t((96,), "bfloat16", 20),
    )
    conv_args = ([1, 1], [3, 3], [1, 1], False, [0, 0], 96)
    dw = _node(
        "aten.convolution.default",
        (xd, wd, bd),
        (TensorInfo((64, 96, 56, 56), cl, "bfloat16", 21),),
        ({"t": 0}, {"t": 1}, {"t": 2}, *conv_args),
    )
    gd = TensorInfo((64, 96, 56, 56), cl, "bfloat16", 22)
    dw_bwd = _node(
        "aten.convolution_backward.default",
        (gd, xd, wd),
        (
            TensorInfo((64, 96, 56, 56), cl, "bfloat16", 23),
            t((96, 1, 7, 7), "bfloat16", 24),
            t((96,), "bfloat16", 25),
        ),
        ({"t": 0}, {"t": 1}, {"t": 2}, [96], *conv_args, [True, True, True]),
        phase="backward",
    )
    # (node, the op and phase in the recorded step, its recorded bytes, stage 0's module)
    return {
        "grn mul": (grn, "aten.mul.Tensor", "forward", "blocks.0.mlp.grn"),
        "layer norm": (ln, "aten.native_layer_norm.default", "forward", "blocks.0.norm"),
        "layer norm backward": (
            ln_bwd,
            "aten.native_layer_norm_backward.default",
            "backward",
            "stages.0.blocks.0",
        ),
        "bias gradient": (bias_grad, "aten.sum.dim_IntList", "backward", "stages.0.blocks.0.mlp"),
        "weight gradient": (weight_grad, "aten.mm.default", "backward", "stages.0.blocks.0.mlp"),
        "depthwise 7x7 with bias": (dw, "aten.convolution.default", "forward", "blocks.0.conv_dw"),
        "depthwise 7x7 backward with bias": (
            dw_bwd,
            "aten.convolution_backward.default",
            "backward",
            "blocks.0.conv_dw",
        ),
    }


def _worst_ops(name):
    doc = json.loads((RESULTS / name).read_text())
    return next(c for c in doc["profile"] if c["name"] == "convnextv2_tiny-timm")["worst_ops"]


def _recorded(op, phase, module, nbytes):
    """Device seconds of the recorded op of stage 0 with these bytes (fastest of its
    repeats: every block of the stage runs the same kernel)."""
    times = [
        w["measured_s"]
        for f in RECORDED
        for w in _worst_ops(f)
        if w["op"] == op
        and w["phase"] == phase
        and w["module"].endswith(module)
        and w["bytes"] == pytest.approx(nbytes, rel=1e-3)
    ]
    assert times, f"no recorded {op} in {module}"
    return min(times)


@pytest.mark.parametrize("case", list(_cases()))
def test_shipped_calibration_at_convnext_shapes(case):
    node, op, phase, module = _cases()[case]
    cost = op_cost(node)
    measured = _recorded(op, phase, module, cost.bytes)
    predicted = time_op(node, cost, Rates(H100, find_calibration(H100))).device_s
    assert predicted == pytest.approx(measured, rel=0.2), (predicted, measured)
