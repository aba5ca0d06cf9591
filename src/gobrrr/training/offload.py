"""CPU offload of the optimizer, as the step graph sees it: a trace-time stand-in of torchao's
CPUOffloadOptimizer (what `gobrrr.apply` runs for offload=True, gobrrr.training.optimizers)
and the host memory it needs.

What torchao's CPUOffloadOptimizer does (torchao/optim/cpu_offload.py), and the ops that
stand for it in the graph (gobrrr:: custom ops, no kernels, costed in cost/_ops_offload.py
and scheduled on their own timelines in cost/roofline.py):

- every trainable parameter of at least MINIMAL_SIZE elements gets a pinned host copy of
  itself and of its gradient, and its own base optimizer on the host (AdamW: fused, on the
  CPU); smaller ones keep one optimizer of the base class on the GPU;
- a post-accumulate-grad hook on each offloaded parameter copies its gradient to the host on
  a side stream, behind everything the compute stream was given so far
  (`gobrrr::offload_grad_d2h`, in backward, on every micro-batch);
- step(): the GPU optimizer steps the small parameters; then, parameter after parameter in the
  order their gradients were ready, the host waits for that copy, runs the CPU step
  (`gobrrr::offload_cpu_step`) and queues the parameter's copy back to the GPU on the side
  stream (`gobrrr::offload_param_h2d`); it returns once the last copy has landed.

On the GPU the step keeps parameters and gradients; optimizer states only for the small
parameters.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph
from gobrrr.training.optimizers import adam_hyper

#: torchao's default: parameters with fewer elements stay on the GPU with their optimizer.
MINIMAL_SIZE = 4096

#: The graph's offload ops, by role.
D2H, CPU_STEP, H2D = (
    "gobrrr.offload_grad_d2h.default",
    "gobrrr.offload_cpu_step.default",
    "gobrrr.offload_param_h2d.default",
)


@torch.library.custom_op("gobrrr::offload_grad_d2h", mutates_args=())
def offload_grad_d2h(param: torch.Tensor) -> None:
    """Stands for: copy param.grad into its pinned host copy on the side stream (no kernel)."""


@torch.library.custom_op("gobrrr::offload_cpu_step", mutates_args=())
def offload_cpu_step(param: torch.Tensor, optimizer: str) -> None:
    """Stands for: the base optimizer's step of param's host copy, on the CPU. optimizer:
    "adamw" (torch's AdamW, fused, as torchao makes it), "adam", or the class's name."""


@torch.library.custom_op("gobrrr::offload_param_h2d", mutates_args=())
def offload_param_h2d(param: torch.Tensor) -> None:
    """Stands for: copy param's updated host copy back into it, on the side stream."""


for _op in (offload_grad_d2h, offload_param_h2d):
    _op.register_fake(lambda param: None)
offload_cpu_step.register_fake(lambda param, optimizer: None)


class OffloadStandIn(torch.optim.Optimizer):
    """CPUOffloadOptimizer(params, optimizer_class, offload_gradients=False, **kwargs) as a
    traced step runs it: the same split of the parameters, the GPU optimizer for the small
    ones (a real one: its ops and states are traced), the hooks and the step's loop as
    gobrrr:: ops. `state` holds the GPU optimizer's states only (the host's are no GPU
    memory)."""

    def __init__(
        self,
        params: Iterable,
        optimizer_class: type = torch.optim.AdamW,
        *,
        minimal_size: int = MINIMAL_SIZE,
        **kwargs: Any,
    ) -> None:
        if optimizer_class is torch.optim.AdamW and "fused" not in kwargs:
            kwargs["fused"] = True  # torchao's default, on the host and the GPU alike
        self.cpu_optimizer = _cpu_name(optimizer_class, kwargs)
        groups = list(params)
        if groups and not isinstance(groups[0], dict):
            groups = [{"params": groups}]
        super().__init__([dict(g, params=list(g["params"])) for g in groups], dict(kwargs))
        self.offloaded: list[torch.Tensor] = []
        self.queue: dict[torch.Tensor, None] = {}  # grad-ready order, as torchao's
        small = []
        for g in groups:
            keep = [p for p in g["params"] if p.requires_grad and p.numel() < minimal_size]
            self.offloaded += [
                p for p in g["params"] if p.requires_grad and p.numel() >= minimal_size
            ]
            if keep:
                small.append(dict(g, params=keep))
        for p in self.offloaded:
            p.register_post_accumulate_grad_hook(self._grad_ready)
        self.d_opt = (
            optimizer_class(small, **_gpu_defaults(optimizer_class, kwargs)) if small else None
        )
        self.state = self.d_opt.state if self.d_opt else {}

    def _grad_ready(self, p: torch.Tensor) -> None:
        torch.ops.gobrrr.offload_grad_d2h(p)
        self.queue.pop(p, None)  # a later micro-batch moves it to the end
        self.queue[p] = None

    @torch.no_grad()
    def step(self, closure=None):
        if self.d_opt is not None:
            self.d_opt.step()
        for p in self.queue:
            torch.ops.gobrrr.offload_cpu_step(p, self.cpu_optimizer)
            torch.ops.gobrrr.offload_param_h2d(p)
        self.queue.clear()


def _cpu_name(cls: type, kwargs: dict[str, Any]) -> str:
    """What runs each offloaded parameter's step on the host, as the calibration keys it."""
    if cls is torch.optim.AdamW and kwargs.get("fused"):
        return "adamw"
    if cls is torch.optim.Adam and not kwargs.get("fused"):
        return "adam"
    return f"{cls.__name__.lower()}{'-fused' if kwargs.get('fused') else ''}"


def _gpu_defaults(cls: type, kwargs: dict[str, Any]) -> dict[str, Any]:
    """The GPU optimizer's arguments: CUDA's foreach where neither fused nor foreach is set
    (torch would pick its per-tensor loop for fake tensors)."""
    if kwargs.get("fused") or "foreach" in kwargs:
        return kwargs
    return {**kwargs, "foreach": True}


def stand_in(opt: torch.optim.Optimizer) -> OffloadStandIn:
    """The stand-in of `gobrrr.training.optimizers.states_optimizer(opt, "as-is",
    offload=True)`: the user's Adam/AdamW, its groups and hyper-parameters, around torch's
    AdamW (fused) or Adam."""
    decoupled, groups = adam_hyper(opt)
    return OffloadStandIn(groups, torch.optim.AdamW if decoupled else torch.optim.Adam)


def pinned_bytes(nbytes: int) -> int:
    """Bytes the CUDA host allocator takes for a pinned tensor of `nbytes`: the next power of
    two (CachingHostAllocator's default rounding)."""
    return 1 << max(nbytes - 1, 0).bit_length() if nbytes > 0 else 0


def offloaded_params(graph: StepGraph) -> dict[int, tuple[int, str]]:
    """{parameter storage id: (elements, dtype)} of every parameter the graph offloads (those
    whose gradients it copies to the host), in the order of their first copy."""
    out: dict[int, tuple[int, str]] = {}
    for n in graph.nodes:
        if n.op == D2H and n.inputs and n.inputs[0].storage not in out:
            t = n.inputs[0]
            out[t.storage] = (t.numel, t.dtype)
    return out


def host_bytes(graph: StepGraph) -> dict[str, int]:
    """Host memory an offloaded step needs (bytes): "pinned", the host copies of the offloaded
    parameters and their gradients (CUDA's pinned allocator rounds each to a power of two);
    "states", the base optimizer's states on the host (Adam: two moments in the parameter's
    dtype and a 4-byte step count per parameter); "total". All zero without offload."""
    pinned = states = 0
    for numel, dtype in offloaded_params(graph).values():
        nbytes = numel * _itemsize(dtype)
        pinned += 2 * pinned_bytes(nbytes)
        states += 2 * nbytes + 4
    return {"pinned": pinned, "states": states, "total": pinned + states}


def _itemsize(dtype: str) -> int:
    try:
        return getattr(torch, dtype).itemsize
    except AttributeError:
        raise GobrrrError(f"unknown dtype {dtype!r} of an offloaded parameter") from None


__all__ = [
    "MINIMAL_SIZE",
    "OffloadStandIn",
    "host_bytes",
    "offloaded_params",
    "pinned_bytes",
    "stand_in",
]
