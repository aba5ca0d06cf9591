"""Memory: replay the step graph's allocations and frees, as CUDA's caching allocator counts them.

Two numbers are predicted:
- `torch.cuda.max_memory_allocated()` over one steady-state step (`MemoryResult.peak`): every
  storage alive at the start (parameters, optimizer states, the batch, the cuBLAS workspace)
  plus the most that is ever alive at once during the step, each allocation rounded as the
  caching allocator rounds it (up to a multiple of 512 bytes).
- `torch.cuda.max_memory_reserved()` (`MemoryResult.reserved`): the segments the caching
  allocator obtains from CUDA, replayed block by block by `gobrrr.allocator`, which is what
  the device runs out of. The cache keeps what earlier steps left in it, so the replay runs the
  process as a training loop does: parameters, buffers and the batch first; the BLAS
  workspaces; then step 1, whose optimizer creates its state when its first op runs (in the
  cached blocks the freed activations left); then the same step again until the measured one
  (`STEPS`). Within a step, per op: its allocations, its scratch (allocated and freed while
  it runs), then its frees.

Whether a step fits is judged on the reserved peak against the memory CUDA leaves to the
process (`process_budget`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from gobrrr.allocator import AllocatorStats, CachingAllocator, OutOfMemory
from gobrrr.graph import StepGraph
from gobrrr.hardware import Calibration, GpuSpec

BLOCK = 512  # the caching allocator's allocation granularity (kMinBlockSize)
STEPS = 4  # steps replayed for the reserved peak: the measured protocol's 3 warm-ups + 1
# Device memory a training process holds outside the caching allocator: the CUDA context with
# the kernels of CUDA, cuBLAS and cuDNN loaded lazily. An assumption (about 0.5 GiB on a
# Hopper GPU with CUDA 12-13), until benchmarks/allocator_truth.py records it on the device
# ("context" in its JSON), against which tests/test_allocator.py checks it.
CUDA_CONTEXT_BYTES = 512 * 1024**2


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
    reserved: predicted max_memory_reserved (the caching allocator's segments), 0 when the
    allocator was not replayed. allocator: its counters (segments, fragmentation at the
    reserved peak, retries). budget: the bytes the segments may take (None = unlimited);
    oom_index: the op whose request fails within the budget (None: none fails).
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
    reserved: int = 0
    allocator: AllocatorStats | None = None
    budget: int | None = None
    oom_index: int | None = None

    @property
    def headroom(self) -> int | None:
        """Bytes of the budget left at the reserved peak (negative: short by that much)."""
        return None if self.budget is None else self.budget - self.reserved

    @property
    def headroom_share(self) -> float | None:
        """headroom as a fraction of the budget."""
        return None if not self.budget else self.headroom / self.budget

    def fits(self, capacity: int | None = None) -> bool:
        """Whether the step runs within `capacity` bytes (default: the budget it was replayed
        with): no request fails and the reserved peak (the allocated peak where the allocator
        was not replayed) stays within it."""
        capacity = self.budget if capacity is None else capacity
        if capacity is None:
            return True
        if self.oom_index is not None and capacity == self.budget:
            return False
        return (self.reserved or self.peak) <= capacity


Scratch = dict[int, int | Sequence[int]]


def simulate(graph: StepGraph, workspace: int | Sequence[int] = 0,
             scratch: Scratch | None = None, budget: int | None = None) -> MemoryResult:
    """Replay allocations in op order. `workspace`: bytes the BLAS library keeps allocated
    (the GPU spec or calibration says how much), one allocation or one per handle.
    `scratch`: {op index: bytes the op allocates and frees inside itself (or the sizes of
    each such allocation)}, which the trace cannot see (cuDNN's layout copies and workspaces:
    `gobrrr.cost.conv.scratch`); they count while the op runs, with its outputs. `budget`:
    bytes the allocator's segments may take (`process_budget`); None = unlimited."""
    sizes = [round_alloc(s.nbytes) for s in graph.storages]
    scratch = scratch or {}
    ws = tuple(b for b in _blocks(workspace) if b > 0)
    live = sum(round_alloc(b) for b in ws) + sum(
        sizes[s.id] for s in graph.storages if s.created < 0 and (s.freed is None or s.freed >= 0))
    peak, peak_index, timeline = live, -1, []
    for node in graph.nodes:
        live += sum(sizes[sid] for sid in node.allocs)
        during = live + _scratch_bytes(scratch, node.index)
        timeline.append(during)
        if during > peak:
            peak, peak_index = during, node.index
        live -= sum(sizes[sid] for sid in node.frees)
    at_peak, by_module = _alive_at(graph, sizes, peak_index)
    at_peak["workspace"] = sum(round_alloc(b) for b in ws) + _scratch_bytes(scratch, peak_index)
    persistent: dict[str, int] = defaultdict(int)
    for s in graph.storages:
        if s.freed is None:
            persistent[s.kind] += sizes[s.id]
    node = graph.nodes[peak_index] if peak_index >= 0 else None
    stats, oom = replay_reserved(graph, ws, scratch, budget)
    return MemoryResult(
        peak=peak, peak_index=peak_index,
        peak_op=node.op if node else "", peak_module=node.module if node else "",
        peak_phase=node.phase if node else "start", at_peak=dict(at_peak),
        by_module=dict(by_module), persistent=dict(persistent), timeline=tuple(timeline),
        workspace=sum(ws), reserved=stats.reserved_peak, allocator=stats, budget=budget,
        oom_index=oom,
    )


def _blocks(v: int | Sequence[int]) -> tuple[int, ...]:
    return (v,) if isinstance(v, int) else tuple(v)


def _scratch_bytes(scratch: Scratch, index: int) -> int:
    return sum(round_alloc(b) for b in _blocks(scratch.get(index, 0)))


# ------------------------------------------------------------------------- the allocator replay
def replay_reserved(graph: StepGraph, workspace: Sequence[int] = (), scratch: Scratch | None = None,
                    budget: int | None = None, steps: int = STEPS
                    ) -> tuple[AllocatorStats, int | None]:
    """Replay the process through the caching allocator (see the module docstring): the
    counters, and the op whose request fails within `budget` (None: none does). Where the
    unlimited replay stays within the budget, that is the answer; otherwise the replay runs
    again within it, as the allocator would (releasing cached segments, then failing)."""
    stats, _ = _replay(graph, workspace, scratch or {}, None, steps)
    if budget is None or stats.reserved_peak <= budget:
        return stats, None
    limited, oom = _replay(graph, workspace, scratch or {}, budget, steps)
    return (stats if oom is not None else limited), oom


def _replay(graph: StepGraph, workspace: Sequence[int], scratch: Scratch, budget: int | None,
            steps: int) -> tuple[AllocatorStats, int | None]:
    alloc = CachingAllocator(budget)
    handles: dict[int, int] = {}
    storages = graph.storages
    start = [s for s in storages if s.created < 0 and (s.freed is None or s.freed >= 0)]
    lazy = [s.id for s in start if s.kind == "optimizer_state"]
    first_opt = next((n.index for n in graph.nodes if n.phase == "optimizer"), None)
    if first_opt is None:  # no optimizer op: its state is simply there from the start
        lazy = []
    survivors = {s.id for s in storages if s.created >= 0 and s.freed is None}

    def malloc(sid: int) -> None:
        if storages[sid].nbytes > 0:
            handles[sid] = alloc.malloc(storages[sid].nbytes)

    at = -1  # the op running (-1: before the first step)
    try:
        for s in start:
            if s.id not in lazy:
                malloc(s.id)
        for b in workspace:
            alloc.malloc(b)
        for step in range(steps):
            for node in graph.nodes:
                at = node.index
                if step == 0 and node.index == first_opt:
                    for sid in lazy:
                        malloc(sid)
                _run_op(alloc, node, handles, survivors, scratch, malloc)
    except OutOfMemory:
        return alloc.stats(), at
    return alloc.stats(), None


def _run_op(alloc: CachingAllocator, node, handles: dict[int, int], survivors: set[int],
            scratch: Scratch, malloc) -> None:
    """One op: its allocations (a storage that outlived the previous step is replaced by this
    step's), its scratch allocated and freed, then its frees."""
    for sid in node.allocs:
        if sid in survivors and sid in handles:
            alloc.free(handles.pop(sid))
        malloc(sid)
    for b in _blocks(scratch.get(node.index, 0)):
        if b > 0:
            alloc.free(alloc.malloc(b))
    for sid in node.frees:
        if sid in handles:
            alloc.free(handles.pop(sid))


def process_budget(gpu: GpuSpec, cal: Calibration | None = None) -> int:
    """Bytes the caching allocator may reserve on `gpu`: the device memory CUDA reports (the
    calibration's measured total where it has one, else the spec's) minus what the process
    holds outside the allocator (CUDA_CONTEXT_BYTES, an assumption)."""
    total = (cal.meta.get("memory") if cal else None) or gpu.memory_bytes
    return int(total) - CUDA_CONTEXT_BYTES


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
