"""Memory: replay the step graph's allocations and frees, as CUDA's caching allocator counts them.

The number predicted is `torch.cuda.max_memory_allocated()` over one steady-state step: every
storage alive at the start (parameters, optimizer states, the batch, the cuBLAS workspace) plus
the most that is ever alive at once during the step. Each allocation is rounded as the caching
allocator rounds it (up to a multiple of 512 bytes).
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass, field

from gobrrr.graph import StepGraph

BLOCK = 512  # the caching allocator's allocation granularity (kMinBlockSize)


def round_alloc(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a request of `nbytes`."""
    if nbytes <= 0:
        return 0
    return ((nbytes + BLOCK - 1) // BLOCK) * BLOCK


@dataclass(frozen=True)
class MemoryResult:
    """Predicted memory of one step, in bytes.

    peak: predicted max_memory_allocated. peak_index: the op at which it happens.
    at_peak: bytes alive at the peak by kind (parameter, gradient, optimizer_state, input,
    activation, temporary, workspace). by_module: activation + temporary bytes alive at the
    peak, by the module that created them. persistent: what outlives the step, by kind.
    timeline: bytes alive after each op's allocations (one entry per op).
    """

    peak: int
    peak_index: int
    peak_op: str
    peak_module: str
    peak_phase: str
    at_peak: dict[str, int]
    by_module: dict[str, int]
    persistent: dict[str, int]
    timeline: tuple[int, ...] = field(repr=False)
    workspace: int = 0

    def fits(self, capacity: int) -> bool:
        return self.peak <= capacity


def simulate(graph: StepGraph, workspace: int = 0,
             scratch: dict[int, int] | None = None) -> MemoryResult:
    """Replay allocations in op order. `workspace`: bytes the BLAS library keeps allocated
    (the GPU spec or calibration says how much). `scratch`: {op index: bytes the op allocates
    and frees inside itself}, which the trace cannot see (cuDNN's layout copies and
    workspaces: `gobrrr.cost.conv.scratch`); they count while the op runs, with its outputs."""
    sizes = [round_alloc(s.nbytes) for s in graph.storages]
    scratch = scratch or {}
    live = workspace + sum(sizes[s.id] for s in graph.storages if s.created < 0
                           and (s.freed is None or s.freed >= 0))
    peak, peak_index, timeline = live, -1, []
    for node in graph.nodes:
        live += sum(sizes[sid] for sid in node.allocs)
        during = live + round_alloc(scratch.get(node.index, 0))
        timeline.append(during)
        if during > peak:
            peak, peak_index = during, node.index
        live -= sum(sizes[sid] for sid in node.frees)
    at_peak, by_module = _alive_at(graph, sizes, peak_index)
    at_peak["workspace"] = workspace + round_alloc(scratch.get(peak_index, 0))
    persistent: dict[str, int] = defaultdict(int)
    for s in graph.storages:
        if s.freed is None:
            persistent[s.kind] += sizes[s.id]
    node = graph.nodes[peak_index] if peak_index >= 0 else None
    return MemoryResult(
        peak=peak, peak_index=peak_index,
        peak_op=node.op if node else "", peak_module=node.module if node else "",
        peak_phase=node.phase if node else "start", at_peak=dict(at_peak),
        by_module=dict(by_module), persistent=dict(persistent), timeline=tuple(timeline),
        workspace=workspace,
    )


def _alive_at(graph: StepGraph, sizes: list[int], index: int) -> tuple[dict, dict]:
    """Bytes alive just after op `index` allocated, by kind and by creating module."""
    by_kind: dict[str, int] = defaultdict(int)
    by_module: dict[str, int] = defaultdict(int)
    for s in graph.storages:
        born = s.created <= index
        dead = s.freed is not None and s.freed < index
        if born and not dead and not (s.created < 0 and s.freed is not None and s.freed < 0):
            by_kind[s.kind] += sizes[s.id]
            if s.kind in ("activation", "temporary"):
                by_module[s.module or "<top>"] += sizes[s.id]
    return by_kind, by_module


def module_rollup(by_module: dict[str, int], depth: int = 2) -> dict[str, int]:
    """Sum a by-module table up to the first `depth` name components ("h.3.attn" -> "h.3")."""
    out: dict[str, int] = defaultdict(int)
    for name, b in by_module.items():
        out[".".join(name.split(".")[:depth])] += b
    return dict(sorted(out.items(), key=lambda kv: -kv[1]))
