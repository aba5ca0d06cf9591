"""The training precisions gobrrr knows, and what each means for autocast and peak FLOP/s."""

from __future__ import annotations

import torch

from gobrrr.errors import GobrrrError

# fp32: no autocast, TF32 off. tf32: fp32 with TF32 matmuls. *-mixed: autocast over fp32
# weights. bf16: weights, gradients and optimizer states in bf16.
PRECISIONS = ("fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16")

_PEAK_MODE = {"fp32": "fp32", "tf32": "tf32", "bf16-mixed": "bf16", "fp16-mixed": "fp16",
              "bf16": "bf16"}


def check_precision(precision: str) -> None:
    if precision not in PRECISIONS:
        raise GobrrrError(f"unknown precision {precision!r}: choose one of {', '.join(PRECISIONS)}")


def autocast_dtype(precision: str) -> torch.dtype | None:
    """The dtype autocast runs matmuls in, or None when the precision uses no autocast."""
    return {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)


def peak_mode(precision: str) -> str:
    """Which dense peak of a GPU (GpuSpec.peak_flops key) a precision's matmuls run at."""
    return _PEAK_MODE.get(precision, "bf16")
