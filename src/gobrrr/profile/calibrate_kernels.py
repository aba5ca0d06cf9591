"""Host cost of gobrrr's own kernel ops, for a calibration (`Calibration.kernel_host`).

A call of one of gobrrr's Triton kernels costs the host far more than an ATen op: Triton's
launcher specialises every argument and the Python glue allocates the outputs (on the H100
host, 500-800 µs per forward+backward of a norm against ~120 µs for PyTorch's own,
benchmarks/README.md). Charged as ordinary ops, a model using these kernels would be predicted
GPU-bound when it is host-bound. Measured as a training step calls them: the forward with
inputs that require grad (autograd records it), the backward as the forward and backward
together minus the forward, on tiny inputs so that the host is what the loop waits on.
"""

from __future__ import annotations

import time

import torch

from gobrrr.profile.calibrate import _sync


def _cases(dev: torch.device):
    """(op name stem, fn, inputs) for each kernel family, bf16 on tiny inputs."""
    from gobrrr import kernels as k

    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True)

    x, u, w, b = r(8, 256), r(8, 256), r(256), r(256)
    q, kk, v = r(1, 2, 64, 64), r(1, 2, 64, 64), r(1, 2, 64, 64)
    yield "rms_norm", lambda: k.rms_norm(x, w), (x, w)
    yield "layer_norm", lambda: k.layer_norm(x, w, b), (x, w, b)
    yield "gelu", lambda: k.gelu(x, "tanh"), (x,)
    yield "swiglu", lambda: k.swiglu(x, u), (x, u)
    yield "attention", lambda: k.attention(q, kk, v, causal=True), (q, kk, v)


def _per_call(fn, dev: torch.device, calls: int, rounds: int) -> float:
    """Least over `rounds` of the mean wall seconds per call of `calls` back-to-back calls."""
    for _ in range(min(calls, 10)):
        fn()
    _sync(dev)
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - t0) / calls)
        _sync(dev)
    return best


def kernel_host_costs(dev: torch.device, calls: int = 200, rounds: int = 5) -> dict[str, float]:
    """Host seconds per call of each gobrrr kernel op, keyed by op name ("rms_norm_fwd",
    "rms_norm_bwd", ...): what the cost model charges for these ops instead of an ordinary
    op's host cost. {} when Triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return {}
    out = {}
    for stem, fn, inputs in _cases(dev):
        dy = fn().detach().clone()

        def fwd_bwd(fn=fn, inputs=inputs, dy=dy):
            torch.autograd.grad(fn(), inputs, dy)

        fwd = _per_call(fn, dev, calls, rounds)
        both = _per_call(fwd_bwd, dev, calls, rounds)
        out[f"{stem}_fwd"], out[f"{stem}_bwd"] = fwd, max(both - fwd, 0.0)
    return out
