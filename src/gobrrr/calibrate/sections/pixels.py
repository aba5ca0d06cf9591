"""Pixel-wise ops of a segmentation head, for a calibration (`Calibration.pixel_grid`).

A SegFormer or DeepLab upsamples its (N, C, h, w) logits bilinearly to the labels' size and
takes the cross-entropy over every pixel. Their kernels are far from a copy's bandwidth:
`upsample_bilinear2d_backward` adds each output gradient into the four input pixels it came
from with atomicAdd (scale^2 writers contend for each), the log-softmax over dim 1 reads the
channels at a stride of H·W, nll_loss2d gathers one value per pixel and its backward fills the
whole gradient. Timed on a grid of sizes, scale factors and channels, fp32 (autocast runs
upsampling in fp32) and bf16; each point is [size, second coordinate, size per second]
(`gobrrr.cost.measured_ops.pixel_coords` says which size and coordinate per op).
"""

from __future__ import annotations

import torch

from gobrrr.calibrate.timing import time_op

CHANNELS = (19, 150)
SIDES = (64, 128)  # the low-resolution logits' side
SCALES = (2, 4, 8)
BATCH = 4
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
A = torch.ops.aten


def _upsample(dev, dtype, c, side, scale, reps, out):
    key = "bf16" if dtype != torch.float32 else "fp32"
    x = torch.randn(BATCH, c, side, side, device=dev, dtype=dtype)
    size = [side * scale] * 2
    y = A.upsample_bilinear2d(x, size, False)
    fwd = time_op(lambda: A.upsample_bilinear2d(x, size, False), dev, reps)
    dy = torch.randn_like(y)
    bwd = time_op(lambda: A.upsample_bilinear2d_backward(dy, size, list(x.shape), False), dev, reps)
    n = float(y.numel())
    out.setdefault(f"upsample_bilinear2d:{key}", []).append([n, scale, n / fwd])
    out.setdefault(f"upsample_bilinear2d_backward:{key}", []).append([n, scale, n / bwd])


def _loss(dev, dtype, c, side, reps, out):
    key = "bf16" if dtype != torch.float32 else "fp32"
    z = torch.randn(BATCH, c, side, side, device=dev, dtype=dtype)
    t = torch.randint(0, c, (BATCH, side, side), device=dev)
    lp = A._log_softmax(z, 1, False)
    g = torch.randn_like(lp)
    n, px = float(z.numel()), float(t.numel())
    loss, total = A.nll_loss2d_forward(lp, t, None, 1, -100)
    times = {
        "_log_softmax": (n, time_op(lambda: A._log_softmax(z, 1, False), dev, reps)),
        "_log_softmax_backward_data": (
            n,
            time_op(lambda: A._log_softmax_backward_data(g, lp, 1, lp.dtype), dev, reps),
        ),
        "nll_loss2d_forward": (
            px,
            time_op(lambda: A.nll_loss2d_forward(lp, t, None, 1, -100), dev, reps),
        ),
        "nll_loss2d_backward": (
            px,
            time_op(
                lambda: A.nll_loss2d_backward(torch.ones_like(loss), lp, t, None, 1, -100, total),
                dev,
                reps,
            ),
        ),
    }
    for op, (size, seconds) in times.items():
        out.setdefault(f"{op}:{key}", []).append([size, float(c), size / seconds])


def pixel_grid(dev: torch.device, reps: int = 10) -> dict[str, list[list[float]]]:
    """{"<op>:<bf16|fp32>": [[size, second coordinate, size per second], ...]} for bilinear
    upsampling (output elements, scale) and its backward, and over the full-resolution logits
    (elements or pixels, channels) the log-softmax over dim 1, its backward and nll_loss2d;
    about 20 s on an H100."""
    out: dict[str, list[list[float]]] = {}
    for dtype in DTYPES.values():
        for c in CHANNELS:
            for side in SIDES:
                for scale in SCALES:
                    _upsample(dev, dtype, c, side, scale, reps, out)
                    _loss(dev, dtype, c, side * scale, reps, out)
    torch.cuda.empty_cache()
    return out
