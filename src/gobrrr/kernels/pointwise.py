"""Fused pointwise activations, forward and backward: SwiGLU and GELU (exact and tanh).

Each kernel is one pass over flat, contiguous memory, in fp32 registers; backward recomputes the
activation from the saved inputs instead of saving it.

Ops: gobrrr::swiglu_fwd, gobrrr::swiglu_bwd, gobrrr::gelu_fwd, gobrrr::gelu_bwd.
"""

from __future__ import annotations

import torch

from gobrrr.errors import GobrrrError
from gobrrr.kernels._util import (
    cdiv,
    check_float,
    check_same_device,
    check_same_shape,
    direct,
    flat,
    is_interpreter,
    jit,
    kernel_for,
    tl,
)

TUNING = {"block": 4096, "warps": 8}  # benchmarks may overwrite these to sweep them
_APPROX = {"none": 0, "tanh": 1}


@jit
def _swiglu_kernel(G, U, DY, Y, DG, DU, n, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    g = tl.load(G + offs, mask=mask, other=0.0).to(tl.float32)
    u = tl.load(U + offs, mask=mask, other=0.0).to(tl.float32)
    sig = tl.sigmoid(g)
    silu = g * sig
    if BACKWARD:
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        dsilu = sig * (1.0 + g * (1.0 - sig))  # d silu(g) / dg
        tl.store(DG + offs, (dy * u * dsilu).to(DG.dtype.element_ty), mask=mask)
        tl.store(DU + offs, (dy * silu).to(DU.dtype.element_ty), mask=mask)
    else:
        tl.store(Y + offs, (silu * u).to(Y.dtype.element_ty), mask=mask)


@jit
def _gelu_kernel(X, DY, OUT, n, APPROX: tl.constexpr, BACKWARD: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    x = tl.load(X + offs, mask=mask, other=0.0).to(tl.float32)
    if APPROX == 1:
        # 0.5 x (1 + tanh(k (x + 0.044715 x^3))), k = sqrt(2/pi); tanh(z) = 2 sigmoid(2z) - 1
        k = 0.7978845608028654
        inner = k * (x + 0.044715 * x * x * x)
        inner = tl.minimum(tl.maximum(inner, -20.0), 20.0)  # tanh is +-1 there; exp stays finite
        t = 2.0 * tl.sigmoid(2.0 * inner) - 1.0
        cdf = 0.5 * (1.0 + t)
        pdf_term = 0.5 * x * (1.0 - t * t) * k * (1.0 + 3.0 * 0.044715 * x * x)
    else:
        cdf = 0.5 * (1.0 + tl.math.erf(x * 0.7071067811865476))
        pdf_term = x * 0.3989422804014327 * tl.exp(-0.5 * x * x)  # x * phi(x)
    if BACKWARD:
        dy = tl.load(DY + offs, mask=mask, other=0.0).to(tl.float32)
        tl.store(OUT + offs, (dy * (cdf + pdf_term)).to(OUT.dtype.element_ty), mask=mask)
    else:
        tl.store(OUT + offs, (x * cdf).to(OUT.dtype.element_ty), mask=mask)


def _grid(n: int) -> tuple[int, dict]:
    block = 16384 if is_interpreter() else TUNING["block"]
    return cdiv(n, block), {"BLOCK": block, "num_warps": TUNING["warps"]}


def _swiglu(gate, up, dy):
    g, u = flat(gate, up)
    n = g.numel()
    progs, meta = _grid(n)
    kern = kernel_for(_swiglu_kernel, g.device)
    if dy is None:
        y = torch.empty_like(g)
        kern[(progs,)](g, u, g, y, y, y, n, BACKWARD=False, **meta)
        return y.view(gate.shape)
    (d,) = flat(dy)
    dg, du = torch.empty_like(g), torch.empty_like(u)
    kern[(progs,)](g, u, d, dg, dg, du, n, BACKWARD=True, **meta)
    return dg.view(gate.shape), du.view(up.shape)


def _gelu(x, dy, approximate):
    (xf,) = flat(x)
    n = xf.numel()
    progs, meta = _grid(n)
    out = torch.empty_like(xf)
    d = xf if dy is None else flat(dy)[0]
    kern = kernel_for(_gelu_kernel, xf.device)
    kern[(progs,)](xf, d, out, n, APPROX=_APPROX[approximate], BACKWARD=dy is not None, **meta)
    return out.view(x.shape)


@torch.library.custom_op("gobrrr::swiglu_fwd", mutates_args=())
def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up, elementwise; computed in fp32, returned in gate's dtype."""
    return _swiglu(gate, up, None)


@swiglu_fwd.register_fake
def _(gate, up):
    return gate.new_empty(gate.shape)


@torch.library.custom_op("gobrrr::swiglu_bwd", mutates_args=())
def swiglu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dgate, dup) of swiglu: dy*up*silu'(gate), dy*silu(gate)."""
    return _swiglu(gate, up, dy)


@swiglu_bwd.register_fake
def _(dy, gate, up):
    return gate.new_empty(gate.shape), up.new_empty(up.shape)


def _swiglu_setup(ctx, inputs, output):
    ctx.save_for_backward(*inputs)


def _swiglu_backward(ctx, dy):
    gate, up = ctx.saved_tensors
    return swiglu_bwd(dy, gate, up)


swiglu_fwd.register_autograd(_swiglu_backward, setup_context=_swiglu_setup)


@torch.library.custom_op("gobrrr::gelu_fwd", mutates_args=())
def gelu_fwd(x: torch.Tensor, approximate: str) -> torch.Tensor:
    """GELU, exact (erf, approximate='none') or the tanh approximation (approximate='tanh')."""
    return _gelu(x, None, approximate)


@gelu_fwd.register_fake
def _(x, approximate):
    return x.new_empty(x.shape)


@torch.library.custom_op("gobrrr::gelu_bwd", mutates_args=())
def gelu_bwd(dy: torch.Tensor, x: torch.Tensor, approximate: str) -> torch.Tensor:
    """dx of gelu given dy and the saved input x."""
    return _gelu(x, dy, approximate)


@gelu_bwd.register_fake
def _(dy, x, approximate):
    return x.new_empty(x.shape)


def _gelu_setup(ctx, inputs, output):
    ctx.approximate = inputs[1]
    ctx.save_for_backward(inputs[0])


def _gelu_backward(ctx, dy):
    (x,) = ctx.saved_tensors
    return gelu_bwd(dy, x, ctx.approximate), None


gelu_fwd.register_autograd(_gelu_backward, setup_context=_gelu_setup)


# The public functions differentiate through autograd.Functions that launch the kernels directly
# when nothing needs to see the ops (`direct`), and call the ops otherwise.


class _SwiGLU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, gate, up):
        ctx.save_for_backward(gate, up)
        return _swiglu(gate, up, None) if direct(gate) else torch.ops.gobrrr.swiglu_fwd(gate, up)

    @staticmethod
    def backward(ctx, dy):
        gate, up = ctx.saved_tensors
        if direct(dy):
            return _swiglu(gate, up, dy)
        return torch.ops.gobrrr.swiglu_bwd(dy, gate, up)


class _GELU(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, approximate):
        ctx.approximate = approximate
        ctx.save_for_backward(x)
        if direct(x):
            return _gelu(x, None, approximate)
        return torch.ops.gobrrr.gelu_fwd(x, approximate)

    @staticmethod
    def backward(ctx, dy):
        (x,) = ctx.saved_tensors
        if direct(dy):
            return _gelu(x, dy, ctx.approximate), None
        return torch.ops.gobrrr.gelu_bwd(dy, x, ctx.approximate), None


def swiglu(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """SwiGLU gate: silu(gate) * up. gate, up: same shape and dtype, any layout."""
    check_float("gate", gate)
    check_float("up", up)
    check_same_shape(gate=gate, up=up)
    check_same_device(gate=gate, up=up)
    if gate.dtype != up.dtype:
        raise GobrrrError(f"gate is {gate.dtype} but up is {up.dtype}; cast them to one dtype")
    return _SwiGLU.apply(gate, up)


def gelu(x: torch.Tensor, approximate: str = "none") -> torch.Tensor:
    """GELU as torch.nn.functional.gelu: approximate='none' (erf) or 'tanh'."""
    check_float("x", x)
    if approximate not in _APPROX:
        raise GobrrrError(f"approximate={approximate!r}; use 'none' or 'tanh'")
    return _GELU.apply(x, approximate)
