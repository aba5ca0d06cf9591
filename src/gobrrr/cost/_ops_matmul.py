"""Matmuls and convolutions: tensor-core ops. FLOPs match torch.utils.flop_counter where it
covers the op (a fused bias add is not counted, as there)."""

from __future__ import annotations

from gobrrr.cost._ops_common import (
    CostFn,
    OpCost,
    conv_math,
    io_bytes,
    matmul_math,
    prod,
    sum_read,
    targ,
)
from gobrrr.graph.ir import OpNode, TensorInfo


def _matmul_cost(node: OpNode, tf32: bool, a: TensorInfo, flops: int) -> OpCost:
    return OpCost(float(flops), float(io_bytes(node)), matmul_math(a.dtype, tf32), "matmul", 1)


def _out_k(node: OpNode, tf32: bool, ia: int, na: str) -> OpCost:
    """2·(output elements)·K, K = the last dim of operand A: mm, bmm, matmul, linear, mv, dot."""
    a = targ(node, ia, na)
    out = node.outputs[0]
    return _matmul_cost(node, tf32, a, 2 * out.numel * (a.shape[-1] if a.shape else 1))


def mm(node: OpNode, tf32: bool) -> OpCost:
    # (M, K) @ (K, N) -> (M, N); also bmm, matmul, linear, _scaled_mm, mv, dot
    return _out_k(node, tf32, 0, "self")


def addmm(node: OpNode, tf32: bool) -> OpCost:
    # self + (M, K) @ (K, N): the bias add is fused in the epilogue and not counted
    return _out_k(node, tf32, 1, "mat1")


def baddbmm(node: OpNode, tf32: bool) -> OpCost:
    return _out_k(node, tf32, 1, "batch1")


def addmv(node: OpNode, tf32: bool) -> OpCost:
    return _out_k(node, tf32, 1, "mat")


def addbmm(node: OpNode, tf32: bool) -> OpCost:
    # self + sum_b (B, M, K) @ (B, K, N): the output has no batch dim
    b1, b2 = targ(node, 1, "batch1"), targ(node, 2, "batch2")
    return _matmul_cost(node, tf32, b1, 2 * b1.numel * b2.shape[-1])


def grouped_mm_groups(node: OpNode) -> int:
    """Groups of a `_grouped_mm`: the length of `offs`, else the batch of a 3-D operand."""
    offs = targ(node, 2, "offs")
    if offs is not None and offs.shape:
        return offs.shape[0]
    return next((t.shape[0] for t in node.inputs[:2] if len(t.shape) == 3), 1)


def grouped_mm(node: OpNode, tf32: bool) -> OpCost:
    """_grouped_mm(mat_a, mat_b, offs?, bias?, out_dtype?): one matmul per group (mixture-of-
    experts layers), 2 FLOPs per multiply-add over every row, so 2·rows·K·N in all, whatever
    the split between groups. Both operands 2-D (the weight gradient: K split by `offs`):
    2·M·N·K_total. bf16/fp16 run one grouped kernel; other dtypes run CUDA's fallback, one
    matmul per group."""
    a, b = targ(node, 0, "self"), targ(node, 1, "mat2")
    out = node.outputs[0]
    if len(a.shape) == 2 and len(b.shape) == 2:
        flops = 2 * out.shape[-2] * out.shape[-1] * a.shape[-1]
    else:
        flops = 2 * out.numel * a.shape[-1]
    launches = 1 if a.dtype in ("bfloat16", "float16") else grouped_mm_groups(node)
    return OpCost(
        float(flops), float(io_bytes(node)), matmul_math(a.dtype, tf32), "matmul", launches
    )


def conv_flop_count(x: tuple, w: tuple, out: tuple, transposed: bool) -> int:
    """torch.utils.flop_counter's count: 2 · batch · C_out · C_in/groups · kernel · spatial
    (spatial of the output, or of the input for a transposed conv)."""
    conv_shape = (x if transposed else out)[2:]
    c_out, c_in, *kernel = w
    return 2 * prod(conv_shape) * prod(kernel) * x[0] * c_out * c_in


def _conv_cost(node: OpNode, tf32: bool, flops: int, launches: int) -> OpCost:
    x = node.inputs[0]
    return OpCost(float(flops), float(io_bytes(node)), conv_math(x.dtype, tf32), "conv", launches)


def convolution(node: OpNode, tf32: bool) -> OpCost:
    """convolution(input, weight, bias?, stride, padding, dilation, transposed, ...)."""
    x, w = targ(node, 0, "input"), targ(node, 1, "weight")
    transposed = node.name in ("convolution", "_convolution", "convolution_overrideable") and bool(
        node.arg(6, "transposed", False)
    )
    flops = conv_flop_count(x.shape, w.shape, node.outputs[0].shape, transposed)
    return _conv_cost(node, tf32, flops, 1)


def _t(shape: tuple) -> tuple:
    return (shape[1], shape[0], *shape[2:])


def conv_backward_flops(node: OpNode) -> tuple[int, int]:
    """(grad_input, grad_weight) FLOPs of a convolution_backward, each 0 where its
    output_mask entry is off; the grad_bias reduction is not counted (as in FlopCounterMode)."""
    go, x, w = (targ(node, i, n) for i, n in enumerate(("grad_output", "input", "weight")))
    transposed = bool(node.arg(7, "transposed", False))
    mask = list(node.arg(10, "output_mask", (True, True, True)))
    grad_input = grad_weight = 0
    if mask[0]:  # grad_input = conv_transpose(grad_out, weight)
        grad_input = conv_flop_count(go.shape, w.shape, x.shape, not transposed)
    if mask[1]:  # grad_weight = conv(input, grad_out) with batch and channels swapped, per
        # group: FlopCounterMode leaves the groups out here and counts `groups` times too much
        # (32x for a 32-channel depthwise convolution); each weight-gradient multiply-add
        # matches one of the forward's, so the true count is the forward's.
        a, b = (go, x) if transposed else (x, go)
        groups = max(int(node.arg(9, "groups", 1) or 1), 1)
        grad_weight = conv_flop_count(_t(a.shape), _t(b.shape), _t(w.shape), False) // groups
    return grad_input, grad_weight


def convolution_backward(node: OpNode, tf32: bool) -> OpCost:
    """convolution_backward(grad_out, input, weight, bias_sizes, stride, padding, dilation,
    transposed, output_padding, groups, output_mask): grad_input and grad_weight each cost one
    convolution (`conv_backward_flops`). Equal to FlopCounterMode's count except for grouped
    convolutions, where it overcounts grad_weight."""
    go, x, w = (targ(node, i, n) for i, n in enumerate(("grad_output", "input", "weight")))
    mask = list(node.arg(10, "output_mask", (True, True, True)))
    flops = sum(conv_backward_flops(node))
    # grad_out is always read; input only for grad_weight, weight only for grad_input
    nbytes = sum_read([go, x if mask[1] else None, w if mask[0] else None])
    nbytes += sum_read(node.outputs)
    return OpCost(
        float(flops),
        float(nbytes),
        conv_math(go.dtype, tf32),
        "conv",
        max(1, sum(bool(m) for m in mask)),
    )


COSTS: dict[str, CostFn] = {
    **{
        f"aten.{n}": mm
        for n in (
            "mm",
            "bmm",
            "matmul",
            "linear",
            "_scaled_mm",
            "_int_mm",
            "mv",
            "dot",
            "vdot",
            "inner",
        )
    },
    "aten._grouped_mm": grouped_mm,
    "aten.addmm": addmm,
    "aten.addmm_": addmm,
    "aten._addmm_activation": addmm,
    "aten.baddbmm": baddbmm,
    "aten.baddbmm_": baddbmm,
    "aten.addbmm": addbmm,
    "aten.addbmm_": addbmm,
    "aten.addmv": addmv,
    "aten.addmv_": addmv,
    **{
        f"aten.{n}": convolution
        for n in (
            "convolution",
            "_convolution",
            "cudnn_convolution",
            "convolution_overrideable",
            "_slow_conv2d_forward",
            "mkldnn_convolution",
        )
    },
    "aten.convolution_backward": convolution_backward,
}
