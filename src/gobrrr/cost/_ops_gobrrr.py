"""gobrrr's own fused kernels, costed from their op signatures (gobrrr::<name>). Bytes come
from the node's actual inputs and outputs, so a slightly different signature still costs
sensibly. FLOPs per element as for the ATen ops they replace (see _ops_norm, _ops_pointwise);
swiglu forward 5 (silu 4 + mul), backward 10."""

from __future__ import annotations

from gobrrr.cost._ops_common import CostFn, OpCost, io_bytes, matmul_math, vector
from gobrrr.cost._ops_norm import LN_DX, LN_FWD, NORM_DB, NORM_DW, RMS_DX, RMS_FWD
from gobrrr.cost._ops_pointwise import _PER_ELEM
from gobrrr.graph import OpNode

SWIGLU_FWD, SWIGLU_BWD = 5, 10
CE_PER_LOGIT = 4  # max, exp, sum, softmax-minus-one-hot: the vector work per logit
CE_LAUNCHES = 4  # logits matmul, loss/grad kernel, dhidden and dweight matmuls (per chunk)


def _n0(node: OpNode) -> int:
    return node.inputs[0].numel if node.inputs else 0


def _x(node: OpNode) -> int:
    """Elements of the normalized activation (the largest input)."""
    return max((t.numel for t in node.inputs), default=0)


def rms_norm_fwd(node: OpNode, tf32: bool) -> OpCost:
    """rms_norm_fwd(x, weight, eps) -> (y, rstd)."""
    return vector((RMS_FWD + 1) * _x(node), io_bytes(node), "norm")


def rms_norm_bwd(node: OpNode, tf32: bool) -> OpCost:
    """rms_norm_bwd(dy, x, weight, rstd) -> (dx, dw): one kernel + a reduction of partial dw."""
    per = RMS_DX + NORM_DW * (len(node.outputs) > 1)
    return vector(per * _x(node), io_bytes(node), "norm", 2)


def layer_norm_fwd(node: OpNode, tf32: bool) -> OpCost:
    """layer_norm_fwd(x, weight, bias?, eps) -> (y, mean, rstd)."""
    per = LN_FWD + 1 + (len(node.inputs) > 2)
    return vector(per * _x(node), io_bytes(node), "norm")


def layer_norm_bwd(node: OpNode, tf32: bool) -> OpCost:
    """layer_norm_bwd(dy, x, weight, mean, rstd) -> (dx, dw, db?)."""
    per = LN_DX + NORM_DW * (len(node.outputs) > 1) + NORM_DB * (len(node.outputs) > 2)
    return vector(per * _x(node), io_bytes(node), "norm", 2)


def swiglu_fwd(node: OpNode, tf32: bool) -> OpCost:
    """swiglu_fwd(gate, up) -> silu(gate) * up."""
    return vector(SWIGLU_FWD * _n0(node), io_bytes(node), "pointwise")


def swiglu_bwd(node: OpNode, tf32: bool) -> OpCost:
    """swiglu_bwd(dy, gate, up) -> (dgate, dup)."""
    return vector(SWIGLU_BWD * _n0(node), io_bytes(node), "pointwise")


def gelu_fwd(node: OpNode, tf32: bool) -> OpCost:
    return vector(_PER_ELEM["gelu"] * _n0(node), io_bytes(node), "pointwise")


def gelu_bwd(node: OpNode, tf32: bool) -> OpCost:
    return vector(_PER_ELEM["gelu_backward"] * _n0(node), io_bytes(node), "pointwise")


def linear_cross_entropy(node: OpNode, tf32: bool) -> OpCost:
    """linear_cross_entropy(hidden (N, d), weight (V, d), targets, bias?, ...) -> (loss,
    dhidden?, dweight?, dbias?): 2·N·d·V for the logits, + 2·N·d·V for each gradient matmul
    whose result is returned, + CE_PER_LOGIT·N·V vector ops. The logits never reach HBM."""
    hidden, weight = node.inputs[0], node.inputs[1]
    d = hidden.shape[-1]
    n, v = hidden.numel // max(d, 1), weight.numel // max(d, 1)
    grads = sum(1 for t in node.outputs[1:3] if t.numel > 1)
    flops = 2 * n * d * v * (1 + grads) + CE_PER_LOGIT * n * v
    return OpCost(float(flops), float(io_bytes(node)), matmul_math(hidden.dtype, tf32), "loss",
                  CE_LAUNCHES)


COSTS: dict[str, CostFn] = {
    "gobrrr.rms_norm_fwd": rms_norm_fwd, "gobrrr.rms_norm_bwd": rms_norm_bwd,
    "gobrrr.layer_norm_fwd": layer_norm_fwd, "gobrrr.layer_norm_bwd": layer_norm_bwd,
    "gobrrr.swiglu_fwd": swiglu_fwd, "gobrrr.swiglu_bwd": swiglu_bwd,
    "gobrrr.gelu_fwd": gelu_fwd, "gobrrr.gelu_bwd": gelu_bwd,
    "gobrrr.linear_cross_entropy": linear_cross_entropy,
}
