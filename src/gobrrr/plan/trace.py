"""Tracing a workload at a chosen micro-batch, for the planner."""

from __future__ import annotations

from typing import Any

import torch

from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.estimate import workload_factory
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Target
from gobrrr.plan.knobs import Knobs
from gobrrr.training.fused_loss import use_fused_loss
from gobrrr.training.offload import stand_in
from gobrrr.training.optim_trace import traced_states_optimizer
from gobrrr.training.optimizers import adam_hyper
from gobrrr.workload import Workload, iter_tensors, map_tensors


class Tracer:
    """micro-batch -> the step graph of the workload at that micro-batch.

    A workload that takes `batch_size` (a built-in, or a function with that argument) is
    built at each micro-batch. One that does not (a Workload, or a function without it) has
    its batch cut along the first dimension: every micro-batch must then be at most its
    batch, whose size is the default global batch.
    """

    def __init__(self, source: Any, *, seq: int | None, precision: str,
                 target: Target, variant: Knobs | None = None) -> None:
        self.source, self.seq, self.precision, self.target = source, seq, precision, target
        self.variant = variant or Knobs(micro_batch=1)
        self.traces = 0
        self._fixed: int | None = None

    def default_batch(self) -> int:
        """The workload's own batch: samples in its batch's first tensor."""
        with torch.device("meta"):
            w = workload_factory(self.source, None, self.seq)()
        return _batch_size(w)

    def parameter_bytes(self) -> int:
        """Bytes of the model's parameters as built (on the meta device: nothing allocated)."""
        with torch.device("meta"):
            w = workload_factory(self.source, 1, self.seq)()
        return sum(p.numel() * p.element_size() for p in w.model.parameters())

    def takes_batch(self) -> bool:
        with torch.device("meta"):
            a = workload_factory(self.source, 1, self.seq)()
            b = workload_factory(self.source, 2, self.seq)()
        return _batch_size(a) == 1 and _batch_size(b) == 2

    def __call__(self, micro_batch: int) -> StepGraph:
        make = self._variant(self._maker(micro_batch))
        self.traces += 1
        return capture(make, precision=self.variant.precision(self.precision),
                       sdpa=target_for(self.target.gpu.full_name), compile=self.variant.compile)

    def _maker(self, m: int):
        if self._fixed is None:
            self._fixed = 0 if self.takes_batch() else self.default_batch()
        if not self._fixed:
            return workload_factory(self.source, m, self.seq)
        if m > self._fixed:
            raise GobrrrError(
                f"the workload's batch is fixed at {self._fixed} samples, so no micro-batch of "
                f"{m} can be cut from it: make the global batch at most {self._fixed}, or give "
                "a function that takes batch_size (see README, `plan`)")
        inner = workload_factory(self.source, None, self.seq)
        return lambda: _cut(inner(), m)

    def _variant(self, make):
        """The workload as `gobrrr.apply` will run it: the fused loss in place of the head
        and loss, the optimizer keeping its states as planned (8-bit: torchao's states and
        one traced op per update, `optim_trace`), or offloaded (torchao's CPUOffloadOptimizer,
        traced as gobrrr.training.offload's stand-in)."""
        v = self.variant
        if not v.fused_loss and v.optimizer_states == "as-is" and not v.offload:
            return make
        if v.offload and v.optimizer_states != "as-is":
            raise GobrrrError(f"offload with optimizer_states={v.optimizer_states!r} is not "
                              "planned: offload keeps the optimizer's own states (as-is)")

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

    def offload_refusal(self) -> str | None:
        """Why the optimizer cannot be offloaded as planned (None: it can): offload is
        costed for AdamW (torchao runs torch's fused AdamW on the CPU, the step calibrated)."""
        with torch.device("meta"):
            w = workload_factory(self.source, 1, self.seq)()
        opt = w.make_optimizer()
        if type(opt) is not torch.optim.AdamW:
            return (f"the workload's optimizer is {type(opt).__name__}; offload is costed "
                    "for torch.optim.AdamW (its fused CPU step is what the calibration "
                    "measures)")
        try:
            adam_hyper(opt)  # an option the offloaded optimizer lacks (amsgrad, maximize)
        except GobrrrError as e:
            return str(e)
        return None

    def states_refusal(self, states: str) -> str | None:
        """Why the workload's optimizer cannot keep its states as `states` (None: it can)."""
        with torch.device("meta"):
            w = workload_factory(self.source, 1, self.seq)()
            try:
                traced_states_optimizer(w.make_optimizer(), states)
            except GobrrrError as e:
                return str(e)
        return None

    def fused_loss_refusal(self) -> str | None:
        """Why the fused loss does not apply to this model (None: it does)."""
        with torch.device("meta"):
            w = workload_factory(self.source, 1, self.seq)()
        try:
            use_fused_loss(w.model)
        except GobrrrError as e:
            return str(e)
        return None


def _batch_size(w: Workload) -> int:
    ts = list(iter_tensors(w.batch))
    return int(ts[0].shape[0]) if ts and ts[0].dim() else 1


def _cut(w: Workload, m: int) -> Workload:
    """The workload with its batch's first m samples (tokens scaled to match)."""
    full = _batch_size(w)
    w.batch = map_tensors(w.batch, lambda t: t[:m].clone() if t.dim() and t.shape[0] == full else t)
    if w.tokens is not None:
        w.tokens = w.tokens * m // full
    return w
