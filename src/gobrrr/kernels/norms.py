"""Fused RMSNorm and LayerNorm over the last dimension, forward and backward.

Forward: one pass over x; it saves x itself plus the per-row rstd (and mean for LayerNorm), in
fp32. Backward: a persistent grid; each program walks a strided set of row tiles, writes dx and
keeps fp32 partial sums of dw (and db) in registers, then one small kernel sums the programs'
partials into dw and db in the weight's dtype. Rows too wide for an fp32 tile and the
accumulators to share the registers (16384 wide at 8 warps) keep the tile in its 16-bit input
dtype between the row sums and dx; fp32 rows that wide are read twice: row sums first, then dx
from a second read that hits L1/L2. All arithmetic is fp32; outputs take the input's dtype.

Ops (what the cost model counts): gobrrr::rms_norm_fwd, gobrrr::rms_norm_bwd,
gobrrr::layer_norm_fwd, gobrrr::layer_norm_bwd.
"""

from __future__ import annotations

import torch

from gobrrr.errors import GobrrrError
from gobrrr.kernels._norm_kernels import _norm_bwd_kernel, _norm_fwd_kernel, _sum_parts_kernel
from gobrrr.kernels._util import (
    cdiv,
    check_float,
    check_same_device,
    direct,
    is_interpreter,
    kernel_for,
    next_pow2,
    num_sms,
    rows_2d,
)

# Launch heuristics; 0 (-1 for bwd_reload) means "by row width" (_bwd_launch). Benchmarks
# overwrite entries to sweep them; the defaults come from such a sweep on an H100
# (docs/investigations/2026-11-22-triton-kernels-against-pytorch.md): the backward runs one
# program per SM, 8 warps, and pipelines its row
# loop 3 deep for rows up to 8192 wide; bwd_chunk is the column chunk of the first read of the
# two-read path (0: the whole row, which keeps the most bytes in flight). Wide 16-bit rows
# (bwd_keep16) are read once and held in 16 bits, at bwd_keep16_warps_{rms,ln} warps, 2 stages.
# sum_block_n: columns per program of the dw (db) partial sums.
TUNING = {
    "fwd_elems": 4096,
    "fwd_warps": 0,
    "bwd_elems": 8192,
    "bwd_warps": 8,
    "bwd_per_sm": 1,
    "bwd_stages": 0,
    "bwd_reload": -1,
    "bwd_chunk": 0,
    "bwd_reload_warps_rms": 16,
    "bwd_keep16": 1,
    "bwd_keep16_warps_rms": 8,
    "bwd_keep16_warps_ln": 16,
    "sum_block_n": 32,
}
MAX_N = 65536  # widest row held in registers at once


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
        x2,
        weight,
        bias if bias is not None else weight,
        y,
        mean,
        rstd,
        m,
        n,
        x2.stride(0),
        y.stride(0),
        eps,
        IS_RMS=is_rms,
        HAS_BIAS=bias is not None,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        num_warps=_warps(block_m * block_n, TUNING["fwd_warps"]),
    )
    lead = x.shape[:-1]
    return y.view(x.shape), mean.view(lead), rstd.view(lead)


def _bwd_launch(
    m: int, n: int, has_bias: bool, device: torch.device, dtype: torch.dtype = torch.float32
) -> dict:
    """Tile shape, program count and kernel flags of the backward for (m, n) rows."""
    block_m, block_n = _block_m(n, TUNING["bwd_elems"]), next_pow2(n)
    tiles = cdiv(m, block_m)
    # as many programs as SMs, but no more than the tiles need: 4096 tiles on 132 SMs run as 128
    # programs of 32 tiles, not 132 of which 4 take a 32nd tile while the rest wait
    per_prog = cdiv(tiles, num_sms(device) * (TUNING["bwd_per_sm"] or 1))
    warps = _warps(block_m * block_n, TUNING["bwd_warps"])
    # fp32 values a thread holds: the x and dy tiles plus the dw (db) accumulators; from 192
    # (16384 wide at 8 warps) ptxas spills. A 16-bit tile is then held in 16 bits (keep16); an
    # fp32 one is read twice. On an H100 (4096x16384 bf16) keep16 beat reading twice, and the
    # two-read path ran RMSNorm fastest at 16 warps
    # (docs/investigations/2026-11-22-triton-kernels-against-pytorch.md).
    per_thread = block_m * block_n // (32 * warps) * (4 if has_bias else 3)
    reload = TUNING["bwd_reload"] if TUNING["bwd_reload"] >= 0 else per_thread >= 192
    keep16 = bool(reload and TUNING["bwd_keep16"] and dtype in (torch.bfloat16, torch.float16))
    if keep16:
        reload, warps = False, TUNING["bwd_keep16_warps_ln" if has_bias else "bwd_keep16_warps_rms"]
    elif reload and not has_bias and TUNING["bwd_reload_warps_rms"]:
        warps = TUNING["bwd_reload_warps_rms"]
    return dict(
        block_m=block_m,
        block_n=block_n,
        tiles=tiles,
        n_progs=cdiv(tiles, per_prog),
        warps=warps,
        reload=bool(reload),
        keep16=keep16,
        mask_m=m % block_m != 0,
        mask_n=n != block_n,
        stages=TUNING["bwd_stages"] or (3 if block_n <= 8192 else 2 if keep16 else 1),
        chunk=min(TUNING["bwd_chunk"] or block_n, block_n),
    )


def _sum_parts(dw_part, db_part, has_bias, dtype):
    """Column sums of the (programs, N) fp32 partials of dw (and db): one launch for both."""
    p, n = dw_part.shape
    dw = torch.empty(n, dtype=dtype, device=dw_part.device)
    db = torch.empty(n if has_bias else 0, dtype=dtype, device=dw_part.device)
    block_p = next_pow2(p)
    block_n = TUNING["sum_block_n"] if dw_part.device.type == "cuda" else next_pow2(n)
    kern = kernel_for(_sum_parts_kernel, dw_part.device)
    kern[(cdiv(n, block_n),)](
        dw_part,
        db_part,
        dw,
        db if has_bias else dw,
        p,
        n,
        HAS_BIAS=has_bias,
        BLOCK_P=block_p,
        BLOCK_N=block_n,
        num_warps=8 if block_p * block_n >= 8192 else 4,
    )
    return dw, db


def _bwd(dy, x, weight, mean, rstd, has_bias, is_rms):
    n = x.shape[-1]
    x2, dy2 = rows_2d(x), rows_2d(dy)
    m = x2.shape[0]
    c = _bwd_launch(m, n, has_bias, x.device, x.dtype)
    dx = torch.empty((m, n), dtype=x.dtype, device=x.device)
    dw_part = torch.empty((c["n_progs"], n), dtype=torch.float32, device=x.device)
    db_part = torch.empty_like(dw_part) if has_bias else dw_part
    kern = kernel_for(_norm_bwd_kernel, x.device)
    kern[(c["n_progs"],)](
        dy2,
        x2,
        weight,
        mean.reshape(-1),
        rstd.reshape(-1),
        dx,
        dw_part,
        db_part,
        m,
        n,
        dy2.stride(0),
        x2.stride(0),
        dx.stride(0),
        c["tiles"],
        IS_RMS=is_rms,
        HAS_BIAS=has_bias,
        BLOCK_M=c["block_m"],
        BLOCK_N=c["block_n"],
        MASK_M=c["mask_m"],
        MASK_N=c["mask_n"],
        W_IN_LOOP=c["block_n"] >= 8192,
        RELOAD=c["reload"],
        CHUNK=c["chunk"],
        NUM_STAGES=c["stages"],
        KEEP16=c["keep16"],
        BF16=x.dtype == torch.bfloat16,
        num_warps=c["warps"],
    )
    dw, db = _sum_parts(dw_part, db_part, has_bias, weight.dtype)
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
    dy: torch.Tensor,
    x: torch.Tensor,
    weight: torch.Tensor,
    mean: torch.Tensor,
    rstd: torch.Tensor,
    has_bias: bool,
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
# The public functions differentiate through autograd.Functions that launch the kernels directly
# when nothing needs to see the ops (`direct`), and call the ops otherwise.


class _RMSNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, eps):
        if direct(x):
            y, _, rstd = _fwd(x, weight, None, eps, is_rms=True)
        else:
            y, rstd = torch.ops.gobrrr.rms_norm_fwd(x, weight, eps)
        ctx.save_for_backward(x, weight, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, rstd = ctx.saved_tensors
        if direct(dy):
            dx, dw, _ = _bwd(dy, x, weight, rstd, rstd, has_bias=False, is_rms=True)
        else:
            dx, dw = torch.ops.gobrrr.rms_norm_bwd(dy, x, weight, rstd)
        return dx, dw, None


class _LayerNorm(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias, eps):
        if direct(x):
            y, mean, rstd = _fwd(x, weight, bias, eps, is_rms=False)
        else:
            y, mean, rstd = torch.ops.gobrrr.layer_norm_fwd(x, weight, bias, eps)
        ctx.has_bias = bias is not None
        ctx.save_for_backward(x, weight, mean, rstd)
        return y

    @staticmethod
    def backward(ctx, dy):
        x, weight, mean, rstd = ctx.saved_tensors
        if direct(dy):
            dx, dw, db = _bwd(dy, x, weight, mean, rstd, ctx.has_bias, is_rms=False)
        else:
            dx, dw, db = torch.ops.gobrrr.layer_norm_bwd(dy, x, weight, mean, rstd, ctx.has_bias)
        return dx, dw, (db if ctx.has_bias else None), None


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
    return _RMSNorm.apply(x, weight, float(eps))


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, eps: float = 1e-5
) -> torch.Tensor:
    """LayerNorm over the last dim: (x - mean) / sqrt(var + eps) * weight + bias (biased var)."""
    _check(x, weight, bias)
    return _LayerNorm.apply(x, weight, bias, float(eps))
