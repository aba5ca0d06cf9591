"""Dropout as CUDA runs it, reproduced in the CPU trace.

`F.dropout` (aten::dropout, a composite op) takes a fused kernel on CUDA: `native_dropout`, which
returns the output and a 1-byte boolean mask, the mask saved for backward. Elsewhere (the CPU,
where the trace runs) it builds a noise tensor in the input's dtype and multiplies, saving the
noise: 2 to 4 bytes an element where CUDA keeps 1. Every dropout layer of a BERT or a GPT-2 was
over-counted that way (aten/src/ATen/native/Dropout.cpp: `is_fused_kernel_acceptable`).

While `cuda_dropout()` is active, aten::dropout on CPU tensors takes CUDA's path: native_dropout
when training with 0 < p < 1 on a non-empty tensor, the input itself when not training or p == 0.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator

import torch


def _dropout(input: torch.Tensor, p: float, train: bool) -> torch.Tensor:
    if train and 0 < p < 1 and input.numel() > 0:
        return torch.ops.aten.native_dropout(input, p, train)[0]
    if p == 1 and train:
        return input * torch.zeros_like(input)
    return input


@contextlib.contextmanager
def cpu_composite(op: str, kernel, ns: str = "aten") -> Iterator[None]:
    """Within this context the composite ATen op `op` (an op of library `ns`) runs `kernel` on
    CPU tensors (its AutogradCPU kernel replaced: after autocast, wherever it is called from,
    recomputation included); restored on exit."""
    lib = torch.library.Library(ns, "IMPL")
    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": intended
            warnings.simplefilter("ignore")
            lib.impl(op, kernel, "AutogradCPU")
        yield
    finally:
        lib._destroy()
        # the Python dispatcher (dynamo, AOTAutograd) caches each overload's kernel per key:
        # left stale, a later real torch.compile on the CPU runs the op without autograd
        packet = getattr(getattr(torch.ops, ns), op.split(".")[0])
        for name in packet.overloads():
            getattr(packet, name)._dispatch_cache.clear()


def cuda_dropout() -> contextlib.AbstractContextManager[None]:
    """Within this context aten::dropout on CPU tensors runs CUDA's fused path."""
    return cpu_composite("dropout", _dropout)
