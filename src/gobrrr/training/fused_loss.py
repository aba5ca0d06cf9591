"""The fused linear + cross-entropy in place of a model's output head and loss.

    use_fused_loss(model)      # gobrrr's GPT2/Llama, or a Hugging Face causal LM (also one
                               # inside a peft PeftModel: a LoRA fine-tune)

The model then never makes its (tokens, vocab) logits when it computes a loss: its final
hidden states, the head's weight and the targets go to gobrrr's fused kernel
(gobrrr.kernels.linear_cross_entropy), which runs on CUDA (or on the CPU under
TRITON_INTERPRET=1); elsewhere a torch reference path computes the same loss (logits, fp32
cross-entropy). Only the loss changes place: parameters, their names and the model's forward
without a loss (inference) stay as they were.
"""

from __future__ import annotations

import ast
import contextlib
import contextvars
import functools
import inspect
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gobrrr.errors import GobrrrError
from gobrrr.models.gpt2 import GPT2
from gobrrr.models.llama import Llama


def fused_linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, targets): gobrrr's fused kernel (no logits
    tensor) where it runs, else the torch reference (logits in the autocast dtype, the loss
    in fp32, as F.cross_entropy over `.float()` logits). hidden (..., d), weight (V, d),
    targets (...) with ignore_index for positions without a target; returns an fp32 scalar."""
    if _kernel_runs(hidden.device):
        from gobrrr.kernels import linear_cross_entropy  # lazy: triton is optional

        return linear_cross_entropy(hidden, weight, targets, bias, ignore_index, reduction)
    logits = F.linear(hidden, weight, bias)  # (..., V)
    return F.cross_entropy(
        logits.reshape(-1, logits.shape[-1]).float(),
        targets.reshape(-1),
        ignore_index=ignore_index,
        reduction=reduction,
    )


_AS_ON_CUDA = contextvars.ContextVar("gobrrr_fused_loss_as_on_cuda", default=False)


@contextlib.contextmanager
def as_on_cuda() -> Iterator[None]:
    """Within: the loss takes the kernel's path whatever the device (gobrrr.capture traces
    the step as CUDA runs it, on fake CPU tensors; the kernel's op has a fake kernel)."""
    token = _AS_ON_CUDA.set(True)
    try:
        yield
    finally:
        _AS_ON_CUDA.reset(token)


def _kernel_runs(device: torch.device) -> bool:
    if _AS_ON_CUDA.get():
        return True
    from gobrrr.kernels._util import is_interpreter, triton  # lazy: it imports triton

    return triton is not None and (
        device.type == "cuda" or (device.type == "cpu" and is_interpreter())
    )


def use_fused_loss(model: nn.Module) -> str:
    """Route `model`'s loss through fused_linear_cross_entropy, in place; returns what was
    changed, in words. Takes gobrrr's built-in GPT2 and Llama (their `head_loss`) and
    Hugging Face causal LMs whose forward hands `lm_head`'s output straight to the standard
    causal-LM loss (e.g. LlamaForCausalLM, GPT2LMHeadModel); any other model is a
    GobrrrError saying why. A peft PeftModel (LoRA) is changed in the model it wraps: its
    head is usually frozen, and the fused loss then makes no gradient for it."""
    if getattr(model, "_gobrrr_fused_loss", False):
        return "already fused"
    why = fused_loss_refusal(model)
    if why:
        raise GobrrrError(why)
    inner = peft_base(model)
    if inner is not model:
        what = use_fused_loss(inner)
        model._gobrrr_fused_loss = True
        return f"peft {type(model).__name__} over {what}"
    if isinstance(model, (GPT2, Llama)):
        norm = model.transformer.ln_f if isinstance(model, GPT2) else model.norm
        model.head_loss = functools.partial(_head_loss, norm, model.lm_head)
        what = f"gobrrr {type(model).__name__}: lm_head + cross-entropy fused"
    else:
        what = _use_in_hf(model)
    model._gobrrr_fused_loss = True
    return what


def fused_loss_refusal(model: nn.Module) -> str | None:
    """Why use_fused_loss cannot take over `model`'s head and loss, as one GobrrrError line
    (None: it can)."""
    if getattr(model, "_gobrrr_fused_loss", False) or isinstance(model, (GPT2, Llama)):
        return None
    inner = peft_base(model)
    if inner is not model:
        why, name = fused_loss_refusal(inner), type(inner).__name__
        return why and why.replace(f"{name} ", f"{name} (in peft's {type(model).__name__}) ", 1)
    why = _hf_refusal(model)
    if why is None:
        return None
    return (
        f"fused_loss needs a model whose output head feeds a cross-entropy gobrrr can take "
        f"over, and {type(model).__name__} {why}: set fused_loss=False"
    )


def peft_base(model: nn.Module) -> nn.Module:
    """The model a peft PeftModel wraps (LoRA layers in place of its targets, the rest as it
    was), or `model` itself. peft is looked up only where it is already imported: a model
    cannot be a PeftModel otherwise."""
    peft = sys.modules.get("peft")
    if peft is None or not isinstance(model, peft.PeftModel):
        return model
    return model.get_base_model()


def _head_loss(
    norm: nn.Module, head: nn.Linear, x: torch.Tensor, targets: torch.Tensor
) -> torch.Tensor:
    """The built-in models' head_loss, fused: final norm, then the fused loss."""
    return fused_linear_cross_entropy(norm(x), head.weight, targets, head.bias)


# -- Hugging Face causal LMs ----------------------------------------------------------------


def _use_in_hf(model: nn.Module) -> str:
    name = type(model).__name__
    head, forward, state = model.lm_head, model.forward, {"on": False}
    labels_at = _labels_position(type(model).forward)

    def head_forward(x: torch.Tensor, _linear=head.forward) -> torch.Tensor:
        return x if state["on"] else _linear(x)  # the loss gets the hidden states

    def model_forward(*args, **kwargs):
        state["on"] = _given(args, kwargs, labels_at)
        try:
            out = forward(*args, **kwargs)
        finally:
            state["on"] = False
        if _given(args, kwargs, labels_at) and getattr(out, "logits", None) is not None:
            out["logits"] = None  # they were never made (what reads them gets None)
        return out

    head.forward = head_forward
    model.forward = model_forward
    model.loss_function = functools.partial(_causal_lm_loss, head)
    return f"transformers {name}: lm_head + causal-LM loss fused"


def _causal_lm_loss(
    head: nn.Linear,
    logits: torch.Tensor,
    labels: torch.Tensor,
    vocab_size: int,
    num_items_in_batch: Any = None,
    ignore_index: int = -100,
    shift_labels: torch.Tensor | None = None,
    **kwargs,
) -> torch.Tensor:
    """transformers' ForCausalLMLoss with `logits` the hidden states lm_head would have
    projected: labels shifted left (position t predicts t + 1), the mean over the labels !=
    ignore_index, or the sum over num_items_in_batch when the trainer gives it."""
    if shift_labels is None:
        shift_labels = F.pad(labels, (0, 1), value=ignore_index)[..., 1:]  # (B, T)
    shift_labels = shift_labels.to(logits.device)
    reduction = "sum" if num_items_in_batch is not None else "mean"
    loss = fused_linear_cross_entropy(
        logits, head.weight, shift_labels, head.bias, ignore_index, reduction
    )
    if num_items_in_batch is not None:
        if isinstance(num_items_in_batch, torch.Tensor):
            num_items_in_batch = num_items_in_batch.to(loss.device)
        loss = loss / num_items_in_batch
    return loss


def _hf_refusal(model: nn.Module) -> str | None:
    """Why a Hugging Face model cannot take the fused loss, or None when it can."""
    try:
        from transformers import PreTrainedModel
    except ImportError:
        PreTrainedModel = None  # noqa: N806
    if PreTrainedModel is None or not isinstance(model, PreTrainedModel):
        return (
            "is neither gobrrr's GPT2/Llama nor a Hugging Face causal LM (the fused loss "
            "replaces a known head and loss; a Workload(loss=) or (step=) of your own is "
            "not rewritten)"
        )
    if not isinstance(getattr(model, "lm_head", None), nn.Linear):
        return "has no nn.Linear lm_head"
    loss_name = getattr(model.loss_function, "__name__", type(model.loss_function).__name__)
    if loss_name != "ForCausalLMLoss":
        return f"computes its loss with {loss_name}, not the causal-LM cross-entropy"
    if not _head_feeds_loss(type(model).forward):
        return (
            "transforms the logits between lm_head and the loss (e.g. soft-capping or "
            "scaling them), or its forward could not be read"
        )
    return None


def _head_feeds_loss(forward: Any) -> bool:
    """Whether forward assigns `logits = self.lm_head(...)` once and uses `logits` only as an
    argument of self.loss_function(...) and as `logits=` of what it returns."""
    try:
        fn = ast.parse(textwrap.dedent(inspect.getsource(forward))).body[0]
    except (OSError, TypeError, SyntaxError, IndexError):
        return False
    assigns = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Assign)
        and any(isinstance(t, ast.Name) and t.id == "logits" for t in n.targets)
    ]
    if len(assigns) != 1 or not _calls_self(assigns[0].value, "lm_head"):
        return False
    allowed: set[int] = set()
    for node in ast.walk(fn):
        if isinstance(node, ast.Call) and _calls_self(node, "loss_function"):
            allowed |= {id(a) for a in [*node.args, *(k.value for k in node.keywords)]}
        if isinstance(node, ast.Return) and isinstance(node.value, ast.Call):
            allowed |= {id(k.value) for k in node.value.keywords if k.arg == "logits"}
    loads = [
        n
        for n in ast.walk(fn)
        if isinstance(n, ast.Name) and n.id == "logits" and isinstance(n.ctx, ast.Load)
    ]
    return bool(loads) and all(id(n) in allowed for n in loads)


def _calls_self(node: ast.AST, attr: str) -> bool:
    """node is a call `self.<attr>(...)`."""
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr == attr
        and isinstance(node.func.value, ast.Name)
        and node.func.value.id == "self"
    )


def _labels_position(forward: Any) -> int | None:
    """Index of `labels` among forward's positional arguments (self excluded), or None."""
    try:
        names = [
            p.name
            for p in inspect.signature(forward).parameters.values()
            if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        ]
    except (TypeError, ValueError):
        return None
    names = names[1:] if names and names[0] == "self" else names
    return names.index("labels") if "labels" in names else None


def _given(args: tuple, kwargs: dict, labels_at: int | None) -> bool:
    if kwargs.get("labels") is not None:
        return True
    return labels_at is not None and len(args) > labels_at and args[labels_at] is not None


__all__ = ["fused_linear_cross_entropy", "fused_loss_refusal", "peft_base", "use_fused_loss"]
