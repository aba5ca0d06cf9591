"""Triton flash-attention forward (FlashAttention-2 with the online softmax in base 2).

One program computes one (BLOCK_M, D) tile of the output for one (batch, head): it streams the
key/value blocks of that head's KV head (grouped-query attention reads K/V in place), keeps the
running row max m, row sum l and the fp32 accumulator in registers, and writes O and the
log-sum-exp. The key range splits into blocks that need no mask (off-diagonal / interior) and
blocks that do (the causal diagonal and the ragged tail), so the common loop carries no masking.
Pieces the backward shares live here too.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

INTERPRET = os.environ.get("TRITON_INTERPRET", "0").lower() in ("1", "true", "yes", "on")
LOG2E = 1.4426950408889634  # log2(e): exp(x) = exp2(x * LOG2E)
K_LOG2E = tl.constexpr(LOG2E)  # the same constants, readable inside @triton.jit functions
K_LN2 = tl.constexpr(0.6931471805599453)


def block_d(head_dim: int) -> int:
    """Tile width for the head dim: the next power of two, at least 16 (tl.dot's minimum)."""
    return max(16, 1 << (head_dim - 1).bit_length())  # not triton.next_power_of_2: ~7 us a call


def seq_bucket(s: int) -> int:
    """Autotuning key for a sequence length: the next power of two (>= 128)."""
    return max(128, 1 << (s - 1).bit_length())


def cfg(block_m: int, block_n: int, warps: int, stages: int) -> triton.Config:
    return triton.Config(
        {"BLOCK_M": block_m, "BLOCK_N": block_n}, num_warps=warps, num_stages=stages
    )


def config_kwargs(c: triton.Config) -> dict:
    """Launch kwargs for running a kernel at one fixed config (no autotuning)."""
    return dict(c.kwargs, num_warps=c.num_warps, num_stages=c.num_stages)


def strides(t: torch.Tensor) -> tuple[int, int, int, int]:
    return tuple(t.stride())


# Under the interpreter one small config: autotuning there is slow and pointless.
INTERPRET_FWD = cfg(64, 32, 4, 1)


def fwd_configs(bd: int) -> list[triton.Config]:
    """Candidate (BLOCK_M, BLOCK_N, warps, stages) for the GPU, by head-dim tile width; each
    compiles for sm_90 without register spills (ptxas -v)."""
    if bd <= 64:
        return [
            cfg(128, 64, 4, 3),
            cfg(128, 64, 4, 4),
            cfg(128, 128, 8, 3),
            cfg(128, 64, 8, 3),
            cfg(128, 32, 4, 3),
            cfg(64, 64, 4, 3),
        ]
    return [
        cfg(128, 64, 8, 3),
        cfg(128, 64, 8, 2),
        cfg(128, 64, 8, 4),
        cfg(128, 32, 8, 3),
        cfg(64, 64, 4, 3),
    ]


# ----------------------------------------------------------------------------- shared pieces
# The interpreter multiplies bf16 tiles as raw uint16 bits; there, dots run on fp32 copies.
UPCAST_DOTS = tl.constexpr(INTERPRET)


@triton.jit
def mma(a, b, acc):
    """tl.dot(a, b, acc) with fp32 accumulation."""
    if UPCAST_DOTS:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    return tl.dot(a, b, acc)


@triton.jit
def load_tile(
    ptrs,
    rows,
    n_rows,
    offs_d,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    ROW_MASK: tl.constexpr,
):
    """Load a (rows, BLOCK_D) tile; zero rows >= n_rows (if ROW_MASK) and columns >= HEAD_DIM."""
    if ROW_MASK:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs, mask=rows[:, None] < n_rows, other=0.0)
        else:
            x = tl.load(
                ptrs, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM), other=0.0
            )
    else:
        if BLOCK_D == HEAD_DIM:
            x = tl.load(ptrs)
        else:
            x = tl.load(ptrs, mask=offs_d[None, :] < HEAD_DIM, other=0.0)
    return x


@triton.jit
def store_tile(ptrs, x, rows, n_rows, offs_d, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr):
    if BLOCK_D == HEAD_DIM:
        tl.store(ptrs, x, mask=rows[:, None] < n_rows)
    else:
        tl.store(ptrs, x, mask=(rows[:, None] < n_rows) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def kv_ranges(start_m, S_K, CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Keys for the query rows [start_m, start_m + BLOCK_M): [0, full_hi) need no mask,
    [full_hi, hi) need the causal and/or sequence-end mask; keys >= hi are never visible."""
    if CAUSAL:
        hi = tl.minimum(start_m + BLOCK_M, S_K)
        full_hi = (start_m // BLOCK_N) * BLOCK_N  # keys below start_m are seen by every row
    else:
        hi = S_K
        full_hi = (S_K // BLOCK_N) * BLOCK_N
    return full_hi, hi


# ----------------------------------------------------------------------------- forward
@triton.jit
def _fwd_inner(
    acc,
    l_i,
    m_i,
    q,
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
        qk = mma(q, tl.trans(k), None)  # (BLOCK_M, BLOCK_N) fp32, raw scores
        if MASKED:
            valid = cols[None, :] < S_K
            if CAUSAL:
                valid = valid & (offs_m[:, None] >= cols[None, :])
            qk = tl.where(valid, qk * qk_scale, float("-inf"))
            m_ij = tl.maximum(m_i, tl.max(qk, 1))
            qk = qk - m_ij[:, None]
        else:
            m_ij = tl.maximum(m_i, tl.max(qk, 1) * qk_scale)
            qk = qk * qk_scale - m_ij[:, None]  # one FMA per score, log2 units
        p = tl.math.exp2(qk)
        alpha = tl.math.exp2(m_i - m_ij)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = acc * alpha[:, None]
        v = load_tile(v_ptrs, cols, S_K, offs_d, HEAD_DIM, BLOCK_D, MASKED)
        acc = mma(p.to(v.dtype), v, acc)
        m_i = m_ij
        k_ptrs += BLOCK_N * stride_ks
        v_ptrs += BLOCK_N * stride_vs
    return acc, l_i, m_i


@triton.jit(do_not_specialize=["H", "S_Q", "S_K", "S_BUCKET"])
def _attn_fwd_kernel(
    Q,
    K,
    V,
    O,
    LSE,
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
    H,
    GROUP,
    S_Q,
    S_K,
    S_BUCKET,
    qk_scale,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    CAUSAL: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid_m = tl.program_id(0)
    if CAUSAL:  # the last query blocks see the most keys: start them first
        pid_m = tl.num_programs(0) - 1 - pid_m
    off_bh = tl.program_id(1)
    off_b = (off_bh // H).to(tl.int64)
    off_h = (off_bh % H).to(tl.int64)
    off_hk = off_h // GROUP  # grouped-query attention: K/V head shared by GROUP query heads
    Q += off_b * stride_qb + off_h * stride_qh
    K += off_b * stride_kb + off_hk * stride_kh
    V += off_b * stride_vb + off_hk * stride_vh
    O += off_b * stride_ob + off_h * stride_oh

    start_m = pid_m * BLOCK_M
    offs_m = start_m + tl.arange(0, BLOCK_M)
    offs_n = tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    q_ptrs = Q + offs_m[:, None] * stride_qs + offs_d[None, :] * stride_qd
    q = load_tile(q_ptrs, offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D, True)  # (BLOCK_M, BLOCK_D)
    k_ptrs = K + offs_n[:, None] * stride_ks + offs_d[None, :] * stride_kd
    v_ptrs = V + offs_n[:, None] * stride_vs + offs_d[None, :] * stride_vd

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)  # running max, log2 units
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)  # running sum of exp2(s - m_i)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    full_hi, hi = kv_ranges(start_m, S_K, CAUSAL, BLOCK_M, BLOCK_N)
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
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
    acc, l_i, m_i = _fwd_inner(
        acc,
        l_i,
        m_i,
        q,
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
    # every row sees key 0, so l_i >= 1 and m_i is finite
    acc = acc / l_i[:, None]
    lse = (m_i + tl.math.log2(l_i)) * K_LN2  # natural log
    tl.store(LSE + off_bh.to(tl.int64) * S_Q + offs_m, lse, mask=offs_m < S_Q)
    o_ptrs = O + offs_m[:, None] * stride_os + offs_d[None, :] * stride_od
    store_tile(o_ptrs, acc.to(O.dtype.element_ty), offs_m, S_Q, offs_d, HEAD_DIM, BLOCK_D)


_TUNERS: dict = {}  # (tag, BLOCK_D) -> triton Autotuner
BEST: dict = {}  # (tag, key) -> the config the autotuner chose
_BEST_KWARGS: dict = {}  # (tag, key) -> (that config, its launch kwargs)


def launch(
    kernel,
    grid,
    args: tuple,
    consts: dict,
    *,
    tag: str,
    key: tuple,
    configs,
    config: triton.Config | None = None,
    interpret_config: triton.Config | None = None,
    **tune_kwargs,
) -> None:
    """Run `kernel` at `config`; else at the autotuned config for `key` (head dim, causal,
    sequence bucket, dtype), tuning on the first call. `configs(BLOCK_D)` lists the candidates;
    it is called only to tune. Later calls skip the autotuner and launch the chosen config
    directly, with the grid as a tuple and the launch kwargs built once (less host time)."""
    if config is None and INTERPRET:
        config = interpret_config
    if config is None:
        config = BEST.get((tag, key))
    if config is None:
        tuner_id = (tag, consts["BLOCK_D"])  # the candidate list depends on the head-dim tile
        if tuner_id not in _TUNERS:
            _TUNERS[tuner_id] = triton.autotune(
                configs(consts["BLOCK_D"]), key=["HEAD_DIM", "CAUSAL", "S_BUCKET"], **tune_kwargs
            )(kernel)
        _TUNERS[tuner_id][grid](*args, **consts)
        BEST[(tag, key)] = _TUNERS[tuner_id].best_config
        return
    cached = _BEST_KWARGS.get((tag, key))
    if cached is None or cached[0] is not config:
        cached = _BEST_KWARGS[(tag, key)] = (config, config_kwargs(config))
    kernel[grid(config.kwargs)](*args, **consts, **cached[1])


def attention_forward(q, k, v, causal: bool, scale: float, config: triton.Config | None = None):
    """out (like q) and lse (fp32, (B, H, S_q), natural log) for q: (B, H, S_q, D),
    k/v: (B, Hkv, S_k, D). config: run at this config instead of the autotuned one."""
    b, h, s_q, d = q.shape
    s_k, hkv = k.shape[2], k.shape[1]
    out = torch.empty_like(q)
    lse = torch.empty((b, h, s_q), device=q.device, dtype=torch.float32)
    bd, bucket = block_d(d), seq_bucket(max(s_q, s_k))

    def grid(META):  # Triton passes the launch's meta-parameters
        return (triton.cdiv(s_q, META["BLOCK_M"]), b * h)

    args = (
        q,
        k,
        v,
        out,
        lse,
        *strides(q),
        *strides(k),
        *strides(v),
        *strides(out),
        h,
        h // hkv,
        s_q,
        s_k,
        bucket,
        scale * LOG2E,
    )
    launch(
        _attn_fwd_kernel,
        grid,
        args,
        dict(HEAD_DIM=d, BLOCK_D=bd, CAUSAL=causal),
        tag="fwd",
        key=(d, causal, bucket, q.dtype),
        configs=fwd_configs,
        config=config,
        interpret_config=INTERPRET_FWD,
    )
    return out, lse
