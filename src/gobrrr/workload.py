"""What a user writes to describe their own training step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

Batch = Any  # a tensor, a tuple/list of tensors, or a dict of tensors


@dataclass
class Workload:
    """One training step: `loss = loss_fn(model(*batch), batch)`, backward, optimizer step.

    Fields:
        model: the nn.Module to train.
        batch: the inputs. A tuple/list is unpacked into model(*batch), a dict into
            model(**batch), a single tensor passed as model(batch) (unless `step` is given).
        loss: None when model(...) returns the loss itself (a scalar tensor, or an object
            with a `.loss` attribute, or a tuple whose first element is the loss); otherwise
            a callable loss(output, batch) -> scalar tensor.
        step: the forward and loss of one step written out, step(model, batch) -> scalar
            loss, for batches the model does not take whole (e.g. images and labels:
            `step=lambda m, b: F.cross_entropy(m(b[0]), b[1])`). When given, `loss` must be
            None and the batch is passed to it as it is.
        optimizer: a callable params -> torch.optim.Optimizer (default AdamW, lr 3e-4).
        tokens: tokens (or samples) per step, for throughput; inferred from the batch's first
            integer tensor's numel, else its first dimension, when None.
        name: shown in reports.
        seq_len: sequence length, for the attention term of model FLOPs (None if not a
            sequence model).
        max_seq_len: the longest sequence the model accepts, to reject impossible --seq.
        info: free-form facts about the model (layers, hidden, heads, vocab) used by the
            closed-form formulas when present.
    """

    model: nn.Module
    batch: Batch
    loss: Callable[[Any, Batch], torch.Tensor] | None = None
    optimizer: Callable[[Iterable[nn.Parameter]], torch.optim.Optimizer] | None = None
    step: Callable[[nn.Module, Batch], Any] | None = None
    tokens: int | None = None
    name: str = "workload"
    seq_len: int | None = None
    max_seq_len: int | None = None
    info: dict[str, Any] = field(default_factory=dict)

    def make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is None:
            return torch.optim.AdamW(params, lr=3e-4)
        return self.optimizer(params)

    def run_model(self, batch: Batch) -> Any:
        if isinstance(batch, dict):
            return self.model(**batch)
        if isinstance(batch, (tuple, list)):
            return self.model(*batch)
        return self.model(batch)

    def compute_loss(self, batch: Batch) -> torch.Tensor:
        if self.step is not None:
            return extract_loss(self.step(self.model, batch))
        out = self.run_model(batch)
        if self.loss is not None:
            return self.loss(out, batch)
        return extract_loss(out)

    def token_count(self) -> int:
        if self.tokens is not None:
            return self.tokens
        tensors = list(iter_tensors(self.batch))
        for t in tensors:
            if not t.is_floating_point():
                return t.numel()
        return tensors[0].shape[0] if tensors and tensors[0].dim() > 0 else 1


def extract_loss(out: Any) -> torch.Tensor:
    """The loss from what a model returned, or a clear error."""
    from gobrrr.errors import GobrrrError

    if isinstance(out, torch.Tensor):
        loss = out
    elif hasattr(out, "loss") and isinstance(out.loss, torch.Tensor):
        loss = out.loss
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss = out[0]
    else:
        raise GobrrrError(
            f"the model returned {type(out).__name__}, not a loss: give Workload(loss=...) "
            "a function (output, batch) -> scalar tensor"
        )
    if loss.numel() != 1:
        raise GobrrrError(
            f"the loss has shape {tuple(loss.shape)}, expected a scalar: reduce it (e.g. .mean()) "
            "or give Workload(loss=...)"
        )
    return loss


def embedding_only_params(model: nn.Module) -> int:
    """Parameters used only as embedding lookups (no matmul per token: they are left out of
    the 6·N of model FLOPs). An embedding tied to an output head takes part in a matmul and is
    not counted here."""
    users: dict[int, int] = {}
    for m in model.modules():
        for p in m._parameters.values():
            if p is not None:
                users[id(p)] = users.get(id(p), 0) + 1
    seen: set[int] = set()
    total = 0
    for m in model.modules():
        w = getattr(m, "weight", None)
        if isinstance(m, nn.Embedding) and id(w) not in seen and users.get(id(w)) == 1:
            seen.add(id(w))
            total += w.numel()
    return total


def iter_tensors(x: Any):
    if isinstance(x, torch.Tensor):
        yield x
    elif isinstance(x, dict):
        for v in x.values():
            yield from iter_tensors(v)
    elif isinstance(x, (tuple, list)):
        for v in x:
            yield from iter_tensors(v)


def map_tensors(x: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    if isinstance(x, torch.Tensor):
        return fn(x)
    if isinstance(x, dict):
        return {k: map_tensors(v, fn) for k, v in x.items()}
    if isinstance(x, tuple):
        return tuple(map_tensors(v, fn) for v in x)
    if isinstance(x, list):
        return [map_tensors(v, fn) for v in x]
    return x
