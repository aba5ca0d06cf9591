"""The whole training step captured once as a CUDA graph and replayed (`Knobs.cuda_graph`).

    step = CapturedStep(train_step, optimizer)   # train_step(batch) -> loss, one optimizer step
    loss = step(batch)                            # first call: warm up, capture, replay

PyTorch's "whole network capture" (torch.cuda.graphs docs), around gobrrr's TrainStep: on the
first call the batch is cloned into static input buffers; a few steps run on a side stream
(warm-up: cuBLAS picks its kernels, the optimizer makes its state, autograd its buffers);
their updates are undone (parameters and buffers restored, the optimizer's state tensors
zeroed, as a fresh Adam(W) or SGD holds them); the gradients are set to None so the captured
backward allocates them from the graph's private pool; the cache the warm-up left is emptied
(what `passes.cudagraph` predicts); then one step is captured with `torch.cuda.graph`. Each
call copies its batch into the static inputs and replays the graph: every micro-batch's
forward and backward and the optimizer step, with one launch. The loss returned is the
graph's static output tensor, overwritten by the next replay (clone it to keep it).

What cannot be captured: a host sync in the step (`.item()`, a data-dependent shape such as
`nonzero`, fp16's GradScaler reading found_inf), an optimizer that keeps host-side values (it
must take `capturable=True`, or be SGD), shapes that change between steps. A capture that
fails is one GobrrrError naming the line of the step that failed.
"""

from __future__ import annotations

import traceback
from collections.abc import Callable
from pathlib import Path

import torch
from torch import nn

from gobrrr.errors import GobrrrError
from gobrrr.workload import Batch, iter_tensors, map_tensors

WARMUP = 3  # steps run before capture, as PyTorch's whole-network example runs


def optimizer_capture_refusal(optimizer: torch.optim.Optimizer) -> str | None:
    """Why `optimizer` cannot step inside a captured CUDA graph (None: it can): it must take
    `capturable=True` (torch's Adam, AdamW, RMSprop, NAdam, RAdam, ...: step counts and bias
    corrections on the GPU) or keep nothing on the host (SGD)."""
    if isinstance(optimizer, torch.optim.SGD) or "capturable" in optimizer.defaults:
        return None
    return (
        f"cuda_graph captures the optimizer step, and {type(optimizer).__name__} has no "
        "capturable=True (it keeps values on the host): use torch's Adam, AdamW or SGD, or "
        "set cuda_graph=False"
    )


def make_capturable(optimizer: torch.optim.Optimizer) -> torch.optim.Optimizer:
    """`optimizer` set to step inside a graph: capturable=True in its defaults and every
    param group (read at each step; its state, made at the first step, then lives on the
    GPU). Made before its first step. SGD is left as it is."""
    if "capturable" in optimizer.defaults:
        optimizer.defaults["capturable"] = True
        for group in optimizer.param_groups:
            group["capturable"] = True
    return optimizer


class CapturedStep:
    """One training step replayed from a captured CUDA graph (see the module docstring).

    Args:
        step: runs one optimizer step on a batch and returns its loss (a TrainStep).
        model: whose parameters and buffers the warm-up's updates are undone on.
        optimizer: what `step` steps (made capturable, `make_capturable`).
        warmup: steps run on a side stream before capture.
    """

    def __init__(
        self,
        step: Callable[[Batch], torch.Tensor | None],
        model: nn.Module,
        optimizer: torch.optim.Optimizer,
        warmup: int = WARMUP,
    ) -> None:
        self.step, self.model, self.optimizer, self.warmup = step, model, optimizer, warmup
        self.graph: torch.cuda.CUDAGraph | None = None
        self.static: Batch | None = None
        self.loss: torch.Tensor | None = None

    def __call__(self, batch: Batch) -> torch.Tensor | None:
        if self.graph is None:
            self.static = map_tensors(batch, lambda t: t.clone())
            self._capture()
        else:
            for dst, src in zip(iter_tensors(self.static), iter_tensors(batch), strict=True):
                dst.copy_(src, non_blocking=True)
        self.graph.replay()
        return self.loss

    def _capture(self) -> None:
        kept = [t.detach().clone() for t in self._weights()]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(self.warmup):
                self._run("warming up")
        torch.cuda.current_stream().wait_stream(side)
        with torch.no_grad():  # the warm-up's updates undone, in place (the graph's addresses)
            for t, k in zip(self._weights(), kept, strict=True):
                t.copy_(k)
            for state in self.optimizer.state.values():
                for v in state.values():
                    if isinstance(v, torch.Tensor):
                        v.zero_()
        del kept
        self.optimizer.zero_grad(set_to_none=True)
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph):
                self.loss = self._run("capturing")
        except GobrrrError:
            raise
        except Exception as e:  # CUDA's own error, raised from inside the step
            raise GobrrrError(capture_error(e)) from None
        self.graph = graph

    def _run(self, doing: str) -> torch.Tensor | None:
        try:
            return self.step(self.static)
        except GobrrrError:
            raise
        except Exception as e:
            if doing == "capturing":
                raise
            raise GobrrrError(f"while {doing} for the CUDA graph: {e}") from e

    def _weights(self) -> list[torch.Tensor]:
        return [*self.model.parameters(), *self.model.buffers()]


def capture_error(e: BaseException) -> str:
    """One line for an exception raised while capturing: what failed, the line of the step
    it failed at (the innermost frame outside torch), and the fix. The capture's end raises
    its own error over the one the step raised ("operation failed due to a previous error
    during capture"): the step's, the first of the chain, is the one reported."""
    while e.__context__ is not None and e.__context__ is not e:
        e = e.__context__
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    torch_dir = str(Path(torch.__file__).parent)
    frames = [f for f in traceback.extract_tb(e.__traceback__) if torch_dir not in f.filename]
    ours = str(Path(__file__).parent.parent)
    user = [f for f in frames if ours not in f.filename] or frames
    where = f" at {user[-1].filename}:{user[-1].lineno} ({user[-1].line})" if user else ""
    return (
        f"the step cannot be captured as a CUDA graph{where}: {first}; a captured step "
        "must not sync the host (.item(), .cpu(), print of a tensor, nonzero or another "
        "data-dependent shape) nor change shapes: remove that from the step, or set "
        "cuda_graph=False"
    )


__all__ = [
    "WARMUP",
    "CapturedStep",
    "capture_error",
    "make_capturable",
    "optimizer_capture_refusal",
]
