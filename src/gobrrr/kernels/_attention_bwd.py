"""Triton flash-attention backward (FlashAttention-2).

delta = rowsum(dO * O)                       (B, H, S_q) fp32
P  = exp2(q kᵀ · scale·log2e - lse·log2e)    recomputed from the saved log-sum-exp
dV = Pᵀ dO      dP = dO Vᵀ      dS = P ∘ (dP - delta)
dK = scale · dSᵀ Q                           dK/dV kernel: one program per key block,
                                             looping over the query blocks of every query
                                             head that shares the KV head (GQA sums there)
dQ = scale · dS K                            dQ kernel: one program per query block, looping
                                             over key blocks (recomputes P and dP); it runs
                                             first and also computes delta, so no separate
                                             preprocess pass. Alternative, measured slower
                                             on an H100 (docs/investigations/
                                             2026-11-22-attention-kernels-against-sdpa.md):
                                             dq_mode="atomic", fp32 atomics from the dK/dV
                                             kernel after a preprocess pass
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gobrrr.kernels._attention_fwd import (
    K_LOG2E,
    LOG2E,
    block_d,
    cfg,
    kv_ranges,
    launch,
    load_tile,
    mma,
    seq_bucket,
    store_tile,
    strides,
)

# For the dK/dV kernel BLOCK_N is the key block a program owns, BLOCK_M the query step.
INTERPRET_DKDV = cfg(32, 64, 4, 1)
INTERPRET_DQ = cfg(64, 32, 4, 1)
PRE_BLOCK_M = 64
DQ_MODE = "separate"  # "separate": dQ kernel, no atomics; "atomic": fp32 atomics in dK/dV


def dkdv_configs(bd: int) -> list[triton.Config]:
    """dK/dV candidates: the dK and dV accumulators (2 x BLOCK_N x D fp32) fill the registers,
    so D=128 takes BLOCK_M=32 query steps. At D=128 all but (32, 128, 8, 3) spill a little
    (ptxas, Triton 3.9) and some still win on the H100
    (docs/investigations/2026-11-22-attention-kernels-against-sdpa.md)."""
    if bd <= 64:
        return [
            cfg(32, 64, 4, 3),
            cfg(32, 64, 4, 4),
            cfg(16, 64, 4, 3),
            cfg(64, 128, 8, 3),
            cfg(32, 128, 8, 3),
        ]
    return [
        cfg(32, 128, 8, 3),
        cfg(32, 128, 8, 4),
        cfg(64, 128, 8, 2),
        cfg(64, 128, 8, 3),
        cfg(32, 64, 4, 3),
        cfg(32, 64, 4, 4),
    ]


def dq_configs(bd: int) -> list[triton.Config]:
    if bd <= 64:
        return [
            cfg(64, 64, 4, 3),
            cfg(64, 64, 4, 4),
            cfg(64, 32, 4, 3),
            cfg(128, 64, 8, 3),
            cfg(128, 32, 4, 3),
        ]
    return [cfg(128, 64, 8, 3), cfg(128, 32, 8, 3), cfg(128, 32, 8, 4), cfg(64, 32, 4, 3)]


def dkdv_atomic_configs(bd: int) -> list[triton.Config]:
    if bd <= 64:
        return [cfg(64, 64, 8, 3), cfg(64, 64, 8, 2)]
    return [cfg(32, 64, 8, 3), cfg(64, 64, 8, 2)]


@triton.jit(do_not_specialize=["H", "S_Q"])
def _bwd_preprocess_kernel(
    O,
    DO,
    DELTA,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dod,
    H,
    S_Q,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr,
):
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh
    o_ptrs += offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    do_ptrs = DO + off_b * stride_dob + off_h * stride_doh
    do_ptrs += offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod
    o = load_tile(o_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, True).to(tl.float32)
    do = load_tile(do_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, True).to(tl.float32)
    tl.store(DELTA + off_bh.to(tl.int64) * S_Q + offs_m, tl.sum(o * do, 1), mask=offs_m < S_Q)


# ----------------------------------------------------------------------------- dK, dV
@triton.jit
def _dkdv_inner(
    dk,
    dv,
    k,
    v,
    q_ptrs,
    do_ptrs,
    dq_ptrs,
    LSE,
    DELTA,
    stride_qs,
    stride_dos,
    stride_dqs,
    offs_n,
    offs_d,
    lo,
    hi,
    S_Q,
    qk_scale,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    MASKED: tl.constexpr,
):
    offs_m = lo + tl.arange(0, BLOCK_M)
    q_ptrs += lo * stride_qs
    do_ptrs += lo * stride_dos
    dq_ptrs += lo * stride_dqs
    for _ in range(lo, hi, BLOCK_M):
        q = load_tile(q_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_M, BLOCK_D)
        if MASKED:
            lse2 = tl.load(LSE + offs_m, mask=offs_m < S_Q, other=0.0) * K_LOG2E
        else:
            lse2 = tl.load(LSE + offs_m) * K_LOG2E
        qkT = mma(k, tl.trans(q), None)  # (BLOCK_N, BLOCK_M)
        pT = tl.math.exp2(qkT * qk_scale - lse2[None, :])
        if MASKED:
            valid = offs_m[None, :] < S_Q
            if CAUSAL:
                valid = valid & (offs_m[None, :] >= offs_n[:, None])
            pT = tl.where(valid, pT, 0.0)
        do = load_tile(do_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        dv = mma(pT.to(do.dtype), do, dv)
        if MASKED:
            delta = tl.load(DELTA + offs_m, mask=offs_m < S_Q, other=0.0)
        else:
            delta = tl.load(DELTA + offs_m)
        dpT = mma(v, tl.trans(do), None)  # (BLOCK_N, BLOCK_M)
        dsT = (pT * (dpT - delta[None, :])).to(q.dtype)
        dk = mma(dsT, q, dk)
        if ATOMIC_DQ:
            dq = mma(tl.trans(dsT), k, None) * scale  # (BLOCK_M, BLOCK_D) fp32
            dq_mask = (offs_m[:, None] < S_Q) & (offs_d[None, :] < HEAD_DIM)
            tl.atomic_add(dq_ptrs, dq, mask=dq_mask, sem="relaxed")
        offs_m += BLOCK_M
        q_ptrs += BLOCK_M * stride_qs
        do_ptrs += BLOCK_M * stride_dos
        dq_ptrs += BLOCK_M * stride_dqs
    return dk, dv


@triton.jit(do_not_specialize=["H", "S_Q", "S_K", "S_BUCKET"])
def _attn_bwd_dkdv_kernel(
    Q,
    K,
    V,
    DO,
    LSE,
    DELTA,
    DK,
    DV,
    DQ,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dod,
    stride_dkb,
    stride_dkh,
    stride_dks,
    stride_dkd,
    stride_dvb,
    stride_dvh,
    stride_dvs,
    stride_dvd,
    stride_dqb,
    stride_dqh,
    stride_dqs,
    stride_dqd,
    H,
    GROUP,
    S_Q,
    S_K,
    S_BUCKET,
    qk_scale,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    ATOMIC_DQ: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    start_n = tl.program_id(0) * BLOCK_N
    off_bk = tl.program_id(1)
    h_kv = H // GROUP
    off_b = (off_bk // h_kv).to(tl.int64)
    off_hk = (off_bk % h_kv).to(tl.int64)
    offs_n = start_n + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh
    k_ptrs += offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh
    v_ptrs += offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd
    k = load_tile(k_ptrs, offs_n, S_K, offs_d, HEAD_DIM, BLOCK_D, True)  # (BLOCK_N, BLOCK_D)
    v = load_tile(v_ptrs, offs_n, S_K, offs_d, HEAD_DIM, BLOCK_D, True)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)

    # query rows: [start_n, diag_hi) straddle the causal diagonal (masked), [diag_hi, full_hi)
    # are whole unmasked blocks, [full_hi, S_Q) the ragged tail (masked)
    if CAUSAL:
        diag_hi = tl.minimum(start_n + (BLOCK_N + BLOCK_M - 1) // BLOCK_M * BLOCK_M, S_Q)
    else:
        diag_hi = 0
    full_hi = diag_hi + (S_Q - diag_hi) // BLOCK_M * BLOCK_M
    for g in range(GROUP):  # query heads sharing this KV head: their dK/dV add up
        off_h = off_hk * GROUP + g
        q_ptrs = Q + off_b * stride_qb + off_h * stride_qh
        q_ptrs += offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
        do_ptrs = DO + off_b * stride_dob + off_h * stride_doh
        do_ptrs += offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod
        dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh
        dq_ptrs += offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
        row0 = (off_b * H + off_h) * S_Q
        if CAUSAL:
            dk, dv = _dkdv_inner(
                dk,
                dv,
                k,
                v,
                q_ptrs,
                do_ptrs,
                dq_ptrs,
                LSE + row0,
                DELTA + row0,
                stride_qs,
                stride_dos,
                stride_dqs,
                offs_n,
                offs_d,
                start_n,
                diag_hi,
                S_Q,
                qk_scale,
                scale,
                HEAD_DIM,
                BLOCK_D,
                CAUSAL,
                ATOMIC_DQ,
                BLOCK_M,
                True,
            )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            dq_ptrs,
            LSE + row0,
            DELTA + row0,
            stride_qs,
            stride_dos,
            stride_dqs,
            offs_n,
            offs_d,
            diag_hi,
            full_hi,
            S_Q,
            qk_scale,
            scale,
            HEAD_DIM,
            BLOCK_D,
            CAUSAL,
            ATOMIC_DQ,
            BLOCK_M,
            False,
        )
        dk, dv = _dkdv_inner(
            dk,
            dv,
            k,
            v,
            q_ptrs,
            do_ptrs,
            dq_ptrs,
            LSE + row0,
            DELTA + row0,
            stride_qs,
            stride_dos,
            stride_dqs,
            offs_n,
            offs_d,
            full_hi,
            S_Q,
            S_Q,
            qk_scale,
            scale,
            HEAD_DIM,
            BLOCK_D,
            CAUSAL,
            ATOMIC_DQ,
            BLOCK_M,
            True,
        )
    dk_ptrs = DK + off_b * stride_dkb + off_hk * stride_dkh
    dk_ptrs += offs_n[:, None] * stride_dks + offs_d[None, :] * stride_dkd
    dv_ptrs = DV + off_b * stride_dvb + off_hk * stride_dvh
    dv_ptrs += offs_n[:, None] * stride_dvs + offs_d[None, :] * stride_dvd
    store_tile(
        dk_ptrs, (dk * scale).to(DK.dtype.element_ty), offs_n, S_K, offs_d, HEAD_DIM, BLOCK_D
    )
    store_tile(dv_ptrs, dv.to(DV.dtype.element_ty), offs_n, S_K, offs_d, HEAD_DIM, BLOCK_D)


# ----------------------------------------------------------------------------- dQ
@triton.jit
def _dq_inner(
    dq,
    q,
    do,
    lse2,
    delta,
    k_ptrs,
    v_ptrs,
    stride_ks,
    stride_vs,
    offs_m,
    offs_n,
    offs_d,
    lo,
    hi,
    S_K,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    MASKED: tl.constexpr,
):
    k_ptrs += lo * stride_ks
    v_ptrs += lo * stride_vs
    for start_n in range(lo, hi, BLOCK_N):
        cols = start_n + offs_n
        k = load_tile(k_ptrs, cols, S_K, offs_d, HEAD_DIM, BLOCK_D, MASKED)  # (BLOCK_N, BLOCK_D)
        v = load_tile(v_ptrs, cols, S_K, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        qk = mma(q, tl.trans(k), None)  # (BLOCK_M, BLOCK_N)
        p = tl.math.exp2(qk * qk_scale - lse2[:, None])
        if MASKED:
            valid = cols[None, :] < S_K
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            p = tl.where(valid, p, 0.0)
        dp = mma(do, tl.trans(v), None)  # (BLOCK_M, BLOCK_N)
        ds = (p * (dp - delta[:, None])).to(k.dtype)
        dq = mma(ds, k, dq)
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return dq


@triton.jit(do_not_specialize=["H", "S_Q", "S_K", "S_BUCKET"])
def _attn_bwd_dq_kernel(
    Q,
    K,
    V,
    O,
    DO,
    LSE,
    DELTA,
    DQ,
    stride_qb,
    stride_qh,
    stride_qs,
    stride_qd,
    stride_kb,
    stride_kh,
    stride_ks,
    stride_kd,
    stride_vb,
    stride_vh,
    stride_vs,
    stride_vd,
    stride_ob,
    stride_oh,
    stride_os,
    stride_od,
    stride_dob,
    stride_doh,
    stride_dos,
    stride_dod,
    stride_dqb,
    stride_dqh,
    stride_dqs,
    stride_dqd,
    H,
    GROUP,
    S_Q,
    S_K,
    S_BUCKET,
    qk_scale,
    scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if CAUSAL:
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_hk = off_h // GROUP
    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + off_b * stride_qb + off_h * stride_qh
    q_ptrs += offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    do_ptrs = DO + off_b * stride_dob + off_h * stride_doh
    do_ptrs += offs_m[:, None] * stride_dos + offs_d[None, :] * stride_dod
    q = load_tile(q_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    do = load_tile(do_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, True)
    o_ptrs = O + off_b * stride_ob + off_h * stride_oh
    o_ptrs += offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    o = load_tile(o_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, True)
    # delta = rowsum(dO * O), computed here and stored for the dK/dV kernel that runs next
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    row_ok = offs_m < S_Q
    tl.store(DELTA + off_bh.to(tl.int64) * S_Q + offs_m, delta, mask=row_ok)
    lse2 = tl.load(LSE + off_bh.to(tl.int64) * S_Q + offs_m, mask=row_ok, other=0.0) * K_LOG2E
    k_ptrs = K + off_b * stride_kb + off_hk * stride_kh
    k_ptrs += offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = V + off_b * stride_vb + off_hk * stride_vh
    v_ptrs += offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_hi, hi = kv_ranges(start_m, S_K, CAUSAL, BLOCK_M, BLOCK_N)
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        k_ptrs,
        v_ptrs,
        stride_ks,
        stride_vs,
        offs_m,
        offs_n,
        offs_d,
        0,
        full_hi,
        S_K,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        CAUSAL,
        BLOCK_N,
        False,
    )
    dq = _dq_inner(
        dq,
        q,
        do,
        lse2,
        delta,
        k_ptrs,
        v_ptrs,
        stride_ks,
        stride_vs,
        offs_m,
        offs_n,
        offs_d,
        full_hi,
        hi,
        S_K,
        qk_scale,
        HEAD_DIM,
        BLOCK_D,
        CAUSAL,
        BLOCK_N,
        True,
    )
    dq_ptrs = DQ + off_b * stride_dqb + off_h * stride_dqh
    dq_ptrs += offs_m[:, None] * stride_dqs + offs_d[None, :] * stride_dqd
    store_tile(
        dq_ptrs, (dq * scale).to(DQ.dtype.element_ty), offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D
    )


# ----------------------------------------------------------------------------- launchers
def bwd_preprocess(out, dout):
    """delta = rowsum(dout * out) in fp32, (B, H, S_q)."""
    b, h, s_q, d = out.shape
    delta = torch.empty((b, h, s_q), device=out.device, dtype=torch.float32)
    grid = (triton.cdiv(s_q, PRE_BLOCK_M), b * h)
    _bwd_preprocess_kernel[grid](
        out,
        dout,
        delta,
        *strides(out),
        *strides(dout),
        h,
        s_q,
        HEAD_DIM=d,
        BLOCK_D=block_d(d),
        BLOCK_M=PRE_BLOCK_M,
        num_warps=4,
    )
    return delta


def bwd_dkdv(dout, q, k, v, lse, delta, causal, scale, dq_acc=None, config=None):
    """dK, dV (like k, v); with dq_acc (fp32, zeroed, like q) also accumulates dQ into it."""
    b, h, s_q, d = q.shape
    hkv, s_k = k.shape[1], k.shape[2]
    dk, dv = torch.empty_like(k), torch.empty_like(v)
    bd, bucket, atomic = block_d(d), seq_bucket(max(s_q, s_k)), dq_acc is not None
    dq_arg = dq_acc if atomic else dk  # unused placeholder when not atomic

    def grid(META):  # Triton passes the launch's meta-parameters
        return (triton.cdiv(s_k, META["BLOCK_N"]), b * hkv)

    args = (
        q,
        k,
        v,
        dout,
        lse,
        delta,
        dk,
        dv,
        dq_arg,
        *strides(q),
        *strides(k),
        *strides(v),
        *strides(dout),
        *strides(dk),
        *strides(dv),
        *strides(dq_arg),
        h,
        h // hkv,
        s_q,
        s_k,
        bucket,
        scale * LOG2E,
        scale,
    )
    consts = dict(HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal, ATOMIC_DQ=atomic)
    key = (d, causal, bucket, q.dtype)
    if atomic:
        launch(
            _attn_bwd_dkdv_kernel,
            grid,
            args,
            consts,
            tag="dkdv_atomic",
            key=key,
            configs=dkdv_atomic_configs,
            config=config,
            interpret_config=INTERPRET_DKDV,
            reset_to_zero=["DQ"],
        )
    else:
        launch(
            _attn_bwd_dkdv_kernel,
            grid,
            args,
            consts,
            tag="dkdv",
            key=key,
            configs=dkdv_configs,
            config=config,
            interpret_config=INTERPRET_DKDV,
        )
    return dk, dv


def bwd_dq(dout, q, k, v, out, lse, causal, scale, config=None):
    """dQ (like q) by looping over key blocks, and delta = rowsum(dout * out) (fp32, (B, H, S_q))
    on the way."""
    b, h, s_q, d = q.shape
    hkv, s_k = k.shape[1], k.shape[2]
    dq = torch.empty_like(q)
    delta = torch.empty((b, h, s_q), device=q.device, dtype=torch.float32)
    bd, bucket = block_d(d), seq_bucket(max(s_q, s_k))

    def grid(META):  # Triton passes the launch's meta-parameters
        return (triton.cdiv(s_q, META["BLOCK_M"]), b * h)

    args = (
        q,
        k,
        v,
        out,
        dout,
        lse,
        delta,
        dq,
        *strides(q),
        *strides(k),
        *strides(v),
        *strides(out),
        *strides(dout),
        *strides(dq),
        h,
        h // hkv,
        s_q,
        s_k,
        bucket,
        scale * LOG2E,
        scale,
    )
    launch(
        _attn_bwd_dq_kernel,
        grid,
        args,
        dict(HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal),
        tag="dq",
        key=(d, causal, bucket, q.dtype),
        configs=dq_configs,
        config=config,
        interpret_config=INTERPRET_DQ,
    )
    return dq, delta


def attention_backward(
    dout, q, k, v, out, lse, causal: bool, scale: float, dq_mode: str | None = None
):
    """dq, dk, dv for saved q, k, v, out, lse and the incoming gradient dout (all like q/k/v)."""
    if (dq_mode or DQ_MODE) == "atomic":
        delta = bwd_preprocess(out, dout)
        dq_acc = torch.zeros(q.shape, device=q.device, dtype=torch.float32)
        dk, dv = bwd_dkdv(dout, q, k, v, lse, delta, causal, scale, dq_acc=dq_acc)
        return torch.empty_like(q).copy_(dq_acc), dk, dv
    dq, delta = bwd_dq(dout, q, k, v, out, lse, causal, scale)  # also writes delta
    dk, dv = bwd_dkdv(dout, q, k, v, lse, delta, causal, scale)
    return dq, dk, dv
