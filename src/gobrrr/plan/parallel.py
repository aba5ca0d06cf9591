"""The plan over several GPUs: DDP or FSDP2 chosen jointly with the one-GPU knobs.

Every candidate is the one-GPU search's composition of passes over one rank's trace (the
graph at the rank's micro-batch, checkpointing, accumulation to the rank's share of the
global batch), then the data-parallel pass: `passes.ddp`, or `passes.fsdp` with the
candidate's reshard_after_forward (over the "bf16" trace, `estimate.traced_precision`). The
one-rank trace does not depend on the parallelism: DDP's candidates share one trace family,
FSDP2's another (reshard on and off share theirs, and the graph before the pass).

What the search skips, and why it cannot miss a plan that fits:
- DDP, where the replicated parameters, their gradients and DDP's bucket copies of them
  (3 x the parameters' bytes, before any optimizer state) exceed the budget: no trace.
- FSDP2, but for the user's precision "bf16-mixed" (FSDP2 is costed with torchtitan's
  MixedPrecisionPolicy) and a model with repeated blocks (its units).
- Compile and offload: planned on one GPU only (the passes model neither under DDP or FSDP2).
- Memory first: a candidate's allocation replay runs before its time; one that does not fit
  is kept with its memory, untimed. Checkpointing every block (the least memory) is costed
  first; where even that does not fit, no other policy at that micro-batch can. Reshard off
  (more memory) only where reshard on fits; the user's head and loss only where the fused
  loss (less memory) fitted somewhere.
- Micro-batches grow until none fits (memory grows with them), but under FSDP2 the rank's
  whole share in one micro-batch is costed too: without accumulation FSDP2 holds no
  unsharded fp32 gradients between micro-batches.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from dataclasses import replace

from gobrrr.errors import GobrrrError
from gobrrr.estimate import traced_precision
from gobrrr.evaluate import evaluate, throughput_unit
from gobrrr.graph.ir import StepGraph
from gobrrr.memory.replay import MemoryResult, step_memory
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.checkpoint import checkpoint as checkpoint_pass
from gobrrr.passes.ddp import ddp
from gobrrr.passes.fsdp import fsdp
from gobrrr.plan.applicable import parallel_refusal
from gobrrr.plan.knobs import Knobs, every_kth
from gobrrr.plan.result import Plan
from gobrrr.plan.search import (
    BASE,
    Request,
    Variant,
    _plan,
    _Search,
    _Steps,
    describe,
    divisors,
    parallelism,
    variant_of,
)
from gobrrr.plan.trace import Tracer, forked_map

GIB = 2**30


def parallel_search(planner, source, seq: int | None) -> _ParallelSearch:
    """The search of `planner` (a Planner over gpus > 1) for `source` at `seq`: its
    variants per parallelism chosen from the probe alone (nothing traced yet)."""
    req, probe, precision = planner.req, planner.probe, planner.precision
    notes: list[str] = []
    states = planner._states(notes)  # allowed, and possible for the workload's optimizer
    if "fp8" in req.allow:
        notes.append("fp8 not planned: FP8 training is costed on one GPU only")
    if "cudagraphs" in req.allow:
        notes.append("CUDA graphs not planned: a captured step is costed on one GPU only")
    by = {p: _variants(planner, p, states, notes) for p in ("ddp", "fsdp")}
    if not by["ddp"] and not by["fsdp"]:
        raise GobrrrError(notes[-1])
    steps = _Steps(
        lambda key: Tracer(
            source,
            seq=seq,
            precision=key[1],
            target=planner.target,
            variant=key[0],
            ahead=planner.ahead,
        ),
        req.per_rank,
    )
    search = _ParallelSearch(req, planner.target, steps, list(probe.blocks), by, precision)
    search.ahead = planner.ahead  # candidates costed in children too, where it allows
    search.notes.extend(notes)
    search.trainable = sum(p.numel() for p in probe.workload.model.parameters() if p.requires_grad)
    return search


def _variants(planner, parallel: str, states: list[str], notes: list[str]) -> list[Variant]:
    """The traced variants worth costing under `parallel`, fused loss first; none where the
    parallelism cannot fit or run, and only those apply runs with it
    (`applicable.parallel_refusal`; a note says what is left out and why)."""
    req, probe = planner.req, planner.probe
    name = _NAMES[parallel]
    why = parallel_refusal(replace(BASE, parallel=parallel), planner.precision, probe.blocks)
    if why:
        notes.append(f"{name} not planned: {why}")
        return []
    fused = [] if probe.fused_loss_refusal else [replace(BASE, fused_loss=True)]
    base = [*fused, BASE]
    out = base + [replace(v, optimizer_states=st) for st in states for v in base]
    if "bf16-weights" in req.allow and planner.precision != "bf16":
        out += [replace(v, weights="bf16") for v in base]
    out += [replace(BASE, **{k: True}) for k in ("compile", "offload") if k in req.allow]
    out = _applicable(out, parallel, planner, notes)
    if parallel == "fsdp":
        return out
    kept = [v for v in out if _ddp_floor(planner, v) <= req.usable]
    if not kept:
        floor = min(_ddp_floor(planner, v) for v in out)
        notes.append(
            f"DDP not planned: every rank holds the parameters, their gradients and DDP's "
            f"bucket copies of them, {floor / GIB:.1f} GiB before any optimizer state, over "
            f"the {req.usable / GIB:.1f} GiB budget"
        )
    return kept


def _applicable(variants: list[Variant], parallel: str, planner, notes: list[str]):
    """`variants` that apply runs under `parallel`; one note for those it does not."""
    kept, left = [], {}
    for v in variants:
        why = parallel_refusal(
            replace(v, parallel=parallel), planner.precision, planner.probe.blocks
        )
        if why:
            left.setdefault(why, []).extend(describe(replace(v, fused_loss=False), 1, []))
        else:
            kept.append(v)
    for why, what in left.items():
        what = ", ".join(dict.fromkeys(what))
        notes.append(f"{_NAMES[parallel]}: {what} not planned: {why}")
    return kept


def _ddp_floor(planner, v: Variant) -> int:
    """Bytes every DDP rank holds whatever else is planned: the parameters, their gradients
    and DDP's bucket copies of them (as built; halved where the step runs in pure bf16)."""
    bf16 = v.weights == "bf16" or planner.precision == "bf16"
    return 3 * planner.probe.parameter_bytes // (2 if bf16 else 1)


class _ParallelSearch(_Search):
    """Costs DDP and FSDP2 candidates at each per-rank micro-batch (see the module
    docstring for the order and what it skips)."""

    def __init__(self, req: Request, target, steps, blocks, by: dict, precision: str) -> None:
        super().__init__(req, target, steps, blocks, [])
        self.by, self.precision = by, precision
        self.costed: dict[Knobs, Plan] = {}
        self._graph: tuple[Knobs, StepGraph] | None = None  # the last candidate's, unsharded
        # FSDP2 candidates with reshard that fit: their graphs before sharding, until
        # `_no_reshard` costs them again without it (then popped)
        self._unsharded: dict[Knobs, StepGraph] = {}
        self._at: tuple[tuple, StepGraph] | None = None  # the last traced or derived graph
        self.workload_name = ""
        self.trainable = 0  # parameters the optimizer steps (set by parallel_search)
        self._grads: int | None = None
        # the fastest plan that fits so far, with its graph: the chosen plan's memory chart
        # (`report.charts`) asks for that graph again once the search is done
        self._best: tuple[Knobs, Plan, StepGraph] | None = None
        # candidates costed ahead in forked children, (knobs, timed) -> (plan, replay), until
        # `cost` asks for them (`prefetch`)
        self._fetched: dict[tuple[Knobs, bool], tuple[Plan, MemoryResult]] = {}

    def run(self, progress: Callable[[int, int], None] | None = None) -> list[Plan]:
        """Every parallelism's candidates; `progress` called with (variants costed, of)."""
        self._progress, self._done = progress, 0
        self._total = sum(len(v) for v in self.by.values())
        # the traces the search will ask for, in its order: the user's head and loss are
        # costed only where a plan with the fused loss fits, but their traces start now (a
        # worker would otherwise wait idle for the first fit; one nobody asks for costs a
        # worker's time, never a different plan)
        for parallel, variants in self.by.items():
            for v in sorted(variants, key=lambda v: not v.fused_loss):
                self.steps.expect(self._trace_key(replace(v, parallel=parallel)))
        for parallel, variants in self.by.items():
            try:
                self.parallel(parallel, variants)
            except _Refused as e:  # the pass cannot shard this model's step
                self.notes.append(f"{_NAMES[parallel]} not planned: {e}")
                self.costed = {k: p for k, p in self.costed.items() if k.parallel != parallel}
        return list(self.costed.values())

    def parallel(self, parallel: str, variants: list[Variant]) -> None:
        fused = [v for v in variants if v.fused_loss]
        for v in variants:
            if not v.fused_loss and fused and not self._fitted(parallel):
                self.notes.append(
                    f"{_NAMES[parallel]}: the model's own head and loss not costed: no "
                    "plan with the fused loss, which needs less memory, fits"
                )
                return
            self.variant(parallel, v)
            self._done += 1
            if self._progress:
                self._progress(self._done, self._total)

    def _fitted(self, parallel: str) -> bool:
        return any(p.fits and p.knobs.parallel == parallel for p in self.costed.values())

    def variant(self, parallel: str, v: Variant) -> None:
        """Every micro-batch of `v` under `parallel`, smallest first, until none fits; under
        FSDP2 then the rank's whole share in one micro-batch."""
        ms = divisors(self.req.per_rank)
        if parallel == "fsdp" and len(ms) > 1 and self._unsharded_grads() > self.req.usable:
            v = replace(v, parallel="fsdp", sync_each=True)  # unsharded fp32 grads cannot fit
        plain_first = False  # the first micro-batch: checkpointing every block first
        for m in ms:
            if parallel == "fsdp" and not plain_first and m != ms[-1] and self.blocks:
                # the rank's whole share, checkpointed, is costed in the end whichever
                # micro-batch stops the loop: costed beside this one's first candidate
                full = every_kth(self.blocks, 1)
                self.prefetch(
                    [
                        (self._knobs(m, v, parallel)(checkpoint=full), False),
                        (self._knobs(ms[-1], v, parallel)(checkpoint=full), False),
                    ]
                )
            plans = self.at_micro_batch(m, v, parallel, plain_first)
            if not any(p.fits for p in plans):
                break
            plain_first = not plans[0].knobs.checkpoint and plans[0].fits
        else:
            return
        if parallel == "fsdp" and m != ms[-1]:
            self.at_micro_batch(ms[-1], v, parallel, False)

    def _unsharded_grads(self) -> int:
        """Bytes FSDP2 holds between micro-batches under accumulation: without the gradient
        sync every unit's gradients stay unsharded, in reduce_dtype fp32
        (`to_accumulated_grad_if_needed`), 4 bytes a trainable parameter (a note says so
        where that alone exceeds the budget)."""
        if self._grads is None:
            self._grads = 4 * self.trainable
            if self._grads > self.req.usable:
                self.notes.append(
                    f"FSDP2 accumulates by reduce-scattering every micro-batch: with the "
                    f"sync skipped until the last it would keep every gradient unsharded in "
                    f"fp32 between micro-batches, {self._grads / GIB:.1f} GiB over the "
                    f"{self.req.usable / GIB:.1f} GiB budget"
                )
        return self._grads

    def at_micro_batch(
        self, m: int, v: Variant = BASE, parallel: str = "ddp", plain_first: bool = True
    ) -> list[Plan]:
        """The candidates at micro-batch m, the plain step first where `plain_first` (it
        fitted at the micro-batch before), else checkpointing every block first (where even
        that does not fit, nothing at m does)."""
        knobs = self._knobs(m, v, parallel)
        ckpt = bool(self.blocks)
        if plain_first or not ckpt:
            plain = self.cost(knobs())
            if plain.fits or not ckpt:
                return self._no_reshard([plain])
        full = self.cost(knobs(checkpoint=every_kth(self.blocks, 1)))
        if not full.fits:
            return self._no_reshard([full])
        # what comes next, costed at once: the plain step (timed); the selective and
        # every-other-block candidates, wanted where it does not fit (where it does, their
        # costs are dropped); the fitting full plan without reshard
        ahead = [
            (knobs(), True),
            (knobs(checkpoint=every_kth(self.blocks, 1, "selective")), True),
            (knobs(checkpoint=every_kth(self.blocks, 2)), False),
        ]
        if full.knobs.parallel == "fsdp" and full.knobs.reshard:
            ahead.append((replace(full.knobs, reshard=False), False))
        self.prefetch(ahead)
        plain = self.cost(knobs(), timed=True)
        out = [plain, full]
        if not plain.fits:
            sel, half = self.cost_each(
                [
                    (knobs(checkpoint=every_kth(self.blocks, 1, "selective")), True),
                    (knobs(checkpoint=every_kth(self.blocks, 2)), False),
                ]
            )
            out += [sel, half]
            out += self.budget_optimal(knobs, plain, sel, full)
        return self._no_reshard(out)

    def _knobs(self, m: int, v: Variant, parallel: str) -> Callable[..., Knobs]:
        """(**changes) -> the knobs of `v` under `parallel` at micro-batch m, accumulated to
        the rank's share, with those changes."""
        n = self.req.per_rank // m
        return functools.partial(
            replace,
            v,
            micro_batch=m,
            accumulation=n,
            parallel=parallel,
            sync_each=v.sync_each and n > 1,
        )

    def prefetch(self, wanted: list[tuple[Knobs, bool]]) -> None:
        """Cost `wanted` ((knobs, timed) each) ahead, the first here and the others in forked
        children meanwhile, where the trace workers allow it (as `cost_each`); `cost` then
        takes each plan as it asks for it, in the search's own order, and counts it there.
        A candidate the search does not ask for after all costs a child's time, never a
        different plan (each plan is its knobs' alone)."""
        a = self.ahead
        todo = [w for w in dict.fromkeys(wanted) if w not in self._fetched and self._wanted(*w)]
        if a is None or a.here or a.processes < 1 or len(todo) < 2:
            return
        self.graph(todo[0][0])  # the micro-batch's graph, derived here (children share it)
        with self.collected():
            got = forked_map([functools.partial(self._costed, k, t) for k, t in todo], a.processes)
        self._fetched.update(zip(todo, got, strict=True))

    def _no_reshard(self, plans: list[Plan]) -> list[Plan]:
        """FSDP2's plans that fit, costed again with reshard_after_forward off (each from
        the graph its reshard candidate was sharded from: checkpointing and accumulation
        do not depend on it)."""
        more = [
            self.cost(replace(p.knobs, reshard=False))
            for p in plans
            if p.fits and p.knobs.parallel == "fsdp" and p.knobs.reshard
        ]
        self._unsharded.clear()
        return plans + more

    def user(self) -> Plan | None:
        """The rank's whole share in one micro-batch under the first parallelism planned,
        nothing else changed, where the search costed it."""
        first = next(p for p, vs in self.by.items() if vs)
        return self.costed.get(Knobs(micro_batch=self.req.per_rank, parallel=first))

    def _trace_key(self, knobs: Knobs) -> tuple[Knobs, str]:
        """The trace family knobs' graph comes from: the variant, in the precision the
        parallelism runs in."""
        precision = traced_precision(knobs.precision(self.precision), 2, knobs.parallel)
        return (
            replace(variant_of(knobs), parallel="none", reshard=True, sync_each=False),
            precision,
        )

    def graph(self, knobs: Knobs) -> StepGraph:
        """One rank's graph of knobs' variant at knobs' micro-batch, traced in the precision
        the parallelism runs in (before checkpointing and sharding)."""
        key = self._trace_key(knobs)
        if self._at is None or self._at[0] != (key, knobs.micro_batch):
            g = self.steps.at(key, knobs.micro_batch)
            self._at = ((key, knobs.micro_batch), g)
            self.workload_name = self.workload_name or str(g.meta.name)
        return self._at[1]

    def cost(self, knobs: Knobs, timed: bool = False) -> Plan:
        """The predicted step of `knobs` on one rank: its memory, and its time where it fits
        (or `timed`: the knapsack reads the times of plans that do not fit)."""
        if not self._wanted(knobs, timed):
            return self.costed[knobs]
        got = self._fetched.pop((knobs, timed), None)
        if got is not None:  # costed ahead (`prefetch`)
            plan, self.memory[knobs] = got
        else:
            with self.collected():
                plan = self._one(knobs, timed)
        self._record(knobs, plan)
        return plan

    def _record(self, knobs: Knobs, plan: Plan) -> None:
        """Count a candidate costed, and keep its plan."""
        self.evaluated += 1
        if plan.fits and not self._fitted(knobs.parallel):  # the user's head and loss next
            for v in (v for v in self.by[knobs.parallel] if not v.fused_loss):
                self.steps.expect(self._trace_key(replace(v, parallel=knobs.parallel)))
        self.costed[knobs] = plan

    def cost_each(self, wanted: list[tuple[Knobs, bool]]) -> list[Plan]:
        """`cost(knobs, timed)` of each, the first here and the others in forked children
        meanwhile where the trace workers allow it (`forked_map`, as `_Search.cost_all`): the
        same plans, in the same order, as one after another here. What a child works out
        on the way (a graph before sharding, the per-op memo) is worked out here again where
        a later candidate needs it."""
        self.prefetch(wanted)
        return [self.cost(k, t) for k, t in wanted]  # counted in the order asked

    def _wanted(self, knobs: Knobs, timed: bool) -> bool:
        """Whether `cost(knobs, timed)` has work to do (else it returns what it costed)."""
        got = self.costed.get(knobs)
        return got is None or (got.step_s is None and timed)

    def _costed(self, knobs: Knobs, timed: bool) -> tuple[Plan, MemoryResult]:
        """`_one` and the replay it made (what a forked child hands back)."""
        plan = self._one(knobs, timed)
        return plan, self.memory[knobs]

    def _one(self, knobs: Knobs, timed: bool) -> Plan:
        """`cost` of a candidate not costed yet."""
        g = self.sharded(knobs)
        mem = self.memory.get(knobs)  # replayed already where a plan is timed after all
        if mem is None:
            mem = self.memory[knobs] = step_memory(
                g, self.target.gpu, self.target.cal, self.target.memory_cal
            )
        reserved = mem.reserved or mem.peak
        if (mem.oom_index is not None or reserved > self.req.usable) and not timed:
            plan = _untimed(knobs, g, mem.peak, reserved, self.req, self.blocks)
        else:
            est = evaluate(g, self.target, memory=mem, memo=self.memo)
            plan = _plan(knobs, est, self.req, self.blocks)
        if plan.fits and knobs.parallel == "fsdp" and knobs.reshard and self._graph:
            self._unsharded[knobs] = self._graph[1]  # `_no_reshard` shards it again
        if plan.fits and (self._best is None or plan.units_per_s > self._best[1].units_per_s):
            self._best = (knobs, plan, g)
        return plan

    def sharded(self, knobs: Knobs) -> StepGraph:
        """The candidate's one-rank graph: checkpointed, accumulated, then sharded; the
        graph before sharding kept for the next candidate that differs only in reshard, the
        sharded graph of the fastest plan that fits so far until a faster one fits."""
        if self._best is not None and self._best[0] == knobs:
            return self._best[2]
        key = replace(knobs, reshard=True)
        if key in self._unsharded:
            self._graph = (key, self._unsharded.pop(key))
        elif self._graph is None or self._graph[0] != key:
            g = self.graph(knobs)
            if knobs.checkpoint:
                g = checkpoint_pass(g, dict(knobs.checkpoint))
            self._graph = (key, accumulate(g, knobs.accumulation))
        g = self._graph[1]
        try:
            if knobs.parallel == "ddp":
                return ddp(g, self.req.gpus, self.req.nodes)
            return fsdp(
                g,
                self.req.gpus,
                self.req.nodes,
                reshard_after_forward=knobs.reshard,
                sync_each=knobs.sync_each and knobs.accumulation > 1,
            )
        except GobrrrError as e:
            raise _Refused(str(e)) from e


class _Refused(GobrrrError):
    """The data-parallel pass refused the step: that parallelism is not planned."""


_NAMES = {"ddp": "DDP", "fsdp": "FSDP2"}


def _untimed(
    knobs: Knobs, g: StepGraph, peak: int, reserved: int, req: Request, blocks: list[str]
) -> Plan:
    """A candidate whose memory does not fit: its peaks, not its time."""
    return Plan(
        knobs=knobs,
        unit=throughput_unit(g),
        units_per_s=0.0,
        step_s=None,
        peak_bytes=peak,
        reserved_bytes=reserved,
        fits=False,
        headroom_bytes=req.budget - reserved,
        changes=tuple(describe(knobs, req.per_rank, blocks)),
        why=f"needs {reserved / GIB:.1f} GiB reserved per rank, over the "
        f"{req.usable / GIB:.1f} GiB a plan may take (not timed)",
        gpus=req.gpus,
        parallel=parallelism(knobs, req.gpus, req.nodes),
    )


__all__ = ["parallel_search"]
