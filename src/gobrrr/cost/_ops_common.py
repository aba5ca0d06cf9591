"""Shared pieces of the per-op cost model: the OpCost result and byte/dtype helpers."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from gobrrr.graph.ir import OpNode, TensorInfo
from gobrrr.graph.meta import StepMeta, Tf32


@dataclass(frozen=True)
class OpCost:
    """What one op costs on a GPU in eager mode.

    flops: floating-point operations (a multiply-add = 2).
    bytes: minimal HBM traffic in bytes: each input read once, each output written once.
    math: which peak applies: "bf16" | "fp16" | "tf32" | "fp32" | "fp8" for tensor-core ops,
        "vector" for everything on CUDA cores (pointwise, reductions, norms, ...).
    kind: "matmul" | "attention" | "conv" | "pointwise" | "reduction" | "norm" | "softmax" |
        "embedding" | "loss" | "optimizer" | "copy" | "view" | "other".
    launches: GPU kernels the op launches in eager mode (0 for views and metadata ops).
    """

    flops: float
    bytes: float
    math: str
    kind: str
    launches: int


def tf32_of(meta: StepMeta) -> Tf32:
    """The TF32 settings a traced step ran under (its graph's meta), PyTorch's defaults for
    graphs traced before they were recorded; precision "tf32" turns both on."""
    return meta.tf32_mode


CostFn = Callable[[OpNode, "Tf32 | bool"], OpCost]

VIEW_COST = OpCost(0.0, 0.0, "vector", "view", 0)

_TC_MATH = {"bfloat16": "bf16", "float16": "fp16", "int8": "fp8", "uint8": "fp8"}


def matmul_math(dtype: str, tf32: Tf32 | bool) -> str:
    """Tensor-core peak for a matmul whose inputs have `dtype` (float64 counts as fp32)."""
    if isinstance(tf32, Tf32):
        tf32 = tf32.matmul
    if dtype.startswith("float8"):
        return "fp8"
    if dtype in _TC_MATH:
        return _TC_MATH[dtype]
    return "tf32" if tf32 and dtype == "float32" else "fp32"


def conv_math(dtype: str, tf32: Tf32 | bool) -> str:
    """Tensor-core peak for a cuDNN convolution on `dtype` (TF32 for fp32 by PyTorch's default)."""
    return matmul_math(dtype, tf32.conv if isinstance(tf32, Tf32) else tf32)


def read_bytes(t: TensorInfo | None) -> int:
    """Bytes a kernel must fetch from HBM to read `t` once: broadcast (stride-0) dims count once,
    so an expanded tensor costs its own size."""
    if t is None:
        return 0
    n = 1
    for size, stride in zip(t.shape, t.stride, strict=False):
        if size == 0:
            return 0
        if stride != 0:
            n *= size
    return n * t.itemsize


def sum_read(ts: Iterable[TensorInfo | None]) -> int:
    return sum(read_bytes(t) for t in ts)


def sum_numel(ts: Iterable[TensorInfo | None]) -> int:
    return sum(t.numel for t in ts if t is not None)


def io_bytes(node: OpNode) -> int:
    """Inputs read once (at their own size) + outputs written once, in bytes."""
    return sum_read(node.inputs) + sum_read(node.outputs)


def refs(node: OpNode, value: Any) -> list[TensorInfo]:
    """Tensors behind an argument: a {"t": i} reference, a list of them, or nothing."""
    if isinstance(value, (list, tuple)):
        return [t for v in value for t in refs(node, v)]
    t = node.tensor(value)
    return [t] if t is not None else []


def targ(node: OpNode, i: int, name: str) -> TensorInfo | None:
    """The tensor passed as positional argument i (or keyword `name`), None if absent."""
    return node.tensor(node.arg(i, name))


def first_out(node: OpNode) -> TensorInfo | None:
    if node.outputs:
        return node.outputs[0]
    return node.inputs[0] if node.inputs else None


def prod(xs: Iterable[int]) -> int:
    n = 1
    for x in xs:
        n *= int(x)
    return n


def vector(flops: float, nbytes: float, kind: str, launches: int = 1) -> OpCost:
    return OpCost(float(flops), float(nbytes), "vector", kind, launches)
