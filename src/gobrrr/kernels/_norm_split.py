"""Norm backward for wide rows: each row's columns shared out among SPLIT programs.

One program holding a whole 16384-wide row needs the row in registers plus full-width fp32 dw
(db) accumulators: LayerNorm then spills. Here the SPLIT programs of a group take the same rows
and each owns 1/SPLIT of the columns: it writes dx and accumulates dw (db) for its slice only.
The two row sums of dx, c1 = mean(g * xhat) and c2 = mean(g) (g = dy * w), need the whole row,
so every program reads the whole row to compute them; the group's programs read the same rows at
about the same time, so HBM sees each byte once and the repeats are L2 hits. The program then
reads its own slice again (from L1) for dx. No program waits on another.
"""

from __future__ import annotations

import torch

from gobrrr.kernels._util import cdiv, jit, kernel_for, next_pow2, num_sms, tl


@jit
def _norm_bwd_cols_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, M, N, stride_dy, stride_x, stride_dx,
    n_groups, slice_w,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_N: tl.constexpr,
    BLOCK_S: tl.constexpr,
):
    # program = (group, part): the group takes rows group, group + n_groups, ...; the part owns
    # columns [part * slice_w, (part + 1) * slice_w). One row at a time, 1-D throughout.
    pid = tl.program_id(0)
    group = pid // SPLIT
    part = pid % SPLIT
    cols = tl.arange(0, BLOCK_N)
    col_ok = cols < N
    offs = tl.arange(0, BLOCK_S)
    own = part * slice_w + offs  # (BLOCK_S,) this program's columns
    own_ok = (offs < slice_w) & (own < N)
    w_own = tl.load(W + own, mask=own_ok, other=0.0).to(tl.float32)
    dw_acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    for i in range(0, tl.cdiv(M - group, n_groups)):
        row64 = (group + i * n_groups).to(tl.int64)
        rstd = tl.load(RSTD + row64)
        mean = 0.0 if IS_RMS else tl.load(MEAN + row64)
        # 1. the row sums over the whole row (the group's other programs read it too: L2)
        x = tl.load(X + row64 * stride_x + cols, mask=col_ok, other=0.0).to(tl.float32)
        dy = tl.load(DY + row64 * stride_dy + cols, mask=col_ok, other=0.0).to(tl.float32)
        g = dy * tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)
        xhat = (x - mean) * rstd
        c1 = tl.sum(g * xhat, axis=0) / N
        c2 = 0.0 if IS_RMS else tl.sum(g, axis=0) / N
        # 2. this program's slice again (L1), dx and the dw (db) sums
        xs = tl.load(X + row64 * stride_x + own, mask=own_ok, other=0.0).to(tl.float32)
        dys = tl.load(DY + row64 * stride_dy + own, mask=own_ok, other=0.0).to(tl.float32)
        xhat_s = (xs - mean) * rstd
        dx = (dys * w_own - xhat_s * c1 - c2) * rstd
        tl.store(DX + row64 * stride_dx + own, dx.to(DX.dtype.element_ty), mask=own_ok,
                 eviction_policy="evict_first")
        dw_acc += dys * xhat_s
        if HAS_BIAS:
            db_acc += dys
    out = group.to(tl.int64) * N + own  # this group's partials, for this program's columns
    tl.store(DW_PART + out, dw_acc, mask=own_ok)
    if HAS_BIAS:
        tl.store(DB_PART + out, db_acc, mask=own_ok)


def split_plan(m: int, n: int, device: torch.device, slice_cols: int, per_sm: int) -> dict:
    """Programs per row (a power of two, at most 16) owning about `slice_cols` columns each, and
    groups: `per_sm` programs per SM, no more groups than rows."""
    split = min(16, next_pow2(cdiv(n, slice_cols)))
    slice_w = cdiv(cdiv(n, split), 16) * 16  # 16-element aligned slices: full-width accesses
    n_groups = max(1, min(m, num_sms(device) * per_sm // split))
    return dict(split=split, slice_w=slice_w, block_s=next_pow2(slice_w), n_groups=n_groups)


def split_bwd(dy2, x2, weight, mean, rstd, dx, has_bias, is_rms, tuning):
    """dx into `dx`, and the (groups, N) fp32 partial sums of dw (db) over each group's rows, of
    a norm's backward with each row's columns shared out among programs (module docstring).
    Returns (dw_part, db_part)."""
    m, n = x2.shape
    plan = split_plan(m, n, x2.device, tuning["split_cols"], tuning["split_per_sm"])
    dw_part = torch.empty((plan["n_groups"], n), dtype=torch.float32, device=x2.device)
    db_part = torch.empty_like(dw_part) if has_bias else dw_part
    kern = kernel_for(_norm_bwd_cols_kernel, x2.device)
    kern[(plan["n_groups"] * plan["split"],)](
        dy2, x2, weight, mean, rstd, dx, dw_part, db_part, m, n, dy2.stride(0), x2.stride(0),
        dx.stride(0), plan["n_groups"], plan["slice_w"],
        IS_RMS=is_rms, HAS_BIAS=has_bias, SPLIT=plan["split"], BLOCK_N=next_pow2(n),
        BLOCK_S=plan["block_s"], num_warps=tuning["split_warps"],
    )
    return dw_part, db_part
