"""What CUDA's LayerNorm allocates inside the call: contiguous copies of non-contiguous inputs,
and the partial sums of the weight and bias gradients over many rows.

ATen's CUDA `native_layer_norm` and `native_layer_norm_backward` run on contiguous tensors
(`expect_contiguous`): an input whose strides are not the contiguous ones (a residual stream
that kept a transposed layout, e.g. after `permute` or multi-head attention's output
projection) is copied first, and the copy freed when the op returns. The trace carries
CUDA's strides, so the copies follow from it. Checked against the allocator traces of the
zoo's steps (`tests/fixtures/zoo_diagnose_h100.json`): ViT-B/16 (24 forward and 36
backward copies of 37 MiB) and Whisper (13 and 13 of 47 MiB), one for one.

The backward's weight and bias gradients (aten/src/ATen/native/cuda/layer_norm_kernel.cu,
`LaunchGammaBetaBackwardCUDAKernel`): with many rows and few columns (M > 64Ki rows and
N / 32 < SMs / 2) the kernel parallelises over the rows: one block per 32 rows (at most
32Ki / ceil(N / 32) of them) writes a partial sum per column into a (blocks, N) tensor of the
weight's dtype, one for each gradient asked for, and `.sum(0)` reduces each, through the
reduction's own staging buffer (`reduce_scratch`). The two partial tensors live to the end
of the call; the two sums run one after the other, so the second staging buffer reuses the
first's block. Checked against ConvNeXt-T's allocator trace (channels 96 over 64 x 56 x 56
rows: two 2.3 MiB partials and a 1.15 MiB staging buffer per LayerNorm,
`zoo_diagnose_plain_h100.json`).
"""

from __future__ import annotations

import math

from gobrrr.graph.ir import OpNode, StepGraph, itemsize
from gobrrr.memory.scratch.reduce import SMS, reduce_buffers

# op name -> positions of the tensor inputs the CUDA kernel makes contiguous
COPIED = {"native_layer_norm": (0,), "native_layer_norm_backward": (0, 1)}


ROWS_PER_BLOCK = 32  # rows_per_block_y of the partial-sum kernel
COLUMNS_PER_BLOCK = 32  # block_dim_x
MAX_GRID = 64 * 1024 // 2  # max_grid_size: blocks of the partial-sum kernel


def partial_sums(node: OpNode) -> tuple[int, ...]:
    """native_layer_norm_backward's blocks for its weight and bias gradients over many rows:
    the partial-sum tensors, then one `.sum(0)` staging buffer and its semaphores; () where
    the kernel reduces in one pass."""
    if node.name != "native_layer_norm_backward" or len(node.inputs) < 2:
        return ()
    shape = node.arg(2, "normalized_shape")
    mask = node.arg(7, "output_mask")
    x = node.inputs[1]
    if not isinstance(shape, list) or not mask or len(mask) < 3 or not x.shape:
        return ()
    n = math.prod(shape)
    m = x.numel // max(n, 1)
    if not (m > 64 * 1024 and n // COLUMNS_PER_BLOCK < SMS // 2):
        return ()
    weight, bias = node.tensor(node.arg(5, "weight")), node.tensor(node.arg(6, "bias"))
    grads = (weight is not None and bool(mask[1])) + (bias is not None and bool(mask[2]))
    if not grads:
        return ()
    cols = -(-n // COLUMNS_PER_BLOCK)
    rows = min(MAX_GRID // cols, -(-m // ROWS_PER_BLOCK))
    dtype = (weight or bias).dtype  # the gradients' dtype: the weight's
    part = rows * n * itemsize(dtype)
    buf, sem = reduce_buffers((rows, n), (n, 1), [0], itemsize(dtype))
    return (part,) * grads + tuple(b for b in (buf, sem) if b)


def op_scratch(node: OpNode) -> tuple[int, ...]:
    """Bytes of each contiguous copy the op makes (in input order), then a LayerNorm
    backward's partial sums (`partial_sums`); () for other ops."""
    where = COPIED.get(node.name)
    if where is None:
        return ()
    copies = tuple(
        t.nbytes
        for i in where
        if i < len(node.inputs) and not (t := node.inputs[i]).is_contiguous()
    )
    return copies + partial_sums(node)


def scratch(graph: StepGraph) -> dict[int, tuple[int, ...]]:
    """{op index: blocks} for the graph's LayerNorms on non-contiguous inputs."""
    return {n.index: b for n in graph.nodes if (b := op_scratch(n))}
