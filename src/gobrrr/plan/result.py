"""What `gobrrr plan` returns: each configuration it costed, and the ranking."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from gobrrr.errors import GobrrrError
from gobrrr.plan.knobs import Knobs

PLAN_VERSION = 1


@dataclass(frozen=True)
class Plan:
    """One configuration of the step, predicted on the target GPU.

    units_per_s: tokens (sequence models) or samples per second at the global batch.
    step_s: one optimizer step (all micro-batches), seconds. peak_bytes: predicted
    max_memory_allocated; reserved_bytes: predicted max_memory_reserved, what "fits" is judged
    on; headroom_bytes: the budget left at the reserved peak (negative: short by that much).
    changes: what differs from the user's step, one phrase each; why: the reason in a line.
    host_bytes: host memory the step needs beyond the user's (CPU offload: pinned parameter
    and gradient copies, and the optimizer states); host_pinned_bytes: the pinned part.
    Over several GPUs (gpus > 1): units_per_s is the whole job's (per GPU x gpus), the bytes
    are one rank's, parallel says the data parallelism ("FSDP2 x4, reshard"),
    exposed_comm_s the communication the step waits for; a configuration whose memory does
    not fit is not timed (step_s None, units_per_s 0).
    """

    knobs: Knobs
    unit: str
    units_per_s: float
    step_s: float | None
    peak_bytes: int
    reserved_bytes: int
    fits: bool
    headroom_bytes: int
    changes: tuple[str, ...]
    why: str
    recompute_s: float = 0.0
    host_bytes: int = 0
    host_pinned_bytes: int = 0
    gpus: int = 1
    parallel: str = ""
    exposed_comm_s: float = 0.0

    @property
    def units_per_s_per_gpu(self) -> float:
        """Throughput of one GPU (units per second)."""
        return self.units_per_s / self.gpus

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "knobs": self.knobs.to_dict(),
            "unit": self.unit,
            f"{self.unit}_per_s": self.units_per_s,
            "step_s": self.step_s,
            "peak_bytes": self.peak_bytes,
            "reserved_bytes": self.reserved_bytes,
            "fits": self.fits,
            "headroom_bytes": self.headroom_bytes,
            "recompute_s": self.recompute_s,
            "host_bytes": self.host_bytes,
            "host_pinned_bytes": self.host_pinned_bytes,
            "changes": list(self.changes),
            "why": self.why,
        }
        if self.gpus > 1:
            out.update(
                gpus=self.gpus,
                parallel=self.parallel,
                **{f"{self.unit}_per_s_per_gpu": self.units_per_s_per_gpu},
                exposed_comm_s=self.exposed_comm_s,
            )
        return out


@dataclass(frozen=True)
class PlanResult:
    """The plans for one workload at one global batch on one GPU, best first.

    user: the step as the user gave it (the whole global batch in one micro-batch, nothing
    checkpointed; over several GPUs, each rank's share in one micro-batch under the first
    parallelism planned, None where the search did not cost it). plans: every distinct
    configuration costed, those that fit first, each group by predicted throughput.
    budget_bytes: what each GPU's reserved peak must stay within. gpus, nodes: the job's.
    torch: the version of PyTorch that traced the step.
    """

    workload: str
    gpu: str
    precision: str
    global_batch: int
    budget_bytes: int
    blocks: int
    user: Plan | None
    plans: tuple[Plan, ...]
    considered: int
    traces: int
    took_s: float
    notes: tuple[str, ...] = ()
    gpus: int = 1
    nodes: int = 1
    # the PyTorch that traced the step: what a compiled step saves for backward is its
    # partitioner's choice, which moves between versions (plan with the torch that runs it)
    torch: str = ""

    @property
    def best(self) -> Plan | None:
        """The fastest plan that fits, or None when none does."""
        return self.plans[0] if self.plans and self.plans[0].fits else None

    def require_best(self) -> Plan:
        if self.best is None:
            raise GobrrrError(no_fit_message(self))
        return self.best

    def to_dict(self, top: int | None = None) -> dict[str, Any]:
        plans = self.plans if top is None else self.plans[:top]
        out = {
            "version": PLAN_VERSION,
            "workload": self.workload,
            "gpu": self.gpu,
            "precision": self.precision,
            "global_batch": self.global_batch,
            "budget_bytes": self.budget_bytes,
            "blocks": self.blocks,
            "fits": self.best is not None,
            "user": self.user.to_dict() if self.user else None,
            "best": self.best.to_dict() if self.best else None,
            "plans": [p.to_dict() for p in plans],
            "considered": self.considered,
            "traces": self.traces,
            "took_s": self.took_s,
            "notes": list(self.notes),
            "torch": self.torch,
        }
        if self.gpus > 1:
            out.update(gpus=self.gpus, nodes=self.nodes, per_rank=self.global_batch // self.gpus)
        return out


def no_fit_message(r: PlanResult) -> str:
    """One line: nothing fits, the smallest reserved peak found, and what would make it fit."""
    gib = 2**30
    low = min(r.plans, key=lambda p: p.reserved_bytes) if r.plans else r.user
    gpus = f"each of {r.gpus} GPUs' " if r.gpus > 1 else ""
    more = (
        "more GPUs (FSDP2 shards parameters, gradients and optimizer states over them)"
        if r.gpus > 1
        else "more GPUs (shard parameters, gradients and optimizer states)"
    )
    host = (
        "offloaded plans did not fit either"
        if any(p.knobs.offload for p in r.plans)
        else "optimizer states on the host (--allow offload)"
    )
    return (
        f"no configuration of {r.workload} at global batch {r.global_batch} fits "
        f"{gpus}{r.budget_bytes / gib:.1f} GiB on {r.gpu}: the smallest reserved peak found is "
        f"{low.reserved_bytes / gib:.1f} GiB ({_what(low)}); "
        f"to fit: {more}, optimizer "
        f"states in 8 bits, {host}, or a smaller model or sequence"
    )


def _what(p: Plan) -> str:
    """A plan's configuration in words: its parallelism and what it changes."""
    return ", ".join([*([p.parallel] if p.parallel else []), *p.changes]) or "as given"
