"""`evaluate`: one step graph on one GPU -> its time and memory (an `Estimate`).

Everything that turns a graph into numbers goes through `evaluate`: `gobrrr estimate` (capture
and evaluate), `profile --compare`, the planner (which evaluates hundreds of graphs made by
passes from one trace) and the benchmarks. The GPU spec and its calibration are resolved once,
into a `Target`. It runs as named stages:

    costs     each op's FLOPs, bytes and launches (`op_costs`, cost/flops.py)
    times     each op's roofline time on the GPU (`op_times`, cost/roofline.py)
    schedule  the ops on the host and the GPU's streams (`step_schedule`, schedule/)
    power     the power limit's fixed point over the schedule (schedule/power.py)
    memory    the allocation replay (memory/replay.py)

Rendering an `Estimate` (JSON) is `gobrrr.report.estimate`; what it advises,
`gobrrr.report.advice`.
"""

from __future__ import annotations

import functools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gobrrr import formulas
from gobrrr.cost._ops_comm import COLLECTIVE_OF, HOOK_KIND
from gobrrr.cost._ops_comm import KIND as COMM_KIND
from gobrrr.cost._ops_common import tf32_of
from gobrrr.cost._ops_offload import KINDS as OFFLOAD_KINDS
from gobrrr.cost.collectives import parallel_time
from gobrrr.cost.contention import Contention
from gobrrr.cost.cudagraph import graphed_times
from gobrrr.cost.dp_host import hook_host_s, rank_skew
from gobrrr.cost.flops import OpCost, op_cost
from gobrrr.cost.rates import Rates
from gobrrr.cost.roofline import (
    OpTime,
    compiled_times,
    model_flops,
    model_flops_6n,
    optimizer_host,
    time_op,
)
from gobrrr.cost.shapes import checkpointed_modules, host_key, selective_modules
from gobrrr.graph.ir import StepGraph, evolve
from gobrrr.hardware import Calibration, GpuSpec, Target
from gobrrr.memory.replay import MemoryResult, round_alloc, step_memory
from gobrrr.memory.trainable import Trainable, trainable
from gobrrr.schedule.contention import contended
from gobrrr.schedule.power import power_limited
from gobrrr.schedule.scheduler import Timeline, exposed_comm, scheduler
from gobrrr.schedule.streams import COMM, stream_of


def evaluate(
    graph: StepGraph,
    target: str | GpuSpec | Target = "h100",
    *,
    compiled: bool | None = None,
    capture_s: float = 0.0,
    memory: MemoryResult | None = None,
    memo: dict | None = None,
) -> Estimate:
    """The step's memory (allocation replay through the caching allocator, against the
    memory CUDA leaves the process) and time (per-op roofline and the host/GPU schedule) on
    `target`. compiled: the model's forward and backward run under torch.compile; None =
    as the graph was captured (meta.compiled: `capture(compile=True)`, whose graph holds
    the compiled step's own tensors). True on an eager trace: the eager step's memory (an
    upper bound) with the compiled time model. memory: this graph's `step_memory` on this
    target where the caller already replayed it (the planner replays memory first). memo: a
    dict the caller keeps for graphs it evaluates on this one target (the planner's
    candidates, made by passes from a few traces): each distinct op is costed once in it
    (`_per_op`)."""
    t = Target.resolve(target)
    time = step_time(graph, t, compiled=compiled, memo=memo)
    if compiled is None:
        compiled = bool(graph.meta.compiled)
    return Estimate(
        graph=graph,
        gpu=t.gpu,
        memory=memory if memory is not None else step_memory(graph, t.gpu, t.cal, t.memory_cal),
        time=time,
        cal=t.cal,
        memory_cal=t.memory_cal,
        formulas=closed_forms(graph),
        capture_s=capture_s,
        compiled=compiled,
    )


def step_time(
    graph: StepGraph,
    target: str | GpuSpec | Target = "h100",
    *,
    compiled: bool | None = None,
    memo: dict | None = None,
) -> Prediction:
    """`evaluate`'s time alone, without its memory replay (seconds; the same Prediction):
    for a caller that reads only the ops' times (the planner's per-block recompute costs)."""
    if compiled is None:
        compiled = bool(graph.meta.compiled)
    t = Target.resolve(target)
    return predict(graph, t.gpu, t.cal, compiled=compiled, memo=memo)


def predict(
    graph: StepGraph,
    gpu: GpuSpec,
    calibration: Calibration | None = None,
    compiled: bool = False,
    memo: dict | None = None,
) -> Prediction:
    """The step's time on `gpu`: the stages costs -> times -> schedule -> power. `compiled`:
    the model runs under torch.compile (forward and backward fused by Inductor; the
    optimizer stays eager). `memo`: see `evaluate`."""
    rates = Rates(gpu, calibration)
    if memo is None:
        costs = op_costs(graph)
        ops = op_times(graph, costs, rates, compiled)
    else:
        costs, ops = _per_op(graph, rates, memo)
        ops = _step_times(graph, costs, ops, rates, compiled)
    sched = step_schedule(graph, ops)
    ops, fraction, timeline = power_limited(ops, graph.weights(), rates, sched)
    ops, timeline = _contended(graph, ops, timeline, sched, rates)
    return prediction(graph, costs, ops, timeline, gpu, calibration, fraction)


def _contended(
    graph: StepGraph,
    ops: tuple[OpTime, ...],
    timeline: Timeline,
    sched: Callable[[tuple[OpTime, ...]], Timeline],
    rates: Rates,
) -> tuple[tuple[OpTime, ...], Timeline]:
    """The step with its collectives and the compute beside them slowing each other
    (`schedule.contention`), where it has collectives and the calibration measured the
    contention grid; the collectives' stretch only within one host (the grid ran over
    NVLink; a collective across hosts waits on the network)."""
    if not rates.cal or not rates.cal.contention:
        return ops, timeline
    colls = {
        o.index: (COLLECTIVE_OF[graph.nodes[o.index].op][0], o.bytes)
        for o in ops
        if o.kind == COMM_KIND and o.device_s > 0
    }
    if not colls:
        return ops, timeline
    table = Contention.from_points(rates.cal.contention)  # ~70 us: read each time
    par = graph.meta.parallel
    if par is not None and par.hosts > 1:
        table = table.compute_only()
    return contended(ops, timeline, sched, colls, table)


def op_costs(graph: StepGraph) -> list[OpCost]:
    """Stage costs: each node's FLOPs, bytes, kind and launches."""
    tf32 = tf32_of(graph.meta)
    return [op_cost(n, tf32) for n in graph.nodes]


def op_times(
    graph: StepGraph, costs: list[OpCost], rates: Rates, compiled: bool
) -> tuple[OpTime, ...]:
    """Stage times: each node's roofline time (s), a checkpointed forward op at its host
    cost; under torch.compile, Inductor's kernels; the optimizer's measured host time."""
    under, selective = checkpointed_modules(graph), selective_modules(graph)
    ops = tuple(
        time_op(n, c, rates, host_phase=host_key(n, under, selective))
        for n, c in zip(graph.nodes, costs, strict=True)
    )
    return _step_times(graph, costs, ops, rates, compiled)


def _step_times(
    graph: StepGraph,
    costs: list[OpCost],
    ops: tuple[OpTime, ...],
    rates: Rates,
    compiled: bool,
) -> tuple[OpTime, ...]:
    """What the step as a whole changes in its ops' own times (`op_times`)."""
    if compiled:
        ops = compiled_times(graph, costs, ops, rates)
    ops = comm_times(graph, optimizer_host(graph, ops, rates), rates)
    if graph.meta.cuda_graph is not None:  # replayed: one launch, not an issue per op
        ops = graphed_times(graph, costs, ops, rates)
    return ops


def _per_op(graph: StepGraph, rates: Rates, memo: dict) -> tuple[list[OpCost], tuple[OpTime, ...]]:
    """`op_costs` and the per-op `time_op` of `op_times`, each worked out once per distinct
    op in `memo` (kept by the caller for one target). The planner evaluates many graphs
    made by passes from a few traces: an accumulated step's later micro-batch repeats its
    first, every block runs the same ops, checkpointing or sharding changes a few ops of
    thousands. An op's cost and time read nothing of it but what `_op_key` holds (its index
    and module only go into OpTime's, its module into the host-cost key too, its storages
    only matter where two of its tensors share one, e.g. an in-place op), so equal keys give
    equal results."""
    tf32 = tf32_of(graph.meta)
    under, selective = checkpointed_modules(graph), selective_modules(graph)
    costs, ops = [], []
    for n in graph.nodes:
        phase = host_key(n, under, selective)
        k = (tf32, _op_key(n, phase))
        got = memo.get(k)
        if got is None:
            c = op_cost(n, tf32)
            got = memo[k] = (c, time_op(n, c, rates, host_phase=phase))
        c, t = got
        if t.index != n.index or t.module != n.module:
            t = evolve(t, index=n.index, module=n.module)  # the same time, of this op
        costs.append(c)
        ops.append(t)
    return costs, tuple(ops)


def _op_key(n, host_phase: str | None) -> tuple:
    """What an op's cost and time depend on: the op, its phase and host-cost key (and, for a
    forward op under checkpointing, the tensors it saves), its tensors but for which storage
    each is in (only which of them share one), its arguments (as repr: 1, 1.0 and True
    differ)."""
    ids: dict[int, int] = {}
    ins = tuple(
        (t.shape, t.stride, t.dtype, t.offset, ids.setdefault(t.storage, len(ids)))
        for t in n.inputs
    )
    outs = tuple(
        (t.shape, t.stride, t.dtype, t.offset, ids.setdefault(t.storage, len(ids)))
        for t in n.outputs
    )
    saved = n.saved if host_phase and host_phase.startswith("checkpointed") else None
    return (n.op, n.phase, host_phase, saved, ins, outs, repr(n.args), repr(n.kwargs))


def comm_times(graph: StepGraph, ops: tuple[OpTime, ...], rates: Rates) -> tuple[OpTime, ...]:
    """The data-parallel ops' times. Collectives: on the comm stream, NCCL's, over the ranks
    and hosts of `meta.parallel` (one rank without it: no time), from the calibration's
    measured `collectives` (`cost.collectives.parallel_time`); their regime "comm" (no
    compute stream time). FSDP2's hooks: host time, the calibration's `dp_host` per unit and
    phase (`cost.dp_host`) less what the ops the pass put in that unit's phase already cost
    the host (the measurement holds them). Every other op's host time in forward, backward
    and recompute is the slowest rank's: one rank's, times the calibration's skew over that
    many ranks (`cost.dp_host.rank_skew`; the hooks' figure is the slowest rank's already).
    Unchanged where the step has neither collectives nor hooks."""
    idx = [o.index for o in ops if o.kind == COMM_KIND]
    hooks = [o.index for o in ops if o.kind == HOOK_KIND]
    if not idx and not hooks:
        return ops
    par = graph.meta.parallel
    kind, world, hosts = (par.kind, par.world, par.hosts) if par else ("ddp", 1, 1)
    points = rates.cal.collectives if rates.cal else []
    out = list(ops)
    for i in idx:
        node = graph.nodes[i]
        buf = node.inputs[0] if node.inputs else node.outputs[0]
        dtype = "fp32" if buf.dtype == "float32" else "bf16"
        op = COLLECTIVE_OF[node.op][0]
        t = parallel_time(kind, op, ops[i].bytes, dtype, world, hosts, points)
        out[i] = evolve(ops[i], device_s=t, memory_s=t, regime="comm")
    section = rates.cal.dp_host if rates.cal else None
    if hooks:
        charged = _fsdp_charged(graph, ops)
        for i in hooks:
            node = graph.nodes[i]
            phase, params, reshard = node.args
            t = hook_host_s(section, phase, params, reshard, world)
            out[i] = evolve(ops[i], host_s=max(t - charged.get((node.module, phase), 0.0), 0.0))
    return _skewed(out, section, world)


def _skewed(ops: list[OpTime], section: Any, world: int) -> tuple[OpTime, ...]:
    """`ops` with the host time of every op but FSDP2's hooks in forward, backward and
    recompute scaled by the ranks' skew in that phase (the slowest rank's pace)."""
    skew = {
        "forward": rank_skew(section, "forward", world),
        "backward": rank_skew(section, "backward", world),
    }
    skew["recompute"] = skew["backward"]
    if all(f == 1.0 for f in skew.values()):
        return tuple(ops)
    # `evolve`, not `dataclasses.replace`: every op of a 64-rank step is copied (several
    # seconds of each planner run over the candidates)
    return tuple(
        evolve(o, host_s=o.host_s * skew[o.phase])
        if o.kind != HOOK_KIND and o.phase in skew and o.host_s
        else o
        for o in ops
    )


#: the ops `passes.fsdp` puts beside a unit's own on the compute stream (the rest of its ops
#: run on the comm stream)
_FSDP_COMPUTE_OPS = ("aten.split_with_sizes_copy.out", "aten._chunk_cat.default")


def _fsdp_charged(graph: StepGraph, ops: tuple[OpTime, ...]) -> dict[tuple[str, str], float]:
    """{(unit, "forward" | "backward"): host seconds of the ops FSDP2 runs for the unit in
    that phase}, once per micro-batch's worth (the hooks are per micro-batch too)."""
    hooks: dict[tuple[str, str], int] = defaultdict(int)
    charged: dict[tuple[str, str], float] = defaultdict(float)
    for n, o in zip(graph.nodes, ops, strict=True):
        phase = "forward" if n.phase == "forward" else "backward"
        if o.kind == HOOK_KIND:
            hooks[(n.module, n.args[0])] += 1
        elif n.stream == COMM or n.op in _FSDP_COMPUTE_OPS:
            charged[(n.module, phase)] += o.host_s
    return {k: v / max(hooks.get(k, 1), 1) for k, v in charged.items()}


def step_schedule(
    graph: StepGraph, ops: tuple[OpTime, ...]
) -> Callable[[tuple[OpTime, ...]], Timeline]:
    """Stage schedule: the scheduler of `graph`'s ops, given their times (the power limit
    changes the ops' times, never which ops they are, on which streams or what they wait
    for)."""
    syncs, param_of = set(graph.meta.syncs or ()), _offloaded(graph, ops)
    streams = [stream_of(n) for n in graph.nodes]
    repeat = graph.repeat
    touches = None
    if COMM in streams:
        touches = [frozenset(t.storage for t in (*n.inputs, *n.outputs)) for n in graph.nodes]
    return scheduler(streams, syncs, repeat, param_of, touches)


def _offloaded(graph: StepGraph, ops: tuple[OpTime, ...]) -> dict[int, int]:
    """{op index: its parameter's storage} for CPU offload's ops (their first input)."""
    return {
        o.index: graph.nodes[o.index].inputs[0].storage
        for o in ops
        if o.kind in OFFLOAD_KINDS and graph.nodes[o.index].inputs
    }


def prediction(
    graph: StepGraph,
    costs: list[OpCost],
    ops: tuple[OpTime, ...],
    timeline: Timeline,
    gpu: GpuSpec,
    calibration: Calibration | None,
    fraction: float,
) -> Prediction:
    """The step's figures from its scheduled ops: busy device time, FLOPs, time by phase
    and by regime, each op counted as often as it runs (`StepGraph.weights`)."""
    weights = graph.weights()
    step = timeline.step_s
    # the collectives run on the comm stream: not the compute stream's busy time
    weights = [0 if o.kind == COMM_KIND else w for o, w in zip(ops, weights, strict=True)]
    kinds = {o.index: COLLECTIVE_OF[graph.nodes[o.index].op][0] for o in ops if o.kind == COMM_KIND}
    (comm_s, exposed_s), by_collective = exposed_comm(timeline, kinds)
    device_busy = sum(o.device_s * w for o, w in zip(ops, weights, strict=True))
    phase_s: dict[str, float] = defaultdict(float)
    regime_s: dict[str, float] = defaultdict(float)
    for o, w in zip(ops, weights, strict=True):
        phase_s[o.phase] += o.device_s * w
        if o.device_s > 0:
            regime_s[o.regime] += o.device_s * w
    return Prediction(
        gpu=gpu.name,
        calibrated=calibration is not None,
        ops=ops,
        step_s=step,
        device_s=device_busy,
        host_s=timeline.host_end,
        idle_s=max(step - device_busy, 0.0),
        flops=sum(o.flops * w for o, w in zip(ops, weights, strict=True)),
        model_flops=model_flops(graph, costs),
        tokens=int(graph.meta.tokens or 0),
        peak_flops=gpu.peak(graph.meta.precision.peak_mode),
        phase_s=dict(phase_s),
        regime_s=dict(regime_s),
        clock_fraction=fraction,
        timeline=timeline,
        comm_s=comm_s,
        exposed_comm_s=exposed_s,
        comm_by_collective=by_collective,
        world=graph.meta.parallel.world if graph.meta.parallel else 1,
    )


@dataclass(frozen=True)
class Prediction:
    """The step on one GPU. Times in seconds, FLOP/s as fractions of the dense peak."""

    gpu: str
    calibrated: bool
    ops: tuple[OpTime, ...] = field(repr=False)
    step_s: float
    device_s: float
    host_s: float
    idle_s: float
    flops: float
    model_flops: float
    tokens: int
    peak_flops: float
    phase_s: dict[str, float]
    regime_s: dict[str, float]
    #: compute-bound kernels' share of their burst rate under the power limit (`power_limited`)
    clock_fraction: float = 1.0
    #: every op on the host and its stream (`gobrrr.schedule`); None where not scheduled
    timeline: Timeline | None = field(default=None, repr=False)
    #: the collectives' time on the comm stream, and the part of it no other kernel runs
    #: (exposed; the rest overlaps compute: `schedule.scheduler.exposed_comm`)
    comm_s: float = 0.0
    exposed_comm_s: float = 0.0
    #: per collective ("all_gather", "reduce_scatter", "all_reduce"): {"busy_s", "exposed_s"}
    comm_by_collective: dict[str, dict[str, float]] = field(default_factory=dict)
    #: data-parallel ranks (`meta.parallel`; 1: one GPU); `tokens` are one rank's
    world: int = 1

    @property
    def overlapped_comm_s(self) -> float:
        return self.comm_s - self.exposed_comm_s

    @property
    def job_tokens_per_s(self) -> float:
        """Tokens per second over every rank (each runs `tokens` a step)."""
        return self.tokens_per_s * self.world

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over `peak_flops`, the precision's dense matmul peak. Model
        FLOPs: those of the traced forward and backward, without recomputation (see
        `model_flops`), so MFU <= HFU."""
        return self.model_flops / self.step_s / self.peak_flops if self.step_s > 0 else 0.0

    @property
    def hfu(self) -> float:
        """Every FLOP the step runs (recompute and optimizer included) per second over the
        same peak."""
        return self.flops / self.step_s / self.peak_flops if self.step_s > 0 else 0.0

    def regime_share(self) -> dict[str, float]:
        """Share of the step's time by regime; idle device time counts as overhead."""
        total = self.step_s or 1.0
        out = {k: v / total for k, v in self.regime_s.items()}
        out["overhead"] = out.get("overhead", 0.0) + self.idle_s / total
        return out

    def by_module(self, depth: int = 2) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for o in self.ops:
            out[".".join((o.module or "<top>").split(".")[:depth])] += o.device_s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def backward_forward_ratio(self) -> float:
        fwd = sum(o.flops for o in self.ops if o.phase == "forward")
        bwd = sum(o.flops for o in self.ops if o.phase in ("backward", "recompute"))
        return bwd / fwd if fwd else 0.0


@dataclass(frozen=True)
class Estimate:
    """A predicted step: the graph it was computed from, its memory and its time."""

    graph: StepGraph = field(repr=False)
    gpu: GpuSpec
    memory: MemoryResult
    time: Prediction
    cal: Calibration | None  # the calibration used; None = datasheet peaks + default efficiencies
    formulas: dict[str, Any]
    capture_s: float
    compiled: bool = False
    # the step's memory under the other training loop (`gobrrr.passes.loop.other`), where
    # `gobrrr.estimate` replayed it; None otherwise
    other_loop: MemoryResult | None = None
    # where the memory's workspace tables came from, if not `cal` (`Target.memory_cal`)
    memory_cal: Calibration | None = None

    @property
    def calibration(self) -> str | None:
        """The device name of the calibration used, if any."""
        return self.cal.device_name if self.cal else None

    @property
    def memory_calibration(self) -> str | None:
        """The device name of the calibration the memory's workspace tables came from where
        it is not `calibration`: a GPU without one reads those of its chip's
        (`hardware.memory_calibration`). None otherwise."""
        tables = self.memory_cal
        return tables.device_name if tables is not None and tables is not self.cal else None

    @property
    def fits(self) -> bool:
        """The step runs on the GPU: the caching allocator's reserved peak stays within the
        memory CUDA leaves to the process (`gobrrr.memory.replay.process_budget`)."""
        return self.memory.fits()

    @functools.cached_property
    def trainable(self) -> Trainable:
        """The parameters the optimizer steps and those frozen (elements and bytes by
        dtype), and the gradients and optimizer states only the trained ones have (bytes);
        read off the graph once (the terminal and the JSON each ask)."""
        return trainable(self.graph)

    def throughput(self) -> dict[str, Any]:
        """Units per second in the workload's unit: tokens for sequences, samples otherwise."""
        unit = throughput_unit(self.graph)
        t = self.time
        out: dict[str, Any] = {"unit": unit, "units_per_step": t.tokens, "per_s": t.tokens_per_s}
        if unit == "tokens":
            out["tokens_per_s"] = t.tokens_per_s
        return out

    def utilization(self) -> dict[str, Any]:
        """MFU and HFU against one peak (the precision's dense matmul peak), with their
        definitions; for sequence models also MFU by the 6·N + attention convention."""
        t = self.time
        out: dict[str, Any] = {
            "mfu": t.mfu,
            "hfu": t.hfu,
            "flops": t.flops,
            "model_flops": t.model_flops,
            "peak_flops": t.peak_flops,
            "peak": f"dense {self.graph.meta.precision.peak_mode} matmul peak",
            "mfu_definition": MFU_DEFINITION,
            "hfu_definition": HFU_DEFINITION,
        }
        if self.graph.meta.seq_len and t.step_s > 0:
            flops_6n = model_flops_6n(self.graph)
            out["model_flops_6n_attention"] = flops_6n
            out["mfu_6n_attention"] = flops_6n / t.step_s / t.peak_flops
        return out


MFU_DEFINITION = (
    "model FLOPs: the traced forward and backward, without recomputation, per second over the peak"
)
HFU_DEFINITION = "every FLOP the step runs (recompute, optimizer) per second over the peak"


def throughput_unit(graph: StepGraph) -> str:
    """ "tokens" for a sequence workload (a seq_len, or its units counted from an integer
    (batch, sequence) input), else "samples"."""
    if graph.meta.seq_len:
        return "tokens"
    inputs = {s.id for s in graph.storages if s.kind == "input"}
    for n in graph.nodes:
        for t in n.inputs:
            if t.storage in inputs and t.dtype.startswith(("int", "uint")) and len(t.shape) >= 2:
                micro = graph.meta.tokens // (graph.meta.accumulation or 1)  # one micro-batch's
                return "tokens" if t.numel == micro else "samples"
    return "samples"


def checkpointing(graph: StepGraph) -> tuple[str, int]:
    """How the traced step checkpoints, seen in the graph (recomputed ops), and how many ops
    it recomputes: "full" (gobrrr's --checkpoint full), "model" (the model checkpoints
    itself, e.g. gradient_checkpointing_enable()) or "none"."""
    recomputed = sum(1 for n in graph.nodes if n.phase == "recompute")
    if graph.meta.checkpoint == "full":
        return "full", recomputed
    return ("model" if recomputed else "none"), recomputed


def saved_activations(graph: StepGraph) -> int:
    """Bytes created in forward and still alive when backward starts (saved for backward)."""
    return sum(round_alloc(s.nbytes) for s in graph.storages if s.kind == "activation")


def parameter_shapes(graph: StepGraph) -> list[tuple[str, tuple[int, ...]]]:
    """(name, shape) of each parameter storage, shapes as the ops saw the whole tensor (a
    parameter no op read counts as one flat vector)."""
    whole: dict[int, tuple[int, ...]] = {}
    sizes = {s.id: s.nbytes for s in graph.storages if s.kind == "parameter"}
    for n in graph.nodes:
        for t in (*n.inputs, *n.outputs):
            if t.storage in sizes and t.storage not in whole and t.nbytes == sizes[t.storage]:
                whole[t.storage] = tuple(t.shape)
    return [
        (s.label, whole.get(s.id, (s.nbytes // 4,)))
        for s in graph.storages
        if s.kind == "parameter"
    ]


def closed_forms(graph: StepGraph) -> dict[str, Any]:
    """The textbook numbers for a transformer, beside the traced ones."""
    info = graph.meta.info or {}
    if not all(k in info for k in ("layers", "hidden", "vocab", "heads")):
        return {}
    L, d, V, a = info["layers"], info["hidden"], info["vocab"], info["heads"]
    seq = graph.meta.seq_len or 0
    batch = (graph.meta.tokens or 0) // seq if seq else 0
    elem = graph.meta.precision.element_size
    out: dict[str, Any] = {
        "params_traced": graph.meta.params,
        "params_textbook_12d2L_2dV": formulas.textbook_params(L, d, V),
        "params_gap": [
            list(g) for g in formulas.textbook_param_gap(L, d, V, parameter_shapes(graph))
        ],
    }
    if seq:
        out["activations_traced_bytes"] = saved_activations(graph)
        out["activations_lecture_bytes"] = batch * formulas.activation_bytes_per_sequence(
            L, d, seq, a, V, elem
        )
        recompute = "full" if graph.meta.checkpoint == "full" else "flash"
        out["activations_megatron_bytes"] = formulas.megatron_activation_bytes(
            seq, batch, d, a, L, recompute=recompute
        )
        out["megatron_variant"] = recompute
    return out
