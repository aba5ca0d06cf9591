"""bitsandbytes' ops (bitsandbytes::<name>), costed from their tensors: a QLoRA base model's
dequantization and 4-bit matmul, and its 8-bit and 32-bit optimizers' updates.

Dequantization is memory-bound: `dequantize_4bit` reads the packed codes (0.5 byte an
element) and one fp32 absmax per block, and writes every element in the compute dtype (2 bytes
in bf16); `dequantize_blockwise` (double quantization's absmax, or an 8-bit optimizer state)
reads one byte an element, a scale per block and the 256-entry code book, and writes fp32.
Both do one code-book lookup and one multiply an element (1 FLOP: the lookup is a load). The
bytes are the node's own tensors, so the format's sizes are those the trace holds.

`gemm_4bit` is left in the graph only where CUDA runs it as one fused kernel (few rows:
`gobrrr.capture.bnb`): 2·M·N·K on the tensor cores of the input's dtype, the weight read
packed.

The optimizers' updates (one kernel per parameter) read the gradient, the parameter and each
state with its scales and code book once and write back the parameter and the states:
Adam's FLOPs per element as torch's fused kernel (`_ops_optim`), and for 8-bit states the
dequantization, block absmax and code search of torchao's 8-bit Adam (same algorithm).
"""

from __future__ import annotations

from gobrrr.cost._ops_common import (
    CostFn,
    OpCost,
    io_bytes,
    matmul_math,
    prod,
    sum_read,
    targ,
    vector,
)
from gobrrr.cost._ops_optim import ADAM8_PER_ELEM
from gobrrr.graph.ir import OpNode

ADAM_PER_ELEM = 14  # fused AdamW with weight decay (_ops_optim.fused_adam)
DEQUANT_PER_ELEM = 1  # a code-book load times the block's absmax


def dequantize(node: OpNode, tf32: bool) -> OpCost:
    """dequantize_4bit(A, absmax, blocksize, quant_type, shape, dtype) -> (shape) and
    dequantize_blockwise(A, absmax, code, blocksize, dtype) -> A's shape: inputs read once,
    the dequantized tensor written."""
    out = node.outputs[0] if node.outputs else None
    n = out.numel if out is not None else prod(node.arg(4, "shape", []) or [0])
    return vector(DEQUANT_PER_ELEM * n, io_bytes(node), "pointwise")


def gemm_4bit(node: OpNode, tf32: bool) -> OpCost:
    """gemm_4bit(A (..., K), B packed, shapeB (N, K), absmax, blocksize, quant_type, bias?,
    absmax_8bit?, absmax_code?, absmax_offset?) -> (..., N): CUDA's fused 4-bit matmul."""
    a = node.inputs[0]
    n, k = (int(d) for d in node.arg(2, "shapeB"))
    rows = a.numel // max(k, 1)
    math = matmul_math(a.dtype, tf32)
    return OpCost(2.0 * rows * n * k, float(io_bytes(node)), math, "matmul", 1)


def _update(node: OpNode, per_elem: int, written: tuple[tuple[int, str], ...]) -> OpCost:
    """One parameter's update: every tensor read once, `written` (argument position, name)
    written back; `per_elem` FLOPs per element of the parameter."""
    p = targ(node, 2, "p")
    out = [t for i, name in written if (t := targ(node, i, name)) is not None]
    numel = p.numel if p is not None else 0
    return vector(per_elem * numel, sum_read(node.inputs) + sum_read(out), "optimizer", 1)


def update_8bit(node: OpNode, tf32: bool) -> OpCost:
    """optimizer_update_8bit_blockwise(name, g, p, state1, state2?, beta1, beta2, beta3, alpha,
    eps, step, lr, qmap1, qmap2?, absmax1, absmax2?, ...): p, the 8-bit states and their
    block scales updated in place."""
    written = ((2, "p"), (3, "state1"), (4, "state2"), (14, "absmax1"), (15, "absmax2"))
    return _update(node, ADAM8_PER_ELEM, written)


def update_32bit(node: OpNode, tf32: bool) -> OpCost:
    """optimizer_update_32bit(name, g, p, state1, state2?, unorm_vec?, ...): p and the fp32
    states updated in place."""
    return _update(node, ADAM_PER_ELEM, ((2, "p"), (3, "state1"), (4, "state2")))


COSTS: dict[str, CostFn] = {
    "bitsandbytes.dequantize_4bit": dequantize,
    "bitsandbytes.dequantize_blockwise": dequantize,
    "bitsandbytes.gemm_4bit": gemm_4bit,
    "bitsandbytes.optimizer_update_8bit_blockwise": update_8bit,
    "bitsandbytes.optimizer_update_32bit": update_32bit,
}
