"""Windowed pooling, forward and backward, for a calibration (`Calibration.pool_grid`).

PyTorch's CUDA pooling kernels are far from a copy's bandwidth: one thread per output (or, in
the backward, per input) element derives its (n, c, h, w) from a flat index with 64-bit
divisions and, in avg_pool2d's backward, sums each window it falls in with a division per
window. On an H100 Inception-v3's 3x3 stride-1 average pools ran 10-15x slower than their
bytes at a copy's rate (docs/investigations/2026-11-27-far-off-mechanisms.md, "Pooling").
Timed here per op, window (kernel, stride, padding), dtype and layout, over maps from 8 to 112
pixels a side and 64 to 768 channels, the batch set so the pooled map spans 4 MB to 400 MB;
each point is [map bytes, map bytes per second, side, channels, batch]
(`gobrrr.cost.measured_ops.pool_coords` says which map).

Global average pooling to 1x1 (a CNN's head) is not here: PyTorch runs it as `mean` over the
map and its backward as expand + div, which the reduction and pointwise rates cost.
"""

from __future__ import annotations

import torch

from gobrrr.calibrate.timing import time_op
from gobrrr.cost.measured_ops import pool_key

A = torch.ops.aten
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
LAYOUTS = {"channels_first": torch.contiguous_format, "channels_last": torch.channels_last}
#: (kernel, stride, padding): VGG's and DenseNet's 2x2/2, Inception's 3x3/1 pad 1 branch
#: pools, ResNet's and MaxViT's 3x3/2 pad 1, Inception's 3x3/2 unpadded max pools, and 2x2/1
WINDOWS = ((2, 2, 0), (2, 1, 0), (3, 1, 1), (3, 2, 1), (3, 2, 0))
#: (side, channels, bytes of the pooled map): wide shallow maps early in a CNN, narrow deep
#: ones late, as networks have them
SIZES = (
    (112, 64, 400e6),
    (56, 128, 160e6),
    (35, 288, 64e6),
    (17, 768, 16e6),
    (8, 768, 4e6),
)


def _batch(side: int, channels: int, nbytes: float, itemsize: int) -> int:
    """The batch that makes a (batch, channels, side, side) map about `nbytes` (at least 1)."""
    return max(1, round(nbytes / (channels * side * side * itemsize)))


def _point(x: torch.Tensor, seconds: float) -> list[float]:
    n, c, side, _ = x.shape
    nbytes = float(x.numel() * x.element_size())
    return [nbytes, nbytes / seconds, float(side), float(c), float(n)]


def _time_window(x: torch.Tensor, window: tuple[int, int, int], reps: int) -> dict[str, float]:
    """Seconds of each pooling op over the map `x` with `window` (kernel, stride, padding)."""
    dev = x.device
    k, s, p = ([v, v] for v in window)
    y = A.avg_pool2d(x, k, s, p)
    dy = torch.randn_like(y)
    out = {
        "avg_pool2d": time_op(lambda: A.avg_pool2d(x, k, s, p), dev, reps),
        "avg_pool2d_backward": time_op(
            lambda: A.avg_pool2d_backward(dy, x, k, s, p, False, True, None), dev, reps
        ),
    }
    ym, idx = A.max_pool2d_with_indices(x, k, s, p)
    dym = torch.randn_like(ym)
    out["max_pool2d_with_indices"] = time_op(
        lambda: A.max_pool2d_with_indices(x, k, s, p), dev, reps
    )
    out["max_pool2d_with_indices_backward"] = time_op(
        lambda: A.max_pool2d_with_indices_backward(dym, x, k, s, p, [1, 1], False, idx),
        dev,
        reps,
    )
    return out


def pool_grid(
    dev: torch.device,
    reps: int = 5,
    windows: tuple[tuple[int, int, int], ...] = WINDOWS,
    sizes: tuple[tuple[int, int, float], ...] = SIZES,
) -> dict[str, list[list[float]]]:
    """{"<op>:k<kernel>s<stride>p<padding>:<bf16|fp32>:<channels_first|channels_last>":
    [[map bytes, map bytes per second, side, channels, batch], ...]} for avg_pool2d,
    max_pool2d_with_indices and their backwards, each timed alone (the median of `reps`
    CUDA-event-timed runs behind a spin); the map is the op's full-resolution tensor (the
    forward's input, the backward's gradient input). About 10-20 s on an H100."""
    out: dict[str, list[list[float]]] = {}
    for dkey, dtype in DTYPES.items():
        item = torch.empty((), dtype=dtype).element_size()
        for side, channels, nbytes in sizes:
            n = _batch(side, channels, nbytes, item)
            for lkey, fmt in LAYOUTS.items():
                x = torch.randn(n, channels, side, side, device=dev, dtype=dtype)
                x = x.contiguous(memory_format=fmt)
                for window in windows:
                    for op, seconds in _time_window(x, window, reps).items():
                        key = pool_key(op, window, dkey, lkey)
                        out.setdefault(key, []).append(_point(x, seconds))
                del x
    if dev.type == "cuda":
        torch.cuda.empty_cache()
    return {k: sorted(v) for k, v in out.items()}
