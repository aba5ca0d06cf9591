"""Shared utilities for the Triton kernels: input checks, launch targets, block sizes."""

from __future__ import annotations

import os
from collections.abc import Iterable

import torch

from gobrrr.errors import GobrrrError

try:
    import triton
    import triton.language as tl

    jit = triton.jit
except ImportError:  # ops still register (fake tensors, capture); launching a kernel raises
    triton = tl = None

    def jit(fn):
        return fn


FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16)
INDEX_DTYPES = (torch.int64, torch.int32)


def is_interpreter() -> bool:
    """True when TRITON_INTERPRET=1: kernels then run on CPU tensors, slowly, in numpy."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def check_float(name: str, t: torch.Tensor, ndim: int | None = None) -> None:
    """Raise GobrrrError unless `t` is a floating tensor (fp32/bf16/fp16) of rank `ndim`."""
    if not isinstance(t, torch.Tensor):
        raise GobrrrError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise GobrrrError(
            f"{name} has dtype {t.dtype}; use float32, bfloat16 or float16 (e.g. {name}.float())"
        )
    if ndim is not None and t.dim() != ndim:
        raise GobrrrError(f"{name} must have {ndim} dims, got shape {tuple(t.shape)}")
    if t.numel() == 0:
        raise GobrrrError(f"{name} is empty (shape {tuple(t.shape)}); pass at least one element")


def check_same_device(**tensors: torch.Tensor | None) -> torch.device:
    """Return the common device of the given tensors (None entries skipped) or raise."""
    devices = {name: t.device for name, t in tensors.items() if t is not None}
    if len(set(devices.values())) > 1:
        listing = ", ".join(f"{n} on {d}" for n, d in devices.items())
        raise GobrrrError(f"inputs are on different devices ({listing}); move them to one device")
    return next(iter(devices.values()))


def check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise unless all given tensors have one shape."""
    shapes = {name: tuple(t.shape) for name, t in tensors.items()}
    if len(set(shapes.values())) > 1:
        raise GobrrrError(f"shapes must match, got {shapes}")


def check_runnable(device: torch.device) -> None:
    """Raise unless Triton can run on `device`: CUDA, or CPU under TRITON_INTERPRET=1."""
    if triton is None:
        raise GobrrrError("gobrrr kernels need triton; install it: pip install 'gobrrr[kernels]'")
    if device.type == "cuda":
        return
    if device.type == "cpu" and is_interpreter():
        return
    if device.type == "cpu":
        raise GobrrrError(
            "gobrrr kernels got CPU tensors; move them to a CUDA GPU, or set TRITON_INTERPRET=1 "
            "(slow, for tests) before running"
        )
    raise GobrrrError(f"gobrrr kernels run on CUDA GPUs only, got tensors on {device}")


_INTERPRETED: dict[int, object] = {}


def kernel_for(kernel, device: torch.device):
    """The launchable form of a @triton.jit `kernel` for `device`.

    On CPU (interpreter mode) the kernel is re-wrapped for the interpreter, so that it runs even
    when triton was imported before TRITON_INTERPRET=1 was set.
    """
    check_runnable(device)
    if device.type == "cuda" or type(kernel).__name__ == "InterpretedFunction":
        return kernel
    key = id(kernel)
    if key not in _INTERPRETED:
        from triton.runtime.interpreter import InterpretedFunction

        _INTERPRETED[key] = InterpretedFunction(kernel.fn)
    return _INTERPRETED[key]


DIRECT = True  # benchmarks switch it off to measure the path through the ops


def direct(t: torch.Tensor) -> bool:
    """True when nothing needs to see gobrrr's ops: a plain tensor, outside torch.compile, with
    no dispatch or function mode (FakeTensorMode, op recorders), functorch transform or profiler
    active. The public functions then launch their kernels without the op dispatcher, whose
    custom-op layers cost more host time than the launches
    (docs/investigations/2026-11-22-kernel-host-time-per-call.md); in every other case the
    ops run, so traces, fake tensors and profiles still show the gobrrr:: ops."""
    return (
        DIRECT
        and type(t) is torch.Tensor
        and not torch.compiler.is_compiling()
        and not torch._C._len_torch_dispatch_stack()
        and not torch._C._is_torch_function_mode_enabled()
        and not torch._C._are_functorch_transforms_active()
        and not torch._C._autograd._profiler_enabled()
    )


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (n >= 1)."""
    return 1 << (max(int(n), 1) - 1).bit_length()


def cdiv(a: int, b: int) -> int:
    """Ceiling division of non-negative ints."""
    return -(-a // b)


def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors on `device` (4 under the interpreter: few, large programs)."""
    if device.type != "cuda":
        return 4
    return torch.cuda.get_device_properties(device).multi_processor_count


def rows_2d(x: torch.Tensor) -> torch.Tensor:
    """View `x` as (rows, last dim) with a unit last-dim stride, copying only when needed."""
    x2 = x.reshape(-1, x.shape[-1])
    if x2.stride(-1) != 1 or (x2.shape[0] > 1 and x2.stride(0) < x2.shape[1]):
        x2 = x2.contiguous()
    return x2


def flat(*tensors: torch.Tensor) -> Iterable[torch.Tensor]:
    """Contiguous 1-D views of `tensors` (copies made only for non-contiguous inputs)."""
    return tuple(t.contiguous().view(-1) for t in tensors)
