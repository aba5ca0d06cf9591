"""`y = x.cos().cos()` on a large tensor: the classic memory-bound chain that fusion halves.

Eager runs two kernels, each reading and writing the whole tensor (4 bytes in + 4 out per
element, twice); a fused kernel (torch.compile) reads x once and writes y once: half the bytes,
so about half the time. The loss is y.mean() x a scalar parameter, so the step has an
optimizer but its time is the cos chain's.

    gobrrr profile examples/cos_cos.py:workload --precision fp32
    gobrrr profile examples/cos_cos.py:workload --precision fp32 --compile
"""

import torch
from torch import nn

from gobrrr import Workload


class CosCos(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x.cos().cos()  # (N,), written to memory: it is the model's output


def workload(
    batch_size: int | None = None, seq_len: int | None = None, numel: int = 2**28
) -> Workload:
    """numel fp32 elements (default 2**28 = 1 GiB); batch_size scales it (default 1)."""
    n = numel * (batch_size or 1)
    model = CosCos()
    return Workload(
        model=model,
        batch=torch.rand(n),
        name="cos_cos",
        loss=lambda y, x: y.mean() * model.scale,
        optimizer=lambda p: torch.optim.SGD(p, lr=1e-3),
        tokens=n,
    )
