"""What CUDA's LayerNorm allocates inside the call: contiguous copies of non-contiguous inputs.

ATen's CUDA `native_layer_norm` and `native_layer_norm_backward` run on contiguous tensors
(`expect_contiguous`): an input whose strides are not the contiguous ones (a residual stream
that kept a transposed layout, e.g. after `permute` or multi-head attention's output
projection) is copied first, and the copy freed when the op returns. The trace carries
CUDA's strides, so the copies follow from it. Checked against the allocator traces of the
zoo's steps (`benchmarks/results/zoo_diagnose_h100.json`): ViT-B/16 (24 forward and 36
backward copies of 37 MiB) and Whisper (13 and 13 of 47 MiB), one for one.
"""

from __future__ import annotations

from gobrrr.graph import OpNode, StepGraph

# op name -> positions of the tensor inputs the CUDA kernel makes contiguous
COPIED = {"native_layer_norm": (0,), "native_layer_norm_backward": (0, 1)}


def op_scratch(node: OpNode) -> tuple[int, ...]:
    """Bytes of each contiguous copy the op makes (in input order); () for other ops."""
    where = COPIED.get(node.name)
    if where is None:
        return ()
    return tuple(t.nbytes for i in where if i < len(node.inputs)
                 and not (t := node.inputs[i]).is_contiguous())


def scratch(graph: StepGraph) -> dict[int, tuple[int, ...]]:
    """{op index: blocks} for the graph's LayerNorms on non-contiguous inputs."""
    return {n.index: b for n in graph.nodes if (b := op_scratch(n))}
