"""The state torch's Adam and AdamW keep, made as their first step makes it, without the step.

The capture runs one untraced warm-up step so that the recorded step is a steady-state one:
its optimizer state exists. For an arbitrary optimizer that warm-up is the whole step (what
it creates, and what it reads of the values, are the optimizer's own). For torch.optim's
Adam and AdamW, the built-in models' optimizer, what the first step leaves behind is known:
each stepped parameter's state made by the optimizer's own `_init_group` (the step count, the
moments, AMSGrad's maximum) and its step count moved on by one, as `_single_tensor_adam` and
`_multi_tensor_adam` do. The parameter update and the moments' update change no tensor's
shape, dtype or storage, so the recorded step that follows is op for op the same; the update
is about a tenth of a 70B trace (fake-tensor dispatch of every foreach op over 723
parameters), and the planner traces six times per plan.
"""

from __future__ import annotations

import functools
import inspect

import torch
from torch.optim import optimizer as _optimizer

#: the optimizers whose first step's state `init_state` makes (exact classes: a subclass may
#: step differently)
DIRECT = (torch.optim.Adam, torch.optim.AdamW)

#: `_init_group`'s parameters as `init_state` calls it (torch 2.x's Adam)
_INIT_GROUP = (
    "self",
    "group",
    "params_with_grad",
    "grads",
    "exp_avgs",
    "exp_avg_sqs",
    "max_exp_avg_sqs",
    "state_steps",
)


@functools.cache
def _init_group_known(cls: type) -> bool:
    return tuple(inspect.signature(cls._init_group).parameters) == _INIT_GROUP


def direct(opt: torch.optim.Optimizer) -> bool:
    """Whether `init_state` makes what `opt`'s first step would leave: torch's own Adam or
    AdamW, on the per-tensor or foreach path (not fused, capturable or differentiable, whose
    step counts live elsewhere or carry autograd), without step hooks (a hook would see the
    step) and with no state yet."""
    if type(opt) not in DIRECT or not _init_group_known(type(opt)) or opt.state:
        return False
    if opt._optimizer_step_pre_hooks or opt._optimizer_step_post_hooks:
        return False
    if _optimizer._global_optimizer_pre_hooks or _optimizer._global_optimizer_post_hooks:
        return False
    return all(
        not g.get("fused") and not g.get("capturable") and not g.get("differentiable")
        for g in opt.param_groups
    )


def init_state(opt: torch.optim.Optimizer) -> None:
    """The state `opt`'s first step leaves (see the module docstring), for the parameters
    that have a gradient (`direct(opt)` must hold)."""
    for group in opt.param_groups:
        params: list[torch.Tensor] = []
        steps: list[torch.Tensor] = []
        opt._init_group(group, params, [], [], [], [], steps)
        if not steps:
            continue
        if group.get("foreach"):
            _foreach_steps(params, steps)
        else:
            for step in steps:  # _single_tensor_adam
                step += 1


def _foreach_steps(params: list[torch.Tensor], steps: list[torch.Tensor]) -> None:
    """`_multi_tensor_adam`'s step counts moved on: per group of parameters of one device
    and dtype, one foreach add (the CPU's with a tensor one)."""
    grouped = torch.optim.Optimizer._group_tensors_by_device_and_dtype([params, steps])
    for (_, group_steps), _ in grouped.values():
        if group_steps[0].is_cpu:
            torch._foreach_add_(group_steps, torch.tensor(1.0, device="cpu"), alpha=1.0)
        else:
            torch._foreach_add_(group_steps, 1)
