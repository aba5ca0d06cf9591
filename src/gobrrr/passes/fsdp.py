"""FSDP2 (`torch.distributed.fsdp.fully_shard`) as a graph pass: one rank's step.

The input is the one-GPU step traced with precision "bf16" (FSDP2's
`MixedPrecisionPolicy(param_dtype=bf16)` computes in bf16 without autocast; that trace holds
bf16 weights, bf16 gradients made by the backward ops, bf16 AdamW states). The pass re-types
and re-times what FSDP2 (`_fsdp_param.py`, `_fsdp_param_group.py`, `_fsdp_collectives.py`)
allocates on one rank, with `reduce_dtype=fp32`:

- persistent: each parameter's dim-0 shard in fp32, padded so dim 0 divides by `world`
  (ceil(d0 / world) rows; one allocation per parameter); AdamW's states on the shards (fp32,
  rank 0's chunk, the largest); the optimizer's temporaries at shard size in fp32.
- per unit and gather (`foreach_all_gather`, `foreach_all_gather_copy_out`): the shards cast
  to bf16 into one flat copy-in buffer; the all-gather output (world x that, bf16), the copy-in
  buffer then freed; the all-gather; the copy-out into one padded unsharded bf16 buffer per
  parameter (what the ops read), the all-gather output then freed.
- forward: each unit is gathered right before its first op (no forward prefetch by default)
  and, with reshard_after_forward, freed after its last (the root: after the model's last
  op, before the loss). Passed explicitly, the flag holds for the root too; left to
  fully_shard's default (None), the root keeps its parameters to backward (FSDP2's lazy
  init turns resharding off for a root whose flag was not given).
- backward: the default backward prefetch: at a unit's pre-backward (its first backward or
  recompute op) its copy-out runs, then the next unit in backward order issues its all-gather
  (copy-in and all-gather output), so that unit's all-gather output coexists with this unit's
  backward. The root's pre-backward (the first backward op inside the model) gathers the
  root again if it resharded, then prefetches the last block.
- post-backward (after the unit's last backward op that makes or adds a gradient): its
  unsharded parameters freed (reshard_after_backward); the previous unit's reduce-scatter
  input freed (one kept in flight, `reduce_scatter_max_input_buffers` = 1); the reduce-scatter
  input allocated (fp32, world x padded shard), the unsharded bf16 gradients copied in and
  freed; the reduce-scatter output (fp32 shard) allocated: the sharded gradients are views of
  it, alive until zero_grad. The root's post-backward is the last (autograd's final
  callback), which also drops the last reduce-scatter input.
- accumulation (`set_requires_gradient_sync(False)` on every micro-batch but the last; the
  graph made by `passes.accumulate`): a micro-batch without sync casts each unit's bf16
  gradients to unsharded fp32 ones at its post-backward (`to_accumulated_grad_if_needed`),
  the next adds into them; the last reduce-scatters those. The accumulated graph's second
  micro-batch stands for n - 1 runs and is modelled as the synced last one: its collectives
  are exact for n = 2 and counted n - 1 times for larger n.

HSDP (`hsdp=True`: fully_shard on a 2-D mesh (hosts, ranks per host), torchtitan's
data_parallel_replicate_degree = hosts and data_parallel_shard_degree = ranks per host): every
parameter, gradient and state is sharded over the ranks of ONE host (ceil(d0 / per_host) rows),
the all-gathers and reduce-scatters run within the host; after each unit's reduce-scatter
(`foreach_reduce`) its fp32 output, the sharded gradients, is all-reduced in place across the
hosts (the replicate group: one rank a host, the network), and the optimizer waits for it
(`finalize_backward`). That all-reduce needs no buffer of its own: it reduces the
reduce-scatter output, which FSDP2 keeps (`AllReduceState`) and the gradients view until
zero_grad. FSDP2 runs it on a stream of its own, beside the all-gathers and reduce-scatters;
here it is on the one comm stream after its reduce-scatter (the intra-host collectives queue
behind it: an upper bound on their delay). Without sync (accumulation) HSDP neither
reduce-scatters nor all-reduces, as FSDP.

Collectives are ops on the "comm" stream with their whole buffers as inputs and outputs:
`c10d._allgather_base_.default` (output: world x shard, bf16),
`c10d._reduce_scatter_base_.default` (input: world x shard, fp32) and, under HSDP,
`c10d.allreduce_.default` (the fp32 shard, across hosts). Their group is the node's
`args[0]` (ranks); `meta.parallel` ("fsdp" or "hsdp") says which link each crosses.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from gobrrr.errors import GobrrrError, did_you_mean
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo, evolve, itemsize
from gobrrr.graph.meta import Parallel, Repeat
from gobrrr.passes import gc_paused

ROOT = ""  # the root unit: fully_shard(model), every parameter no other unit holds
PARAM_DTYPE = "bfloat16"
REDUCE_DTYPE = "float32"
SHARD_DTYPE = "float32"
ALL_GATHER = "c10d._allgather_base_.default"
HOOKS = "fsdp.hooks.default"
REDUCE_SCATTER = "c10d._reduce_scatter_base_.default"
ALL_REDUCE = "c10d.allreduce_.default"  # HSDP's, across hosts
_BWD = ("backward", "recompute")
# FSDP2's side streams (the all-gather's copy-in stream allocates its input and output, the
# reduce-scatter stream the sharded gradients) are "comm" here; the allocator replay keeps
# the blocks of each stream in its own pool
COMM = "comm"


@dataclass
class Param:
    """One parameter: its storage, name, whole shape and unit."""

    sid: int
    name: str
    shape: tuple[int, ...]
    unit: str
    grad: int | None = None  # its gradient's storage in the traced graph

    def shard_shape(self, world: int) -> tuple[int, ...]:
        """FSDP2's padded dim-0 shard: ceil(d0 / world) rows."""
        if not self.shape:
            return (1,)
        return (-(-self.shape[0] // world), *self.shape[1:])

    def shard_numel(self, world: int) -> int:
        return math.prod(self.shard_shape(world))

    @property
    def numel(self) -> int:
        return math.prod(self.shape)


@dataclass
class Unit:
    """One fully_shard unit in one micro-batch: its op positions (original indices)."""

    name: str
    params: list[Param]
    fwd_first: int = -1
    fwd_last: int = -1
    bwd_first: int = -1
    post: int = -1  # the op after which its post-backward runs
    forward: _Gather | None = None  # its forward's gather


@dataclass
class _Plan:
    """What the pass inserts and changes, keyed by original op index."""

    graph: StepGraph
    world: int  # the ranks each parameter is sharded over (one host's under HSDP)
    storages: list[StorageInfo]
    replicas: int = 1  # HSDP: the hosts the shards are replicated over (all-reduced across)
    before: dict[int, list[OpNode]] = field(default_factory=dict)
    after: dict[int, list[OpNode]] = field(default_factory=dict)
    extra_frees: dict[int, list[int]] = field(default_factory=dict)
    drop_frees: set[int] = field(default_factory=set)
    dropped: set[int] = field(default_factory=set)  # traced ops FSDP2 does not run
    # op -> {storage it reads: the storage (or the whole view) it reads instead}
    remap: dict[int, dict[int, TensorInfo | int]] = field(default_factory=dict)
    # ids of the maps in `remap` that several ops share (a unit's, `_read`): copied by `own`
    # before one op's is changed
    shared: set[int] = field(default_factory=set)

    def new_storage(self, nbytes: int, kind: str, label: str, module: str) -> int:
        sid = len(self.storages)
        self.storages.append(StorageInfo(sid, nbytes, kind, 0, None, label, module))
        return sid

    def own(self, i: int) -> dict[int, TensorInfo | int]:
        """Op i's map in `remap`, its own to change (made, or copied where it is shared)."""
        m = self.remap.get(i)
        if m is None:
            m = self.remap[i] = {}
        elif id(m) in self.shared:
            m = self.remap[i] = m.copy()
        return m

    def op(self, at: dict[int, list[OpNode]], i: int, *nodes: OpNode) -> None:
        at.setdefault(i, []).extend(nodes)


def fsdp(
    graph: StepGraph,
    world: int,
    hosts: int = 1,
    reshard_after_forward: bool | None = True,
    units: Sequence[str] | None = None,
    hsdp: bool = False,
    sync_each: bool = False,
) -> StepGraph:
    """One rank's step of `graph` (traced with precision "bf16") under FSDP2 over `world`
    ranks on `hosts` hosts: every unit in `units` (default: the repeated blocks,
    `graph.meta.blocks`, as torchtitan wraps each decoder layer) and the root sharded, with
    param_dtype bf16 and reduce_dtype fp32 (see the module docstring). reshard_after_forward
    as passed to every fully_shard call, the root's included (as torchtitan passes it);
    None: fully_shard's default, True for the units and False for the root.

    hsdp: False, sharded over all `world` ranks (the collectives span the hosts); True, HSDP:
    sharded over each host's world / hosts ranks and replicated across the `hosts` hosts
    (needs hosts > 1).

    sync_each: under accumulation, the gradients are reduce-scattered on every micro-batch
    (FSDP2's default; torchtitan's accumulation), each later micro-batch's sharded gradients
    added into the first's, instead of held unsharded in fp32 until the last
    (`set_requires_gradient_sync(False)` on the others): less memory, a reduce-scatter per
    micro-batch."""
    _check(graph, world, hosts, hsdp)
    names = _unit_names(graph, units)
    shards = world // hosts if hsdp else world
    with gc_paused():
        params = _params(graph, names)
        plan = _Plan(graph, shards, list(graph.storages), replicas=hosts if hsdp else 1)
        _reshape_persistent(plan, params)
        rs_outs = _micro_batches(plan, params, names, reshard_after_forward, sync_each)
        _optimizer(plan, params, rs_outs)
        return _assemble(plan, world, hosts, reshard_after_forward, names, sync_each)


def _check(graph: StepGraph, world: int, hosts: int, hsdp: bool = False) -> None:
    if not isinstance(world, int) or world < 1:
        raise GobrrrError(f"fsdp: world must be a positive number of ranks, got {world!r}")
    if hosts < 1 or world % hosts:
        raise GobrrrError(f"fsdp: {world} ranks do not split evenly over {hosts} hosts")
    if hsdp and hosts < 2:
        raise GobrrrError(
            "fsdp: HSDP shards within a host and replicates across hosts: it needs hosts > 1 "
            "(on one host it is plain FSDP, hsdp=False)"
        )
    if graph.meta.parallel is not None:
        raise GobrrrError(
            f"fsdp: the graph is already sharded ({graph.meta.parallel.kind}); "
            "apply the pass to the one-GPU step"
        )
    if graph.meta.precision.name != "bf16":
        raise GobrrrError(
            f"fsdp: the step was traced with precision {graph.meta.precision}; FSDP2 with "
            "param_dtype bf16 computes in bf16 without autocast: trace it with precision 'bf16'"
        )


def _unit_names(graph: StepGraph, units: Sequence[str] | None) -> list[str]:
    """The units: `units` checked against the modules that ran ops (each one of them, none
    inside another), or the repeated blocks (none: a GobrrrError; units=[] asks for the root
    alone)."""
    if units is None:
        if not graph.meta.blocks:
            raise GobrrrError(
                "fsdp: the model has no repeated blocks to shard as FSDP2 units (an "
                "nn.ModuleList or nn.Sequential of two or more modules of one class): name "
                "the units, or use DDP"
            )
        return list(graph.meta.blocks)
    modules = _module_names(graph)
    names = [u for u in units if u]
    for u in names:
        if u not in modules:
            raise GobrrrError(
                f"fsdp: unit {u!r} is not a module that runs in the step"
                f"{did_you_mean(u, sorted(modules))}: name units as model.named_modules() does"
            )
    for a in names:
        for b in names:
            if b != a and b.startswith(a + "."):
                raise GobrrrError(
                    f"fsdp: unit {b!r} lies inside unit {a!r}: nested units are not modelled; "
                    "name one of the two"
                )
    return names


def _module_names(graph: StepGraph) -> set[str]:
    """Every module that ran an op, and the modules holding it."""
    out: set[str] = set()
    for m in {n.module for n in graph.nodes if n.module}:
        parts = m.split(".")
        out.update(".".join(parts[: k + 1]) for k in range(len(parts)))
    return out


# ------------------------------------------------------------------------------ parameters
def _params(graph: StepGraph, units: list[str]) -> dict[int, Param]:
    """{storage: Param} of every parameter, with its whole shape, unit and gradient."""
    shapes: dict[int, tuple[int, ...]] = {}
    sizes = {s.id: s.nbytes for s in graph.storages if s.kind == "parameter"}
    for n in graph.nodes:
        for t in (*n.inputs, *n.outputs):
            if t.storage in sizes and t.storage not in shapes and t.nbytes == sizes[t.storage]:
                if t.is_contiguous() or t.is_dense():
                    shapes[t.storage] = _dense_shape(t)
    out = {}
    for s in graph.storages:
        if s.kind != "parameter":
            continue
        shape = shapes.get(s.id, (s.nbytes // itemsize(PARAM_DTYPE),))
        out[s.id] = Param(s.id, s.label, shape, _unit_of(s.label, units))
    _match_grads(graph, out)
    return out


def _dense_shape(t: TensorInfo) -> tuple[int, ...]:
    """The shape of the tensor the view is a permutation of (a weight's .t() read by mm is
    the weight transposed): dims by decreasing stride."""
    dims = sorted(zip(t.stride, t.shape, strict=True), key=lambda d: -d[0])
    return tuple(sz for _, sz in dims)


def _unit_of(name: str, units: list[str]) -> str:
    best = ROOT
    for u in units:
        if (name == u or name.startswith(u + ".")) and len(u) > len(best):
            best = u
    return best


def _match_grads(graph: StepGraph, params: dict[int, Param]) -> None:
    """Each parameter's gradient storage: by name ("<param>.grad"), then, for a tied
    parameter named otherwise, the one unmatched parameter of the same size."""
    by_name = {p.name: p for p in params.values()}
    grads = [s for s in graph.storages if s.kind == "gradient"]
    left = []
    for g in grads:
        p = by_name.get(g.label.removesuffix(".grad"))
        if p is not None and p.grad is None:
            p.grad = g.id
        else:
            left.append(g)
    for g in left:
        free = [p for p in params.values() if p.grad is None and _bytes(p) == g.nbytes]
        if len(free) != 1:
            raise GobrrrError(f"fsdp: cannot tell which parameter gradient {g.label!r} is for")
        free[0].grad = g.id


def _bytes(p: Param) -> int:
    return p.numel * itemsize(PARAM_DTYPE)


def _reshape_persistent(plan: _Plan, params: dict[int, Param]) -> None:
    """Parameters become their fp32 padded shards (kept as the same storages)."""
    for p in params.values():
        s = plan.storages[p.sid]
        plan.storages[p.sid] = dataclasses.replace(
            s, nbytes=p.shard_numel(plan.world) * itemsize(SHARD_DTYPE)
        )


# --------------------------------------------------------------------------- micro-batches
def _micro_batches(
    plan: _Plan, params: dict[int, Param], names: list[str], reshard: bool, sync_each: bool
) -> dict[str, int]:
    """Gathers, reshards and reductions of every micro-batch; returns {unit: the storage of
    its sharded gradients} (the last micro-batch's reduce-scatter outputs; with sync_each,
    the first's, which the later ones add into)."""
    g = plan.graph
    opt = next((n.index for n in g.nodes if n.phase == "optimizer"), len(g.nodes))
    ranges = [(0, opt)] if g.repeat is None else [(0, g.repeat[0]), (g.repeat[0], g.repeat[1])]
    by_unit: dict[str, list[Param]] = {u: [] for u in (*names, ROOT)}
    for p in params.values():
        by_unit[p.unit].append(p)
    accumulated: dict[int, int] = {}  # param storage -> its unsharded fp32 gradient
    rs_outs: dict[str, int] = {}
    grads = {p.grad: p for p in params.values() if p.grad is not None}
    for m, (lo, hi) in enumerate(ranges):
        units = _positions(g, lo, hi, by_unit, grads)
        sync = sync_each or m == len(ranges) - 1
        _hooks(plan, units, reshard)
        _forward(plan, units, reshard)
        gathered = _backward_gathers(plan, units, reshard)
        if sync_each and m > 0:
            fresh = _fresh_grads(plan, lo, hi, grads)
            _reduce(plan, units, gathered, accumulated, fresh, into=rs_outs)
            continue
        _retarget_adds(plan, lo, hi, grads, accumulated)
        if sync:
            rs_outs = _reduce(plan, units, gathered, accumulated)
        else:
            _to_accumulated(plan, units, gathered, accumulated)
    for p in params.values():  # the traced gradients now die at their unit's post-backward
        if p.grad is not None:
            plan.drop_frees.add(p.grad)
            plan.storages[p.grad] = dataclasses.replace(
                plan.storages[p.grad], kind="temporary", label=f"{p.name}.grad (unsharded)"
            )
    return rs_outs


def _positions(g: StepGraph, lo: int, hi: int, by_unit, grads) -> list[Unit]:
    """The units of one micro-batch (ops lo..hi-1), root first, with their op positions."""
    units = {u: Unit(u, ps) for u, ps in by_unit.items() if ps}
    root = units.get(ROOT) or Unit(ROOT, [])
    units[ROOT] = root
    blocks = [u for u in units.values() if u.name != ROOT]
    owners: dict[str, Unit | None] = {}  # module -> its unit (thousands of ops a module)
    for n in g.nodes[lo:hi]:
        u = owners.get(n.module, _NONE)
        if u is _NONE:
            u = owners[n.module] = _owner(n.module, blocks)
        if n.phase == "forward":
            if n.module and root.fwd_first < 0:
                root.fwd_first = n.index
            if n.module:  # the model's own ops: the loss outside it runs after its post-forward
                root.fwd_last = n.index
            if u is not None:
                u.fwd_first = n.index if u.fwd_first < 0 else u.fwd_first
                u.fwd_last = n.index
        elif n.phase in _BWD:
            if n.module and root.bwd_first < 0:
                root.bwd_first = n.index
            root.post = n.index
            if u is not None:
                u.bwd_first = n.index if u.bwd_first < 0 else u.bwd_first
                u.post = n.index
            for t in n.outputs:  # a gradient made or added into
                if (p := grads.get(t.storage)) is not None and p.unit != ROOT:
                    unit = units[p.unit]
                    unit.post = max(unit.post, n.index)
    for u in units.values():
        if u.fwd_first < 0 or u.bwd_first < 0:
            raise GobrrrError(
                f"fsdp: unit {u.name or '<root>'!r} runs no forward or no backward op; "
                "name units from the graph's meta.blocks"
            )
    return [root, *sorted(blocks, key=lambda u: u.fwd_first)]


_NONE = Unit("", [])  # not looked up yet (None: no unit holds the module)


def _owner(module: str, blocks: list[Unit]) -> Unit | None:
    for u in blocks:
        if module == u.name or module.startswith(u.name + "."):
            return u
    return None


@dataclass
class _Gather:
    """One all-gather of a unit: its unsharded buffers {param storage: buffer storage}."""

    unit: Unit
    bufs: dict[int, int]


def _unshard(plan: _Plan, unit: Unit, issue_at: int, out_at: int, when: str) -> _Gather:
    """FSDP2's unshard: copy-in and all-gather placed before op `issue_at`, copy-out before
    op `out_at` (later ops of the same list come after)."""
    w, ps = plan.world, unit.params
    shard = sum(p.shard_numel(w) for p in ps)
    label = f"{unit.name or '<root>'}"
    mod = unit.name
    ag_in = plan.new_storage(shard * 2, "temporary", f"{label} all-gather input ({when})", mod)
    ag_out = plan.new_storage(shard * w * 2, "temporary", f"{label} all-gather output", mod)
    shards = tuple(_flat(p.sid, p.shard_numel(w), SHARD_DTYPE) for p in ps)
    flat_in = _flat(ag_in, shard, PARAM_DTYPE)
    flat_out = _flat(ag_out, shard * w, PARAM_DTYPE)
    mine = TensorInfo((shard,), (1,), PARAM_DTYPE, ag_out, 0)
    bufs = {
        p.sid: plan.new_storage(
            p.shard_numel(w) * w * 2, "temporary", f"{p.name} (unsharded, {when})", mod
        )
        for p in ps
    }
    unsharded = tuple(
        TensorInfo((w, p.shard_numel(w)), (p.shard_numel(w), 1), PARAM_DTYPE, bufs[p.sid])
        for p in ps
    )
    # the copy-in (the shards cast to bf16) and the all-gather output are allocated on
    # FSDP2's copy-in stream: they run on COMM here, their blocks in its pool
    cast = _node("aten._to_copy.default", mod, shards, (flat_in,), allocs=(ag_in,), stream=COMM)
    copy_in = _node(
        "fsdp.all_gather_copy_in.default",
        mod,
        (flat_in,),
        (flat_out,),
        allocs=(ag_out,),
        frees=(ag_in,),
        stream=COMM,
    )
    gather = _node(ALL_GATHER, mod, (flat_out, mine), (flat_out,), stream=COMM, args=(w,))
    plan.op(plan.before, issue_at, cast, copy_in, gather)
    view = TensorInfo((w, shard), (shard, 1), PARAM_DTYPE, ag_out)
    plan.op(
        plan.before,
        out_at,
        _node(
            "aten.split_with_sizes_copy.out",
            mod,
            (view,),
            unsharded,
            allocs=tuple(bufs.values()),
            frees=(ag_out,),
        ),
    )
    return _Gather(unit, bufs)


def _forward(plan: _Plan, units: list[Unit], reshard: bool | None) -> None:
    """Each unit gathered before its first forward op; blocks freed after their last one
    (reshard_after_forward), the root kept. (Units run in forward order: the root first.)"""
    for u in units:
        ga = _unshard(plan, u, u.fwd_first, u.fwd_first, "forward")
        u.forward = ga
        _read(plan, u.params, ga, u.fwd_first, u.fwd_last, ("forward",))
        if _reshards(u, reshard):
            plan.extra_frees.setdefault(u.fwd_last, []).extend(ga.bufs.values())


def _hooks(plan: _Plan, units: list[Unit], reshard: bool | None) -> None:
    """FSDP2's Python around each unit, host time only (`cost.dp_host`): the forward's
    before its gather, the backward's after its last backward op (before its
    reduce-scatter's copy-in); measured per unit and phase, as one op each."""
    for u in units:
        n, rs = len(u.params), _reshards(u, reshard)
        if u.fwd_first >= 0:
            hook = _node(HOOKS, u.name, (), (), args=("forward", n, rs))
            plan.op(plan.before, u.fwd_first, hook)
        if u.post >= 0:
            plan.op(plan.after, u.post, _node(HOOKS, u.name, (), (), args=("backward", n, rs)))


def _reshards(u: Unit, reshard: bool | None) -> bool:
    """Whether the unit frees its parameters after forward: None is fully_shard's default,
    True for every unit but the root (whose parameters backward needs first)."""
    return (u.name != ROOT) if reshard is None else reshard


def _backward_gathers(plan: _Plan, units: list[Unit], reshard: bool | None) -> dict[str, _Gather]:
    """The gathers backward reads: with reshard, each block gathered again, its all-gather
    issued at the pre-backward of the unit before it in backward order (the root first),
    its copy-out at its own; without, the forward's."""
    order = [units[0], *sorted(units[1:], key=lambda u: u.bwd_first)]
    gathered: dict[str, _Gather] = {}
    for k, u in enumerate(order):
        if not _reshards(u, reshard):
            ga = u.forward
        elif u.name == ROOT:  # gathered at its pre-backward, before it prefetches the next
            ga = _unshard(plan, u, u.bwd_first, u.bwd_first, "backward")
        else:
            ga = _unshard(plan, u, order[k - 1].bwd_first, u.bwd_first, "backward")
        gathered[u.name] = ga
        _read(plan, u.params, ga, u.bwd_first, u.post, _BWD)
    return gathered


def _read(plan, ps: list[Param], ga: _Gather, lo: int, hi: int, phases) -> None:
    """The unit's ops lo..hi of those phases read its parameters from the gather's buffers
    (any op of the phase in the micro-batch: a tied weight read outside its unit's span)."""
    bufs = {p.sid: ga.bufs[p.sid] for p in ps}
    nodes, remap = plan.graph.nodes, plan.remap
    plan.shared.add(id(bufs))
    for i in range(lo, hi + 1):
        if nodes[i].phase in phases:
            m = remap.get(i)
            if m is None:  # most ops: the unit's map, shared (`own` copies it to change it)
                remap[i] = bufs
            else:  # what an earlier unit or phase mapped stays
                m = plan.own(i)
                for sid, buf in bufs.items():
                    m.setdefault(sid, buf)


def _retarget_adds(plan: _Plan, lo: int, hi: int, grads, accumulated: dict[int, int]) -> None:
    """A later micro-batch's `grad += new` (passes.accumulate) adds into the unsharded fp32
    gradient FSDP2 accumulates in."""
    for n in plan.graph.nodes[lo:hi]:
        if n.name == "add_" and n.inputs and (p := grads.get(n.inputs[0].storage)) is not None:
            acc = accumulated.get(p.sid)
            if acc is not None:
                view = dataclasses.replace(n.inputs[0], storage=acc, dtype=REDUCE_DTYPE)
                plan.own(n.index)[p.grad] = view


def _fresh_grads(plan: _Plan, lo: int, hi: int, grads) -> dict[int, int]:
    """A later micro-batch synced on its own: its `grad += new` (passes.accumulate) does not
    run, the earlier unsharded gradient being gone; `new` is what is reduce-scattered.
    Returns {parameter storage: its new gradient's storage}."""
    fresh = {}
    for n in plan.graph.nodes[lo:hi]:
        if n.name == "add_" and len(n.inputs) > 1 and (p := grads.get(n.inputs[0].storage)):
            fresh[p.sid] = n.inputs[1].storage
            plan.dropped.add(n.index)
    return fresh


def _to_accumulated(plan: _Plan, units: list[Unit], gathered, accumulated) -> None:
    """A micro-batch without gradient sync: at each unit's post-backward its parameters are
    resharded and each bf16 gradient cast to an unsharded fp32 one (the bf16 one freed)."""
    for u in units:
        plan.extra_frees.setdefault(u.post, []).extend(gathered[u.name].bufs.values())
        for p in u.params:
            if p.grad is None:
                continue
            acc = plan.new_storage(
                p.numel * itemsize(REDUCE_DTYPE),
                "gradient",
                f"{p.name}.grad (accumulated)",
                u.name,
            )
            accumulated[p.sid] = acc
            src = TensorInfo(p.shape, _contiguous(p.shape), PARAM_DTYPE, p.grad)
            dst = TensorInfo(p.shape, _contiguous(p.shape), REDUCE_DTYPE, acc)
            plan.op(
                plan.after,
                u.post,
                _node(
                    "aten._to_copy.default", u.name, (src,), (dst,), allocs=(acc,), frees=(p.grad,)
                ),
            )


def _reduce(
    plan: _Plan,
    units: list[Unit],
    gathered,
    accumulated,
    fresh: dict[int, int] | None = None,
    into: dict[str, int] | None = None,
) -> dict[str, int]:
    """The synced micro-batch's post-backwards, in backward order (the root last): reshard,
    the previous reduce-scatter input freed, copy-in (the unsharded gradients freed), the
    reduce-scatter into the unit's sharded gradients. `fresh`: {parameter: the gradient
    storage to reduce instead of its traced one}; `into`: {unit: sharded gradients} a later
    micro-batch's reduce-scatter output is added into (then freed), as FSDP2 accumulates
    sharded gradients."""
    fresh = fresh or {}
    w = plan.world
    order = sorted(units[1:], key=lambda u: u.post) + [units[0]]
    # the blocks' post-backwards in backward order, each after its own last op; the root's
    # runs in autograd's final callback, after them all, even where the last backward op is
    # a block's (a root holding only the head: its gradients are made first)
    posts = [u.post for u in order[:-1]]
    if (
        posts != sorted(posts)
        or len(set(posts)) != len(posts)
        or order[-1].post < max(posts, default=-1)
    ):
        raise GobrrrError("fsdp: units' backward spans overlap; cannot order post-backwards")
    prev: int | None = None
    outs = {}
    for u in order:
        ps = [p for p in u.params if p.grad is not None]
        frees = plan.extra_frees.setdefault(u.post, [])
        frees.extend(gathered[u.name].bufs.values())
        if prev is not None:
            frees.append(prev)
        if not ps:
            continue
        shard = sum(p.shard_numel(w) for p in ps)
        rs_in = plan.new_storage(
            shard * w * 4, "temporary", f"{u.name or '<root>'} reduce-scatter input", u.name
        )
        adds = into is not None and u.name in into
        rs_out = plan.new_storage(
            shard * 4,
            "temporary" if adds else "gradient",
            f"{u.name or '<root>'} sharded grads{' (this micro-batch)' if adds else ''}",
            u.name,
        )
        srcs, dead = [], []
        for p in ps:
            acc = accumulated.get(p.sid)
            sid, dt = (acc, REDUCE_DTYPE) if acc is not None else (p.grad, PARAM_DTYPE)
            sid = fresh.get(p.sid, sid)
            srcs.append(TensorInfo(p.shape, _contiguous(p.shape), dt, sid))
            dead.append(sid)
        flat_in = _flat(rs_in, shard * w, REDUCE_DTYPE)
        flat_out = _flat(rs_out, shard, REDUCE_DTYPE)
        last = u is order[-1]
        plan.op(
            plan.after,
            u.post,
            _node(
                "aten._chunk_cat.default",
                u.name,
                tuple(srcs),
                (flat_in,),
                allocs=(rs_in,),
                frees=tuple(dead),
            ),
        )
        plan.op(
            plan.after,
            u.post,
            _node(
                REDUCE_SCATTER,
                u.name,
                (flat_out, flat_in),
                (flat_out,),
                allocs=(rs_out,),
                stream=COMM,
                args=(w,),
                frees=(rs_in,) if last else (),
            ),
        )
        if plan.replicas > 1:  # HSDP: the shard all-reduced in place across the hosts
            ar = _node(ALL_REDUCE, u.name, (flat_out,), (flat_out,), stream=COMM)
            plan.op(plan.after, u.post, dataclasses.replace(ar, args=(plan.replicas,)))
        if adds:  # sharded_param.grad += the new shard, on the reduce-scatter's stream
            acc_out = _flat(into[u.name], shard, REDUCE_DTYPE)
            add = _node(
                "aten.add_.Tensor", u.name, (acc_out, flat_out), (acc_out,), frees=(rs_out,)
            )
            plan.op(plan.after, u.post, dataclasses.replace(add, stream=COMM))
        prev, outs[u.name] = rs_in, rs_out
    return outs


# ------------------------------------------------------------------------------- optimizer
def _optimizer(plan: _Plan, params: dict[int, Param], rs_outs: dict[str, int]) -> None:
    """The optimizer steps the fp32 shards: its bf16 tensors become fp32 dim-0 shards (states
    and temporaries resized), gradients the views of their unit's reduce-scatter output; the
    zero_grad that freed the gradients frees those outputs."""
    w, g = plan.world, plan.graph
    grad_view: dict[int, TensorInfo] = {}
    for unit, out in rs_outs.items():
        off = 0
        for p in (p for p in params.values() if p.unit == unit and p.grad is not None):
            shape = p.shard_shape(w)
            grad_view[p.grad] = TensorInfo(shape, _contiguous(shape), SHARD_DTYPE, out, off)
            off += p.shard_numel(w)
    resized: set[int] = set()
    zeroed = False
    for n in g.nodes:
        if n.phase != "optimizer":
            continue
        m = plan.own(n.index)
        for t in (*n.inputs, *n.outputs):
            if t.storage in grad_view:
                m[t.storage] = grad_view[t.storage]
            elif t.dtype == PARAM_DTYPE:
                m[t.storage] = _sharded(t, w)
                s = plan.storages[t.storage]
                if t.storage not in params and t.storage not in resized and s.nbytes:
                    resized.add(t.storage)
                    plan.storages[t.storage] = dataclasses.replace(s, nbytes=_sharded(t, w).nbytes)
        if not zeroed and any(sid in grad_view for sid in n.frees):  # zero_grad
            plan.extra_frees.setdefault(n.index, []).extend(rs_outs.values())
            zeroed = True
    for s in g.storages:  # states no optimizer op touched (none in AdamW) keep their size
        if s.kind == "optimizer_state" and s.id not in resized and s.nbytes:
            plan.storages[s.id] = dataclasses.replace(s, nbytes=_shard_bytes(s.nbytes, w))


def _sharded(t: TensorInfo, world: int) -> TensorInfo:
    shape = (-(-t.shape[0] // world), *t.shape[1:]) if t.shape else ()
    return TensorInfo(shape, _contiguous(shape), SHARD_DTYPE, t.storage, 0)


def _shard_bytes(nbytes: int, world: int) -> int:
    return -(-nbytes // world) * itemsize(SHARD_DTYPE) // itemsize(PARAM_DTYPE)


# --------------------------------------------------------------------------------- assembly
def _assemble(
    plan: _Plan, world: int, hosts: int, reshard: bool, names: list[str], sync_each: bool = False
) -> StepGraph:
    g = plan.graph
    nodes: list[OpNode] = []
    at: dict[int, int] = {}  # original op -> its new index
    first: dict[int, int] = {}  # original op -> the new index of the first op placed for it
    for n in g.nodes:
        first[n.index] = len(nodes)
        phase = "forward" if n.phase == "forward" else "backward"
        for x in plan.before.get(n.index, ()):
            nodes.append(evolve(x, index=len(nodes), phase=phase))
        at[n.index] = len(nodes)
        if n.index not in plan.dropped:
            nodes.append(_moved(plan, n, len(nodes)))
        for x in plan.after.get(n.index, ()):
            nodes.append(evolve(x, index=len(nodes), phase=phase))
    first[len(g.nodes)] = len(nodes)
    made = {sid: x.index for x in nodes for sid in x.allocs}
    died = {sid: x.index for x in nodes for sid in x.frees}
    storages = []
    for s in plan.storages:
        c = made.get(s.id, at[s.created] if s.created >= 0 else s.created)
        f = died.get(s.id, at[s.freed] if s.freed is not None and s.freed >= 0 else s.freed)
        if s.id in plan.drop_frees and s.id not in died:
            f = None
        same = c == s.created and f == s.freed
        storages.append(s if same else evolve(s, created=c, freed=f))
    meta = g.meta.with_ops_moved(lambda i: at[i])
    repeat = g.meta.repeat
    if repeat is not None:
        repeat = Repeat(first[repeat.start], first[repeat.end], repeat.times)
    record = {
        "pass": "fsdp",
        "world": world,
        "hosts": hosts,
        "reshard_after_forward": reshard,
        "units": names,
    }
    hsdp = plan.replicas > 1
    if hsdp:
        record.update(hsdp=True, shard=plan.world)
    if sync_each:
        record.update(sync_each=True)
    meta = meta.with_pass(
        record, parallel=Parallel("hsdp" if hsdp else "fsdp", world, hosts), repeat=repeat
    )
    return StepGraph(nodes=tuple(nodes), storages=tuple(storages), meta=meta)


def _moved(plan: _Plan, n: OpNode, index: int) -> OpNode:
    """`n` at `index`, reading what the pass remapped, freeing what it moved here (`evolve`:
    the pass copies every op of the step)."""
    m = plan.remap.get(n.index)
    frees, extra = n.frees, plan.extra_frees.get(n.index)
    if frees or extra:
        kept = [s for s in frees if s not in plan.drop_frees]
        frees = tuple(dict.fromkeys(kept + extra if extra else kept))
    else:
        frees = ()
    ins, outs = n.inputs, n.outputs
    if m:

        def t(x: TensorInfo) -> TensorInfo:
            r = m.get(x.storage)
            if r is None:
                return x
            if isinstance(r, TensorInfo):
                return r
            return evolve(x, storage=r)

        ins, outs = tuple(t(x) for x in ins), tuple(t(x) for x in outs)
    return evolve(n, index=index, inputs=ins, outputs=outs, frees=frees)


def _node(op, module, inputs, outputs, allocs=(), frees=(), stream="compute", args=()):
    """An op FSDP2 runs (index and phase set where `_assemble` places it)."""
    return OpNode(
        index=-1,
        op=op,
        phase="fsdp",
        module=module,
        inputs=tuple(inputs),
        outputs=tuple(outputs),
        args=tuple(args),
        allocs=tuple(allocs),
        frees=tuple(frees),
        stream=stream,
    )


def _flat(sid: int, numel: int, dtype: str) -> TensorInfo:
    return TensorInfo((numel,), (1,), dtype, sid)


def _contiguous(shape: tuple[int, ...]) -> tuple[int, ...]:
    out, acc = [], 1
    for s in reversed(shape):
        out.append(acc)
        acc *= s
    return tuple(reversed(out))
