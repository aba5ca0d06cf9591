"""Norm backward for wide rows: each row split across SPLIT cooperating programs.

One program holding a whole 16384-wide row needs the row in registers plus full-width fp32 dw
(db) accumulators: about half the register file, so one program per SM, an idle SM while it
waits on its loads, and (LayerNorm) spills. Here a row's columns are cut into SPLIT slices; the
SPLIT programs of a group each take one slice of the same rows, so a program holds 1/SPLIT of a
row and of the accumulators, several programs fit on an SM, and the rows spread evenly over all
SMs. Only the two row sums of dx, c1 = mean(g * xhat) and c2 = mean(g) (g = dy * w), need the
whole row: each program publishes its slice's partial sums and reads its peers'.

A partial sum travels in one int64 slot, (1 << 32) | fp32 bits, written with a release exchange
and read with acquire loads: a slot is its own ready flag (the slots are zeroed before the
launch). Waiting on peers needs every program of a group on the GPU at once, so the grid never
exceeds what fits (programs per SM from the compiled kernel's registers, shared memory and
warps). The interpreter runs programs one after another, so there the kernel runs twice: PHASE 1
publishes every partial sum, PHASE 2 reads them and writes dx; on a GPU PHASE 0 does both in one
pass over x and dy.
"""

from __future__ import annotations

import torch

from gobrrr.errors import GobrrrError
from gobrrr.kernels._util import cdiv, is_interpreter, jit, kernel_for, next_pow2, num_sms, tl

READY = 1 << 32  # high word of a published slot


@jit
def _publish(SLOT, off, value):
    """Store fp32 scalar `value` at SLOT[off] as (1 << 32) | bits, releasing this program's
    writes."""
    bits = value.to(tl.int32, bitcast=True).to(tl.int64) & 0xFFFFFFFF
    tl.atomic_xchg(SLOT + off, bits | 4294967296, sem="release")


@jit
def _gather(SLOT, offs, mask):
    """The fp32 values published at SLOT[offs] (1-D), waiting until every slot under `mask` is
    published; masked-off slots read as zeros."""
    v = tl.atomic_add(SLOT + offs, 0, mask=mask, sem="acquire")
    missing = tl.sum(tl.where(mask & (v < 4294967296), 1, 0))
    while missing > 0:
        v = tl.atomic_add(SLOT + offs, 0, mask=mask, sem="acquire")
        missing = tl.sum(tl.where(mask & (v < 4294967296), 1, 0))
    vals = (v & 0xFFFFFFFF).to(tl.int32).to(tl.float32, bitcast=True)
    return tl.where(mask, vals, 0.0)


@jit
def _norm_bwd_split_kernel(
    DY, X, W, MEAN, RSTD, DX, DW_PART, DB_PART, SLOT, M, N, stride_dy, stride_x, stride_dx,
    n_groups, slice_w,
    IS_RMS: tl.constexpr, HAS_BIAS: tl.constexpr, SPLIT: tl.constexpr, BLOCK_S: tl.constexpr,
    PHASE: tl.constexpr,
):
    # program = (group, part): the group takes rows group, group + n_groups, ...; the part takes
    # columns [part * slice_w, (part + 1) * slice_w) of each of its rows. A row's slots are
    # SLOT[row * SPLIT * NSUM:][part * NSUM + k]: k = 0 the sum of g * xhat, k = 1 of g.
    # Everything is 1-D (one row at a time): 2-D tiles here made Triton 3.6 pick layouts that
    # convert through shared memory and spill.
    NSUM: tl.constexpr = 1 if IS_RMS else 2
    pid = tl.program_id(0)
    group = pid // SPLIT
    part = pid % SPLIT
    offs = tl.arange(0, BLOCK_S)
    cols = part * slice_w + offs  # (BLOCK_S,)
    col_ok = (offs < slice_w) & (cols < N)
    j = tl.arange(0, SPLIT * NSUM)
    w = tl.load(W + cols, mask=col_ok, other=0.0).to(tl.float32)  # a slice: held throughout
    dw_acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    db_acc = tl.zeros([BLOCK_S], dtype=tl.float32)
    n_rows = tl.cdiv(M - group, n_groups)
    # software pipeline: the next row's loads are in flight while this row's sums travel
    row = group.to(tl.int64)
    x_next, dy_next = _load_row(X, DY, row, cols, col_ok, M, stride_x, stride_dy)
    for _ in range(0, n_rows):
        x, dy = x_next.to(tl.float32), dy_next.to(tl.float32)  # (BLOCK_S,)
        x_next, dy_next = _load_row(X, DY, row + n_groups, cols, col_ok, M, stride_x, stride_dy)
        rstd = tl.load(RSTD + row)
        xhat = x * rstd if IS_RMS else (x - tl.load(MEAN + row)) * rstd
        g = dy * w  # dL/dxhat
        base = row * SPLIT * NSUM
        if PHASE != 2:  # 1. publish this slice's partial row sums
            _publish(SLOT, base + part * NSUM, tl.sum(g * xhat, axis=0))
            if not IS_RMS:
                _publish(SLOT, base + part * NSUM + 1, tl.sum(g, axis=0))
        if PHASE != 1:  # 2. the whole row's sums from every part, then dx of this slice
            got = _gather(SLOT, base + j, j < SPLIT * NSUM)
            c1 = tl.sum(tl.where(j % NSUM == 0, got, 0.0), axis=0) / N
            if IS_RMS:
                dx = (g - xhat * c1) * rstd
            else:
                c2 = tl.sum(tl.where(j % NSUM == 1, got, 0.0), axis=0) / N
                dx = (g - xhat * c1 - c2) * rstd
            tl.store(DX + row * stride_dx + cols, dx.to(DX.dtype.element_ty), mask=col_ok,
                     eviction_policy="evict_first")
            dw_acc += dy * xhat
            if HAS_BIAS:
                db_acc += dy
        row += n_groups
    if PHASE != 1:  # this group's dw (db) partials over its rows, for its columns
        out = group.to(tl.int64) * N + cols
        tl.store(DW_PART + out, dw_acc, mask=col_ok)
        if HAS_BIAS:
            tl.store(DB_PART + out, db_acc, mask=col_ok)


@jit
def _load_row(X, DY, row, cols, col_ok, M, stride_x, stride_dy):
    """x and dy of one row's columns `cols` in their own dtype; a row past M reads as zeros."""
    mask = col_ok & (cols * 0 + row < M)  # (a vector: the interpreter wants one)
    x = tl.load(X + row * stride_x + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    dy = tl.load(DY + row * stride_dy + cols, mask=mask, other=0.0, eviction_policy="evict_first")
    return x, dy


def split_plan(m: int, n: int, device: torch.device, slice_cols: int, per_sm: int) -> dict:
    """Slices per row (a power of two, at most 16) of about `slice_cols` columns each, and
    groups: `per_sm` programs per SM, no more groups than rows."""
    split = min(16, next_pow2(cdiv(n, slice_cols)))
    slice_w = cdiv(cdiv(n, split), 16) * 16  # 16-element aligned slices: full-width loads
    n_groups = max(1, min(m, num_sms(device) * per_sm // split))
    return dict(split=split, slice_w=slice_w, block_s=next_pow2(slice_w), n_groups=n_groups)


_FITS: dict[tuple, dict] = {}  # per kernel variant: programs per SM, registers, spills
LAST: dict = {}  # the last GPU launch's plan, for benchmarks


def programs_per_sm(compiled, num_warps: int, device: torch.device) -> int:
    """How many programs of a compiled Triton kernel an SM holds at once: the least of the
    register file (allocated per warp in units of 256), shared memory and thread limits."""
    init = getattr(compiled, "_init_handles", None)  # loads the binary: fills n_regs
    if init is not None:
        init()
    props = torch.cuda.get_device_properties(device)
    regs = getattr(props, "regs_per_multiprocessor", 65536)
    smem = getattr(props, "shared_memory_per_multiprocessor", 233472)
    threads = getattr(props, "max_threads_per_multi_processor", 2048)
    per_warp = cdiv(max(compiled.n_regs, 1) * 32, 256) * 256
    by_regs = regs // (per_warp * num_warps)
    shared = compiled.metadata.shared
    by_smem = smem // (shared + 1024) if shared else 32
    return max(0, min(by_regs, by_smem, threads // (32 * num_warps), 32))


def split_bwd(dy2, x2, weight, mean, rstd, dx, has_bias, is_rms, tuning):
    """dx into `dx` and the (groups, N) fp32 partials of dw (db) of a norm's backward, rows split
    across programs (module docstring). Returns (dw_part, db_part)."""
    m, n = x2.shape
    warps = tuning["split_warps"]
    plan = split_plan(m, n, x2.device, tuning["split_cols"], tuning["split_per_sm"])
    kern = kernel_for(_norm_bwd_split_kernel, x2.device)
    slots = torch.zeros(m * plan["split"] * (1 if is_rms else 2), dtype=torch.int64,
                        device=x2.device)
    meta = dict(IS_RMS=is_rms, HAS_BIAS=has_bias, SPLIT=plan["split"], BLOCK_S=plan["block_s"],
                num_warps=warps)

    def launch(n_groups, phase, warmup=False):
        dw_part = torch.empty((n_groups, n), dtype=torch.float32, device=x2.device)
        db_part = torch.empty_like(dw_part) if has_bias else dw_part
        args = (dy2, x2, weight, mean, rstd, dx, dw_part, db_part, slots, m, n,
                dy2.stride(0), x2.stride(0), dx.stride(0), n_groups, plan["slice_w"])
        grid = (n_groups * plan["split"],)
        if warmup:
            return kern.warmup(*args, grid=grid, PHASE=phase, **meta)
        kern[grid](*args, PHASE=phase, **meta)
        return dw_part, db_part

    if is_interpreter():  # programs run one at a time: publish all, then read all
        launch(plan["n_groups"], 1)
        return launch(plan["n_groups"], 2)
    key = (x2.device.index, plan["split"], tuple(sorted(meta.items())))
    if key not in _FITS:
        compiled = launch(plan["n_groups"], 0, warmup=True)
        _FITS[key] = dict(per_sm=programs_per_sm(compiled, warps, x2.device),
                          n_regs=compiled.n_regs, n_spills=compiled.n_spills)
    fit = _FITS[key]["per_sm"] * num_sms(x2.device) // plan["split"]
    if fit < 1:
        raise GobrrrError(
            f"norm backward: the {plan['split']} programs that share a row do not fit on the GPU "
            f"at once ({_FITS[key]}); set gobrrr.kernels.norms.TUNING['split_cols'] = 0"
        )
    LAST.clear()
    LAST.update(plan, **_FITS[key], n_groups=min(plan["n_groups"], fit))
    return launch(LAST["n_groups"], 0)
