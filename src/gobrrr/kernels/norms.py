"""Fused RMSNorm and LayerNorm over the last dimension, forward and backward.

Forward: one pass over x; it saves x itself plus the per-row rstd (and mean for LayerNorm), in
fp32. Backward: a persistent grid; each program walks a strided set of row tiles, writes dx and
keeps fp32 partial sums of dw (and db) in registers, then one small torch reduction over the
programs' partials gives dw. All arithmetic is fp32; outputs take the input's dtype.

Ops (what the cost model counts): gobrrr::rms_norm_fwd, gobrrr::rms_norm_bwd,
gobrrr::layer_norm_fwd, gobrrr::layer_norm_bwd.
"""

from __future__ import annotations

import torch

from gobrrr.errors import GobrrrError
from gobrrr.kernels._util import (
    cdiv,
    check_float,
    check_same_device,
    is_interpreter,
    jit,
    kernel_for,
    next_pow2,
    num_sms,
    rows_2d,
    tl,
)

# Launch heuristics; 0 means "by row width" (_bwd_launch). Benchmarks overwrite entries to sweep
# them; the defaults come from such a sweep on an H100 (benchmarks/README.md): the backward runs
# one program per SM, 8 warps, and pipelines its row loop 3 deep for rows up to 8192 wide.
TUNING = {"fwd_elems": 4096, "fwd_warps": 0, "bwd_elems": 8192, "bwd_warps": 8, "bwd_per_sm": 1,
          "bwd_stages": 0}
MAX_N = 65536  # widest row held in registers at once


@jit
def _norm_fwd_kernel(
    X, W, B, Y, MEAN, RSTD, M, N, stride_x, stride_y, eps,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)  # (BLOCK_M,)
    cols = tl.arange(0, BLOCK_N)  # (BLOCK_N,)
    row_ok = rows < M
    col_ok = cols < N
    mask = row_ok[:, None] & col_ok[None, :]
    rows64 = rows.to(tl.int64)
    x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)  # (BLOCK_M, BLOCK_N)
    if IS_RMS:
        xc = x
    else:
        mean = tl.sum(x, axis=1) / N
        xc = tl.where(mask, x - mean[:, None], 0.0)
        tl.store(MEAN + rows, mean, mask=row_ok)
    rstd = 1.0 / tl.sqrt(tl.sum(xc * xc, axis=1) / N + eps)  # (BLOCK_M,)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    y = xc * rstd[:, None] * w[None, :]
    if HAS_BIAS:
        y += tl.load(B + cols, mask=col_ok, other=0.0).to(tl.float32)[None, :]
    tl.store(Y + rows64[:, None] * stride_y + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)
    tl.store(RSTD + rows, rstd, mask=row_ok)


@jit
def _norm_bwd_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, M, N, stride_dy, stride_x, stride_dx,
    tiles_per_prog,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    W_IN_LOOP: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    if not W_IN_LOOP:
        w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, tiles_per_prog, num_stages=NUM_STAGES):
        rows = (pid + i * n_progs) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_ok = rows < M
        mask = row_ok[:, None] & col_ok[None, :]
        rows64 = rows.to(tl.int64)
        x = tl.load(X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0)
        dy = tl.load(DY + rows64[:, None] * stride_dy + cols[None, :], mask=mask, other=0.0)
        x = x.to(tl.float32)
        dy = dy.to(tl.float32)
        rstd = tl.load(RSTD + rows, mask=row_ok, other=0.0)
        if IS_RMS:
            xhat = x * rstd[:, None]
        else:
            mean = tl.load(MEAN + rows, mask=row_ok, other=0.0)
            xhat = tl.where(mask, (x - mean[:, None]) * rstd[:, None], 0.0)
        if W_IN_LOOP:  # wide rows: re-read w (from cache) rather than hold it in registers
            w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = dy * w[None, :]  # dL/dxhat
        c1 = tl.sum(g * xhat, axis=1) / N
        if IS_RMS:
            dx = (g - xhat * c1[:, None]) * rstd[:, None]
        else:
            c2 = tl.sum(g, axis=1) / N
            dx = (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]
        tl.store(DX + rows64[:, None] * stride_dx + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=mask)
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    tl.store(DW_PART + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_ok)
    if HAS_BIAS:
        tl.store(DB_PART + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_ok)


def _block_m(n_cols: int, elems: int) -> int:
    block_n = next_pow2(n_cols)
    if is_interpreter():
        return max(1, min(64, 8192 // block_n))  # few big programs: the interpreter is per-program
    return max(1, min(64, elems // block_n))


def _warps(block_elems: int, override: int) -> int:
    if override:
        return override
    return 8 if block_elems <= 8192 else 16


def _fwd(x, weight, bias, eps, is_rms):
    n = x.shape[-1]
    x2 = rows_2d(x)  # (M, N)
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    rstd = torch.empty(m, dtype=torch.float32, device=x.device)
    mean = rstd if is_rms else torch.empty(m, dtype=torch.float32, device=x.device)
    block_m, block_n = _block_m(n, TUNING["fwd_elems"]), next_pow2(n)
    kern = kernel_for(_norm_fwd_kernel, x.device)
    kern[(cdiv(m, block_m),)](
        x2, weight, bias if bias is not None else weight, y, mean, rstd, m, n,
        x2.stride(0), y.stride(0), eps,
        IS_RMS=is_rms, HAS_BIAS=bias is not None, BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=_warps(block_m * block_n, TUNING["fwd_warps"]),
    )
    lead = x.shape[:-1]
    return y.view(x.shape), mean.view(lead), rstd.view(lead)


def _bwd(dy, x, weight, mean, rstd, has_bias, is_rms):
    n = x.shape[-1]
    x2, dy2 = rows_2d(x), rows_2d(dy)
    m = x2.shape[0]
    block_m, block_n = _block_m(n, TUNING["bwd_elems"]), next_pow2(n)
    tiles = cdiv(m, block_m)
    per_sm = TUNING["bwd_per_sm"] or 1
    n_progs = max(1, min(tiles, num_sms(x.device) * per_sm))
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dw_part = torch.empty((n_progs, n), dtype=torch.float32, device=x.device)
    db_part = torch.empty((n_progs, n), dtype=torch.float32, device=x.device) if has_bias else None
    kern = kernel_for(_norm_bwd_kernel, x.device)
    kern[(n_progs,)](
        dy2, x2, weight, mean.reshape(-1), rstd.reshape(-1), dx, dw_part,
        db_part if has_bias else dw_part, m, n, dy2.stride(0), x2.stride(0), dx.stride(0),
        cdiv(tiles, n_progs),
        IS_RMS=is_rms, HAS_BIAS=has_bias, BLOCK_M=block_m, BLOCK_N=block_n,
        W_IN_LOOP=block_n >= 8192, NUM_STAGES=TUNING["bwd_stages"] or (3 if block_n <= 8192 else 1),
        num_warps=_warps(block_m * block_n, TUNING["bwd_warps"]),
    )
    dw = dw_part.sum(0).to(weight.dtype)
    db = db_part.sum(0).to(weight.dtype) if has_bias else weight.new_empty(0)
    return dx.view(x.shape), dw, db


# ---------------------------------------------------------------- RMSNorm ops


@torch.library.custom_op("gobrrr::rms_norm_fwd", mutates_args=())
def rms_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """y = x * rstd * weight, rstd = 1/sqrt(mean(x^2) + eps). Returns (y, rstd: fp32, rows)."""
    y, _, rstd = _fwd(x, weight, None, eps, is_rms=True)
    return y, rstd


@rms_norm_fwd.register_fake
def _(x, weight, eps):
    return x.new_empty(x.shape), x.new_empty(x.shape[:-1], dtype=torch.float32)


@torch.library.custom_op("gobrrr::rms_norm_bwd", mutates_args=())
def rms_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, rstd: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Gradients (dx, dweight) of rms_norm given dy and the saved x, rstd."""
    dx, dw, _ = _bwd(dy, x, weight, rstd, rstd, has_bias=False, is_rms=True)
    return dx, dw


@rms_norm_bwd.register_fake
def _(dy, x, weight, rstd):
    return x.new_empty(x.shape), weight.new_empty(weight.shape)


def _rms_setup(ctx, inputs, output):
    x, weight, _ = inputs
    ctx.set_materialize_grads(False)  # no zero-filled gradient for the unused rstd output
    ctx.mark_non_differentiable(output[1])
    ctx.save_for_backward(x, weight, output[1])


def _rms_backward(ctx, dy, _drstd):
    if dy is None:
        return None, None, None
    x, weight, rstd = ctx.saved_tensors
    dx, dw = rms_norm_bwd(dy, x, weight, rstd)
    return dx, dw, None


rms_norm_fwd.register_autograd(_rms_backward, setup_context=_rms_setup)


# ---------------------------------------------------------------- LayerNorm ops


@torch.library.custom_op("gobrrr::layer_norm_fwd", mutates_args=())
def layer_norm_fwd(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, eps: float
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """LayerNorm over the last dim. Returns (y, mean, rstd), stats fp32 of shape x.shape[:-1]."""
    return _fwd(x, weight, bias, eps, is_rms=False)


@layer_norm_fwd.register_fake
def _(x, weight, bias, eps):
    stat = x.new_empty(x.shape[:-1], dtype=torch.float32)
    return x.new_empty(x.shape), stat, stat.new_empty(stat.shape)


@torch.library.custom_op("gobrrr::layer_norm_bwd", mutates_args=())
def layer_norm_bwd(
    dy: torch.Tensor, x: torch.Tensor, weight: torch.Tensor, mean: torch.Tensor,
    rstd: torch.Tensor, has_bias: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Gradients (dx, dweight, dbias) of layer_norm; dbias is empty (0,) when has_bias is False."""
    return _bwd(dy, x, weight, mean, rstd, has_bias, is_rms=False)


@layer_norm_bwd.register_fake
def _(dy, x, weight, mean, rstd, has_bias):
    db = weight.new_empty(weight.shape if has_bias else (0,))
    return x.new_empty(x.shape), weight.new_empty(weight.shape), db


def _ln_setup(ctx, inputs, output):
    x, weight, bias, _ = inputs
    ctx.has_bias = bias is not None
    ctx.set_materialize_grads(False)  # no zero-filled gradients for the unused mean, rstd
    ctx.mark_non_differentiable(output[1], output[2])
    ctx.save_for_backward(x, weight, output[1], output[2])


def _ln_backward(ctx, dy, _dmean, _drstd):
    if dy is None:
        return None, None, None, None
    x, weight, mean, rstd = ctx.saved_tensors
    dx, dw, db = layer_norm_bwd(dy, x, weight, mean, rstd, ctx.has_bias)
    return dx, dw, (db if ctx.has_bias else None), None


layer_norm_fwd.register_autograd(_ln_backward, setup_context=_ln_setup)


# ---------------------------------------------------------------- functional API


def _check(x, weight, bias):
    check_float("x", x)
    check_float("weight", weight, ndim=1)
    if bias is not None:
        check_float("bias", bias, ndim=1)
    check_same_device(x=x, weight=weight, bias=bias)
    n = x.shape[-1]
    for name, p in (("weight", weight), ("bias", bias)):
        if p is not None and p.shape[0] != n:
            raise GobrrrError(
                f"{name} has {p.shape[0]} elements but x's last dim is {n}; they must match"
            )
    if n > MAX_N:
        raise GobrrrError(f"last dim {n} exceeds {MAX_N}; use torch's norm for such wide rows")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """RMSNorm over the last dim: x / sqrt(mean(x^2) + eps) * weight, any leading shape.

    Computes in fp32; returns x's dtype. weight: (x.shape[-1],), any float dtype.
    """
    _check(x, weight, None)
    return rms_norm_fwd(x, weight, float(eps))[0]


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias (biased var)."""
    _check(x, weight, bias)
    return layer_norm_fwd(x, weight, bias, float(eps))[0]
