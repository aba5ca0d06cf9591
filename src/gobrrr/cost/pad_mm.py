"""The padded operand copies of a compiled matmul (Inductor's pad_mm) that live through the call.

Under torch.compile Inductor rewrites a 16-bit matmul whose inner (k) or output-column (n)
dimension is not a multiple of 8 elements (`torch/_inductor/fx_passes/pad_mm.py`: 16 bytes,
`get_alignment_size`) into a matmul of zero-padded copies: the operands that hold the
misaligned dimension are written into new buffers padded up to the next multiple, the matmul
runs on those, and the copies are freed after it. The time model takes such matmuls at the
aligned rate (`roofline.compiled_times`); this module gives the copies' bytes, allocated with the
matmul and freed after it. A copy Inductor writes itself gets its row stride padded too when
it is over 1024 elements and not a multiple of 128 bytes (`config.comprehensive_padding`,
`padding_alignment_bytes`, `padding_stride_threshold`).

Seen in Inductor's generated code for Hugging Face's GPT-2 (vocabulary 50257) on an H100: the
LM head's forward pads its weight to (768, 50264); the backward's input gradient pads the
(8192, 50257) logits gradient to (8192, 50264) with rows 50304 apart and the weight to
(50264, 768), both freed after the matmul; the weight gradient, whose misaligned dimension is
its rows (m), is left unpadded, so only k and n are padded here.

An operand that a fused kernel of the same graph makes, and that nothing after the graph
reads, needs no copy: Inductor writes it padded in the first place (`should_exclude_padding_
time`: "memory plan away all non inputs"). gobrrr's own GPT-2, compiled with its loss, makes
the logits' gradient inside the backward graph, and that matmul pads only the saved weight.
"""

from __future__ import annotations

from gobrrr.cost.flops import graph_costs
from gobrrr.cost.fusion import extern
from gobrrr.graph.ir import OpNode, StepGraph, TensorInfo, itemsize

ALIGN_ELEMENTS = 8  # 16-bit dtypes: pad_mm's get_alignment_size
STRIDE_THRESHOLD = 1024  # elements: longer rows get their stride padded
STRIDE_ALIGN_BYTES = 128
MATMULS = ("mm", "addmm", "bmm")
PADDED_DTYPES = ("bfloat16", "float16")


def _pad(x: int) -> int:
    return x if x % ALIGN_ELEMENTS == 0 or x == 1 else (x // ALIGN_ELEMENTS + 1) * ALIGN_ELEMENTS


def _copy_bytes(rows: int, cols: int, batch: int, size: int) -> int:
    """Bytes of a (batch, rows, cols) buffer Inductor allocates, its row stride padded."""
    stride = cols
    align = STRIDE_ALIGN_BYTES // size
    if stride > STRIDE_THRESHOLD and stride % align:
        stride = (stride // align + 1) * align
    return batch * rows * stride * size


def copies(node: OpNode, planned=lambda t: False) -> list[tuple[TensorInfo, int]]:
    """(operand, bytes of its padded copy) for each operand pad_mm copies for one matmul node
    (none: the node is not a misaligned 16-bit matmul). `planned(t)`: whether operand `t` is
    written padded by its producer (no copy)."""
    if node.name not in MATMULS or len(node.inputs) < 2:
        return []
    a, b = node.inputs[-2], node.inputs[-1]
    if a.dtype not in PADDED_DTYPES or b.dtype != a.dtype or len(a.shape) != len(b.shape):
        return []
    batch = a.shape[0] if len(a.shape) == 3 else 1
    m, k = a.shape[-2], a.shape[-1]
    n = b.shape[-1]
    kp, np_ = _pad(k), _pad(n)
    if kp == k and np_ == n:
        return []
    size = itemsize(a.dtype)
    out = []
    if kp != k and not planned(a):
        out.append((a, _copy_bytes(m, kp, batch, size)))
    if not planned(b):
        out.append((b, _copy_bytes(kp, np_, batch, size)))
    return out


def by_op(graph: StepGraph, costs: list | None = None):
    """{op index: [(operand, copy bytes)]} of the matmuls in a compiled capture's regions.
    `costs`: the graph's `graph_costs`, where the caller has them."""
    runs = graph.meta.compiled_regions
    if not runs:
        return {}
    costs = graph_costs(graph) if costs is None else costs
    made_by = graph.allocated_by()
    out: dict[int, list[tuple[TensorInfo, int]]] = {}
    for _, first, last in runs:

        def planned(t, first=first, last=last) -> bool:
            at, s = made_by.get(t.storage), graph.storages[t.storage]
            return (
                at is not None
                and first <= at <= last
                and not extern(graph.nodes[at], costs[at])
                and s.freed is not None
                and s.freed <= last
            )

        for node in graph.nodes[first : last + 1]:
            if made := copies(node, planned):
                out[node.index] = made
    return out


def scratch(graph: StepGraph) -> dict[int, tuple[int, ...]]:
    """{op index: padded copies' bytes} of the matmuls in a compiled capture's regions."""
    return {i: tuple(b for _, b in made) for i, made in by_op(graph).items()}
