"""cuDNN's fused recurrent layers, for a calibration (`Calibration.rnn_grid`).

An LSTM's forward is one `_cudnn_rnn` over the whole stack: per layer, one GEMM for the input
over all steps, then per step a small GEMM and a pointwise kernel, each waiting on the last.
Its time follows layers x steps at a rate the hidden width and the batch set, far from what
its FLOPs say, and the host's cost of issuing those kernels (~15 us a layer-step forward, ~20
backward on an H100 host) is larger than their device time (~8 and ~12 at hidden 1024, batch
32): a training step with an RNN waits on the host.

Each configuration is timed as a training step runs it: an fp32 module (its weights flat, as
`flatten_parameters` leaves them on CUDA) under `torch.autocast("cuda", bfloat16)`, whose
`_cudnn_rnn` kernel (aten/src/ATen/cudnn/AutocastRNN.cpp) re-packs the weights into an fp16
buffer and runs in fp16 whatever autocast's dtype (key "fp16"); a bf16 module (cuDNN >= 9.13;
`torch.backends.cudnn.is_acceptable` refuses bf16, so its weights are never flat and every call
compacts them, as in such a model's step: key "bf16"); an fp32 module ("fp32"). The key is the
dtype cuDNN ran (the output's). Per call two times: the host's (`time.perf_counter` around the
call) and the device's (CUDA events, the call
queued behind a spin kernel longer than the host's time, so the GPU never waits on the host:
with the calibration's usual ~1 ms spin the earlier grid measured the host, ~2x the device).
The backward is forward + backward less the forward.

cuDNN's persistent algorithm (PyTorch's `get_algo`: fp16, one layer, hidden <= 1024 and a
multiple of 128, batch a multiple of 8 up to 128, LSTM and plain RNN only, sm80+ with >= 98
SMs) runs one-layer fp16 LSTMs ~2x faster; `gobrrr.cost._ops_rnn.persistent` tells which points
and calls take it, and "device:persist" records whether this GPU passes the device test.
The reserve space's size per (layer, step, sequence, hidden unit) is read off the autograd node
(`_saved_result3`), which `gobrrr.capture.rnn.RESERVE_ELEMENTS` is checked against.
"""

from __future__ import annotations

import contextlib
import statistics
import time
import warnings

import torch

from gobrrr.calibrate.timing import SPIN_CYCLES

HIDDEN = (256, 1024, 2048)
LAYERS = (1, 2)  # one layer: the persistent algorithm's; two: the standard one (any depth)
BATCH = (8, 64)
STEPS = (64, 256)
KINDS = ("fp16", "bf16", "fp32")  # the dtype cuDNN runs (see the module docstring)
#: `rnn_grid(quick=True)`: the LSTM of a bf16-mixed or fp32 step, in a few seconds
QUICK = {"modes": ("lstm",), "kinds": ("fp16", "fp32"), "hidden": (1024,), "steps": (256,)}
REPS = 3
SPIN_S = 1e-3  # SPIN_CYCLES's length on an H100 (~2 GHz), to size the device-timing spin


def device_persist(dev: torch.device) -> bool:
    """PyTorch's `use_persist_device_heuristics` for an LSTM on this GPU (sm80+, not sm86,
    at least 98 SMs; Volta's batch rules are not modelled)."""
    p = torch.cuda.get_device_properties(dev)
    return p.major >= 8 and p.minor != 6 and p.multi_processor_count >= 98


def _module(cell, kind: str, dev, hidden: int, layers: int):
    """The module and the context a training step runs it in, for one kernel dtype."""
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    net = cell(hidden, hidden, num_layers=layers, device=dev, dtype=dtype)
    if kind == "fp16":
        return net, dtype, lambda: torch.autocast("cuda", dtype=torch.bfloat16)
    return net, dtype, contextlib.nullcontext


def _host_s(fn, dev) -> float:
    """Median host seconds to issue fn() from an idle GPU: the GPU drains each kernel as it
    is queued, so the host waits only where the GPU is the slower (as in a training step)."""
    out = []
    for _ in range(REPS):
        torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    torch.cuda.synchronize(dev)
    return statistics.median(out)


def _device_s(fn, dev, host_s: float) -> float:
    """Median device seconds of fn(), queued behind a spin longer than the host's time."""
    cycles = int(SPIN_CYCLES * (1 + 1.2 * host_s / SPIN_S))
    out = []
    for _ in range(REPS):
        torch.cuda._sleep(cycles)
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        out.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(out)


def _case(cell, kind, dev, hidden, layers, batch, steps):
    """{"forward": (host s, device s), "backward": (...), "reserve": bytes, "dtype": key}."""
    net, dtype, ctx = _module(cell, kind, dev, hidden, layers)
    x = torch.randn(steps, batch, hidden, device=dev, dtype=dtype, requires_grad=True)
    with warnings.catch_warnings():  # a bf16 module's "not part of single contiguous chunk"
        warnings.simplefilter("ignore")
        with ctx():
            out = net(x)[0]
        dy = torch.randn_like(out)
        saved = getattr(out.grad_fn, "_saved_result3", None)  # the reserve (CudnnRnnBackward0)

        def fwd():
            with ctx():
                net(x)

        def both():
            with ctx():
                y = net(x)[0]
            torch.autograd.backward(y, dy)

        for _ in range(2):  # warm-up: cuDNN plans, the allocator
            both()
        host_f, host_b = _host_s(fwd, dev), _host_s(both, dev)
        dev_f, dev_b = _device_s(fwd, dev, host_f), _device_s(both, dev, host_b)
    return {
        "forward": (host_f, dev_f),
        "backward": (max(host_b - host_f, 0.0), max(dev_b - dev_f, 0.0)),
        "reserve": saved.numel() if isinstance(saved, torch.Tensor) else -1,
        "dtype": {torch.float16: "fp16", torch.bfloat16: "bf16"}.get(out.dtype, "fp32"),
    }


def rnn_grid(dev: torch.device, quick: bool = False) -> dict[str, list[list[float]]]:
    """{"<lstm|gru>:<forward|backward>:<fp16|bf16|fp32>": [[hidden, batch, layers, steps,
    device seconds], ...], "host:<same key>": [[..., host seconds], ...],
    "reserve:<mode>:<dtype>": [[..., bytes per (layer, step, sequence, hidden unit)], ...],
    "device:persist": [[1 or 0]]}. About 25 s of GPU time on an H100; `quick` (a few s): the
    LSTM of a bf16-mixed / fp32 step at hidden 1024 only."""
    q = QUICK if quick else {}
    cells = {"lstm": torch.nn.LSTM, "gru": torch.nn.GRU}
    out: dict[str, list[list[float]]] = {"device:persist": [[float(device_persist(dev))]]}
    for mode in q.get("modes", cells):
        for kind in q.get("kinds", KINDS):
            for h in q.get("hidden", HIDDEN):
                for layers in LAYERS:
                    for b in BATCH:
                        for s in q.get("steps", STEPS):
                            r = _case(cells[mode], kind, dev, h, layers, b, s)
                            _record(out, mode, r, [h, b, layers, s])
    torch.cuda.empty_cache()
    return out


def _record(out: dict, mode: str, r: dict, row: list) -> None:
    for direction in ("forward", "backward"):
        host, device = r[direction]
        key = f"{mode}:{direction}:{r['dtype']}"
        out.setdefault(key, []).append([*row, device])
        out.setdefault(f"host:{key}", []).append([*row, host])
    h, b, layers, s = row
    per = r["reserve"] / (layers * s * b * h) if r["reserve"] >= 0 else -1.0
    out.setdefault(f"reserve:{mode}:{r['dtype']}", []).append([*row, per])
