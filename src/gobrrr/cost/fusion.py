"""What `torch.compile` (Inductor) does to the step's cost: fuse the ops between matmuls.

Inductor leaves matmuls, convolutions and attention to their libraries (extern kernels,
`extern`) and generates fused Triton kernels for everything between them. Within a fused
group, intermediate tensors stay in registers: the group reads each tensor it did not
produce once and writes only what is used after it (or outlives the step). A reduction ends
a kernel, so a group launches one kernel per reduction-like op (at least one). Views cost
nothing.

On a compiled capture (`gobrrr.capture.compiled`: meta.compiled_regions) the groups are
cut from the compiled graphs' runs only (the optimizer, and a loss computed outside the
model, stay eager); on an eager trace, from the forward and backward phases.
"""

from __future__ import annotations

from dataclasses import dataclass

from gobrrr.cost.flops import OpCost
from gobrrr.graph.ir import OpNode, StepGraph

ANCHORS = ("matmul", "conv", "attention")
REDUCING = ("reduction", "norm", "softmax", "loss", "embedding")
#: ATen ops Inductor does not generate code for but calls as they are (its fallbacks): they
#: run alone, and their inputs and outputs are allocated.
FALLBACKS = frozenset(
    {
        "sort",
        "topk",
        "_grouped_mm",
        "nonzero",
        "randperm",
        "_fft_r2c",
        "_fft_c2r",
        "_fft_c2c",
        "_cudnn_rnn",
        "_embedding_bag",
        "_embedding_bag_backward",
        "multinomial",
        "_scaled_mm",
    }
)


def extern(node: OpNode, cost: OpCost) -> bool:
    """Whether Inductor runs `node` as an extern kernel (a library call or a fallback), not
    inside a fused kernel: matmuls, convolutions, attention, custom ops (gobrrr's kernels:
    namespaces other than aten and prims) and FALLBACKS."""
    return (
        cost.kind in ANCHORS
        or node.op.split(".")[0] not in ("aten", "prims")
        or node.name in FALLBACKS
    )


@dataclass(frozen=True)
class FusedGroup:
    """Consecutive fusible ops (indices into the graph) and their fused cost."""

    nodes: tuple[int, ...]
    cost: OpCost


def last_uses(graph: StepGraph) -> dict[int, int]:
    """Storage id -> index of the last op that reads it."""
    out: dict[int, int] = {}
    for n in graph.nodes:
        for t in n.inputs:
            out[t.storage] = n.index
    return out


def group_cost(
    graph: StepGraph, members: list[OpNode], costs: list[OpCost], uses: dict[int, int]
) -> OpCost:
    """Bytes a fused kernel moves: what it reads from outside plus what others need after it."""
    lo, hi = members[0].index, members[-1].index
    made = {sid for n in members for sid in n.allocs}
    read = _reads(members, costs, made)
    written = {}
    for n in members:
        for t in n.outputs:
            s = graph.storages[t.storage]
            needed_later = uses.get(t.storage, -1) > hi or s.freed is None
            if needed_later and (t.storage in made or s.created < lo):
                written[t.storage] = max(written.get(t.storage, 0), t.nbytes)
    launches = max(1, sum(1 for c in costs if c.kind in REDUCING and c.launches))
    if all(c.launches == 0 for c in costs):
        launches = 0
    return OpCost(
        flops=sum(c.flops for c in costs),
        bytes=float(read + sum(written.values())),
        math="vector",
        kind="fused",
        launches=launches,
    )


#: Inductor keeps a reduction "persistent" (the whole reduced extent in registers, its
#: pointwise consumers in the same kernel) up to this many reduced elements when they are
#: contiguous in memory, and up to PERSISTENT_OUTER when they are not
#: (`torch._inductor.choices.should_use_persistent_reduction`).
PERSISTENT_INNER, PERSISTENT_OUTER = 1024, 64


def looped(node: OpNode, cost: OpCost) -> bool:
    """Whether a reduction-like op runs as a looped (not persistent) reduction, whose
    consumers then run in a kernel of their own that reads its sources again."""
    if cost.kind not in REDUCING or not node.inputs or not node.outputs:
        return False
    x = max(node.inputs, key=lambda t: t.numel)
    rnumel = x.numel // max(1, max(t.numel for t in node.outputs))
    inner = x.stride[-1:] == (1,) and _reduces_last(node, len(x.shape))
    return rnumel > (PERSISTENT_INNER if inner else PERSISTENT_OUTER)


def _reduces_last(node: OpNode, ndim: int) -> bool:
    dims = node.arg(1, "dim", None)
    if not isinstance(dims, (list, tuple)):
        return dims is None or not isinstance(dims, int) or dims in (-1, ndim - 1)
    return any(d in (-1, ndim - 1) for d in dims) if dims else True


def _reads(members: list[OpNode], costs: list[OpCost], made: set[int]) -> int:
    """Bytes the group's kernels read from memory. The group is cut into kernels after each
    looped reduction; each kernel reads what its ops need from outside the group, a pointwise
    value made by an earlier kernel of the group by reading that value's own sources again
    (Inductor recomputes it inline), a reduction's result as it is."""
    sources: dict[int, dict[int, int]] = {}  # storage made in the group -> what it reads
    total, kernel = 0, {}
    for n, c in zip(members, costs, strict=True):
        need: dict[int, int] = {}
        for t in n.inputs:
            need.update(
                sources.get(t.storage, {t.storage: t.nbytes})
                if t.storage in made
                else {t.storage: t.nbytes}
            )
        kernel.update(need)
        for sid in n.allocs:
            sources[sid] = {sid: 0} if c.kind in REDUCING else need
        if looped(n, c):
            total += sum(kernel.values())
            kernel = {}
            for sid in n.allocs:
                sources[sid] = {sid: max(t.nbytes for t in n.outputs)}
    return total + sum(kernel.values())


def regions(
    graph: StepGraph, phases: tuple[str, ...] = ("forward", "backward", "recompute")
) -> list[int]:
    """Each node's compiled region (an index; -1: runs eagerly): the compiled graphs' runs
    on a compiled capture, else one region per run of consecutive nodes in `phases`."""
    runs = graph.meta.compiled_regions
    out = [-1] * len(graph.nodes)
    if runs is not None:
        for r, (_, first, last) in enumerate(runs):
            out[first : last + 1] = [r] * (last + 1 - first)
        return out
    r, prev = -1, None
    for n in graph.nodes:  # eager trace: each run of one phase is one region
        if n.phase != prev:
            r, prev = r + 1, n.phase
        if n.phase in phases:
            out[n.index] = r
    return out


def fuse(
    graph: StepGraph,
    costs: list[OpCost],
    phases: tuple[str, ...] = ("forward", "backward", "recompute"),
) -> list[FusedGroup]:
    """Split the compiled regions' non-extern ops into fused groups (extern ops stay
    alone); see `regions` for what is compiled."""
    uses = last_uses(graph)
    region = regions(graph, phases)
    groups: list[FusedGroup] = []
    run: list[OpNode] = []

    def flush() -> None:
        if run:
            idx = [n.index for n in run]
            groups.append(
                FusedGroup(tuple(idx), group_cost(graph, run, [costs[i] for i in idx], uses))
            )
            run.clear()

    for n in graph.nodes:
        c = costs[n.index]
        fusible = region[n.index] >= 0 and not extern(n, c)
        if not fusible or (run and region[run[-1].index] != region[n.index]):
            flush()
        if fusible:
            run.append(n)
    flush()
    return groups
