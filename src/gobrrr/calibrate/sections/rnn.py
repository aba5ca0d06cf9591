"""cuDNN's fused recurrent layers, for a calibration (`Calibration.rnn_grid`).

An LSTM's forward is one `_cudnn_rnn` over the whole stack: per layer, one GEMM for the input
over all steps, then one small GEMM per step, each waiting on the last. Its time follows
layers x steps at a rate the hidden width and the batch set, far from what its FLOPs say.
Timed as nn.LSTM / nn.GRU run in training (forward, then backward through the output),
over a grid of hidden width, layers, batch and steps, in bf16 and fp32; the reserve space's
size per (layer, step, sequence, hidden unit) is read off the autograd node
(`_saved_result3`), which `gobrrr.capture.rnn.RESERVE_ELEMENTS` is checked against.
"""

from __future__ import annotations

import torch

from gobrrr.calibrate.timing import time_op

HIDDEN = (256, 512, 1024, 2048)
LAYERS = (1, 3)
BATCH = (8, 64)
STEPS = (64, 256)
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def _case(cell, dev, dtype, hidden, layers, batch, steps, reps):
    """(forward seconds, backward seconds, reserve bytes) of one configuration."""
    net = cell(hidden, hidden, num_layers=layers, device=dev, dtype=dtype)
    x = torch.randn(steps, batch, hidden, device=dev, dtype=dtype, requires_grad=True)
    out = net(x)[0]
    dy = torch.randn_like(out)
    saved = getattr(out.grad_fn, "_saved_result3", None)  # the reserve (CudnnRnnBackward0)
    reserve = saved.numel() if isinstance(saved, torch.Tensor) else -1
    fwd = time_op(lambda: net(x), dev, reps)

    def both():
        torch.autograd.backward(net(x)[0], dy)

    total = time_op(both, dev, reps)
    return fwd, max(total - fwd, 0.0), reserve


def rnn_grid(dev: torch.device, reps: int = 3) -> dict[str, list[list[float]]]:
    """{"<lstm|gru>:<forward|backward>:<bf16|fp32>": [[hidden, batch, layers, steps,
    seconds], ...], "reserve:<mode>:<dtype>": [[hidden, batch, layers, steps, bytes per
    (layer, step, sequence, hidden unit)], ...]}; `rnn_grid` on an H100 takes about a minute."""
    out: dict[str, list[list[float]]] = {}
    cells = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}
    for mode, cell in cells.items():
        for key, dtype in DTYPES.items():
            for h in HIDDEN:
                for layers in LAYERS:
                    for b in BATCH:
                        for s in STEPS:
                            fwd, bwd, reserve = _case(cell, dev, dtype, h, layers, b, s, reps)
                            row = [h, b, layers, s]
                            out.setdefault(f"{mode}:forward:{key}", []).append([*row, fwd])
                            out.setdefault(f"{mode}:backward:{key}", []).append([*row, bwd])
                            per = reserve / (layers * s * b * h) if reserve >= 0 else -1.0
                            out.setdefault(f"reserve:{mode}:{key}", []).append([*row, per])
    torch.cuda.empty_cache()
    return out
