"""The Triton kernels of the fused RMSNorm and LayerNorm (launched from gobrrr.kernels.norms).

Forward: one program per row tile. Backward: a persistent grid; each program walks a strided set
of row tiles, writes dx and keeps fp32 partial sums of dw (and db) in registers, written once as
its row of DW_PART (DB_PART); `_sum_parts_kernel` sums those rows. Rows too wide for an fp32
tile and the accumulators to share the registers are held in their 16-bit dtype between the
row sums and dx (`_rows_keep16`), or read twice (RELOAD).
"""

from __future__ import annotations

from gobrrr.kernels._util import jit, tl


@jit
def _norm_fwd_kernel(
    X,
    W,
    B,
    Y,
    MEAN,
    RSTD,
    M,
    N,
    stride_x,
    stride_y,
    eps,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
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
def _bwd_tile(
    X,
    DY,
    MEAN,
    RSTD,
    rows,
    cols,
    mask,
    M,
    stride_x,
    stride_dy,
    IS_RMS: tl.constexpr,
    EVICT: tl.constexpr,
):
    """dy and xhat = (x - mean) * rstd of one tile, fp32 (BLOCK_M, BLOCK_N); rstd (BLOCK_M,).
    Masked-off elements have dy = 0, so they add nothing to any sum."""
    rows64 = rows.to(tl.int64)
    x = tl.load(
        X + rows64[:, None] * stride_x + cols[None, :], mask=mask, other=0.0, eviction_policy=EVICT
    ).to(tl.float32)
    dy = tl.load(
        DY + rows64[:, None] * stride_dy + cols[None, :],
        mask=mask,
        other=0.0,
        eviction_policy=EVICT,
    ).to(tl.float32)
    rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
    if IS_RMS:
        xhat = x * rstd[:, None]
    else:
        xhat = (x - tl.load(MEAN + rows, mask=rows < M, other=0.0)[:, None]) * rstd[:, None]
    return dy, xhat, rstd


@jit
def _f32_again(v, BF16: tl.constexpr):
    """v (the input dtype) as fp32 through other ops than v.to(fp32), so the compiler does not
    merge the two conversions and keep the fp32 tile live between them: the 16-bit tile is
    half the registers."""
    if BF16:
        return (v.to(tl.uint16, bitcast=True).to(tl.uint32) << 16).to(tl.float32, bitcast=True)
    else:
        return v.to(tl.float32)


@jit
def _tile_mask(rows, cols, M, N, MASK_M: tl.constexpr, MASK_N: tl.constexpr):
    """Bounds mask of a (rows, cols) tile; only the dimensions that can overhang are tested."""
    if MASK_M and MASK_N:
        return (rows < M)[:, None] & (cols < N)[None, :]
    elif MASK_M:
        return (rows < M)[:, None] & (cols >= 0)[None, :]
    elif MASK_N:
        return (rows >= 0)[:, None] & (cols < N)[None, :]
    else:
        return (rows >= 0)[:, None] & (cols >= 0)[None, :]


@jit
def _row_sums_chunked(
    X,
    DY,
    W,
    MEAN,
    RSTD,
    rows,
    M,
    N,
    stride_x,
    stride_dy,
    IS_RMS: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    CHUNK: tl.constexpr,
):
    """c1 = mean(g * xhat), c2 = mean(g) per row (g = dy * w), reading CHUNK columns at a time
    and keeping them in L1 for the backward's second read. Returns two (BLOCK_M,) fp32."""
    s1 = tl.zeros([BLOCK_M], dtype=tl.float32)
    s2 = tl.zeros([BLOCK_M], dtype=tl.float32)
    for c0 in range(0, N, CHUNK):
        cols = c0 + tl.arange(0, CHUNK)
        mask = _tile_mask(rows, cols, M, N, MASK_M, True)
        dy, xhat, _ = _bwd_tile(
            X, DY, MEAN, RSTD, rows, cols, mask, M, stride_x, stride_dy, IS_RMS, "evict_last"
        )
        g = dy * tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)[None, :]
        s1 += tl.sum(g * xhat, axis=1)
        s2 += tl.sum(g, axis=1)
    return s1 / N, s2 / N


@jit
def _dx_tile(
    X,
    DY,
    W,
    MEAN,
    RSTD,
    DX,
    rows,
    cols,
    M,
    N,
    stride_x,
    stride_dy,
    stride_dx,
    c1,
    c2,
    dw_acc,
    db_acc,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
):
    """Writes dx of one tile given its rows' sums c1, c2; returns the accumulators (dw, db) plus
    the tile's dy * xhat (and dy)."""
    mask = _tile_mask(rows, cols, M, N, MASK_M, MASK_N)
    dy, xhat, rstd = _bwd_tile(
        X, DY, MEAN, RSTD, rows, cols, mask, M, stride_x, stride_dy, IS_RMS, "evict_first"
    )
    w = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
    g = dy * w.to(tl.float32)[None, :]  # dL/dxhat
    dx = _dx(g, xhat, rstd, c1, c2, IS_RMS)
    dx_ptrs = DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
    tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask, eviction_policy="evict_first")
    dw_acc += dy * xhat
    if HAS_BIAS:
        db_acc += dy
    return dw_acc, db_acc


@jit
def _dx(g, xhat, rstd, c1, c2, IS_RMS: tl.constexpr):
    """dL/dx from g = dL/dxhat: (g - xhat·c1 - c2)·rstd per row, c1 = mean(g·xhat) and
    c2 = mean(g) (no c2 term for RMSNorm)."""
    if IS_RMS:
        return (g - xhat * c1[:, None]) * rstd[:, None]
    return (g - xhat * c1[:, None] - c2[:, None]) * rstd[:, None]


@jit
def _centre(x, mean, IS_RMS: tl.constexpr):
    if IS_RMS:
        return x
    else:
        return x - mean[:, None]


@jit
def _rows_keep16(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PART,
    DB_PART,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    pid,
    n_progs,
    n_tiles,
    base,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    BF16: tl.constexpr,
):
    """One read of each row tile, held in the input dtype between the row sums and dx: half
    the registers of an fp32 tile, which leaves room for the full-width dw (db) accumulators."""
    cols = tl.arange(0, BLOCK_N)
    dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for i in tl.range(0, n_tiles, num_stages=NUM_STAGES):
        rows = (pid + i * n_progs) * BLOCK_M + tl.arange(0, BLOCK_M)
        mask = _tile_mask(rows, cols, M, N, MASK_M, MASK_N)
        rows64 = rows.to(tl.int64)
        x16 = tl.load(
            X + rows64[:, None] * stride_x + cols[None, :],
            mask=mask,
            other=0.0,
            eviction_policy="evict_first",
        )
        dy16 = tl.load(
            DY + rows64[:, None] * stride_dy + cols[None, :],
            mask=mask,
            other=0.0,
            eviction_policy="evict_first",
        )
        rstd = tl.load(RSTD + rows, mask=rows < M, other=0.0)
        # mean is RSTD's row for RMSNorm, unused: _centre ignores it
        mean = tl.load(MEAN + rows, mask=rows < M, other=0.0)
        # 1. row sums: c1 = mean(g * xhat), c2 = mean(g), g = dy * w
        w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        xhat = _centre(x16.to(tl.float32), mean, IS_RMS) * rstd[:, None]
        g = dy16.to(tl.float32) * w[None, :]
        c1 = tl.sum(g * xhat, axis=1) / N
        c2 = tl.sum(g, axis=1) / N
        # 2. dx, and dw (db) partials, from the 16-bit tile converted again; w is re-read (L1)
        # with another cache hint, so the two loads stay apart and no fp32 w stays live
        w = tl.load(W + cols, mask=cols < N, other=0.0, eviction_policy="evict_last")
        dy = _f32_again(dy16, BF16)
        xhat = _centre(_f32_again(x16, BF16), mean, IS_RMS) * rstd[:, None]
        dx = _dx(dy * w.to(tl.float32)[None, :], xhat, rstd, c1, c2, IS_RMS)
        tl.store(
            DX + rows64[:, None] * stride_dx + cols[None, :],
            dx.to(DX.dtype.element_ty),
            mask=mask,
            eviction_policy="evict_first",
        )
        dw_acc += dy * xhat
        if HAS_BIAS:
            db_acc += dy
    _store_parts(DW_PART, DB_PART, base, cols, N, dw_acc, db_acc, HAS_BIAS)


@jit
def _store_parts(DW_PART, DB_PART, base, cols, N, dw_acc, db_acc, HAS_BIAS: tl.constexpr):
    """This program's dw (db) partial sums over its rows, as its row of DW_PART (DB_PART)."""
    tl.store(DW_PART + base + cols, tl.sum(dw_acc, axis=0), mask=cols < N)
    if HAS_BIAS:
        tl.store(DB_PART + base + cols, tl.sum(db_acc, axis=0), mask=cols < N)


@jit
def _norm_bwd_kernel(
    DY,
    X,
    W,
    MEAN,
    RSTD,
    DX,
    DW_PART,
    DB_PART,
    M,
    N,
    stride_dy,
    stride_x,
    stride_dx,
    tiles,
    IS_RMS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASK_M: tl.constexpr,
    MASK_N: tl.constexpr,
    W_IN_LOOP: tl.constexpr,
    RELOAD: tl.constexpr,
    CHUNK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    KEEP16: tl.constexpr,
    BF16: tl.constexpr,
):
    # Persistent: program p takes row tiles p, p + P, p + 2P, ... and keeps fp32 sums of dw
    # (and db) over them in registers; it writes them once, as its row of DW_PART (DB_PART).
    pid = tl.program_id(0)
    n_progs = tl.num_programs(0)
    base = pid.to(tl.int64) * N
    n_tiles = tl.cdiv(tiles - pid, n_progs)
    if RELOAD:
        # Wide rows: a whole tile plus full-width accumulators do not fit in registers (ptxas
        # spills). The row sums take a first pass in narrow column chunks; then the tile is
        # read again (from L1/L2: HBM sees each byte once) in two column halves, each with
        # its own accumulators, which keeps the live ranges short.
        HALF: tl.constexpr = BLOCK_N // 2
        c_lo = tl.arange(0, HALF)
        c_hi = HALF + c_lo
        dw_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        db_lo = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        dw_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        db_hi = tl.zeros([BLOCK_M, HALF], dtype=tl.float32)
        for i in tl.range(0, n_tiles, num_stages=NUM_STAGES):
            rows = (pid + i * n_progs) * BLOCK_M + tl.arange(0, BLOCK_M)
            c1, c2 = _row_sums_chunked(
                X,
                DY,
                W,
                MEAN,
                RSTD,
                rows,
                M,
                N,
                stride_x,
                stride_dy,
                IS_RMS,
                MASK_M,
                MASK_N,
                BLOCK_M,
                CHUNK,
            )
            dw_lo, db_lo = _dx_tile(
                X,
                DY,
                W,
                MEAN,
                RSTD,
                DX,
                rows,
                c_lo,
                M,
                N,
                stride_x,
                stride_dy,
                stride_dx,
                c1,
                c2,
                dw_lo,
                db_lo,
                IS_RMS,
                HAS_BIAS,
                MASK_M,
                MASK_N,
            )
            dw_hi, db_hi = _dx_tile(
                X,
                DY,
                W,
                MEAN,
                RSTD,
                DX,
                rows,
                c_hi,
                M,
                N,
                stride_x,
                stride_dy,
                stride_dx,
                c1,
                c2,
                dw_hi,
                db_hi,
                IS_RMS,
                HAS_BIAS,
                MASK_M,
                MASK_N,
            )
        tl.store(DW_PART + base + c_lo, tl.sum(dw_lo, axis=0), mask=c_lo < N)
        tl.store(DW_PART + base + c_hi, tl.sum(dw_hi, axis=0), mask=c_hi < N)
        if HAS_BIAS:
            tl.store(DB_PART + base + c_lo, tl.sum(db_lo, axis=0), mask=c_lo < N)
            tl.store(DB_PART + base + c_hi, tl.sum(db_hi, axis=0), mask=c_hi < N)
    elif KEEP16:
        _rows_keep16(
            DY,
            X,
            W,
            MEAN,
            RSTD,
            DX,
            DW_PART,
            DB_PART,
            M,
            N,
            stride_dy,
            stride_x,
            stride_dx,
            pid,
            n_progs,
            n_tiles,
            base,
            IS_RMS,
            HAS_BIAS,
            BLOCK_M,
            BLOCK_N,
            MASK_M,
            MASK_N,
            NUM_STAGES,
            BF16,
        )
    else:
        cols = tl.arange(0, BLOCK_N)
        if not W_IN_LOOP:
            w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
        dw_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        db_acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        for i in tl.range(0, n_tiles, num_stages=NUM_STAGES):
            rows = (pid + i * n_progs) * BLOCK_M + tl.arange(0, BLOCK_M)
            mask = _tile_mask(rows, cols, M, N, MASK_M, MASK_N)
            dy, xhat, rstd = _bwd_tile(
                X, DY, MEAN, RSTD, rows, cols, mask, M, stride_x, stride_dy, IS_RMS, "evict_first"
            )
            if W_IN_LOOP:  # wide rows: re-read w (from L1) rather than hold it in registers
                w = tl.load(W + cols, mask=cols < N, other=0.0).to(tl.float32)
            g = dy * w[None, :]  # dL/dxhat
            c1 = tl.sum(g * xhat, axis=1) / N
            c2 = c1 if IS_RMS else tl.sum(g, axis=1) / N  # RMSNorm has no c2 term
            dx = _dx(g, xhat, rstd, c1, c2, IS_RMS)
            dx_ptrs = DX + rows.to(tl.int64)[:, None] * stride_dx + cols[None, :]
            tl.store(dx_ptrs, dx.to(DX.dtype.element_ty), mask=mask, eviction_policy="evict_first")
            dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        _store_parts(DW_PART, DB_PART, base, cols, N, dw_acc, db_acc, HAS_BIAS)


@jit
def _sum_parts_kernel(
    DW_PART,
    DB_PART,
    DW,
    DB,
    P,
    N,
    HAS_BIAS: tl.constexpr,
    BLOCK_P: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    """DW[n] = sum over p of DW_PART[p, n] (and DB from DB_PART) in one read of all P rows:
    (BLOCK_P >= P, BLOCK_N) tiles, fp32 sums stored in the outputs' dtype."""
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    parts = tl.arange(0, BLOCK_P)
    mask = (parts < P)[:, None] & (cols < N)[None, :]
    offs = parts[:, None] * N + cols[None, :]
    dw = tl.sum(tl.load(DW_PART + offs, mask=mask, other=0.0), axis=0)
    tl.store(DW + cols, dw.to(DW.dtype.element_ty), mask=cols < N)
    if HAS_BIAS:
        db = tl.sum(tl.load(DB_PART + offs, mask=mask, other=0.0), axis=0)
        tl.store(DB + cols, db.to(DB.dtype.element_ty), mask=cols < N)
