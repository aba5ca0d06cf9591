"""Tracing a workload at a chosen micro-batch, for the planner."""

from __future__ import annotations

import copy
from typing import Any

import torch

from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.estimate import workload_factory
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Target
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.probe import samples
from gobrrr.training.fused_loss import use_fused_loss
from gobrrr.training.offload import stand_in
from gobrrr.training.optim_trace import traced_states_optimizer
from gobrrr.workload import Workload, map_tensors


class Tracer:
    """micro-batch -> the step graph of the workload at that micro-batch.

    The workload is built at each micro-batch: one that takes `batch_size` (a built-in, or a
    function with that argument) then has that many samples and is traced as built. One whose
    batch stays its own (a Workload, or a function without it) has its first samples cut:
    every micro-batch must then be at most its batch.
    """

    def __init__(
        self,
        source: Any,
        *,
        seq: int | None,
        precision: str,
        target: Target,
        variant: Knobs | None = None,
    ) -> None:
        self.source, self.seq, self.precision, self.target = source, seq, precision, target
        self.variant = variant or Knobs(micro_batch=1)
        self.traces = 0

    def __call__(self, micro_batch: int) -> StepGraph:
        make = self._variant(self._maker(micro_batch))
        self.traces += 1
        return capture(
            make,
            precision=self.variant.precision(self.precision),
            sdpa=target_for(self.target.gpu.full_name),
            compile=self.variant.compile,
        )

    def _maker(self, m: int):
        """The workload at micro-batch m: built at m, and its first m samples cut where its
        batch stayed its own."""
        build = workload_factory(self.source, m, self.seq)

        def make() -> Workload:
            w = build()
            return w if samples(w) == m else _cut(w, m)

        return make

    def _variant(self, make):
        """The workload as `gobrrr.apply` will run it: the fused loss in place of the head
        and loss, the optimizer keeping its states as planned (8-bit: torchao's states and
        one traced op per update, `optim_trace`), or offloaded (torchao's CPUOffloadOptimizer,
        traced as gobrrr.training.offload's stand-in)."""
        v = self.variant
        if not v.fused_loss and v.optimizer_states == "as-is" and not v.offload:
            return make
        if v.offload and v.optimizer_states != "as-is":
            raise GobrrrError(
                f"offload with optimizer_states={v.optimizer_states!r} is not "
                "planned: offload keeps the optimizer's own states (as-is)"
            )

        def build() -> Workload:
            w = make()
            if v.fused_loss:
                use_fused_loss(w.model)
            user = w.optimizer or (lambda ps: torch.optim.AdamW(ps, lr=3e-4))
            if v.offload:
                w.optimizer = lambda ps: stand_in(user(ps))
            elif v.optimizer_states != "as-is":
                w.optimizer = lambda ps: traced_states_optimizer(user(ps), v.optimizer_states)
            return w

        return build


def _cut(w: Workload, m: int) -> Workload:
    """A copy of `w` with its batch's first m samples (tokens scaled to match); `w` itself,
    which may be the user's own Workload, is left whole for the next micro-batch."""
    full = samples(w)
    if m > full:
        raise GobrrrError(
            f"the workload's batch is fixed at {full} samples, so no micro-batch of "
            f"{m} can be cut from it: make the global batch at most {full}, or give "
            "a function that takes batch_size (see README, `plan`)"
        )
    w = copy.copy(w)
    w.batch = map_tensors(w.batch, lambda t: t[:m].clone() if t.dim() and t.shape[0] == full else t)
    if w.tokens is not None:
        w.tokens = w.tokens * m // full
    return w
