"""Host cost of gobrrr's own kernel ops, for a calibration (`Calibration.kernel_host`).

A call of one of gobrrr's Triton kernels costs the host far more than an ATen op: Triton's
launcher specialises every argument and the Python glue allocates the outputs (on the H100
host, 500-800 µs per forward+backward of a norm against ~120 µs for PyTorch's own,
benchmarks/README.md). Charged as ordinary ops, a model using these kernels would be predicted
GPU-bound when it is host-bound. Measured as a training step calls them: a chain of CHAIN
calls with inputs that require grad (autograd records it), then one backward through the chain
(its engine entry shared by the chain, as in a step); per call, the forward is the chain's time
over CHAIN and the backward the backward's. Tiny inputs: the host is what the loop waits on.
"""

from __future__ import annotations

import torch

from gobrrr.calibrate.sections.host import per_call

CHAIN = 16  # calls per measured chain


def _cases(dev: torch.device):
    """(op name stem, fn, inputs) for each kernel family, bf16 on tiny inputs; fn(y) returns an
    output shaped like y (the chained input, inputs[0])."""
    from gobrrr import kernels as k  # lazy: triton is optional

    def r(*shape):
        return torch.randn(*shape, device=dev, dtype=torch.bfloat16, requires_grad=True)

    x, u, w, b = r(8, 256), r(8, 256), r(256), r(256)
    q, kk, v = r(1, 2, 64, 64), r(1, 2, 64, 64), r(1, 2, 64, 64)
    yield "rms_norm", lambda y: k.rms_norm(y, w), (x, w)
    yield "layer_norm", lambda y: k.layer_norm(y, w, b), (x, w, b)
    yield "gelu", lambda y: k.gelu(y, "tanh"), (x,)
    yield "swiglu", lambda y: k.swiglu(y, u), (x, u)
    yield "attention", lambda y: k.attention(y, kk, v, causal=True), (q, kk, v)


def kernel_host_costs(dev: torch.device, calls: int = 20, rounds: int = 5) -> dict[str, float]:
    """Host seconds per call of each gobrrr kernel op, keyed by op name ("rms_norm_fwd",
    "rms_norm_bwd", ...): what the cost model charges for these ops instead of an ordinary
    op's host cost. {} when Triton is not installed."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return {}
    out = {}
    for stem, fn, inputs in _cases(dev):

        def chain(fn=fn, inputs=inputs):
            y = inputs[0]
            for _ in range(CHAIN):
                y = fn(y)
            return y

        dy = chain().detach().clone()

        def fwd_bwd(inputs=inputs, dy=dy, chain=chain):
            torch.autograd.grad(chain(), inputs, dy)

        warmup = min(calls, 10)
        fwd = per_call(chain, dev, calls, rounds, warmup) / CHAIN
        both = per_call(fwd_bwd, dev, calls, rounds, warmup) / CHAIN
        out[f"{stem}_fwd"], out[f"{stem}_bwd"] = fwd, max(both - fwd, 0.0)
    return out
