"""The workload as the planner asks about it: built once, on the meta device, and asked
everything a plan needs to know before any trace (its own batch, its parameters, its repeated
blocks, whether its optimizer and its head and loss take the knobs that replace them)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from gobrrr.capture.cuda_calls import on_traced_gpu
from gobrrr.errors import GobrrrError
from gobrrr.estimate import workload_factory
from gobrrr.plan import applicable
from gobrrr.training.checkpointing import block_names
from gobrrr.workload import Workload, iter_tensors


class Probe:
    """One build of `source` at its own batch (and `seq`), on the meta device: no memory is
    allocated and nothing runs. Each answer is worked out when first asked and kept.

    What apply can apply is asked of `plan.applicable`, the predicate apply itself checks:
    the planner plans nothing apply would refuse.
    """

    def __init__(self, source: Any, seq: int | None) -> None:
        with torch.device("meta"), on_traced_gpu():  # .cuda() and the like: stay on meta
            self.workload = _build(source, seq)
        self._states: dict[str, str | None] = {}

    @cached_property
    def batch(self) -> int:
        """The workload's own batch: samples in its batch's first tensor (1 if that tensor is
        a scalar)."""
        return samples(self.workload)

    @cached_property
    def parameter_bytes(self) -> int:
        """Bytes of the model's parameters, in the dtypes they are built in."""
        return sum(p.numel() * p.element_size() for p in self.workload.model.parameters())

    @cached_property
    def blocks(self) -> tuple[str, ...]:
        """The repeated blocks checkpointing can wrap, named as `model.named_modules()` names
        them, in the model's order (a trace gives the order the forward runs them in)."""
        return tuple(block_names(self.workload.model))

    @cached_property
    def optimizer(self) -> torch.optim.Optimizer:
        """The workload's optimizer, made over the meta parameters."""
        with torch.device("meta"):
            return self.workload.make_optimizer()

    @cached_property
    def fused_loss_refusal(self) -> str | None:
        """Why the fused linear + cross-entropy does not apply to this workload (None: it
        does)."""
        return applicable.fused_loss_refusal(self.workload)

    def states_refusal(self, states: str) -> str | None:
        """Why the optimizer cannot keep its states as `states` ("bf16", "8bit"; None: it
        can)."""
        if states not in self._states:
            self._states[states] = applicable.optimizer_refusal(self.optimizer, states)
        return self._states[states]

    @cached_property
    def offload_refusal(self) -> str | None:
        """Why the optimizer cannot be offloaded as planned (None: it can): offload is costed
        for AdamW (torchao runs torch's fused AdamW on the CPU, the step calibrated)."""
        opt = self.optimizer
        if type(opt) is not torch.optim.AdamW:
            return (
                f"the workload's optimizer is {type(opt).__name__}; offload is costed "
                "for torch.optim.AdamW (its fused CPU step is what the calibration "
                "measures)"
            )
        return applicable.optimizer_refusal(opt, "as-is", offload=True)


def samples(w: Workload) -> int:
    """Samples in `w`'s batch: its first tensor's first dimension (1 for a scalar)."""
    ts = list(iter_tensors(w.batch))
    return int(ts[0].shape[0]) if ts and ts[0].dim() else 1


def _build(source: Any, seq: int | None) -> Workload:
    """`source`'s workload at its own batch; what the user's code raises, as one line."""
    try:
        return workload_factory(source, None, seq)()
    except GobrrrError:
        raise
    except Exception as e:  # user code: report it in one line, as a trace does
        raise GobrrrError(f"building the workload raised {type(e).__name__}: {e}") from e


__all__ = ["Probe", "samples"]
