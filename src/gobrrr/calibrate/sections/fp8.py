"""The FP8 matmul grid: what `torch._scaled_mm` achieves on a GPU with FP8 tensor cores, over
the shapes of the bf16 grid (`step.matmul_grid`), as torchao's float8 recipe calls it.

Each point is (m x k) float8_e4m3fn @ (k x m) float8_e4m3fn, the second operand column-major
(cuBLASLt's FP8 kernels take only that layout, and torchao hands them a transposed weight),
one fp32 scale per operand (tensorwise), bf16 out: [[m*m, k, FLOP/s], ...] under the key
"fp8" of the calibration's `matmul_grid`, where `cost.rates` reads it for every `_scaled_mm`.
torchao's default runs the forward with fast accumulation and both gradients without it;
the grid times the gradients' way (two of the three matmuls), so the forward is costed a
little slow.
"""

from __future__ import annotations

import torch

from gobrrr.calibrate.sections.step import GRID_MAX_FLOP
from gobrrr.calibrate.timing import time_op
from gobrrr.training.fp8 import FP8_CAPABILITY

#: the depths and output sizes of `step.matmul_grid`, so the two grids meet point for point
MNS = (128, 256, 512, 1024, 2048, 4096, 8192, 16384)
KS = (64, 256, 1024, 4096, 16384, 65536, 262144)


def has_fp8(dev: torch.device) -> bool:
    """Whether `dev` is a CUDA GPU with FP8 tensor cores."""
    return dev.type == "cuda" and tuple(torch.cuda.get_device_capability(dev)) >= FP8_CAPABILITY


def scaled_mm_operands(m: int, k: int, n: int, dev: torch.device) -> tuple[torch.Tensor, ...]:
    """(a, b, scale_a, scale_b) of one tensorwise-scaled FP8 matmul (m x k) @ (k x n) as
    torchao's Float8Linear hands them to torch._scaled_mm: a row-major float8_e4m3fn, b a
    column-major one (a transposed (n, k) weight), one fp32 scale each."""
    a = torch.randn(m, k, device=dev).to(torch.float8_e4m3fn)
    b = torch.randn(n, k, device=dev).to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device=dev)
    return a, b, one, one.clone()


def scaled_mm_case(m: int, k: int, n: int, dev: torch.device, fast_accum: bool = False):
    """A zero-argument function running one such matmul (`scaled_mm_operands`), bf16 out."""
    a, b, sa, sb = scaled_mm_operands(m, k, n, dev)

    def run() -> torch.Tensor:
        return torch._scaled_mm(
            a, b, scale_a=sa, scale_b=sb, out_dtype=torch.bfloat16, use_fast_accum=fast_accum
        )

    return run


def fp8_matmul_grid(
    dev: torch.device, mns: tuple[int, ...] = MNS, ks: tuple[int, ...] = KS
) -> dict[str, list[list[float]]]:
    """{"fp8": [[m*m, k, FLOP/s], ...]} of torch._scaled_mm over output sizes m² and depths k
    (points above GRID_MAX_FLOP left out, as in the bf16 grid); {} on a device without FP8
    tensor cores, so a calibration of an A100 keeps no fp8 key."""
    if not has_fp8(dev):
        return {}
    points = []
    for m in mns:
        for k in ks:
            if 2.0 * m * m * k > GRID_MAX_FLOP:
                continue
            run = scaled_mm_case(m, k, m, dev)
            t = time_op(run, dev, 5 if m * m * k > 2**33 else 15)
            points.append([float(m * m), float(k), 2.0 * m * m * k / t])
            del run
    return {"fp8": points}


__all__ = ["fp8_matmul_grid", "has_fp8", "scaled_mm_case", "scaled_mm_operands"]
