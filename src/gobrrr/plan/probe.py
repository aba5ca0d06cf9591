"""The workload as the planner asks about it: built once, on the meta device, and asked
everything a plan needs to know before any trace (its own batch, its parameters, its repeated
blocks, whether its optimizer and its head and loss take the knobs that replace them)."""

from __future__ import annotations

from functools import cached_property
from typing import Any

import torch

from gobrrr.errors import GobrrrError
from gobrrr.estimate import workload_factory
from gobrrr.training.checkpointing import block_names
from gobrrr.training.fused_loss import use_fused_loss
from gobrrr.training.optim_trace import traced_states_optimizer
from gobrrr.training.optimizers import adam_hyper
from gobrrr.workload import Workload, iter_tensors


class Probe:
    """One build of `source` at its own batch (and `seq`), on the meta device: no memory is
    allocated and nothing runs. Each answer is worked out when first asked and kept.

    The fused-loss question routes the probe's model through the fused loss, as a plan with
    it would (the head's forward changes, no parameter or module does): the other answers,
    which read parameters, modules and the optimizer, are the same before and after it.
    """

    def __init__(self, source: Any, seq: int | None) -> None:
        with torch.device("meta"):
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
        """Why the fused linear + cross-entropy does not apply to this model (None: it does)."""
        try:
            use_fused_loss(self.workload.model)
        except GobrrrError as e:
            return str(e)
        return None

    def states_refusal(self, states: str) -> str | None:
        """Why the optimizer cannot keep its states as `states` ("bf16", "8bit"; None: it
        can)."""
        if states not in self._states:
            self._states[states] = _refusal(traced_states_optimizer, self.optimizer, states)
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
        return _refusal(adam_hyper, opt)  # an option the offloaded one lacks (amsgrad, maximize)


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


def _refusal(check, *args) -> str | None:
    """What `check(*args)` refuses, in its words (None: it takes them)."""
    with torch.device("meta"):
        try:
            check(*args)
        except GobrrrError as e:
            return str(e)
    return None


__all__ = ["Probe", "samples"]
