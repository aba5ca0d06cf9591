"""What a user writes to describe their own training step."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from gobrrr.errors import GobrrrError

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
        forward_backward: the user's own step as their loop runs it, fn(model, batch) ->
            loss (or (loss, anything)): forward, loss AND loss.backward() called inside it.
            What it holds alive during backward is what gobrrr traces (e.g. `out` kept
            through backward). gobrrr still owns the optimizer step (fn must not step an
            optimizer), the accumulation (each backward fn starts is scaled by
            1/micro-batches, as gobrrr's own step scales the loss) and checkpointing. Not
            with `loss` or `step`.
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
    forward_backward: Callable[[nn.Module, Batch], Any] | None = None

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Check, before anything is traced, that every field has the form gobrrr uses and
        that the model, `loss`, `step` and `optimizer` accept what gobrrr will call them
        with. Raises GobrrrError saying, in the Workload's own terms, what is expected."""
        _check_fields(self)
        _check_calls(self)

    def make_optimizer(self) -> torch.optim.Optimizer:
        params = [p for p in self.model.parameters() if p.requires_grad]
        if self.optimizer is None:
            return torch.optim.AdamW(params, lr=3e-4)
        try:
            opt = self.optimizer(params)
        except Exception as e:
            raise GobrrrError(
                f"Workload(optimizer={_short(self.optimizer)}) raised {type(e).__name__}: {e}",
                hint="it is called as optimizer(params) with the model's trainable parameters: "
                "check the arguments it gives the optimizer",
            ) from e
        if not isinstance(opt, torch.optim.Optimizer):
            raise GobrrrError(
                f"Workload(optimizer=...) returned {type(opt).__name__}, not a "
                "torch.optim.Optimizer",
                hint="the factory must return the optimizer it builds, e.g. "
                "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)",
            )
        return opt

    def run_model(self, batch: Batch) -> Any:
        if isinstance(batch, dict):
            return self.model(**batch)
        if isinstance(batch, (tuple, list)):
            return self.model(*batch)
        return self.model(batch)

    def compute_loss(self, batch: Batch) -> torch.Tensor:
        assert self.forward_backward is None, "forward_backward runs its own backward"
        if self.step is not None:
            return extract_loss(self.step(self.model, batch), "Workload(step=...) returned")
        out = self.run_model(batch)
        if self.loss is not None:
            return _call_loss(self.loss, out, batch)
        return extract_loss(out)

    def token_count(self) -> int:
        if self.tokens is not None:
            return self.tokens
        tensors = list(iter_tensors(self.batch))
        for t in tensors:
            if not t.is_floating_point():
                return t.numel()
        return tensors[0].shape[0] if tensors and tensors[0].dim() > 0 else 1


def extract_loss(out: Any, what: str = "the model returned") -> torch.Tensor:
    """The loss from what a model (or a `step`) returned: a scalar tensor, an object with a
    `.loss` tensor, a dict with a "loss" tensor, or a tuple whose first element is the loss.
    Anything else is a GobrrrError saying what to give instead."""
    loss = out
    if isinstance(out, dict) and isinstance(out.get("loss"), torch.Tensor):
        loss = out["loss"]
    elif isinstance(getattr(out, "loss", None), torch.Tensor):
        loss = out.loss
    elif isinstance(out, (tuple, list)) and out and isinstance(out[0], torch.Tensor):
        loss = out[0]
    return _check_loss(loss, what, out)


def forward_backward_loss(out: Any) -> torch.Tensor:
    """The loss a `forward_backward` function returned: a one-element tensor, or the first
    element of a tuple/list. Anything else is a GobrrrError saying what to return."""
    loss = out[0] if isinstance(out, (tuple, list)) and out else out
    if not isinstance(loss, torch.Tensor) or loss.numel() != 1:
        what = (
            f"a tensor of shape {tuple(loss.shape)}"
            if isinstance(loss, torch.Tensor)
            else f"{_short(out)} ({type(out).__name__})"
        )
        raise GobrrrError(
            f"Workload(forward_backward=...) returned {what}, not the loss",
            hint="return the scalar loss it called backward on (or (loss, anything)), e.g. "
            "`loss = model(**batch).loss; loss.backward(); return loss`",
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


# -- validation: what a Workload's fields must be, said in the Workload's terms ------------

_FACTORY = "optimizer=lambda params: torch.optim.AdamW(params, lr=3e-4)"


def _check_fields(w: Workload) -> None:
    _check_model(w.model)
    _check_batch(w.batch)
    if w.loss is not None and w.step is not None:
        raise GobrrrError(
            "Workload has both loss= and step=",
            hint="give one: step(model, batch) -> loss computes the loss itself",
        )
    if w.forward_backward is not None and (w.loss is not None or w.step is not None):
        given = "loss=" if w.loss is not None else "step="
        raise GobrrrError(
            f"Workload has both forward_backward= and {given}",
            hint="give one: forward_backward(model, batch) computes the loss and calls "
            "backward itself",
        )
    for name, fn, form in (
        (
            "loss",
            w.loss,
            "a function loss(output, batch) -> scalar tensor, "
            "or None when the model returns its loss",
        ),
        ("step", w.step, "a function step(model, batch) -> scalar loss"),
        (
            "forward_backward",
            w.forward_backward,
            "a function forward_backward(model, batch) that calls loss.backward() and "
            "returns the loss",
        ),
    ):
        if fn is not None and not callable(fn):
            raise GobrrrError(
                f"Workload({name}={fn!r}) is a {type(fn).__name__}", hint=f"give {form}"
            )
    _check_optimizer(w.optimizer)
    for name in ("tokens", "seq_len", "max_seq_len"):
        v = getattr(w, name)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise GobrrrError(
                f"Workload({name}={v!r}) is not a positive whole number",
                hint=f"give {name} as an int > 0, or None",
            )
    if not isinstance(w.name, str) or not w.name:
        raise GobrrrError(f"Workload(name={w.name!r}) is not a name", hint="give a short string")
    if not isinstance(w.info, dict):
        raise GobrrrError(
            f"Workload(info=...) is a {type(w.info).__name__}",
            hint="give a dict (e.g. info=dict(layers=12, hidden=768)) or leave it",
        )


def _check_model(model: Any) -> None:
    if isinstance(model, nn.Module):
        if not any(p.requires_grad for p in model.parameters()):
            raise GobrrrError(
                f"Workload(model=...): the {type(model).__name__} has no trainable parameters "
                "(none with requires_grad=True)",
                hint="gobrrr traces a training step: give a model with parameters to train",
            )
        return
    if isinstance(model, type) and issubclass(model, nn.Module):
        raise GobrrrError(
            f"Workload(model={model.__name__}) is the class, not a model",
            hint=f"give an instance: model={model.__name__}(...)",
        )
    what = (
        "None"
        if model is None
        else "a function"
        if callable(model)
        else f"a {type(model).__name__}"
    )
    raise GobrrrError(
        f"Workload(model={_short(model)}) is {what}, not an nn.Module",
        hint="give the torch.nn.Module to train, e.g. model=MyModel()"
        + (
            " (a function has no parameters to train: wrap it in an nn.Module)"
            if callable(model)
            else ""
        ),
    )


def _check_batch(batch: Any) -> None:
    if batch is None:
        raise GobrrrError(
            "Workload(batch=None) holds no inputs",
            hint="give the model's inputs: a tensor, a tuple/list or a dict of "
            "tensors, e.g. batch=(x, y)",
        )
    for where, v in _leaves(batch, "batch"):
        if type(v).__module__ == "numpy":
            raise GobrrrError(
                f"Workload(batch=...): {where} is a numpy {type(v).__name__}",
                hint=f"make it a tensor: torch.from_numpy({where})",
            )
    if next(iter_tensors(batch), None) is None:
        raise GobrrrError(
            f"Workload(batch={_short(batch)}) holds no tensor",
            hint="give the model's inputs as tensors: a tensor, a tuple/list or a dict of tensors",
        )


def _check_optimizer(opt: Any) -> None:
    if opt is None:
        return
    if isinstance(opt, torch.optim.Optimizer):
        cls, lr = type(opt).__name__, opt.defaults.get("lr")
        raise GobrrrError(
            f"Workload(optimizer=...) is an instance of {cls}, already built on the model's "
            "parameters",
            hint=f"give a factory that builds one from the parameters it is handed: "
            f"optimizer=lambda params: torch.optim.{cls}(params, lr={lr})",
        )
    if not callable(opt):
        raise GobrrrError(
            f"Workload(optimizer={opt!r}) is a {type(opt).__name__}, not a factory",
            hint=f"give a function params -> optimizer, e.g. {_FACTORY}",
        )
    if not _binds(opt, ([],)):
        raise GobrrrError(
            f"Workload(optimizer={_short(opt)}) cannot be called as optimizer(params)",
            hint=f"take the parameters as the one argument, e.g. {_FACTORY}",
        )


def _check_calls(w: Workload) -> None:
    """model(*batch), loss(output, batch) and step(model, batch) must accept these
    arguments (checked on the signatures, before anything runs)."""
    if w.forward_backward is not None:
        if not _binds(w.forward_backward, (w.model, w.batch)):
            raise GobrrrError(
                f"Workload(forward_backward={_short(w.forward_backward)}) cannot be called as "
                "forward_backward(model, batch)",
                hint="take two arguments: the model and the batch",
            )
        return
    if w.step is not None:
        if not _binds(w.step, (w.model, w.batch)):
            raise GobrrrError(
                f"Workload(step={_short(w.step)}) cannot be called as step(model, batch)",
                hint="take two arguments: "
                "step=lambda model, batch: F.cross_entropy(model(batch[0]), "
                "batch[1])",
            )
        return
    if w.loss is not None and not _binds(w.loss, (None, w.batch)):
        raise GobrrrError(
            f"Workload(loss={_short(w.loss)}) cannot be called as loss(output, batch)",
            hint="take two arguments, e.g. loss=lambda "
            "out, batch: F.cross_entropy(out, batch[1]), or use step=",
        )
    args, kwargs = _model_args(w.batch)
    if not _binds(w.model.forward, args, kwargs):
        how = (
            f"model(**batch) with keys {', '.join(map(str, kwargs))}"
            if kwargs
            else f"model(*batch) with {len(args)} argument{'s' * (len(args) != 1)}"
        )
        raise GobrrrError(
            f"Workload(batch=...) is passed as {how}, but "
            f"{type(w.model).__name__}.forward{_signature(w.model.forward)} does not take that",
            hint="give only the model's inputs as batch (a tuple is unpacked, a dict passed as "
            "keywords), or write step=lambda model, batch: loss for inputs and labels",
        )


def _model_args(batch: Any) -> tuple[tuple, dict]:
    if isinstance(batch, dict):
        return (), batch
    if isinstance(batch, (tuple, list)):
        return tuple(batch), {}
    return (batch,), {}


def _signature(fn: Any) -> str:
    import inspect

    try:
        return str(inspect.signature(fn))
    except (TypeError, ValueError):
        return "(...)"


def _binds(fn: Any, args: tuple, kwargs: dict | None = None) -> bool:
    """Whether fn's signature accepts these arguments (True when it cannot be read)."""
    import inspect

    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return True
    try:
        sig.bind(*args, **(kwargs or {}))
    except TypeError:
        return False
    return True


def _call_loss(loss_fn: Callable, out: Any, batch: Batch) -> torch.Tensor:
    try:
        loss = loss_fn(out, batch)
    except TypeError as e:
        raise GobrrrError(
            f"Workload(loss={_short(loss_fn)}) raised TypeError: {e}",
            hint="it is called as loss(output, batch) with the whole batch: take the target "
            "out of it (e.g. loss=lambda out, batch: F.cross_entropy(out, batch[1]))",
        ) from e
    return _check_loss(loss, "Workload(loss=...) returned", loss)


def _check_loss(loss: Any, what: str, out: Any) -> torch.Tensor:
    """A scalar tensor that backward can start from, or a GobrrrError in the Workload's
    terms."""
    if not isinstance(loss, torch.Tensor):
        if getattr(out, "loss", False) is None or (isinstance(out, dict) and "loss" in out):
            raise GobrrrError(
                f"{what} {type(out).__name__} with loss=None",
                hint="pass the labels in the batch (e.g. batch={'input_ids': ids, "
                "'labels': ids}) or give Workload(loss=...)",
            )
        raise GobrrrError(
            f"{what} {_short(out)} ({type(out).__name__}), not a loss tensor",
            hint="return the loss as a scalar tensor computed from the model's "
            "output, or give Workload(loss=fn), fn(output, batch) -> scalar tensor",
        )
    if loss.numel() != 1:
        raise GobrrrError(
            f"{what} a loss of shape {tuple(loss.shape)}, not a scalar",
            hint="reduce it (e.g. .mean()) or give Workload(loss=...)",
        )
    if torch.is_grad_enabled() and not loss.requires_grad:
        raise GobrrrError(
            f"{what} a loss that does not depend on the model's parameters "
            "(requires_grad is False)",
            hint="compute it from the model's output, "
            "without .detach(), .item(), torch.no_grad() or torch.tensor(...)",
        )
    if torch.is_grad_enabled() and loss.grad_fn is None:  # a fresh leaf: backward reaches nothing
        raise GobrrrError(
            f"{what} a loss made from scratch (a leaf tensor, no path back to the parameters)",
            hint="compute it from the model's output, not torch.tensor(..., requires_grad=True)",
        )
    return loss


def _leaves(x: Any, where: str):
    """(path, value) of every leaf of a batch, paths as Python would write them."""
    if isinstance(x, dict):
        for k, v in x.items():
            yield from _leaves(v, f"{where}[{k!r}]")
    elif isinstance(x, (tuple, list)):
        for i, v in enumerate(x):
            yield from _leaves(v, f"{where}[{i}]")
    else:
        yield where, x


def _short(x: Any) -> str:
    """A value as a message shows it: functions by name, long reprs cut."""
    name = getattr(x, "__qualname__", None) or getattr(x, "__name__", None)
    if callable(x) and name:
        return name
    text = repr(x)
    return text if len(text) <= 40 else text[:37] + "..."
