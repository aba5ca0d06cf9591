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
    """

    knobs: Knobs
    unit: str
    units_per_s: float
    step_s: float
    peak_bytes: int
    reserved_bytes: int
    fits: bool
    headroom_bytes: int
    changes: tuple[str, ...]
    why: str
    recompute_s: float = 0.0
    host_bytes: int = 0
    host_pinned_bytes: int = 0

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
        return out


@dataclass(frozen=True)
class PlanResult:
    """The plans for one workload at one global batch on one GPU, best first.

    user: the step as the user gave it (the whole global batch in one micro-batch, nothing
    checkpointed). plans: every distinct configuration costed, those that fit first, each
    group by predicted throughput. budget_bytes: what the reserved peak must stay within.
    """

    workload: str
    gpu: str
    precision: str
    global_batch: int
    budget_bytes: int
    blocks: int
    user: Plan
    plans: tuple[Plan, ...]
    considered: int
    traces: int
    took_s: float
    notes: tuple[str, ...] = ()

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
        return {
            "version": PLAN_VERSION,
            "workload": self.workload,
            "gpu": self.gpu,
            "precision": self.precision,
            "global_batch": self.global_batch,
            "budget_bytes": self.budget_bytes,
            "blocks": self.blocks,
            "fits": self.best is not None,
            "user": self.user.to_dict(),
            "best": self.best.to_dict() if self.best else None,
            "plans": [p.to_dict() for p in plans],
            "considered": self.considered,
            "traces": self.traces,
            "took_s": self.took_s,
            "notes": list(self.notes),
        }


def no_fit_message(r: PlanResult) -> str:
    """One line: nothing fits, the smallest reserved peak found, and what would make it fit."""
    gib = 2**30
    low = min(r.plans, key=lambda p: p.reserved_bytes) if r.plans else r.user
    host = (
        "offloaded plans did not fit either"
        if any(p.knobs.offload for p in r.plans)
        else "optimizer states on the host (--allow offload)"
    )
    return (
        f"no configuration of {r.workload} at global batch {r.global_batch} fits "
        f"{r.budget_bytes / gib:.1f} GiB on {r.gpu}: the smallest reserved peak found is "
        f"{low.reserved_bytes / gib:.1f} GiB ({', '.join(low.changes) or 'as given'}); "
        "to fit: more GPUs (shard parameters, gradients and optimizer states), optimizer "
        f"states in 8 bits, {host}, or a smaller model or sequence"
    )
