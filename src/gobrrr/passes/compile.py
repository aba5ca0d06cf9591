"""The compile pass: what Inductor's generated kernels never allocate.

    graph = inductor(capture(workload, compile=True))   # capture(compile=True) applies it

A compiled capture (`gobrrr.capture.compiled`) records the ATen ops of the graphs
AOTAutograd partitioned, one by one, each output allocated as eager code would allocate it.
Inductor runs them differently: extern kernels (matmuls, convolutions, attention, custom ops
and fallbacks: `gobrrr.cost.fusion.extern`) alone, and each run of the ops between them as
fused kernels (`gobrrr.cost.fusion.fuse`, the groups the time model costs), whose
intermediate values stay in registers. So a tensor made inside a fused group is allocated
only if something outside the group reads it: an extern kernel, a later group, the
backward (the tensors the forward saves are its graph's outputs), the eager code after the
compiled region, or the next step. The rest become storages of 0 bytes (their ops keep their
shapes, so the time model still sees what the group computes); meta["inductor"] says how many
and how many bytes.
"""

from __future__ import annotations

import dataclasses

from gobrrr.cost.flops import graph_costs
from gobrrr.cost.fusion import fuse, last_uses
from gobrrr.graph import StepGraph


def unallocated(graph: StepGraph) -> set[int]:
    """Storages made inside a fused group of a compiled region and read only inside it."""
    uses = last_uses(graph)
    out: set[int] = set()
    for g in fuse(graph, graph_costs(graph)):
        hi = g.nodes[-1]
        for i in g.nodes:
            for sid in graph.nodes[i].allocs:
                s = graph.storages[sid]
                if s.freed is not None and s.freed <= hi and uses.get(sid, i) <= hi:
                    out.add(sid)
    return out


def inductor(graph: StepGraph) -> StepGraph:
    """`graph` (a compiled capture: meta["compiled_regions"]) with the storages Inductor
    fuses away at 0 bytes. A graph without compiled regions is returned as it is."""
    if not graph.meta.get("compiled_regions") or graph.meta.get("inductor"):
        return graph
    gone = unallocated(graph)
    storages = tuple(dataclasses.replace(s, nbytes=0) if s.id in gone else s
                     for s in graph.storages)
    fused_bytes = sum(graph.storages[sid].nbytes for sid in gone)
    meta = {**graph.meta, "inductor": {"unallocated": len(gone), "unallocated_bytes":
                                       fused_bytes}}
    return dataclasses.replace(graph, storages=storages, meta=meta)


__all__ = ["inductor", "unallocated"]
