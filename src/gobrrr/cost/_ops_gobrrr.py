"""gobrrr's own fused kernels, costed from their op signatures (gobrrr::<name>). Bytes come
from the node's actual inputs and outputs, so a slightly different signature still costs
sensibly. FLOPs per element as for the ATen ops they replace (see _ops_norm, _ops_pointwise);
swiglu forward 5 (silu 4 + mul), backward 10."""

from __future__ import annotations

from gobrrr.cost._ops_common import CostFn, OpCost, io_bytes, matmul_math, vector
from gobrrr.cost._ops_norm import LN_DX, LN_FWD, NORM_DB, NORM_DW, RMS_DX, RMS_FWD
from gobrrr.cost._ops_pointwise import _PER_ELEM
from gobrrr.graph.ir import OpNode

SWIGLU_FWD, SWIGLU_BWD = 5, 10
CE_PER_LOGIT = 4  # max, exp, sum, softmax-minus-one-hot: the vector work per logit
CE_MIN_CHUNK = 1024  # mirrors gobrrr.kernels.linear_cross_entropy: at least 1024 tokens a chunk


def _n0(node: OpNode) -> int:
    return node.inputs[0].numel if node.inputs else 0


def _x(node: OpNode) -> int:
    """Elements of the normalized activation (the largest input)."""
    return max((t.numel for t in node.inputs), default=0)


def rms_norm_fwd(node: OpNode, tf32: bool) -> OpCost:
    """rms_norm_fwd(x, weight, eps) -> (y, rstd)."""
    return vector((RMS_FWD + 1) * _x(node), io_bytes(node), "norm")


def _has(node: OpNode, i: int) -> bool:
    return len(node.outputs) > i and node.outputs[i].numel > 0


def rms_norm_bwd(node: OpNode, tf32: bool) -> OpCost:
    """rms_norm_bwd(dy, x, weight, rstd) -> (dx, dw): one kernel, then a sum of the per-program
    partial dw and its cast (3 launches)."""
    per = RMS_DX + NORM_DW * _has(node, 1)
    return vector(per * _x(node), io_bytes(node), "norm", 3)


def layer_norm_fwd(node: OpNode, tf32: bool) -> OpCost:
    """layer_norm_fwd(x, weight, bias?, eps) -> (y, mean, rstd)."""
    per = LN_FWD + 1 + (len(node.inputs) > 2)
    return vector(per * _x(node), io_bytes(node), "norm")


def layer_norm_bwd(node: OpNode, tf32: bool) -> OpCost:
    """layer_norm_bwd(dy, x, weight, mean, rstd, has_bias) -> (dx, dw, db or empty): one kernel,
    then sum + cast of the partial dw (and db)."""
    has_db = _has(node, 2)
    per = LN_DX + NORM_DW * _has(node, 1) + NORM_DB * has_db
    return vector(per * _x(node), io_bytes(node), "norm", 3 + 2 * has_db)


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
    """linear_cross_entropy(hidden (N, d), weight (V, d), targets, bias?, ignore_index,
    reduction, label_smoothing, chunk_size) -> (loss, dhidden, dweight, dbias or empty):
    2·N·d·V for the logits, + 2·N·d·V for each gradient matmul whose result is returned,
    + CE_PER_LOGIT·N·V vector ops (+ N·V for dbias). The logits never reach HBM.
    Launches: 5 + chunks · (6 + 2 with a bias), chunks of chunk_size (0: the kernel's default)."""
    hidden, weight = node.inputs[0], node.inputs[1]
    d = hidden.shape[-1]
    n, v = hidden.numel // max(d, 1), weight.numel // max(d, 1)
    grads = _has(node, 1) + _has(node, 2)
    bias = _has(node, 3)
    flops = 2 * n * d * v * (1 + grads) + (CE_PER_LOGIT + bias) * n * v
    chunk = int(node.arg(7, "chunk_size", 0) or 0) or _default_chunk(n, d, v)
    launches = 5 + -(-n // max(chunk, 1)) * (6 + 2 * bias)
    return OpCost(
        float(flops), float(io_bytes(node)), matmul_math(hidden.dtype, tf32), "loss", launches
    )


def _default_chunk(n: int, d: int, v: int) -> int:
    """Tokens per chunk: logits about the size of the hidden states, at least CE_MIN_CHUNK."""
    by_size = 1 << max(0, (-(-n * d // max(v, 1)) - 1).bit_length())  # next power of two
    return max(1, min(n, max(by_size, CE_MIN_CHUNK)))


COSTS: dict[str, CostFn] = {
    "gobrrr.rms_norm_fwd": rms_norm_fwd,
    "gobrrr.rms_norm_bwd": rms_norm_bwd,
    "gobrrr.layer_norm_fwd": layer_norm_fwd,
    "gobrrr.layer_norm_bwd": layer_norm_bwd,
    "gobrrr.swiglu_fwd": swiglu_fwd,
    "gobrrr.swiglu_bwd": swiglu_bwd,
    "gobrrr.gelu_fwd": gelu_fwd,
    "gobrrr.gelu_bwd": gelu_bwd,
    "gobrrr.linear_cross_entropy": linear_cross_entropy,
}
