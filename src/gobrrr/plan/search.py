"""Search the configurations of a step for the fastest one that fits.

The step is traced twice (at two micro-batches); every candidate is a composition of named
passes over those traces — the graph at a micro-batch (`passes.microbatch`), activation
checkpointing with per-block policies (`passes.checkpoint`), gradient accumulation to the
global batch (`passes.accumulate`) — costed by the one `evaluate`. Nothing is re-traced.

For each micro-batch that divides the global batch it costs: nothing checkpointed; every block
selective; every block full; every other block full; and, where those leave a gap, the
budget-optimal mix: a multiple-choice knapsack over the blocks (none / selective / full for
each), minimising the recompute time the graph's own per-op times give, subject to saving the
activation bytes the budget asks for, then checked by evaluating the pass it chose.
"""

from __future__ import annotations

import functools
import gc
import math
import time
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, replace

import torch

from gobrrr.cost.cudagraph import NOT_CALIBRATED as GRAPHS_NOT_CALIBRATED
from gobrrr.cost.cudagraph import GraphRates
from gobrrr.cost.offload import NOT_CALIBRATED
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import Estimate, evaluate, step_time, throughput_unit
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Target
from gobrrr.memory.replay import MemoryResult, process_budget
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.checkpoint import checkpoint as checkpoint_pass
from gobrrr.passes.cudagraph import cuda_graph as cuda_graph_pass
from gobrrr.passes.microbatch import TRACE_AT, BatchDependentStructure, family, trace_sizes
from gobrrr.plan import applicable
from gobrrr.plan.blocks import BlockCosts, block_costs, knapsack, scaled
from gobrrr.plan.knobs import Knobs, every_kth
from gobrrr.plan.probe import Probe
from gobrrr.plan.result import Plan, PlanResult
from gobrrr.plan.trace import Ahead, Tracer, forked_map, uses_torchscript
from gobrrr.training.fp8 import torchao_float8_refusal
from gobrrr.training.offload import host_bytes
from gobrrr.training.optim_trace import state_bytes

#: The share of the budget a plan leaves unplanned by default: none. What fits is judged as
#: `gobrrr estimate` judges it: the predicted reserved peak within the budget. Measured on an
#: H100 (tests/fixtures/plan_h100_*.json), the allocated peak was predicted within 0.1%
#: and the reserved peak within -3.3%..+5.3% for every configuration that ran, 75.8-78.1 GiB
#: reserved within 0.2% at the edge of the 78.5 GiB budget; and when a reservation fails
#: the caching allocator frees its cached blocks and retries before it gives up. `margin`
#: (`--margin`) keeps a share of the budget free for steps whose shapes vary.
MARGIN = 0.0

#: What `--allow` may add beyond the user's numerics: "bf16-states" keeps Adam's moments in
#: bf16 (the update in fp32); "8bit-states" keeps them block-wise quantised to 8 bits
#: (torchao's AdamW8bit); "bf16-weights" trains in pure bf16 (weights, gradients and states
#: in bf16, no autocast: the forward's and backward's numerics change); "compile" runs the
#: model under torch.compile, whole ("model") and each repeated block on its own ("blocks")
#: (Inductor's fused kernels round differently; each variant is traced compiled too, both
#: ways, which costs seconds per trace: dynamo and AOTAutograd); "offload"
#: keeps AdamW's states on the host and runs its update on the CPU (torchao's
#: CPUOffloadOptimizer: the same numerics); "fp8" trains the linear layers in FP8 (torchao's
#: float8 recipe, tensorwise scales: `Knobs.fp8`), on GPUs with FP8 tensor cores only;
#: "cudagraphs" captures the whole step as one CUDA graph and replays it (`Knobs.cuda_graph`:
#: the same numerics), costed beside each eager configuration that can be captured and kept
#: where it is predicted faster, on a GPU whose calibration measured graph replays.
ALLOW: tuple[str, ...] = (
    "bf16-states",
    "8bit-states",
    "bf16-weights",
    "compile",
    "offload",
    "fp8",
    "cudagraphs",
)

#: A variant of the step that is traced apart (it changes the forward or the optimizer's
#: ops, not only what is kept): the Knobs at micro-batch 1 with no accumulation and no
#: checkpointing, i.e. only the knobs the passes cannot derive (`variant_of`).
Variant = Knobs
BASE: Variant = Knobs(micro_batch=1)


def variant_of(knobs: Knobs) -> Variant:
    """The traced variant a configuration is derived from (a captured step's is traced apart:
    its optimizer is made capturable, which changes its ops: `plan.trace.Tracer`)."""
    return replace(knobs, micro_batch=1, accumulation=1, checkpoint=())


@dataclass(frozen=True)
class Request:
    """What the user asked for: the global batch (samples per optimizer step, over all
    ranks), the bytes each GPU's reserved peak must stay within, and the job's GPUs and
    hosts."""

    global_batch: int
    budget: int
    allow: frozenset[str]
    margin: float = MARGIN
    gpus: int = 1
    nodes: int = 1

    @property
    def usable(self) -> int:
        """What a plan's reserved peak may take: the budget less the margin."""
        return int(self.budget * (1 - self.margin))

    @property
    def per_rank(self) -> int:
        """Samples each rank takes per optimizer step (micro_batch x accumulation)."""
        return self.global_batch // self.gpus


def plan(
    source,
    gpu: str | Target = "h100",
    *,
    global_batch: int | None = None,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    memory_budget: int | None = None,
    allow: Iterable[str] = (),
    margin: float = MARGIN,
    calibration=True,
    gpus: int = 1,
    nodes: int = 1,
    progress: Callable[[int, int], None] | None = None,
) -> PlanResult:
    """The fastest configurations of `source`'s step that fit `gpu`, best first.

    source: what `gobrrr.estimate` takes (a built-in name, "file.py:function", a function
    taking batch_size/seq_len, or a Workload). global_batch: samples per optimizer step
    (default: the workload's own batch). memory_budget: bytes the reserved peak may take
    (default, and at most: what CUDA leaves the process on `gpu`). allow: knobs that go
    beyond the user's numerics (see ALLOW). margin: the share of the budget to leave free
    (see MARGIN). gpus, nodes: the job's GPUs and the hosts they span; with gpus > 1 the
    plan is data-parallel (DDP or FSDP2, `plan.parallel`), global_batch the whole job's and
    memory_budget each GPU's. progress: called with (costed, of) as the search goes
    (variants x micro-batches).
    """
    return Planner(
        source,
        gpu,
        global_batch=global_batch,
        seq=seq,
        precision=precision,
        memory_budget=memory_budget,
        allow=allow,
        margin=margin,
        calibration=calibration,
        gpus=gpus,
        nodes=nodes,
    ).run(progress)


class Planner:
    """One workload at one global batch on one GPU: probed (built once and asked, `Probe`)
    and traced (twice) when made, then any Knobs costed by passes over the traces (`cost`),
    or the whole search (`run`). With gpus > 1 the search is `plan.parallel`'s, which traces
    only what it costs."""

    def __init__(
        self,
        source,
        gpu: str | Target = "h100",
        *,
        global_batch: int | None = None,
        seq: int | None = None,
        precision: str = "bf16-mixed",
        memory_budget: int | None = None,
        allow: Iterable[str] = (),
        margin: float = MARGIN,
        calibration=True,
        gpus: int = 1,
        nodes: int = 1,
        ahead: int = 0,
    ) -> None:
        self.t0 = time.perf_counter()
        self.precision = precision
        self.target = Target.resolve(gpu, calibration)
        self.probe = Probe(source, seq)
        self.req = _request(
            global_batch if global_batch is not None else self.probe.batch,
            self.target,
            memory_budget,
            allow,
            margin,
            gpus,
            nodes,
        )
        if memory_budget is not None:
            _check_state_budget(self.probe.parameter_bytes // gpus, self.req)
        # traces in other processes, forked after the probe (its imports inherited)
        use = ahead > 0 and not uses_torchscript(self.probe.workload.model)
        self.ahead = Ahead(ahead) if use else None
        if gpus > 1:
            from gobrrr.plan.parallel import parallel_search  # the search over several GPUs

            self.base, self.search = None, parallel_search(self, source, seq)
            self.steps = self.search.steps
            return
        self.steps = _Steps(
            lambda variant: Tracer(
                source,
                seq=seq,
                precision=precision,
                target=self.target,
                variant=variant,
                ahead=self.ahead,
            ),
            self.req.global_batch,
        )
        notes: list[str] = []
        wanted = self._variants(notes)  # before the memory filter, which needs the base trace
        self.steps.expect(BASE)
        if self.ahead is not None and _small(self.probe, self.req):
            for v in wanted:  # traced ahead while the base trace runs (see `_small`)
                self.steps.expect(v)
        self.base = self.steps.at(BASE, 1 if self.req.global_batch == 1 else 2)
        variants = [BASE, *self._kept(wanted, notes)]
        for v in variants[1:]:  # the search traces each variant: start those traces now
            self.steps.expect(v)
        blocks = list(self.base.meta.blocks or ())
        refusal = applicable.checkpoint_refusal(self.probe.workload.model, blocks)
        if refusal:  # apply could not wrap them: plan without checkpointing
            notes.append(f"checkpointing not planned: {refusal}")
            blocks = []
        self.search = _Search(self.req, self.target, self.steps, blocks, variants)
        self.search.ahead = self.ahead
        if "cudagraphs" in self.req.allow:
            self.search.graphed = self._graphed(variants, notes)
        self.search.notes.extend(notes)

    def _variants(self, notes: list[str]) -> list[Variant]:
        """The variants worth tracing but the base: the fused loss where the model takes it,
        bf16 optimizer states and weights where allowed, each compiled too where allowed
        (`_kept` then drops those whose persistent bytes alone exceed the budget)."""
        refusal = self.probe.fused_loss_refusal
        if refusal:
            notes.append(f"fused linear + cross-entropy not planned: {refusal}")
        states = ["as-is", *self._states(notes)]
        weights = [
            "as-is",
            *(["bf16"] if "bf16-weights" in self.req.allow and self.precision != "bf16" else []),
        ]
        out = [
            replace(BASE, fused_loss=fused, optimizer_states=st, weights=w)
            for w in weights
            for st in states
            for fused in (False, True)
            if w == "as-is" or st == "as-is"
        ]
        if "offload" in self.req.allow and _offload_allowed(self.target, self.probe, notes):
            out += [replace(BASE, fused_loss=fused, offload=True) for fused in (False, True)]
        out = [v for v in out if not v.fused_loss or not refusal]
        if "fp8" in self.req.allow and self._fp8(notes):  # each variant with FP8 linears too
            out += [replace(v, fp8=True) for v in out]
        if "compile" in self.req.allow:  # each variant compiled too: a trace of its own
            out += [replace(v, compile=c) for c in self._compile_modes(notes) for v in out]
        return [v for v in out if v != BASE]

    def _kept(self, out: list[Variant], notes: list[str]) -> list[Variant]:
        """The variants whose parameters, gradients and optimizer states (read off the base
        trace) fit the budget; a note where some or the base's do not."""
        kept = [v for v in out if _persistent(self.base, v) <= self.req.usable]
        if len(kept) < len(out) or _persistent(self.base, BASE) > self.req.usable:
            gib = 2**30
            notes.append(
                f"parameters, gradients and optimizer states alone need "
                f"{_persistent(self.base, BASE) / gib:.1f} GiB of the "
                f"{self.req.usable / gib:.1f} GiB budget"
            )
        return kept

    def _graphed(self, variants: list[Variant], notes: list[str]) -> frozenset[Variant]:
        """The variants whose step may also be costed captured as a CUDA graph: the target's
        calibration measured graph replays, and apply can capture the variant
        (`applicable.cuda_graph_refusal`, with the host syncs the base trace saw); a note
        where none can be, saying why."""
        section = self.target.cal.cudagraph if self.target.cal else {}
        if GraphRates.of(section) is None:
            what = f"{self.target.gpu.name}'s calibration"
            notes.append("CUDA graphs not planned: " + GRAPHS_NOT_CALIBRATED.format(what=what))
            return frozenset()
        syncs = [self.base.nodes[i].op for i in self.base.meta.syncs or ()]
        w = self.probe.workload
        why = {
            v: applicable.cuda_graph_refusal(w, replace(v, cuda_graph=True), self.precision, syncs)
            for v in variants
        }
        if why[BASE]:
            notes.append(f"CUDA graphs not planned: {why[BASE]}")
        return frozenset(v for v, r in why.items() if not r)

    def _fp8(self, notes: list[str]) -> bool:
        """Whether FP8 training is planned (the GPU and torchao were checked with the request):
        the model must have linears it converts; notes on how its matmuls are costed."""
        refusal = applicable.fp8_refusal(self.probe.workload.model)
        if refusal:
            notes.append(f"fp8 not planned: {refusal}")
            return False
        notes.extend(fp8_notes(self.target))
        return True

    def _compile_modes(self, notes: list[str]) -> list[str]:
        """How the model may be compiled: whole ("model"), and block by block ("blocks")
        where it has repeated blocks to compile."""
        refusal = applicable.compile_refusal(self.probe.workload.model, "blocks")
        if refusal:
            notes.append(f"torch.compile per block not planned: {refusal}")
        return ["model", *([] if refusal else ["blocks"])]

    def _states(self, notes: list[str]) -> list[str]:
        """The optimizer-state storages allowed and possible for the workload's optimizer."""
        out = []
        for st in ("bf16", "8bit"):
            if f"{st}-states" not in self.req.allow:
                continue
            refusal = self.probe.states_refusal(st)
            if refusal:
                notes.append(f"{st} optimizer states not planned: {refusal}")
                continue
            out.append(st)
            if st == "8bit":
                notes.extend(_notes_8bit(self.target))
        return out

    @property
    def blocks(self) -> list[str]:
        return self.search.blocks

    def cost(self, knobs: Knobs) -> Plan:
        """The predicted step with these knobs (their micro_batch x accumulation must be the
        planner's global batch; over several GPUs, each rank's share of it)."""
        if knobs.global_batch != self.req.per_rank:
            raise GobrrrError(
                f"knobs for a global batch of {knobs.global_batch}, the plan's is "
                f"{self.req.global_batch}"
                + (f" ({self.req.per_rank} per rank)" if self.req.gpus > 1 else "")
            )
        if knobs.distributed != (self.req.gpus > 1):
            raise GobrrrError(
                f"knobs with parallel={knobs.parallel!r} for a plan over {self.req.gpus} "
                "GPU(s): give parallel 'ddp' or 'fsdp' with gpus > 1, 'none' with one GPU"
            )
        return self.search.cost(knobs)

    def run(self, progress: Callable[[int, int], None] | None = None) -> PlanResult:
        # the cycle collector walks each candidate's objects once (`_Search.collected`),
        # unless the process keeps it off or froze objects of its own
        self.search.freeze = gc.isenabled() and gc.get_freeze_count() == 0
        try:
            plans = self.search.run(progress)
            user = self.search.user()
        finally:
            if self.search.freeze:
                self.search.freeze = False
                if self.ahead is None:
                    gc.unfreeze()
                # else the process is gobrrr's own (the command line), about to exit: left
                # frozen, the heap is not walked by the interpreter's last collection (a
                # second of a gpt2 plan's 9)
        if self.ahead is not None:  # traces started that the search did not ask for
            self.ahead.close()
        ranked = sorted(_distinct(plans), key=lambda p: (not p.fits, -(p.units_per_s or 0.0)))
        return PlanResult(
            workload=str(self.search.workload_name if self.base is None else self.base.meta.name),
            gpu=self.target.gpu.name,
            precision=self.precision,
            global_batch=self.req.global_batch,
            budget_bytes=self.req.budget,
            blocks=len(self.blocks),
            user=user,
            plans=tuple(ranked),
            considered=self.search.evaluated,
            traces=self.steps.traces,
            took_s=time.perf_counter() - self.t0,
            notes=tuple(self.search.notes),
            gpus=self.req.gpus,
            nodes=self.req.nodes,
            torch=torch.__version__,  # the traces' (made here or in forked workers)
        )


def _request(
    global_batch: int,
    target: Target,
    memory_budget: int | None,
    allow: Iterable[str],
    margin: float,
    gpus: int = 1,
    nodes: int = 1,
) -> Request:
    allowed = frozenset(a.strip() for a in allow if a.strip())
    unknown = sorted(allowed - set(ALLOW))
    if unknown:
        raise GobrrrError(
            f"--allow {','.join(unknown)}: unknown; "
            + (
                f"choose from {', '.join(ALLOW)}"
                if ALLOW
                else "this version plans at the user's numerics only"
            )
        )
    if global_batch < 1:
        raise GobrrrError(
            f"--global-batch must be a positive number of samples, got {global_batch}"
        )
    cap = process_budget(target.gpu, target.cal)
    if memory_budget is not None:
        if memory_budget <= 0:
            raise GobrrrError(f"--memory-budget must be positive, got {memory_budget} bytes")
        cap = min(cap, memory_budget)
    if not 0 <= margin < 1:
        raise GobrrrError(f"--margin must be a fraction of the budget in [0, 1), got {margin}")
    _check_gpus(global_batch, gpus, nodes)
    if "fp8" in allowed:
        _check_fp8(target)
    return Request(global_batch, cap, allowed, margin, gpus, nodes)


def _check_fp8(target: Target) -> None:
    """--allow fp8 needs a GPU with FP8 tensor cores and torchao's float8 recipe (checked
    before anything is traced: the user asked for it, so its absence is an error)."""
    gpu = target.gpu
    if not gpu.fp8_tensor_cores:
        raise GobrrrError(
            f"--allow fp8 on {gpu.name}: it has no FP8 tensor cores (FP8 training needs an "
            "L4, L40S, RTX 4090, H100, H200 or B200, or a GPU spec with fp8_tflops): drop "
            "fp8 from --allow"
        )
    why = torchao_float8_refusal()
    if why:
        raise GobrrrError(f"--allow fp8: {why}")


def fp8_notes(target: Target) -> list[str]:
    """How FP8 matmuls are costed on `target` where no FP8 grid was measured."""
    if target.cal is not None and target.cal.matmul_grid.get("fp8"):
        return []
    gpu = target.gpu
    how = (
        "the bf16 grid's measured efficiency at each shape"
        if target.cal is not None and target.cal.matmul_grid.get("bf16")
        else f"the default efficiency {gpu.matmul_efficiency:.0%}"
    )
    return [
        f"fp8 matmuls (torch._scaled_mm) costed at {gpu.name}'s datasheet FP8 dense peak "
        f"({gpu.peak('fp8') / 1e12:.0f} TFLOP/s) x {how}: no measured fp8 grid in its "
        "calibration (measure it: benchmarks/plan/fp8.py --grid)"
    ]


def _check_gpus(global_batch: int, gpus: int, nodes: int) -> None:
    """The job's GPUs must split the global batch evenly, and its hosts the GPUs."""
    if gpus < 1:
        raise GobrrrError(f"--gpus must be at least 1, got {gpus}")
    if nodes < 1 or gpus % nodes:
        raise GobrrrError(
            f"--nodes {nodes} must divide --gpus {gpus} (the same GPUs on every node)"
        )
    if global_batch < gpus or global_batch % gpus:
        raise GobrrrError(
            f"--global-batch {global_batch} does not split evenly over {gpus} GPUs (each "
            f"rank takes global_batch / gpus samples): give a multiple of {gpus}"
        )


class _Steps:
    """The step's graph for each variant and micro-batch; a variant is traced when first
    asked for (`make_tracer(variant)` traces it)."""

    def __init__(self, make_tracer: Callable[[Variant], Tracer], global_batch: int) -> None:
        self.make_tracer, self.global_batch = make_tracer, global_batch
        self.tracers: dict[Variant, Tracer] = {}
        self._at: dict[Variant, Callable[[int], StepGraph]] = {}
        self._last: tuple[tuple[Variant, int], StepGraph] | None = None

    def at(self, variant: Variant, micro_batch: int) -> StepGraph:
        """The graph of `variant` at `micro_batch`; the last one asked for is kept (each
        candidate at one micro-batch asks for it again, and deriving it walks every op)."""
        key = (variant, micro_batch)
        if self._last is not None and self._last[0] == key:
            return self._last[1]
        if variant not in self._at:
            tracer = self.tracers.setdefault(variant, self.make_tracer(variant))
            self._at[variant] = _graphs(tracer, self.global_batch)
        g = self._at[variant](micro_batch)
        self._last = (key, g)
        return g

    def expect(self, variant: Variant) -> None:
        """The variant's traces will be asked for (see `_graphs`): start them ahead (not
        again once they have been)."""
        if variant in self._at:
            return
        tracer = self.tracers.setdefault(variant, self.make_tracer(variant))
        tracer.expect(_traced_at(self.global_batch))

    @property
    def traces(self) -> int:
        return sum(t.traces for t in self.tracers.values())


def _offload_allowed(target: Target, probe: Probe, notes: list[str]) -> bool:
    """Whether offload can be costed: a calibration with the offload section (the host link
    and the CPU's AdamW step), and the user's AdamW (the CPU step measured); else a note
    saying why not."""
    section = target.cal.offload if target.cal else {}
    if not section.get("d2h") or not section.get("adamw:fp32"):
        notes.append(
            "offload not planned: " + NOT_CALIBRATED.format(what=f"{target.gpu.name}'s calibration")
        )
        return False
    refusal = probe.offload_refusal
    if refusal:
        notes.append(f"offload not planned: {refusal}")
    return not refusal


def _small(probe: Probe, req: Request) -> bool:
    """Whether every variant is all but sure to pass `_kept` before the base trace says:
    the parameters, gradients and two fp32 states of each (4x the parameters' bytes, Adam's
    and what every variant's bound is under) take at most half the budget. Only where they
    do are the variants traced ahead of the base trace; a wrong guess costs a worker's time
    on a trace nobody asks for, never a different plan."""
    return 8 * probe.parameter_bytes <= req.usable


def _persistent(g: StepGraph, variant: Variant) -> int:
    """Bytes of parameters, gradients and optimizer states of `variant`, from the base
    graph `g` (bf16 states: fp32 ones halved; 8-bit: torchao's layout for each parameter's
    moments, `optim_trace.state_bytes`; bf16 weights: all halved; offload: the states on the
    host, the few of the small parameters left on the GPU not counted)."""
    by = {"parameter": 0, "gradient": 0, "optimizer_state": 0}
    for s in g.storages:
        if s.kind in by:
            by[s.kind] += s.nbytes
    if variant.weights == "bf16":  # from fp32 weights (bf16 weights are not offered on bf16)
        return sum(by.values()) // 2
    if variant.optimizer_states == "bf16":
        by["optimizer_state"] //= 2
    if variant.optimizer_states == "8bit":
        by["optimizer_state"] = _states_8bit(g)
    if variant.offload:
        by["optimizer_state"] = 0
    return sum(by.values())


def _states_8bit(g: StepGraph) -> int:
    """Bytes of torchao's 8-bit moments for the parameters whose Adam moments `g` holds
    (the host step counts hold none on the GPU)."""
    size = {t.storage: t.itemsize for n in g.nodes for t in (*n.inputs, *n.outputs)}
    return sum(
        state_bytes(s.nbytes // size.get(s.id, 4), size.get(s.id, 4))
        for s in g.storages
        if s.kind == "optimizer_state" and s.label.endswith(".exp_avg")
    )


def _notes_8bit(target: Target) -> list[str]:
    """What the 8-bit states' cost rests on, where it is not measured."""
    out = []
    if not (target.cal and target.cal.optim8):
        out.append(
            "8-bit optimizer states costed without a measured optim8 calibration "
            "section: each update's bytes at the pointwise bandwidth and the eager "
            "per-op host cost (measure it: benchmarks/calibration/calibrate_sections.py "
            "--sections optim8)"
        )
    try:
        import torchao.optim  # noqa: F401
    except ImportError:
        out.append(
            "8-bit optimizer states are applied with torchao, not installed here: "
            "pip install 'gobrrr[optim]' where the plan runs"
        )
    return out


def _graphs(tracer: Tracer, global_batch: int) -> Callable[[int], StepGraph]:
    """micro-batch -> its step graph: derived from traces at two micro-batches where the
    step's structure does not depend on the batch, else traced at each."""
    tracer.expect(_traced_at(global_batch))  # with an `Ahead`, traced by children
    if global_batch < 2:
        g = tracer(1)
        return lambda m: g
    try:
        fam = family(tracer, *trace_sizes(tracer.source))
    except BatchDependentStructure:
        cache: dict[int, StepGraph] = {}
        return lambda m: cache.setdefault(m, tracer(m))
    return fam.at


def _traced_at(global_batch: int) -> tuple[int, ...]:
    """The micro-batches a variant's step is traced at, in the order `_graphs` traces them:
    the family's two, then micro-batch 1 (where every search starts); 1 alone where the
    global batch is 1."""
    return (1,) if global_batch < 2 else (*TRACE_AT, 1)


def _check_state_budget(params: int, req: Request) -> None:
    """A budget the user gave must hold the parameters at least (checked before tracing)."""
    if params > req.budget:
        gib = 2**30
        raise GobrrrError(
            f"--memory-budget {req.budget / gib:.1f} GiB is smaller than the parameters alone "
            f"({params / gib:.1f} GiB): give a larger budget, or shard the model over more "
            "GPUs"
        )


def divisors(n: int) -> list[int]:
    """The divisors of `n` (> 0), smallest first; O(sqrt n) steps: 10**6 for n = 10**12."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return small + [n // d for d in reversed(small) if d * d != n]


class _Search:
    """Costs the candidates at each micro-batch (smallest first)."""

    def __init__(
        self,
        req: Request,
        target: Target,
        steps: _Steps,
        blocks: list[str],
        variants: list[Variant],
    ) -> None:
        self.req, self.target, self.steps, self.blocks = req, target, steps, blocks
        self.variants = variants
        self.evaluated = 0
        self.memory: dict[Knobs, MemoryResult] = {}  # each candidate's replay, for charts
        self.memo: dict = {}  # each distinct op's cost and time on the target (`evaluate`)
        self.ahead: Ahead | None = None  # where set, candidates are costed in children too
        self._plain: tuple[StepGraph, Estimate] | None = None  # the last one not checkpointed
        self.notes: list[str] = []
        self._user: Plan | None = None
        self.graphed: frozenset[Variant] = frozenset()  # also costed as a CUDA graph
        self.freeze = False  # see `collected` (set by Planner.run)

    @contextmanager
    def collected(self) -> Iterator[None]:
        """One candidate's costing, the cycle collector off while it runs, then run once
        over what the candidate made (its cycles: a trace's, the allocator replay's
        blocks), and what is left alive moved into its permanent generation: a candidate
        makes millions of objects, and each full collection they set off walked the whole
        heap, the traces' too (40% of a 70B plan's time). Frozen objects still die by
        reference count; a cycle among them waits for `gc.unfreeze` (Planner.run's end).
        Only where `freeze` is set: the collector was on and nothing frozen."""
        if not self.freeze:
            yield
            return
        gc.disable()
        try:
            yield
        finally:
            gc.collect(0)  # everything made since it was turned off is in the youngest
            gc.freeze()
            gc.enable()

    def run(self, progress: Callable[[int, int], None] | None = None) -> list[Plan]:
        out: list[Plan] = []
        sizes = divisors(self.req.global_batch)
        if not self.blocks:
            self.notes.append(
                "no repeated blocks (an nn.ModuleList or nn.Sequential of "
                "modules of one class) to checkpoint: planned micro-batch and "
                "accumulation only"
            )
        for i, v in enumerate(self.variants):
            for j, m in enumerate(sizes):
                plans = self.at_micro_batch(m, v)
                out.extend(plans)
                if progress:  # a break skips the rest of this variant's micro-batches
                    done = j + 1 if any(p.fits for p in plans) else len(sizes)
                    progress(i * len(sizes) + done, len(self.variants) * len(sizes))
                if not any(p.fits for p in plans):
                    break  # a larger micro-batch needs more memory still
        return out

    def user(self) -> Plan:
        if self._user is None:
            self._user = self.cost(Knobs(micro_batch=self.req.global_batch))
        return self._user

    def at_micro_batch(self, m: int, v: Variant = BASE) -> list[Plan]:
        n = self.req.global_batch // m
        knobs = functools.partial(replace, v, micro_batch=m, accumulation=n)
        plain = self.cost(knobs())
        if m == self.req.global_batch and v == BASE:
            self._user = plain
        graphed = self.graphed_plan(knobs, plain) if v in self.graphed else []
        if plain.fits or not self.blocks or v.compiled:  # checkpointing: eager variants only
            return [plain, *graphed]
        policies = [
            every_kth(self.blocks, 1, "selective"),
            every_kth(self.blocks, 1),
            every_kth(self.blocks, 2),
        ]
        plans = [plain, *self.cost_all([knobs(checkpoint=c) for c in policies])]
        sel, full = plans[1], plans[2]
        if full.fits:
            plans.extend(self.budget_optimal(knobs, plain, sel, full))
        return [*plans, *graphed]

    def graphed_plan(self, knobs, plain: Plan) -> list[Plan]:
        """The step of `knobs()` captured as a CUDA graph, where it is predicted faster than
        `plain`, the same step eager (none otherwise: it is never chosen for its own sake)."""
        p = self.cost(knobs(cuda_graph=True))
        return [p] if p.step_s < plain.step_s else []

    def budget_optimal(self, knobs, plain: Plan, sel: Plan, full: Plan) -> list[Plan]:
        """The mix of policies that saves just enough memory at the least recompute time,
        checked by evaluating it. The per-block savings and recompute times are the graph's
        (`block_costs`), scaled per policy so their sums are what checkpointing every block
        with it measured (`sel`, `full`); the saving asked for grows by what was still
        missing, a few times at most."""
        g = self.graph(knobs())
        known = self._plain[1].time if self._plain is not None and self._plain[0] is g else None
        costs = scaled(
            block_costs(g, known or step_time(g, self.target, memo=self.memo), self.blocks),
            {
                "selective": (plain.reserved_bytes - sel.reserved_bytes, sel.step_s - plain.step_s),
                "full": (plain.reserved_bytes - full.reserved_bytes, full.step_s - plain.step_s),
            },
        )
        need = plain.reserved_bytes - self.req.usable
        out: list[Plan] = []
        for _ in range(4):
            choice = knapsack(costs, need)
            if choice is None:
                break
            p = self.cost(knobs(checkpoint=choice))
            out.append(p)
            if p.fits:
                break
            need += p.reserved_bytes - self.req.usable + self.req.budget // 200
        return out

    def graph(self, knobs: Knobs) -> StepGraph:
        """The graph of knobs' variant at knobs' micro-batch (before checkpointing)."""
        return self.steps.at(variant_of(knobs), knobs.micro_batch)

    def cost(self, knobs: Knobs) -> Plan:
        with self.collected():
            plan, memory = self._costed(knobs)
        self.evaluated += 1
        self.memory[knobs] = memory
        return plan

    def cost_all(self, many: list[Knobs]) -> list[Plan]:
        """`cost` of each, several at once in forked children where `ahead` allows (the
        candidates at one micro-batch share its graph, derived once here first)."""
        a = self.ahead
        # a child is forked from this process: not once it has traced itself (a fork of a
        # process with autograd's threads can hang on a lock one of them held)
        if a is None or a.here or a.processes < 1 or len(many) < 2:
            return [self.cost(k) for k in many]
        for k in many:
            self.graph(k)  # traced or derived here, not in a child (which would count it)
        with self.collected():
            got = forked_map([functools.partial(self._costed, k) for k in many], a.processes)
        for k, (_, memory) in zip(many, got, strict=True):
            self.evaluated += 1
            self.memory[k] = memory
        return [plan for plan, _ in got]

    def step_graph(self, knobs: Knobs) -> StepGraph:
        """The graph `cost` evaluates for `knobs`: its variant at its micro-batch with the
        passes of its other knobs applied."""
        g = self.graph(knobs)
        if knobs.checkpoint:
            g = checkpoint_pass(g, dict(knobs.checkpoint))
        g = accumulate(g, knobs.accumulation)
        if knobs.cuda_graph:  # the last pass: captured as apply captures it
            g = cuda_graph_pass(g)
        return g

    def _costed(self, knobs: Knobs) -> tuple[Plan, MemoryResult]:
        """The plan of `knobs` and its memory replay; nothing of the search's state changes
        but the graph cache (`cost_all` runs it in children)."""
        g = self.step_graph(knobs)
        plain = not knobs.checkpoint and knobs.accumulation == 1 and not knobs.cuda_graph
        est = evaluate(g, self.target, memo=self.memo)
        if plain:  # the graph `budget_optimal` reads its per-op times from
            self._plain = (g, est)
        return _plan(knobs, est, self.req, self.blocks), est.memory


def _plan(knobs: Knobs, est: Estimate, req: Request, blocks: list[str]) -> Plan:
    m = est.memory
    reserved = m.reserved or m.peak
    fits = m.oom_index is None and reserved <= req.usable
    recompute = est.time.phase_s.get("recompute", 0.0)
    changes = describe(knobs, req.per_rank, blocks)
    gib = 2**30
    why = (
        f"fits with {(req.budget - reserved) / gib:.1f} GiB to spare"
        if fits
        else f"needs {reserved / gib:.1f} GiB reserved, over the {req.usable / gib:.1f} GiB "
        "a plan may take"
        + (f" ({req.budget / gib:.1f} GiB less a {req.margin:.0%} margin)" if req.margin else "")
    )
    if recompute:
        why += f"; recompute costs {recompute / est.time.step_s:.0%} of the step"
    host = host_bytes(est.graph)
    if host["total"]:
        why += (
            f"; needs {host['total'] / gib:.1f} GiB of host memory "
            f"({host['pinned'] / gib:.1f} GiB pinned)"
        )
    per_gpu = est.time.tokens_per_s
    return Plan(
        knobs=knobs,
        unit=throughput_unit(est.graph),
        units_per_s=per_gpu * req.gpus if knobs.distributed else per_gpu,
        step_s=est.time.step_s,
        peak_bytes=m.peak,
        reserved_bytes=reserved,
        fits=fits,
        headroom_bytes=req.budget - reserved,
        changes=tuple(changes),
        why=why,
        recompute_s=recompute,
        host_bytes=host["total"],
        host_pinned_bytes=host["pinned"],
        gpus=req.gpus,
        parallel=parallelism(knobs, req.gpus, req.nodes),
        exposed_comm_s=est.time.exposed_comm_s,
    )


def parallelism(knobs: Knobs, gpus: int, nodes: int = 1) -> str:
    """The data parallelism in words, e.g. "FSDP2 x4, reshard" ("" on one GPU)."""
    if not knobs.distributed:
        return ""
    hosts = f" on {nodes} nodes" if nodes > 1 else ""
    if knobs.parallel == "ddp":
        return f"DDP x{gpus}{hosts}"
    each = ", sync every micro-batch" if knobs.sync_each else ""
    return f"FSDP2 x{gpus}{hosts}, {'reshard' if knobs.reshard else 'no reshard'}{each}"


def describe(knobs: Knobs, global_batch: int, blocks: list[str]) -> list[str]:
    """What the knobs change in the user's step, one phrase each."""
    out = []
    if knobs.micro_batch != global_batch:
        out.append(f"micro-batch {knobs.micro_batch}, accumulate {knobs.accumulation}")
    if knobs.fused_loss:
        out.append("fused linear + cross-entropy")
    if knobs.weights != "as-is":
        out.append(f"weights, gradients and states in {knobs.weights} (pure {knobs.weights})")
    if knobs.optimizer_states != "as-is":
        out.append(
            {"8bit": "8-bit optimizer states"}.get(
                knobs.optimizer_states, f"optimizer states in {knobs.optimizer_states}"
            )
        )
    if knobs.compile == "model":
        out.append("torch.compile(model)")
    elif knobs.compile == "blocks":
        out.append("torch.compile per block")
    if knobs.offload:
        out.append("optimizer states and update on the CPU (offload)")
    if knobs.fp8:
        out.append("fp8 linear layers (torchao float8)")
    if knobs.cuda_graph:
        out.append("the whole step as one CUDA graph (replayed)")
    by_policy: dict[str, int] = {}
    for _, policy in knobs.checkpoint:
        by_policy[policy] = by_policy.get(policy, 0) + 1
    for policy in ("full", "selective"):
        k = by_policy.get(policy, 0)
        if k:
            which = "every block" if k == len(blocks) else f"{k} of {len(blocks)} blocks"
            out.append(f"checkpoint {which} ({policy})")
    return out


def _distinct(plans: list[Plan]) -> list[Plan]:
    seen, out = set(), []
    for p in plans:
        if p.knobs not in seen:
            seen.add(p.knobs)
            out.append(p)
    return out


__all__ = ["ALLOW", "BlockCosts", "Planner", "Request", "describe", "divisors", "plan"]
