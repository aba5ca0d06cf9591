"""What `torch.compile` (Inductor) does to the step's cost: fuse the ops between matmuls.

Inductor leaves matmuls, convolutions and attention to their libraries and generates fused
Triton kernels for everything between them. Within a fused group, intermediate tensors stay
in registers: the group reads each tensor it did not produce once and writes only what is
used after it (or outlives the step). A reduction ends a kernel, so a group launches one
kernel per reduction-like op (at least one). Views cost nothing.
"""

from __future__ import annotations

from dataclasses import dataclass

from gobrrr.cost.flops import OpCost
from gobrrr.graph import OpNode, StepGraph

ANCHORS = ("matmul", "conv", "attention")
REDUCING = ("reduction", "norm", "softmax", "loss", "embedding")


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


def group_cost(graph: StepGraph, members: list[OpNode], costs: list[OpCost],
               uses: dict[int, int]) -> OpCost:
    """Bytes a fused kernel moves: what it reads from outside plus what others need after it."""
    lo, hi = members[0].index, members[-1].index
    made = {sid for n in members for sid in n.allocs}
    read = {}
    for n in members:
        for t in n.inputs:
            if t.storage not in made:
                read.setdefault(t.storage, t.nbytes)
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
    return OpCost(flops=sum(c.flops for c in costs), bytes=float(sum(read.values())
                  + sum(written.values())), math="vector", kind="fused", launches=launches)


def fuse(graph: StepGraph, costs: list[OpCost],
         phases: tuple[str, ...] = ("forward", "backward", "recompute")) -> list[FusedGroup]:
    """Split the compiled phases' non-anchor ops into fused groups (anchors stay alone)."""
    uses = last_uses(graph)
    groups: list[FusedGroup] = []
    run: list[OpNode] = []

    def flush() -> None:
        if run:
            idx = [n.index for n in run]
            groups.append(FusedGroup(tuple(idx), group_cost(graph, run, [costs[i] for i in idx],
                                                            uses)))
            run.clear()

    for n in graph.nodes:
        c = costs[n.index]
        fusible = n.phase in phases and c.kind not in ANCHORS
        if not fusible or (run and run[-1].phase != n.phase):
            flush()
        if fusible:
            run.append(n)
    flush()
    return groups
