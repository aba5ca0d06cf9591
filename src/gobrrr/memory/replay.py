"""Memory: replay the step graph's allocations and frees, as CUDA's caching allocator counts them.

Both numbers come from replaying the process through a model of the caching allocator
(`gobrrr.memory.allocator`), block by block:
- `torch.cuda.max_memory_allocated()` over the measured step (`MemoryResult.peak`): every
  storage alive at its start (parameters, optimizer states, the batch, the cuBLAS workspaces)
  plus the most that is ever alive at once during it, each counted as the block the allocator
  hands out (the request rounded up to 512 bytes, plus any remainder too small to split off).
  `peak_rounded` is the same sum with every request only rounded, for comparison.
- `torch.cuda.max_memory_reserved()` (`MemoryResult.reserved`): the segments the allocator
  obtains from CUDA, which is what the device runs out of.
The cache keeps what earlier steps left in it, so the replay runs the process as a training
loop does: parameters, buffers and the batch first; the BLAS workspaces; then step 1, whose
optimizer creates its state when its first op runs (in the cached blocks the freed
activations left; what a loop carries from one step into the next, a kept output, is not
there yet: `StorageInfo.carried`); then the same step again up to the measured one
(`STEPS`), whose peaks are reset at its start (a multi-GPU step releases the cache first,
as its measured protocol does). Within a step, per op: its allocations, its scratch
(allocated and freed while it runs), then its frees; each allocation from the pool of the
stream of the op that makes it.

Whether a step fits is judged on the reserved peak against the memory CUDA leaves to the
process (`process_budget`).
"""

from __future__ import annotations

import copy
import dataclasses
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from gobrrr.cost import conv, pad_mm
from gobrrr.cost._ops_optim import adam8bit_scratch
from gobrrr.graph.ir import OpNode, StepGraph
from gobrrr.hardware import Calibration, GpuSpec
from gobrrr.memory.allocator import (
    AllocatorStats,
    CachingAllocator,
    OutOfMemory,
    round_size,
    segment_size,
)
from gobrrr.memory.scratch import attention as attention_scratch
from gobrrr.memory.scratch import norm as norm_scratch
from gobrrr.memory.scratch import reduce as reduce_scratch

BLOCK = 512  # the caching allocator's allocation granularity (kMinBlockSize)
CUDA_GRAPH_POOL = "cuda_graph"  # the captured step's private pool (as a stream of its own)
STEPS = 4  # steps replayed: the measured protocol's 3 warm-ups + the measured step
# Device memory a training process holds outside the caching allocator: the CUDA context with
# the kernels of cuBLAS and cuDNN loaded (lazily, on first use). Measured on an H100 80GB HBM3
# (CUDA 13.0, driver 580, torch 2.11) by benchmarks/memory/allocator_truth.py: 527 MiB after the
# context is created, 685 MiB after a cuBLAS matmul, 693 MiB after a cuDNN convolution
# (tests/fixtures/allocator_truth_h100.json, "context"; tests/test_allocator.py holds this
# figure to it). Taken as the same on other GPUs, an assumption.
CUDA_CONTEXT_BYTES = 726_466_560


def round_alloc(nbytes: int) -> int:
    """Bytes the CUDA caching allocator counts for a request of `nbytes`."""
    if nbytes <= 0:
        return 0
    return ((nbytes + BLOCK - 1) // BLOCK) * BLOCK


@dataclass(frozen=True)
class MemoryResult:
    """Predicted memory of one step, in bytes.

    peak: predicted max_memory_allocated over the measured step, as the caching allocator
    counts it (blocks, with the remainders it keeps in them). peak_index: the op at which it
    happens (-1: the state the step starts with). peak_rounded: the most bytes alive at once
    with every allocation only rounded up to 512 bytes, for comparison.
    at_peak: bytes alive at the peak by kind (parameter, gradient, optimizer_state, input,
    activation, temporary, workspace). by_module: activation + temporary bytes alive at the
    peak, by the module that created them. persistent: what outlives the step, by kind.
    timeline: bytes allocated while each op runs (its outputs and scratch; one entry per op).
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
    peak_rounded: int = 0
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
# BLAS workspaces: bytes allocated before step 1, or (bytes, op index) allocated by that op in
# step 1 (after its outputs) and kept
Workspaces = Sequence[int | tuple[int, int]]


def simulate(
    graph: StepGraph,
    workspace: int | Workspaces = 0,
    scratch: Scratch | None = None,
    budget: int | None = None,
) -> MemoryResult:
    """Replay allocations in op order. `workspace`: bytes the BLAS library keeps allocated
    (the GPU spec or calibration says how much), one allocation or one per handle.
    `scratch`: {op index: bytes the op allocates and frees inside itself (or the sizes of
    each such allocation)}, which the trace cannot see (cuDNN's layout copies and workspaces:
    `gobrrr.cost.conv.scratch`); they count while the op runs, with its outputs. `budget`:
    bytes the allocator's segments may take (`process_budget`); None = unlimited."""
    scratch = scratch or {}
    ws = tuple(w for w in _blocks(workspace) if _ws_size(w) > 0)
    ws_sizes = tuple(_ws_size(w) for w in ws)
    run = replay(graph, ws, scratch, budget)
    sizes = [run.sizes.get(s.id, round_alloc(s.nbytes)) for s in graph.storages]
    at_peak, by_module = _alive_at(graph, sizes, run.peak_index)
    at_peak["workspace"] = run.workspace + run.scratch.get(run.peak_index, 0)
    persistent: dict[str, int] = defaultdict(int)
    for s in graph.storages:
        if s.freed is None:
            persistent[s.kind] += sizes[s.id]
    node = graph.nodes[run.peak_index] if run.peak_index >= 0 else None
    return MemoryResult(
        peak=run.stats.allocated_peak,
        peak_index=run.peak_index,
        peak_op=node.op if node else "",
        peak_module=node.module if node else "",
        peak_phase=node.phase if node else "start",
        at_peak=dict(at_peak),
        by_module=dict(by_module),
        persistent=dict(persistent),
        timeline=run.timeline,
        workspace=sum(ws_sizes),
        peak_rounded=rounded_peak(graph, ws_sizes, scratch),
        reserved=run.stats.reserved_peak,
        allocator=run.stats,
        budget=budget,
        oom_index=run.oom_index,
    )


def rounded_peak(
    graph: StepGraph, workspace: Sequence[int] = (), scratch: Scratch | None = None
) -> int:
    """The most bytes alive at once in one step, each allocation rounded up to 512 bytes:
    max_memory_allocated where every block is cut to its request (the replay's peak can be
    higher by the remainders the allocator leaves in blocks)."""
    scratch = scratch or {}
    sizes = [round_alloc(s.nbytes) for s in graph.storages]
    live = sum(round_alloc(b) for b in workspace) + sum(
        sizes[s.id] for s in graph.storages if s.created < 0 and (s.freed is None or s.freed >= 0)
    )
    peak = live
    for node in graph.nodes:  # (most ops allocate, free and scratch nothing)
        if node.allocs:
            live += sum(sizes[sid] for sid in node.allocs)
        extra = scratch.get(node.index)
        if extra:
            peak = max(peak, live + sum(round_alloc(b) for b in _blocks(extra)))
        elif live > peak:
            peak = live
        if node.frees:
            live -= sum(sizes[sid] for sid in node.frees)
    return peak


def _blocks(v: int | Sequence[int]) -> tuple[int, ...]:
    return (v,) if isinstance(v, int) else tuple(v)


def _ws_size(w: int | tuple[int, int]) -> int:
    return w if isinstance(w, int) else w[0]


# ------------------------------------------------------------------------- the allocator replay
@dataclass(frozen=True)
class Replayed:
    """The process replayed through the caching allocator. stats: its counters, with the
    peaks of the measured (last) step, reset at its start as the measured protocol resets them.
    timeline: bytes allocated while each op of that step runs (its outputs and scratch);
    peak_index: the op of the allocated peak (-1: the start of the step). sizes: bytes each
    storage's block counts, by storage id; workspace: the BLAS workspaces' blocks; scratch:
    {op index: its scratch blocks}. oom_index: the op whose request fails within the budget."""

    stats: AllocatorStats
    timeline: tuple[int, ...] = field(repr=False)
    peak_index: int = -1
    sizes: dict[int, int] = field(default_factory=dict, repr=False)
    workspace: int = 0
    scratch: dict[int, int] = field(default_factory=dict, repr=False)
    oom_index: int | None = None


def replay(
    graph: StepGraph,
    workspace: Workspaces = (),
    scratch: Scratch | None = None,
    budget: int | None = None,
    steps: int = STEPS,
) -> Replayed:
    """Replay the process through the caching allocator (see the module docstring). Where the
    unlimited replay stays within `budget`, that is the answer; otherwise the replay runs
    again within it, as the allocator would (releasing cached segments, then failing): if it
    fails, the unlimited replay is returned (what the step needs) with the failing op.

    The replay within the budget runs first: until a segment is refused it is the unlimited
    one, op for op. Where none was refused, the two are one. Where one was and the step
    still ran, the unlimited replay's reserved memory passed the budget there and never came
    down (it releases nothing; a multi-GPU step's does, `_replay_free_first`): the answer
    is the limited one. Only where it failed does the unlimited replay run too."""
    if budget is None:
        return _Process(graph, workspace, scratch or {}, None).run(steps)
    if graph.meta.parallel is not None:  # the measured step starts from an emptied cache
        return _replay_free_first(graph, workspace, scratch or {}, budget, steps)
    first = _Process(graph, workspace, scratch or {}, budget)
    limited = first.run(steps, watch=budget)
    if limited.oom_index is None:
        return limited
    free = _other(first, graph, workspace, scratch or {}, None, steps)
    return dataclasses.replace(free, oom_index=limited.oom_index)


def _replay_free_first(
    graph: StepGraph, workspace: Workspaces, scratch: Scratch, budget: int, steps: int
) -> Replayed:
    """`replay` of a multi-GPU step, whose cache is released before the measured step: its
    warm-ups may pass the budget where the measured step does not (the unlimited replay is
    then the answer), which the limited replay alone cannot tell."""
    first = _Process(graph, workspace, scratch, None)
    free = first.run(steps, watch=budget)
    if free.stats.reserved_peak <= budget:
        return free
    limited = _other(first, graph, workspace, scratch, budget, steps)
    if limited.oom_index is None:
        return limited
    return dataclasses.replace(free, oom_index=limited.oom_index)


def _other(
    first: _Process,
    graph: StepGraph,
    workspace: Workspaces,
    scratch: Scratch,
    budget: int | None,
    steps: int,
) -> Replayed:
    """The replay with `budget` where `first` ran with the other one (None or a budget): from
    the copy of `first` it kept where the two could first part (`_Process.run`'s `watch`),
    else from the start. Up to there the two are one, op for op."""
    if first.forked is not None:
        return first.forked.resume(steps)
    return _Process(graph, workspace, scratch, budget, first.ops).run(steps)


def replay_reserved(
    graph: StepGraph,
    workspace: Workspaces = (),
    scratch: Scratch | None = None,
    budget: int | None = None,
    steps: int = STEPS,
) -> tuple[AllocatorStats, int | None]:
    """The allocator's counters of `replay`, and the op whose request fails (None: none)."""
    run = replay(graph, workspace, scratch, budget, steps)
    return run.stats, run.oom_index


class _Process:
    """A training process as the allocator sees it: the state, the workspaces, then steps.

    Each op's work is read off the graph once (`_ops`): a replay runs the step `STEPS`
    times, and the planner replays every candidate, so the loop over ops is the hot one."""

    def __init__(
        self,
        graph: StepGraph,
        workspace: Workspaces,
        scratch: Scratch,
        budget: int | None,
        ops: list[tuple] | None = None,
    ) -> None:
        self.graph, self.scratch = graph, scratch
        self.ops = ops  # `_ops`, where another replay of the graph read them
        # workspaces made up front, and those made when an op first asks for them (step 1)
        self.workspace = [w for w in workspace if isinstance(w, int)]
        self.ws_at: dict[int, list[int]] = {}
        for w in workspace:
            if not isinstance(w, int):
                self.ws_at.setdefault(w[1], []).append(w[0])
        self.ws_bytes = 0
        self.alloc = CachingAllocator(budget)
        self.handles: dict[int, int] = {}
        self.sizes: dict[int, int] = {}
        st = graph.storages
        self.start = [s.id for s in st if s.created < 0 and (s.freed is None or s.freed >= 0)]
        # the optimizer creates its state in step 1, when its first op runs
        self.first_opt = next((n.index for n in graph.nodes if n.phase == "optimizer"), None)
        self.lazy = (
            [i for i in self.start if st[i].kind == "optimizer_state"]
            if self.first_opt is not None
            else []
        )
        # what a step creates and keeps is replaced by the next step's
        self.survivors = {s.id for s in st if s.created >= 0 and s.freed is None}
        # the first op captured into a CUDA graph's private pool (None: eager)
        c = graph.meta.cuda_graph
        self.captured = c.start if c is not None else None
        # called with each op, before its allocations (zoo/allocdiff.py labels the
        # allocator's events with it)
        self.watch: Callable[[OpNode], None] | None = None
        # a copy of this process as it was before the first op where a replay with the
        # other budget could part from this one (`run`'s `watch`), and where that was
        self.forked: _Process | None = None
        self.position = (0, 0)  # (step, op) a copy resumes at
        self.pending: _Process | None = None  # the copy before the op being replayed
        self._bounds: dict[str, list[int]] = {}  # `_most`
        self.timeline: list[int] = []  # bytes allocated during each op of the last step
        self.scratch_at: dict[int, int] = {}  # op -> its scratch blocks' bytes
        self.at = -1  # the op being replayed

    def _ops(self) -> list[tuple]:
        """Per op: (index, its allocations as (storage, bytes, outlives the step, left by
        the previous step), its stream, its scratch requests, its frees)."""
        st, survivors, scratch = self.graph.storages, self.survivors, self.scratch
        out = []
        for n in self.graph.nodes:
            allocs = (
                tuple((s, st[s].nbytes, s in survivors, st[s].carried) for s in n.allocs)
                if n.allocs
                else ()
            )
            blocks = scratch.get(n.index)
            blocks = tuple(b for b in _blocks(blocks) if b > 0) if blocks else ()
            out.append((n.index, allocs, n.stream, blocks, n.frees))
        return out

    def run(self, steps: int, watch: int | None = None) -> Replayed:
        """Replay `steps` steps. `watch`: the budget of another replay of this process (this
        one's budget None) or None (this one's budget set). The two are one, op for op,
        until a request asks for a segment that would pass that budget (one replay then
        releases cached segments or fails, the other does not): a copy of this process as
        it was before that op is kept (`forked`, resumed with `resume`). Copied before
        each op that could (its requests, each a new segment, could pass the budget) and
        dropped where it did not."""
        if self.ops is None:
            self.ops = self._ops()
        alloc = self.alloc
        try:
            for sid in self.start:
                if sid not in self.lazy:
                    self._malloc(sid)
            self.ws_bytes = sum(alloc.block_size(alloc.malloc(b)) for b in self.workspace)
            if watch is not None and alloc.reserved <= watch:  # else parted already
                alloc.watch = watch
            self._steps(steps, 0, 0)
        except OutOfMemory:
            self._parted()
            return Replayed(alloc.stats(), (), oom_index=self.at)
        return self._replayed()

    def resume(self, steps: int) -> Replayed:
        """`run` of a `forked` copy, from where it was copied."""
        try:
            self._steps(steps, *self.position)
        except OutOfMemory:
            return Replayed(self.alloc.stats(), (), oom_index=self.at)
        return self._replayed()

    def _replayed(self) -> Replayed:
        timeline, alloc = self.timeline, self.alloc
        peak_index = max(range(len(timeline)), key=timeline.__getitem__, default=-1)
        if peak_index >= 0 and timeline[peak_index] < alloc.allocated_peak:
            peak_index = -1  # the step never tops what it started with
        return Replayed(
            alloc.stats(),
            tuple(timeline),
            peak_index,
            self.sizes,
            self.ws_bytes,
            self.scratch_at,
        )

    def _copy(self, step: int, k: int) -> _Process | None:
        """This process before op k of `step`, with the budget its allocator watches."""
        twin = self.alloc.copy()
        if twin is None:  # addresses given: the other replay runs from the start
            return None
        twin.budget = None if self.alloc.budget is not None else self.alloc.watch
        twin.watch, twin.parted = None, False
        c = copy.copy(self)  # the graph and the per-op work shared
        c.alloc = twin
        c.handles, c.sizes = dict(self.handles), dict(self.sizes)
        c.timeline, c.scratch_at = list(self.timeline), dict(self.scratch_at)
        c.position, c.forked, c.pending = (step, k), None, None
        return c

    def _parted(self) -> None:
        """The op after the last copy is done: keep the copy where the replays parted
        there (and watch no more), else drop it."""
        if self.pending is not None and self.alloc.parted:
            self.forked, self.alloc.watch = self.pending, None
        self.pending = None

    def _steps(self, steps: int, step0: int, k0: int) -> None:
        """Steps step0.. (the first from its op k0, its start already done where k0 > 0)."""
        timeline, scratch = self.timeline, self.scratch_at
        alloc, handles, sizes = self.alloc, self.handles, self.sizes
        malloc, free, block_size = alloc.malloc, alloc.free, alloc.block_size
        ops, hook = self.ops, self.watch
        nodes = {n.index: n for n in self.graph.nodes} if hook is not None else {}
        for step in range(step0, steps):
            first = step == 0
            last = step == steps - 1
            lo = k0 if step == step0 else 0
            # captured as a CUDA graph (`passes.cudagraph`): the warm-ups' cache emptied, then
            # the measured step is the capture, its allocations in the graph's pool
            pool = self.captured if last else None
            if lo == 0:
                if last and self.graph.meta.parallel is not None:
                    # the multi-GPU protocol (benchmarks/multigpu/steps.py) releases the
                    # cache after the warm-ups: what building the unsharded model left cached
                    alloc.empty_cache()
                if pool is not None:
                    alloc.empty_cache()
                if last:
                    alloc.reset_peaks()
            most = self._most(first) if alloc.watch is not None else None
            for k in range(lo, len(ops)):
                at, allocs, stream, blocks, frees = ops[k]
                self.at = at
                inside = "compute"  # the pool of what an op allocates inside itself
                if pool is not None and at >= pool:
                    stream = inside = CUDA_GRAPH_POOL
                if most is not None:  # watching for where another budget parts
                    if self.pending is not None:
                        self._parted()
                        if alloc.watch is None:
                            most = None
                    if most is not None and alloc.reserved + most[k] > alloc.watch:
                        alloc.parted = False
                        self.pending = self._copy(step, k)
                if first and at == self.first_opt:
                    for sid in self.lazy:
                        self._malloc(sid)
                if hook is not None:
                    hook(nodes[at])
                # an op's allocations (a storage that outlived the previous step is
                # replaced by this step's; what a previous step left is not there in the
                # first), in the pool of the stream that allocates it
                for sid, nbytes, survives, carried in allocs:
                    if carried and first:
                        continue
                    if survives and sid in handles:
                        free(handles.pop(sid))
                    if nbytes > 0:
                        h = handles[sid] = malloc(nbytes, stream)
                        sizes[sid] = block_size(h)
                if first and at in self.ws_at:  # a BLAS handle's workspace, kept
                    for b in self.ws_at[at]:
                        self.ws_bytes += block_size(malloc(b))
                if blocks:  # its scratch, allocated and freed while it runs
                    got = [malloc(b, inside) for b in blocks]
                    during = alloc.allocated
                    scratch[at] = sum(block_size(h) for h in got)
                    for h in got:
                        free(h)
                else:
                    during = alloc.allocated
                    scratch[at] = 0
                for sid in frees:
                    if sid in handles:
                        free(handles.pop(sid))
                if last:
                    timeline.append(during)
            self._parted()

    def _most(self, first: bool) -> list[int]:
        """Per op: the most its requests can add to the reserved bytes (each a new
        segment), in the first step (its lazy optimizer states and BLAS workspaces too) or
        a later one."""
        key = "first" if first else "later"
        if key in self._bounds:
            return self._bounds[key]
        seg: dict[int, int] = {}  # request bytes -> its segment's (a step repeats sizes)

        def most(sizes) -> int:
            n = 0
            for b in sizes:
                got = seg.get(b)
                if got is None:
                    got = seg[b] = segment_size(round_size(b)) if b > 0 else 0
                n += got
            return n

        if not first:
            out = [
                most(b for _, b, _, _ in allocs) + most(blocks) if allocs or blocks else 0
                for _, allocs, _, blocks, _ in self.ops
            ]
        else:
            out = list(self._most(False))
            st = self.graph.storages
            for k, (at, *_) in enumerate(self.ops):
                if at in self.ws_at:
                    out[k] += most(self.ws_at[at])
                if at == self.first_opt:
                    out[k] += most(st[s].nbytes for s in self.lazy)
        self._bounds[key] = out
        return out

    def _malloc(self, sid: int, stream: str = "compute") -> None:
        if self.graph.storages[sid].nbytes > 0:
            h = self.handles[sid] = self.alloc.malloc(self.graph.storages[sid].nbytes, stream)
            self.sizes[sid] = self.alloc.block_size(h)


def process_budget(gpu: GpuSpec, cal: Calibration | None = None) -> int:
    """Bytes the caching allocator may reserve on `gpu`: the device memory CUDA reports (the
    calibration's measured total where it has one, else the spec's) minus what the process
    holds outside the allocator (CUDA_CONTEXT_BYTES, measured on an H100)."""
    total = (cal.device_memory if cal else None) or gpu.memory_bytes
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


_MATMULS = {"mm", "bmm", "addmm", "baddbmm", "addbmm", "addmv", "mv", "dot"}


def step_memory(
    graph: StepGraph, gpu: GpuSpec, cal: Calibration | None, tables: Calibration | None = None
) -> MemoryResult:
    """The step's memory on `gpu`: the graph's tensors, the BLAS workspaces, and what
    convolutions, attention kernels, reductions and LayerNorms allocate inside themselves
    (their sizes per op come from `cost.conv`, `cost.attention_scratch`, `cost.reduce_scratch`
    and `cost.norm_scratch`) and what a compiled matmul pads (`cost.pad_mm`),
    replayed through the caching allocator against the memory CUDA leaves the process.
    The workspaces' sizes come from `tables` where given (`Target.memory_cal`: where `gpu`
    has no calibration, its chip's), else from `cal`."""
    tables = tables if tables is not None else cal
    return simulate(
        graph,
        workspace=blas_workspace_ops(graph, gpu, tables),
        scratch=step_scratch(graph, tables),
        budget=process_budget(gpu, cal),
    )


def step_scratch(graph: StepGraph, cal: Calibration | None) -> dict[int, tuple[int, ...]]:
    """{op index: blocks} every op of the step allocates and frees inside itself."""
    optim = {n.index: b for n in graph.nodes if (b := adam8bit_scratch(n))}
    return merge_scratch(
        conv.scratch(graph, cal),
        attention_scratch.scratch(graph),
        reduce_scratch.scratch(graph),
        norm_scratch.scratch(graph),
        pad_mm.scratch(graph),
        optim,
    )


def merge_scratch(*parts: Scratch) -> dict[int, tuple[int, ...]]:
    """{op index: blocks} of several scratch tables, an op's blocks in the order given."""
    out: dict[int, tuple[int, ...]] = {}
    for part in parts:
        for i, v in part.items():
            out[i] = out.get(i, ()) + _blocks(v)
    return out


def blas_workspace(graph: StepGraph, gpu: GpuSpec, cal: Calibration | None) -> int:
    """Bytes the BLAS handles keep allocated once the step has run (`blas_workspaces`)."""
    return sum(blas_workspaces(graph, gpu, cal))


def blas_workspaces(graph: StepGraph, gpu: GpuSpec, cal: Calibration | None) -> tuple[int, ...]:
    """The BLAS workspaces the step leaves allocated, one allocation each, in bytes. cuBLAS
    keeps one workspace per handle, and handles are per thread: the main thread's (forward,
    optimizer) and the autograd engine's (backward, recompute) each get one once they run a
    matmul. cuBLASLt adds its own after an addmm (a Linear with a bias takes the Lt path)."""
    blas = cal.blas_workspace if cal and cal.blas_workspace is not None else gpu.blas_workspace
    lt = cal.blaslt_workspace if cal and cal.blaslt_workspace is not None else gpu.blaslt_workspace
    main = {n.name for n in graph.nodes if n.phase in ("forward", "optimizer")}
    engine = {n.name for n in graph.nodes if n.phase in ("backward", "recompute")}
    return tuple(
        b
        for b, used in (
            (blas, main & _MATMULS),
            (blas, engine & _MATMULS),
            (lt, "addmm" in main | engine),
        )
        if used and b
    )


def blas_workspace_ops(
    graph: StepGraph, gpu: GpuSpec, cal: Calibration | None
) -> tuple[tuple[int, int], ...]:
    """`blas_workspaces` as (bytes, op index): each is allocated by the first op that needs it,
    in step 1, right after that op's outputs (cuBLAS creates a handle's workspace lazily; the
    allocator traces of the zoo's steps show the main thread's at the forward's first matmul,
    cuBLASLt's at the first addmm, the autograd engine's at the backward's first matmul)."""
    blas = cal.blas_workspace if cal and cal.blas_workspace is not None else gpu.blas_workspace
    lt = cal.blaslt_workspace if cal and cal.blaslt_workspace is not None else gpu.blaslt_workspace
    first: dict[str, int] = {}
    for n in graph.nodes:
        name = n.name
        if name not in _MATMULS:
            continue
        main = n.phase in ("forward", "optimizer")
        for key, hit in (("main", main), ("engine", not main), ("lt", name == "addmm")):
            if hit:
                first.setdefault(key, n.index)
    size = {"main": blas, "engine": blas, "lt": lt}
    return tuple(
        sorted(
            ((size[k], first[k]) for k in ("main", "engine", "lt") if k in first and size[k]),
            key=lambda w: w[1],
        )
    )
