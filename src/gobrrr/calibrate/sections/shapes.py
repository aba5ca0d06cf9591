"""Calibration of rates that depend on an op's shape: its size and its alignment.

- `size_bandwidths`: copies (dtype casts) and pointwise kernels over the bytes they move. A
  large copy runs at ~3 TB/s on an H100, a cast of a 768 x 768 weight far below it: small
  memory-bound kernels do not fill the chip, and a training step is full of them (autocast's
  weight casts, bias adds, residual sums). Stored as the bandwidth left once the kernel
  latency (a 1-element kernel's time, measured in the same run) is taken off, since the cost
  model adds that latency to every kernel.
- `misaligned_by_alignment`: the matmul rate when a leading dimension is a multiple of 2, 4 or
  8 bytes but not 16 (cuBLAS picks its kernels by the operands' alignment: an odd vocabulary of
  50257 bf16 tokens is 2-byte aligned, BERT's 30522 is 4-byte aligned), as a fraction of the
  aligned rate; keys "<mode>@<bytes>" and "nt:<mode>@<bytes>".
"""

from __future__ import annotations

import torch

from gobrrr.calibrate.timing import flush_buffer, time_op

SIZE_ELEMENTS = tuple(2**k for k in range(12, 29, 2))  # 4K .. 256M elements


def kernel_latency(dev: torch.device) -> float:
    """GPU seconds of a kernel that does (almost) nothing: a 1-element add."""
    x = torch.zeros(1, device=dev)
    return time_op(lambda: x.add_(1), dev, 50)


def size_bandwidths(
    dev: torch.device, sizes: tuple[int, ...] = SIZE_ELEMENTS
) -> dict[str, list[list[float]]]:
    """{"copy" | "pointwise": [[bytes moved, bytes/s], ...]}: an fp32 -> bf16 cast and a bf16
    add over sizes, L2 flushed before each run (a step's tensors come from HBM), bytes/s
    over the time less the kernel latency."""
    flush = flush_buffer(dev)
    lat = kernel_latency(dev)
    out: dict[str, list[list[float]]] = {"copy": [], "pointwise": []}
    for n in sizes:
        x = torch.randn(n, device=dev)
        a, b = (
            torch.randn(n, device=dev, dtype=torch.bfloat16),
            torch.randn(n, device=dev, dtype=torch.bfloat16),
        )
        for key, fn, nbytes in (
            ("copy", lambda x=x: x.to(torch.bfloat16), 6 * n),
            ("pointwise", lambda a=a, b=b: a + b, 6 * n),
        ):
            t = time_op(fn, dev, 10, flush)
            out[key].append([float(nbytes), nbytes / max(t - lat, 0.5 * t)])
        del x, a, b
    return out


def misaligned_by_alignment(dev: torch.device, n: int = 4096) -> dict[str, float]:
    """Fractions of the aligned rate of n x n x m matmuls whose m makes the leading dimension
    a multiple of 2, 4 or 8 bytes only, per math mode: {"bf16@4": ..., "nt:bf16@4": ...}
    (`nt`: the second operand a transposed weight, a linear layer's forward)."""
    out = {}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype, size in (
            ("bf16", torch.bfloat16, 2),
            ("fp16", torch.float16, 2),
            ("tf32", torch.float32, 4),
        ):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(n, n, device=dev, dtype=dtype)
            for nt in (False, True):

                def make(m, t=dtype, nt=nt):
                    if nt:
                        return torch.randn(m, n, device=dev, dtype=t).t()
                    return torch.randn(n, m, device=dev, dtype=t)

                def rate(m, a=a):
                    b = make(m)
                    return 2.0 * n * n * m / time_op(lambda: a @ b, dev, 10)

                aligned = rate(n)
                for align in (2, 4, 8):
                    if align < size:
                        continue
                    m = n - align // size  # leading dim n - k: a multiple of `align` bytes
                    key = f"{'nt:' if nt else ''}{name}@{align}"
                    out[key] = min(rate(m) / aligned, 1.0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out
