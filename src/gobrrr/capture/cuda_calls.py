"""A workload written for the GPU, traced as that GPU's step.

The trace is of a CUDA step already: its fake tensors live on the CPU and each stands for a
tensor on the one GPU traced (`gobrrr.training.fused_loss.as_on_cuda`, CUDA's autocast and
optimizer rules). A training script says where its tensors go; within `on_traced_gpu`:

- a move to a CUDA device (`Tensor.cuda()`, `Tensor.to("cuda")` / `.to("cuda:0")` /
  `.to(torch.device("cuda"))` / `.to(0)`, and `Module.cuda()` / `Module.to("cuda")`, which call
  them) leaves the tensor where it is, as it does on a tensor already on that GPU; a dtype or
  memory-format change it asks for still happens;
- `device="cuda"` (or a `torch.device`, or an ordinal) given to any torch function (factories
  such as `torch.randn`, `new_zeros`, `torch.arange`) is dropped: the tensor is made where
  one without a device would be (the traced device; the meta device in the planner's probe);
- to the workload's own code (not torch, gobrrr or another installed library: see
  `_workload_code`), `torch.cuda.is_available()` is True, `device_count()` 1,
  `current_device()` 0, `get_device_capability()` the target GPU's and
  `is_bf16_supported()` what that capability gives, so a model that branches on them takes
  the GPU's branch.

So a workload with these calls predicts as the one without them, bit for bit. What one
GPU's step cannot be is refused: tensors placed on two CUDA devices (`cuda:0` and `cuda:1`,
model parallelism by hand) raise GobrrrError.
"""

from __future__ import annotations

import contextlib
import functools
import os
import site
import sys
import sysconfig
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from gobrrr.errors import GobrrrError

_TO = torch.Tensor.to
_CUDA = torch.Tensor.cuda


class _OnTracedGpu(TorchFunctionMode):
    """Takes CUDA devices out of torch calls: a move to CUDA keeps the tensor on its own
    device, a factory given a CUDA device makes it where one given none would (the traced
    device: the CPU in a trace, the meta device in the planner's probe). Remembers the CUDA
    device indices named (-1: `cuda` without one)."""

    def __init__(self) -> None:
        super().__init__()
        self.named: set[int] = set()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        if func is _CUDA or func is _TO:
            return self._move(func, args, kwargs)
        if "device" in kwargs and self._cuda(kwargs["device"]):
            del kwargs["device"]
        return func(*args, **kwargs)

    def _move(self, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
        """Tensor.cuda(device=None, non_blocking=False, memory_format=...) and Tensor.to(...)
        with a CUDA device: Tensor.to the tensor's own device (a dtype or memory format it
        asks for still applies; no copy otherwise, as on a tensor already on that GPU)."""
        t, here = args[0], args[0].device
        if func is _CUDA:
            device = args[1] if len(args) > 1 else kwargs.pop("device", None)
            self._cuda("cuda" if device is None else device)
            if len(args) > 2:
                kwargs["non_blocking"] = args[2]
            return _TO(t, here, **kwargs)
        rest = [here if self._cuda(a, ordinal=i == 0) else a for i, a in enumerate(args[1:])]
        if "device" in kwargs and self._cuda(kwargs["device"]):
            kwargs["device"] = here
        return func(t, *rest, **kwargs)

    def _cuda(self, d: Any, ordinal: bool = True) -> bool:
        """Whether `d` names a CUDA device (a str, a torch.device, or an int where it is an
        ordinal); two different indices in one workload are refused."""
        if ordinal and type(d) is int:
            d = torch.device("cuda", d)
        if isinstance(d, str) and d.startswith("cuda"):
            d = torch.device(d)
        if not isinstance(d, torch.device) or d.type != "cuda":
            return False
        if torch.compiler.is_dynamo_compiling():  # no state: its mutation alters the graph
            return True
        self.named.add(d.index if d.index is not None else -1)
        if len(self.named - {-1}) > 1:
            devices = " and ".join(f"cuda:{i}" for i in sorted(self.named - {-1}))
            raise GobrrrError(
                f"the workload places tensors on {devices}: gobrrr traces one GPU's step, "
                "so keep the model and batch on one device (spread it over GPUs with "
                "--gpus, which plans data parallelism and FSDP)"
            )
        return True


def _installed_roots() -> tuple[str, ...]:
    """Folders of installed code: the standard library and site-packages (the user's own
    files, and editable installs of their packages, lie elsewhere)."""
    paths = sysconfig.get_paths()
    roots = {paths[k] for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths}
    roots |= set(site.getsitepackages()) | {site.getusersitepackages()}
    return tuple(os.path.join(os.path.realpath(r), "") for r in roots if r)


_ROOTS = _installed_roots()
_GOBRRR = os.path.join(os.path.dirname(os.path.dirname(os.path.realpath(__file__))), "")


@functools.lru_cache(maxsize=4096)
def _workload_code(filename: str) -> bool:
    """Whether a function in `filename` is the workload's own code: not gobrrr, not torch or
    another installed library (they get torch.cuda's real answers: torch itself would call
    the driver, and libraries such as transformers cache the answer for the process)."""
    path = os.path.realpath(filename) if filename[:1] != "<" else filename
    return not path.startswith((_GOBRRR, *_ROOTS))


def _answer(name: str, value: Callable[..., Any]) -> Callable[..., Any]:
    """torch.cuda.`name` answering `value(...)` to the workload's own code, and as itself to
    any other caller."""
    real = getattr(torch.cuda, name)

    @functools.wraps(real)
    def answer(*args: Any, **kwargs: Any) -> Any:
        # True only where dynamo traces the model (it cannot trace the frame lookup); torch's
        # own code run while compiling (dynamo saving the CUDA RNG state) sees False
        if torch.compiler.is_dynamo_compiling() or _workload_code(
            sys._getframe(1).f_code.co_filename
        ):
            return value(*args, **kwargs)
        return real(*args, **kwargs)

    return answer


def _cuda_answers(capability: tuple[int, int]) -> dict[str, Callable[..., Any]]:
    """torch.cuda's functions a model may branch on, answered as the target GPU would."""
    return {
        "is_available": lambda: True,
        "device_count": lambda: 1,
        "current_device": lambda: 0,
        "get_device_capability": lambda device=None: capability,
        "is_bf16_supported": lambda including_emulation=True: capability >= (8, 0),
    }


@contextlib.contextmanager
def on_traced_gpu(capability: tuple[int, int] = (9, 0)) -> Iterator[None]:
    """Within: the workload's CUDA moves and devices land on the traced device, and torch.cuda
    answers as one GPU of compute capability `capability` (see the module's docstring);
    torch.cuda's own functions are back afterwards."""
    answers = _cuda_answers(capability)
    saved = {name: getattr(torch.cuda, name) for name in answers}
    try:
        for name, value in answers.items():
            setattr(torch.cuda, name, _answer(name, value))
        with _OnTracedGpu():
            yield
    finally:
        for name, fn in saved.items():
            setattr(torch.cuda, name, fn)


__all__ = ["on_traced_gpu"]
