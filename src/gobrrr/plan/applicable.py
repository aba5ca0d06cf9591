"""Whether `gobrrr.apply` can apply a knob to a workload, and why not.

The one place both sides ask: the planner leaves a knob out where apply would refuse it (and
its output says why, in one note line), and apply refuses it, before it changes anything, with
the same words as one GobrrrError line. Each function answers None (it applies) or the reason,
a sentence that names the value and the fix.

    fused_loss_refusal(workload)           the fused linear + cross-entropy
    optimizer_refusal(optimizer, states)   bf16 / 8-bit optimizer states, offload
    checkpoint_refusal(model, blocks)      checkpointing the named blocks
    compile_refusal(model, compile)        torch.compile per repeated block ("blocks")
    parallel_refusal(knobs, precision, blocks)   DDP / FSDP2 with the other knobs
    fp8_refusal(model)                     FP8 training of the linear layers
    cuda_graph_refusal(workload, knobs, precision, syncs)   the step captured as a CUDA graph
    refusal(workload, knobs, precision)    all of them, for one configuration (apply's check)

What the planner leaves out for its own reasons (offload costed for AdamW only, compile and
checkpointing not costed together) are limits of the costing, not of apply, and stay in the
planner. What depends on the machine apply runs on, not on the workload (offload needs CUDA,
8-bit states and FP8 need torchao, FP8 needs FP8 tensor cores, compile on a CPU needs a C
compiler, CUDA graphs need the model on a CUDA GPU), is checked where it runs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Any

import torch
from torch import nn

from gobrrr.errors import GobrrrError, did_you_mean
from gobrrr.plan.knobs import Knobs
from gobrrr.precision import Precision
from gobrrr.training.checkpointing import block_names
from gobrrr.training.cudagraph import optimizer_capture_refusal
from gobrrr.training.fp8 import fp8_refusal
from gobrrr.training.fused_loss import fused_loss_refusal as model_refusal
from gobrrr.training.optimizers import adam_hyper
from gobrrr.workload import Batch, Workload


def fused_loss_refusal(workload: Workload) -> str | None:
    """Why the fused linear + cross-entropy cannot replace the workload's head and loss (None:
    it can). The model must be one whose head and loss gobrrr takes over
    (gobrrr.training.fused_loss), and the loss must be the model's own: returned by the model
    (loss=None), or only read off its output by Workload(loss=...) (`out.loss`,
    `out["loss"]`, `out[0]`, or `out` itself), which the fused model computes the same way.
    A loss computed from anything else (the logits, the batch), a step= or a
    forward_backward= is the user's code, which gobrrr does not rewrite."""
    why = model_refusal(workload.model)
    if why:
        return why
    own = next((k for k in ("step", "forward_backward") if getattr(workload, k) is not None), None)
    if own:
        return (
            f"the workload computes its loss in Workload({own}=...), which gobrrr does not "
            "rewrite: let the model return its loss, or set fused_loss=False"
        )
    if workload.loss is not None and not reads_models_loss(workload.loss, workload.batch):
        return (
            "the workload computes its loss in Workload(loss=...) from more than the model's "
            "own loss, which gobrrr does not rewrite: let the model return its loss (loss=None, "
            "or loss=lambda out, batch: out.loss), or set fused_loss=False"
        )
    return None


class _Output:
    """Stands in for the model's output: records what a loss function reads off it."""

    def __init__(self) -> None:
        self.read: list[Any] = []

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):
            raise AttributeError(name)
        self.read.append(name)
        return _LOSS

    def __getitem__(self, key: Any) -> Any:
        self.read.append(key)
        return _LOSS


_LOSS = object()  # what the stand-in output hands out: the model's loss, as read


def reads_models_loss(loss, batch: Batch) -> bool:
    """Whether `loss(output, batch)` returns the model's own loss as it is: one read of
    `.loss`, `["loss"]` or `[0]` off the output, returned untouched, or the output itself
    (a model returning its loss). Called once on a stand-in output that records what is read;
    anything else (another read, arithmetic on it, an exception) is False."""
    out = _Output()
    try:
        got = loss(out, batch)
    except Exception:  # the user's code, handed a stand-in: it reads something else
        return False
    if got is out:
        return not out.read
    return got is _LOSS and out.read in (["loss"], [0])


def optimizer_refusal(optimizer: torch.optim.Optimizer, states: str, offload: bool = False):
    """Why the optimizer cannot be replaced by one keeping `states` ("bf16", "8bit") or
    offloaded to the host (None: it can): the replacements are Adam(W)s that carry the
    user's hyper-parameters (gobrrr.training.optimizers.adam_hyper)."""
    if states == "as-is" and not offload:
        return None
    try:
        adam_hyper(optimizer)
    except GobrrrError as e:
        return str(e)
    return None


def checkpoint_refusal(model: nn.Module, blocks: Iterable[str]) -> str | None:
    """Why the named blocks cannot be checkpointed (None: they can): each must be a module of
    `model`, named as model.named_modules() names it."""
    names = dict(model.named_modules())
    for block in blocks:
        if block not in names:
            return (
                f"checkpoint block {block!r} is not a module of "
                f"{type(model).__name__}{did_you_mean(block, names)}: name blocks "
                "as model.named_modules() does (e.g. 'transformer.h.3')"
            )
    return None


def compile_refusal(model: nn.Module, compile: str) -> str | None:
    """Why the model cannot be compiled as `compile` says (None: it can): "blocks" compiles
    each repeated block (an nn.ModuleList or nn.Sequential of two or more modules of one
    class, `gobrrr.training.checkpointing.repeated_blocks`), so the model must have some."""
    if compile != "blocks" or block_names(model):
        return None
    return (
        f"compile='blocks' compiles each repeated block, and this {type(model).__name__} has "
        "none (an nn.ModuleList or nn.Sequential of two or more modules of one class): "
        "compile the whole model (compile='model')"
    )


def parallel_refusal(knobs: Knobs, precision: str, blocks: Sequence[str]) -> str | None:
    """Why the knobs' data parallelism cannot run with the rest of them (None: it can, or
    there is none). blocks: the model's repeated blocks (FSDP2's units). DDP and FSDP2 run
    without compile (whole or per block) and offload (the plan costs neither under them);
    FSDP2 runs torchtitan's
    MixedPrecisionPolicy(param bf16, reduce fp32) over the repeated blocks."""
    if not knobs.distributed:
        return None
    if knobs.compiled or knobs.offload:
        return (
            f"parallel={knobs.parallel!r} with compile or offload is not planned (the plan "
            "costs neither under DDP or FSDP2): set compile='none' and offload=False"
        )
    if knobs.cuda_graph:
        return (
            f"parallel={knobs.parallel!r} with cuda_graph is not planned (gradient sync "
            "hooks and collectives are not captured here; the plan costs CUDA graphs on one "
            "GPU): set cuda_graph=False"
        )
    if knobs.fp8:
        return (
            f"parallel={knobs.parallel!r} with fp8 is not planned (the plan costs FP8 "
            "training on one GPU): set fp8=False"
        )
    if knobs.parallel == "fsdp" and (
        precision != "bf16-mixed" or knobs.weights != "as-is" or knobs.optimizer_states != "as-is"
    ):
        return (
            "parallel='fsdp' runs FSDP2 with MixedPrecisionPolicy(param bf16, reduce fp32): "
            f"give precision='bf16-mixed' (got {precision!r}) with weights and "
            "optimizer_states 'as-is'"
        )
    if knobs.parallel == "fsdp" and not blocks:
        return (
            "parallel='fsdp' takes the model's repeated blocks as its units, and it has no "
            "repeated blocks (an nn.ModuleList or nn.Sequential of two or more modules of one "
            "class): use parallel='ddp'"
        )
    return None


def refusal(
    workload: Workload, knobs: Knobs, precision: str, blocks: Sequence[str] = ()
) -> str | None:
    """Why apply cannot run `knobs` on `workload` at `precision` (None: it can), the first
    reason found; blocks: the model's repeated blocks (read with parallel 'fsdp')."""
    checks = [
        lambda: parallel_refusal(knobs, precision, blocks),
        lambda: knobs.fused_loss and fused_loss_refusal(workload),
        lambda: knobs.checkpoint and checkpoint_refusal(workload.model, dict(knobs.checkpoint)),
        lambda: compile_refusal(workload.model, knobs.compile),
        lambda: knobs.fp8 and fp8_refusal(workload.model),
        lambda: _optimizer_refusal(workload, knobs),
        lambda: cuda_graph_refusal(workload, knobs, precision),
    ]
    for check in checks:
        why = check()
        if why:
            return why
    return None


def _optimizer_refusal(workload: Workload, knobs: Knobs) -> str | None:
    if knobs.optimizer_states == "as-is" and not knobs.offload:
        return None  # the user's optimizer as it is: nothing to ask it
    # built to be asked (its class and groups), then dropped: no state exists before a step
    return optimizer_refusal(workload.make_optimizer(), knobs.optimizer_states, knobs.offload)


def cuda_graph_refusal(
    workload: Workload, knobs: Knobs, precision: str, syncs: Sequence[str] = ()
) -> str | None:
    """Why the step cannot be captured as one CUDA graph and replayed (None: it can, or
    knobs.cuda_graph is off). syncs: the ops after which the traced step waits for the GPU
    (the planner passes its trace's; apply has no trace, and a sync it meets while capturing
    is one GobrrrError line naming the step's line: `training.cudagraph.capture_error`).
    Captured: the whole step on one GPU, the user's numerics (no GradScaler, which reads
    found_inf on the host), an optimizer that steps on the GPU alone (capturable=True, or
    SGD), no offload, and none of the knobs not costed with it (compile, FP8, checkpointing,
    bf16 / 8-bit states)."""
    if not knobs.cuda_graph:
        return None
    if knobs.distributed:
        return parallel_refusal(knobs, precision, ())
    if knobs.offload or knobs.optimizer_states != "as-is":
        return (
            "cuda_graph with offload or bf16/8-bit optimizer states is not planned (their "
            "optimizers step on the host or are not capturable): set "
            "optimizer_states='as-is' and offload=False, or cuda_graph=False"
        )
    others = [k for k, on in (("compile", knobs.compiled), ("fp8", knobs.fp8)) if on]
    if knobs.checkpoint:  # checkpoint saves and restores the RNG state, not while capturing
        others.append("checkpoint")
    if others:
        return (
            f"cuda_graph with {' and '.join(others)} is not planned (not costed together; "
            "torch.compile's mode='reduce-overhead' captures graphs of its own): drop "
            f"{', '.join(others)} or set cuda_graph=False"
        )
    if Precision.parse(knobs.precision(precision)).needs_scaler:
        return (
            f"cuda_graph with precision {precision!r}: its GradScaler reads found_inf on the "
            "host every step (a sync a CUDA graph cannot capture): use bf16-mixed, or set "
            "cuda_graph=False"
        )
    if syncs:
        return (
            f"the step waits for the GPU after {syncs[0]} (a host sync: .item(), .cpu(), a "
            "data-dependent shape such as nonzero), which a CUDA graph cannot capture: "
            "remove it from the step, or set cuda_graph=False"
        )
    # built to be asked (its class and defaults), then dropped
    return optimizer_capture_refusal(workload.make_optimizer())


def check(workload: Workload, knobs: Knobs, precision: str, blocks: Sequence[str] = ()) -> None:
    """Raise the reason `refusal` finds as one GobrrrError line."""
    why = refusal(workload, knobs, precision, blocks)
    if why:
        raise GobrrrError(why)


__all__ = [
    "check",
    "checkpoint_refusal",
    "compile_refusal",
    "cuda_graph_refusal",
    "fp8_refusal",
    "fused_loss_refusal",
    "optimizer_refusal",
    "parallel_refusal",
    "reads_models_loss",
    "refusal",
]
