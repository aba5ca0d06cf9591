"""Apply a plan's knobs to the user's real model and optimizer, and run its step.

    from gobrrr.plan.apply import apply
    step = apply(workload, Knobs(micro_batch=8, accumulation=4, optimizer_states="bf16"))
    for batch in data:            # batches of micro_batch * accumulation = 32 samples
        loss = step(batch)        # one optimizer step; the loss of the whole batch

Before anything changes, every knob is checked with `plan.applicable` (the predicate the
planner asks too: what it plans, apply applies); a refusal is one GobrrrError line and leaves
the model as it was. A model apply changed is marked, and a second apply onto it refused: it
would keep the first plan's changes (docs/apply.md).

What each knob does to the real model (in the order applied, and why that order):
    1. precision "bf16" (the user's, or weights="bf16"): the model is cast to bfloat16
       first, so the optimizer and its states are made for the weights as they will train.
    2. fused_loss: the model's output head and cross-entropy become gobrrr's fused linear +
       cross-entropy (gobrrr.training.fused_loss); a change of the forward, so before compile.
    2b. fp8: each linear layer but the output head (dims multiples of 16) becomes torchao's
       Float8Linear (gobrrr.training.fp8.use_fp8); after the fused loss, which keeps the
       head it takes as it is, and before compile and checkpointing, which then compile and
       recompute the converted layers (torchtitan's order).
    3. compile "blocks": each repeated block's forward is replaced by torch.compile of it, in
       place (regional compilation: the blocks share one compilation, the rest of the model
       stays eager; the block's own call and its hooks stay eager too, as with
       `block.compile()` but around its forward only); before checkpointing, so that a
       checkpointed block is checkpoint(compiled forward) and recomputes compiled code.
    4. checkpoint: the named blocks' forwards are wrapped in activation checkpointing with
       their policy (gobrrr.training.checkpointing.apply_checkpointing); before compile
       "model", which traces through them.
    5. optimizer_states / offload: the workload's optimizer is built, its hyper-parameters
       read, and it is replaced by one keeping bf16 or 8-bit moments, on the host when
       offloaded (gobrrr.training.optimizers); it holds the parameters themselves, compiled or not.
    6. compile "model": torch.compile(model), last, over the model as it will run; the
       optimizer stays eager.
    7. micro_batch x accumulation: inside the returned step (gobrrr.training.step.TrainStep).
    8. cuda_graph: the optimizer made capturable (before its first step, so its state is made
       on the GPU), and the whole step (every micro-batch and the optimizer) captured as one
       CUDA graph on the first call, after a warm-up whose updates are undone, then
       replayed (gobrrr.training.cudagraph.CapturedStep); the loss returned is the graph's
       static tensor, overwritten by the next step.

With parallel "ddp" or "fsdp" (inside a torchrun process; `gobrrr plan --gpus N`): the process
joins the job first (gobrrr.training.distributed.process_group) and the model moves to the
rank's device; checkpointing and the fused loss change the model before it is wrapped (DDP
registers its hooks and FSDP2 its units over the modules as they will run); then
`data_parallel` wraps it (DDP, or FSDP2 on each repeated block and the root with
MixedPrecisionPolicy(param bf16, reduce fp32)); the optimizer is built after, over the
wrapped parameters (FSDP2's are DTensor shards). The step skips the gradient sync on every
micro-batch but the last (`gradient_sync`), and under FSDP2 runs without autocast (the policy
casts, as torchtitan does). Each rank's batch is its share: global_batch / gpus samples.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from gobrrr.errors import GobrrrError, did_you_mean
from gobrrr.plan import applicable
from gobrrr.plan.knobs import Knobs
from gobrrr.precision import Precision, check_precision
from gobrrr.training.checkpointing import apply_checkpointing, block_names
from gobrrr.training.cudagraph import CapturedStep, make_capturable
from gobrrr.training.fp8 import device_refusal, torchao_float8_refusal, use_fp8
from gobrrr.training.fused_loss import use_fused_loss
from gobrrr.training.optimizers import states_optimizer
from gobrrr.training.step import TrainStep, batch_size, cast_batch, make_scaler
from gobrrr.workload import Batch, Workload, map_tensors


class AppliedStep:
    """One optimizer step of the planned configuration: `step(batch=None)` runs it on a batch
    of knobs.global_batch samples (the workload's own batch when None) and returns the loss
    of the whole batch, detached (the mean of the micro-batches' losses).

    Attributes:
        model: the user's model, changed in place as planned (checkpoint wrappers, fused
            loss, bf16 weights, Float8Linear layers, compiled block forwards); under
            compile "model", `compiled` is what runs it (None otherwise).
        optimizer: the optimizer that steps it (the user's, or its bf16/8-bit/offloaded
            replacement).
        knobs: the configuration applied.
        precision: the numerics the step runs in.
        changes: what was changed, in words, one entry per knob that changed something.
    """

    def __init__(
        self,
        workload: Workload,
        model: nn.Module,
        runner: nn.Module,
        optimizer: torch.optim.Optimizer,
        knobs: Knobs,
        precision: str,
        changes: tuple[str, ...],
        device: torch.device | None = None,
    ) -> None:
        self.model, self.optimizer, self.knobs, self.precision = model, optimizer, knobs, precision
        self.compiled = runner if runner is not model and not knobs.distributed else None
        self.changes = changes
        self.device = device or _device_of(model)
        running = copy.copy(workload)  # the user's Workload object is left as it was
        running.model = runner
        # FSDP2's MixedPrecisionPolicy casts the parameters and floating inputs to bf16: the
        # step itself runs without autocast (fp32 as far as TrainStep knows), as torchtitan's
        numerics = "fp32" if knobs.parallel == "fsdp" else precision
        self._step = TrainStep(
            running,
            optimizer,
            numerics,
            device_type=self.device.type,
            accumulation=knobs.accumulation,
            scaler=make_scaler(numerics, self.device.type),
            # FSDP2 syncing each micro-batch (sync_each) is fully_shard's default: no hook
            sync=_sync(runner) if knobs.distributed and not knobs.sync_each else None,
        )
        if knobs.cuda_graph:  # captured on the first call, replayed after (training.cudagraph)
            self._step = CapturedStep(self._step, model, optimizer)
        self._batch = workload.batch
        self._own: Batch | None = None  # the workload's batch as the step runs it, made once

    def __call__(self, batch: Batch | None = None) -> torch.Tensor:
        """One optimizer step on `batch` (global_batch samples), or on the workload's own
        batch when None. The workload's batch is cast and moved to the device once, on the
        first call, and reused: a step must not pay a host-to-device copy a hand loop does not
        (a 512-image fp32 batch from pageable host memory is ~300 MB, tens of milliseconds).
        A batch given here is moved each call, as a loop moves what its data loader yields."""
        if batch is None:
            if self._own is None:
                self._own = self._as_run(self._batch)
            return self._step(self._own)
        return self._step(self._as_run(batch))

    def _as_run(self, batch: Batch) -> Batch:
        """The batch checked against the plan's global batch, cast for the precision and on
        the step's device."""
        n = batch_size(batch)
        if n != self.knobs.global_batch:
            if self.knobs.distributed:
                raise GobrrrError(
                    f"a batch of {n} samples, but this rank's share of the plan's global "
                    f"batch is micro_batch {self.knobs.micro_batch} x accumulation "
                    f"{self.knobs.accumulation} = {self.knobs.global_batch}: give each rank "
                    "global_batch / gpus samples"
                )
            raise GobrrrError(
                f"a batch of {n} samples, but the plan's global batch is micro_batch "
                f"{self.knobs.micro_batch} x accumulation {self.knobs.accumulation} = "
                f"{self.knobs.global_batch}: give batches of {self.knobs.global_batch} "
                f"samples, or plan for {n}"
            )
        return map_tensors(
            cast_batch(batch, self.precision), lambda t: t.to(self.device, non_blocking=True)
        )

    def __repr__(self) -> str:
        return f"AppliedStep({self.knobs}, precision={self.precision!r})"


def apply(
    workload: Workload, knobs: Knobs | Mapping[str, Any] | Any, precision: str = "bf16-mixed"
) -> AppliedStep:
    """Change the workload's real model and optimizer as `knobs` say and return the step
    that trains them (see the module docstring for what each knob does, and its order).

    knobs: a Knobs, its JSON form (Knobs.to_dict), or a plan entry with a `.knobs`.
    precision: the user's numerics (gobrrr.precision.PRECISIONS); the model stays on the
    device it is on. Every error is one GobrrrError line naming the value and the fix."""
    knobs = as_knobs(knobs)
    check_precision(precision)
    model = workload.model
    _check_fresh(model)
    # every knob checked before anything changes: a refused plan leaves the model as it was
    blocks = block_names(model) if knobs.parallel == "fsdp" else ()
    applicable.check(workload, knobs, precision, blocks)
    if knobs.fp8:  # what depends on this machine: torchao, and FP8 tensor cores
        _check_fp8(model)
    if knobs.cuda_graph and _device_of(model).type != "cuda":
        raise GobrrrError(
            f"cuda_graph captures the step on a CUDA GPU, and the model is on "
            f"{_device_of(model)}: move it with model.cuda() before apply, or set "
            "cuda_graph=False"
        )
    group = _join() if knobs.distributed else None  # not torchrun: one clear error
    precision = Precision.parse(knobs.precision(precision))
    changes = []
    if group is not None:
        model.to(group.device)
    if precision.casts_weights:
        model.to(precision.param_dtype)
        changes.append("weights in bfloat16")
    if knobs.fused_loss:
        changes.append(use_fused_loss(model))
    if knobs.fp8:
        changes.append(use_fp8(model))
    if knobs.compile == "blocks":
        changes.append(compile_blocks(model))
    if knobs.checkpoint:
        changes.append(checkpoint_blocks(model, dict(knobs.checkpoint)))
    if changes or group is not None:
        model._gobrrr_applied = str(knobs)  # a second apply onto it is refused (_check_fresh)
    runner = model
    if group is not None:
        from gobrrr.training.distributed import data_parallel

        runner = data_parallel(model, knobs.parallel, group, reshard_after_forward=knobs.reshard)
        changes.append(_wrapped(knobs, group.world))
    optimizer = states_optimizer(workload.make_optimizer(), knobs.optimizer_states, knobs.offload)
    if knobs.optimizer_states != "as-is" or knobs.offload:
        changes.append(f"optimizer {type(optimizer).__name__}")
    if knobs.cuda_graph:
        make_capturable(optimizer)
        changes.append("the whole step captured as one CUDA graph, replayed each step")
    if knobs.compile == "model":
        runner = torch.compile(model)
        changes.append("torch.compile(model)")
    device = group.device if group is not None else None
    return AppliedStep(
        workload, model, runner, optimizer, knobs, precision.name, tuple(changes), device
    )


def _check_fresh(model: nn.Module) -> None:
    """A model an earlier apply changed (bf16 weights, the fused head, checkpoint wrappers,
    moved and wrapped for data parallelism) would keep those changes under the next plan."""
    earlier = getattr(model, "_gobrrr_applied", None)
    if earlier is not None:
        raise GobrrrError(
            f"this {type(model).__name__} was already changed by apply({earlier}): build a "
            "fresh model and workload for each plan"
        )


def _check_fp8(model: nn.Module) -> None:
    """FP8 training needs torchao's float8 recipe here and FP8 tensor cores where the model
    is (the CPU runs torch._scaled_mm's reference kernel)."""
    why = torchao_float8_refusal() or device_refusal(_device_of(model))
    if why:
        raise GobrrrError(why)


def _join():
    """This process's place in the torchrun job (torch.distributed imported only here)."""
    from gobrrr.training.distributed import process_group

    return process_group()


def _sync(runner: nn.Module):
    from gobrrr.training.distributed import gradient_sync

    return functools.partial(gradient_sync, runner)


def _wrapped(knobs: Knobs, world: int) -> str:
    if knobs.parallel == "ddp":
        return f"DistributedDataParallel over {world} ranks"
    reshard = "reshard" if knobs.reshard else "no reshard"
    each = ", gradients reduce-scattered every micro-batch" if knobs.sync_each else ""
    return f"fully_shard (FSDP2) over {world} ranks, {reshard}{each}"


def as_knobs(knobs: Knobs | Mapping[str, Any] | Any) -> Knobs:
    """A Knobs from a Knobs, its dict form, or an object carrying `.knobs`; an unknown key is
    a GobrrrError naming it."""
    if isinstance(knobs, Knobs):
        return knobs
    if isinstance(getattr(knobs, "knobs", None), Knobs):
        return knobs.knobs
    if not isinstance(knobs, Mapping):
        raise GobrrrError(
            f"knobs={knobs!r} is a {type(knobs).__name__}: give a "
            "gobrrr.plan.knobs.Knobs (or its to_dict() form)"
        )
    fields = [f.name for f in dataclasses.fields(Knobs)]
    for key in knobs:
        if key not in fields:
            raise GobrrrError(
                f"unknown knob {key!r}{did_you_mean(str(key), fields)}: the knobs "
                f"are {', '.join(fields)}"
            )
    if "micro_batch" not in knobs:
        raise GobrrrError("knobs without micro_batch: give at least {'micro_batch': N}")
    return Knobs.from_dict(dict(knobs))


# -- checkpointing --------------------------------------------------------------------------


def checkpoint_blocks(model: nn.Module, policies: dict[str, str]) -> str:
    """Wrap the named blocks in activation checkpointing with their policies, through
    gobrrr.training.checkpointing.apply_checkpointing(model, policies)."""
    why = applicable.checkpoint_refusal(model, policies)
    if why:
        raise GobrrrError(why)
    apply_checkpointing(model, policies)
    counts = {p: sum(1 for v in policies.values() if v == p) for p in set(policies.values())}
    return "checkpoint " + ", ".join(f"{n} block(s) {p}" for p, n in sorted(counts.items()))


def compile_blocks(model: nn.Module) -> str:
    """Each repeated block's forward replaced by torch.compile of it (one compilation for
    all: dynamo guards on a block's structure, not on which block it is)."""
    names = block_names(model)
    for name in names:
        block = model.get_submodule(name)
        block.forward = torch.compile(block.forward)
    return f"torch.compile per block ({len(names)} blocks)"


def _device_of(model: nn.Module) -> torch.device:
    p = next(model.parameters(), None)
    return p.device if p is not None else torch.device("cpu")


__all__ = ["AppliedStep", "apply", "as_knobs", "checkpoint_blocks", "compile_blocks"]
