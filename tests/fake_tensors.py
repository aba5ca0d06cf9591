"""Hand-made TensorInfos for cost tests."""

from gobrrr.graph.ir import TensorInfo


def contiguous(shape, dtype="bfloat16", sid=0) -> TensorInfo:
    """A contiguous tensor of `shape` on storage `sid`."""
    stride, acc = [], 1
    for s in reversed(shape):
        stride.insert(0, acc)
        acc *= s
    return TensorInfo(tuple(shape), tuple(stride), dtype, sid)
