"""The one real training step: what `capture` traces, `profile` measures and `apply` runs.

    step = TrainStep(workload, optimizer, "bf16-mixed", device_type="cuda", accumulation=4)
    loss = step(batch)            # one optimizer step over the whole batch

One optimizer step: the batch is split along dim 0 into `accumulation` equal micro-batches;
each runs forward + loss (under the precision's autocast) and backward (through the fp16
GradScaler), its loss scaled by 1/accumulation so the gradients add up to those of the mean
over the batch; then optimizer.step and zero_grad(set_to_none=True).

Accumulation is exact for a loss that is a mean over samples of equal weight. A loss that
is a mean over valid tokens (cross-entropy with ignore_index, padding masks) averages each
micro-batch over its own tokens: where the micro-batches hold unequal numbers of valid
tokens, the accumulated loss is the mean of the micro-batch means, not the mean over all the
batch's tokens, exactly as in any gradient-accumulation loop.

A workload with `forward_backward=fn` runs fn(model, micro_batch) instead of forward and
backward: fn calls backward itself. Each backward it starts (torch.autograd.backward, which
Tensor.backward calls) runs on its tensors scaled by 1/accumulation and through the fp16
GradScaler, outside autocast, exactly the arithmetic of `(loss / n)` then `scaler.scale(...)
.backward()` above: the gradients are those of gobrrr's own step, bit for bit. fn must not step
an optimizer (gobrrr steps once, after the last micro-batch) and must produce gradients.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from typing import Any

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook

from gobrrr.errors import GobrrrError
from gobrrr.precision import Precision, autocast_dtype, check_precision
from gobrrr.workload import Batch, Workload, _leaves, forward_backward_loss, map_tensors

PhaseContext = Callable[[str], contextlib.AbstractContextManager]


def autocast_for(precision: str | Precision, device_type: str) -> contextlib.AbstractContextManager:
    """torch.autocast for the mixed precisions, a no-op otherwise."""
    dtype = autocast_dtype(precision)
    return torch.autocast(device_type, dtype=dtype) if dtype else contextlib.nullcontext()


def make_scaler(precision: str | Precision, device_type: str) -> torch.amp.GradScaler | None:
    """The loss scaler fp16-mixed needs (fp16 gradients underflow without it); None otherwise."""
    return torch.amp.GradScaler(device_type) if Precision.parse(precision).needs_scaler else None


def cast_batch(batch: Batch, precision: str | Precision) -> Batch:
    """The batch as the precision runs it: floating tensors in bfloat16 for pure "bf16"
    (the model's weights are bf16 too), unchanged otherwise."""
    dtype = Precision.parse(precision).param_dtype
    if dtype == torch.float32:
        return batch
    return map_tensors(batch, lambda t: t.to(dtype) if t.is_floating_point() else t)


def batch_size(batch: Batch) -> int:
    """Samples in a batch: the common leading dimension of its tensors. A GobrrrError names
    the tensors when they disagree or one has no leading dimension."""
    sizes = {where: t.shape[0] if t.dim() else None for where, t in _tensor_leaves(batch)}
    if not sizes:
        raise GobrrrError("the batch holds no tensor: give the model's inputs as tensors")
    if None in sizes.values() or len(set(sizes.values())) > 1:
        listing = ", ".join(f"{w} {'a scalar' if n is None else n}" for w, n in sizes.items())
        raise GobrrrError(
            f"the batch's tensors do not share a leading (sample) dimension "
            f"({listing}): give every tensor the batch's samples along dim 0"
        )
    return next(iter(sizes.values()))


def split_batch(batch: Batch, parts: int) -> list[Batch]:
    """`batch` split along dim 0 into `parts` equal micro-batches (views, no copies), the
    structure kept (tensors, tuples/lists, dicts; other leaves repeated in each part)."""
    if parts == 1:
        return [batch]
    n = batch_size(batch)
    if n % parts:
        raise GobrrrError(
            f"a batch of {n} samples does not split into {parts} equal "
            f"micro-batches: give a batch that is a multiple of {parts} samples"
        )
    size = n // parts
    return [map_tensors(batch, lambda t, i=i: t[i * size : (i + 1) * size]) for i in range(parts)]


def _tensor_leaves(x: Any, where: str = "batch"):
    """(path, tensor) of every tensor leaf of a batch (see workload's _leaves)."""
    return ((w, v) for w, v in _leaves(x, where) if isinstance(v, torch.Tensor))


class TrainStep:
    """One optimizer step of a workload, callable: `step(batch=None)` (the workload's own
    batch when None) runs it and returns the loss of the whole batch (detached; the mean of
    the micro-batch losses), or None when `keep_loss` is False.

    Args:
        workload: the step's model (as it runs: compiled, checkpointed, ...) and its loss.
        optimizer: steps the model's parameters.
        precision: one of gobrrr.precision.PRECISIONS; the mixed ones run forward and loss
            under autocast on `device_type`. (Casting weights and inputs for pure "bf16" is
            the caller's: `cast_batch`, and the model converted before the optimizer is made.)
        device_type: "cuda" or "cpu", for autocast.
        accumulation: micro-batches per optimizer step (the batch's samples must divide).
        scaler: the fp16 GradScaler (see make_scaler) or None.
        phase: a context manager factory wrapped around each phase ("forward", "backward",
            "optimizer"), e.g. a profiler range; none by default.
        keep_loss: return the loss. Off, each micro-batch's loss is freed right after its
            backward (the trace of the step then holds it no longer than it must).
        sync: `sync(last)` is entered around each micro-batch's forward and backward, True
            on the last (data parallelism's gradient sync, `distributed.gradient_sync`).
    """

    def __init__(
        self,
        workload: Workload,
        optimizer: torch.optim.Optimizer,
        precision: str | Precision,
        *,
        device_type: str = "cuda",
        accumulation: int = 1,
        scaler: torch.amp.GradScaler | None = None,
        phase: PhaseContext | None = None,
        keep_loss: bool = True,
        sync: Callable[[bool], contextlib.AbstractContextManager] | None = None,
    ) -> None:
        check_precision(precision)
        if accumulation < 1:
            raise GobrrrError(f"accumulation={accumulation}: give 1 or more micro-batches")
        self.workload, self.optimizer, self.precision = workload, optimizer, precision
        self.device_type, self.accumulation, self.scaler = device_type, accumulation, scaler
        self._phase = phase
        self.keep_loss = keep_loss
        self._sync = sync or (lambda last: contextlib.nullcontext())

    def phase(self, name: str) -> contextlib.AbstractContextManager:
        return self._phase(name) if self._phase is not None else contextlib.nullcontext()

    def __call__(self, batch: Batch | None = None) -> torch.Tensor | None:
        micro = split_batch(self.workload.batch if batch is None else batch, self.accumulation)
        total = None
        for i, mb in enumerate(micro):
            with self._sync(i == len(micro) - 1):  # data-parallel: sync on the last only
                if self.workload.forward_backward is not None:
                    loss = self.forward_backward(mb)  # its own loss, not scaled by 1/n
                else:
                    loss = self.forward(mb)
                    self.backward(loss)
            if self.keep_loss:
                part = loss.detach()
                if self.workload.forward_backward is not None and self.accumulation > 1:
                    part = part / self.accumulation
                total = part if total is None else total + part
            del loss
        with self.phase("optimizer"):
            self.optimizer_step()
        return total

    def forward(self, micro_batch: Batch) -> torch.Tensor:
        """Forward and loss of one micro-batch, scaled by 1/accumulation."""
        with self.phase("forward"), autocast_for(self.precision, self.device_type):
            loss = self.workload.compute_loss(micro_batch)
            return loss / self.accumulation if self.accumulation > 1 else loss

    def backward(self, loss: torch.Tensor) -> None:
        with self.phase("backward"):
            (self.scaler.scale(loss) if self.scaler is not None else loss).backward()

    def forward_backward(self, micro_batch: Batch) -> torch.Tensor:
        """The workload's forward_backward(model, micro_batch), under the precision's
        autocast; the backward it starts runs through `user_backward`. Returns its loss (not
        scaled). A GobrrrError where it produced no gradient or stepped an optimizer."""
        fn = self.workload.forward_backward
        params = [p for p in self.workload.model.parameters() if p.requires_grad]
        before = _grad_marks(params)
        with (
            self.phase("forward"),
            autocast_for(self.precision, self.device_type),
            _backward_through(self.user_backward),
            _no_optimizer_step(),
        ):
            out = fn(self.workload.model, micro_batch)
        loss = forward_backward_loss(out)
        if _grad_marks(params) == before:
            raise GobrrrError(
                "Workload(forward_backward=...) produced no gradient: it never called backward",
                hint="call loss.backward() inside it (gobrrr scales it for accumulation and "
                "steps the optimizer afterwards), or give step= and let gobrrr call backward",
            )
        return loss

    def user_backward(self, run: Callable[[Any], Any], tensors: Any) -> Any:
        """A backward the workload's forward_backward started: `run(tensors)` on its tensors
        scaled as `forward` and `backward` scale the loss (1/accumulation, the GradScaler),
        outside autocast, as backward runs in gobrrr's own step."""
        with self.phase("backward"), _no_autocast(self.device_type):
            return run(_map_loss(tensors, self._scaled))

    def _scaled(self, loss: torch.Tensor) -> torch.Tensor:
        if self.accumulation > 1:
            loss = loss / self.accumulation
        return self.scaler.scale(loss) if self.scaler is not None else loss

    def optimizer_step(self) -> None:
        """optimizer.step (through the GradScaler, which skips a step whose gradients hold an
        inf or NaN) and zero_grad(set_to_none=True)."""
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
        else:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)


def _grad_marks(params: list[torch.Tensor]) -> list[tuple[int, int] | None]:
    """What each parameter's .grad is now (its identity and version): a backward that reached
    a parameter sets a new .grad or adds into it in place, changing one or the other."""
    return [None if p.grad is None else (id(p.grad), p.grad._version) for p in params]


def _map_loss(tensors: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """torch.autograd.backward's `tensors` (one tensor or a sequence) with fn applied."""
    if isinstance(tensors, torch.Tensor):
        return fn(tensors)
    return [fn(t) for t in tensors]


@contextlib.contextmanager
def _backward_through(hook: Callable[[Callable[[Any], Any], Any], Any]):
    """While the block runs, torch.autograd.backward(tensors, ...) (what Tensor.backward
    calls) goes through hook(run, tensors), run(tensors) doing the original call."""
    original = torch.autograd.backward

    def backward(tensors, *args, **kwargs):
        return hook(lambda ts: original(ts, *args, **kwargs), tensors)

    torch.autograd.backward = backward
    try:
        yield
    finally:
        torch.autograd.backward = original


@contextlib.contextmanager
def _no_optimizer_step():
    """A GobrrrError if any optimizer steps while the block runs (the workload's
    forward_backward must leave the step, and the accumulation, to gobrrr)."""

    def refuse(opt, args, kwargs):
        raise GobrrrError(
            f"Workload(forward_backward=...) called {type(opt).__name__}.step() itself",
            hint="leave the optimizer step to gobrrr: it accumulates the micro-batches' "
            "gradients and steps once (give the optimizer as Workload(optimizer=...))",
        )

    handle = register_optimizer_step_pre_hook(refuse)
    try:
        yield
    finally:
        handle.remove()


def _no_autocast(device_type: str) -> contextlib.AbstractContextManager:
    """Autocast off (backward runs outside it in gobrrr's own step)."""
    if torch.is_autocast_enabled(device_type):
        return torch.autocast(device_type, enabled=False)
    return contextlib.nullcontext()


__all__ = ["TrainStep", "autocast_for", "batch_size", "cast_batch", "make_scaler", "split_batch"]
