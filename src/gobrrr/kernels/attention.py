"""Flash attention (forward + backward) as two custom ops over Triton kernels.

    from gobrrr.kernels.attention import attention
    o = attention(q, k, v, causal=True)         # q: (B, H, S, D), k/v: (B, Hkv, S_k, D)

The ops `gobrrr::attention_fwd` and `gobrrr::attention_bwd` appear as single nodes in a dispatch
trace, have fake (meta) implementations, and so work under FakeTensorMode and torch.compile. This
module imports only torch; the Triton kernels live in `_attention_fwd.py` / `_attention_bwd.py` and
are imported on the first real (non-fake) call, so a step that uses `attention` can be captured on a
machine without Triton or a GPU.

Numerics: bf16/fp16 (fp32 accepted, slower, tf32 matmuls on the GPU) with fp32 softmax statistics
and accumulation. Saved for backward: q, k, v, out and the log-sum-exp (fp32, (B, H, S)).
`attention` differentiates through an autograd.Function that calls the two ops; the raw op
`torch.ops.gobrrr.attention_fwd` has no autograd formula of its own (backward through it raises).
"""

from __future__ import annotations

import math

import torch

from gobrrr.errors import GobrrrError
from gobrrr.kernels._util import direct

if not hasattr(torch.library, "custom_op"):
    raise ImportError(
        f"gobrrr.kernels.attention needs torch.library.custom_op (torch >= 2.4); found torch "
        f"{torch.__version__}. Upgrade torch (pip install -U torch)."
    )

MAX_HEAD_DIM = 128
_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool) -> None:
    """Raise GobrrrError naming the bad value and the fix; works on fake tensors too."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if t.ndim != 4:
            raise GobrrrError(
                f"attention: {name} must be 4-D (B, H, S, D); got shape {tuple(t.shape)}. "
                f"Reshape to (batch, heads, seq, head_dim), e.g. x.view(B, S, H, D).transpose(1, 2)"
            )
        if t.dtype not in _DTYPES:
            raise GobrrrError(
                f"attention: {name}.dtype is {t.dtype}; supported: float16, bfloat16, float32. "
                f"Cast with {name}.to(torch.bfloat16)."
            )
    if not (q.dtype == k.dtype == v.dtype):
        raise GobrrrError(
            f"attention: q, k, v dtypes must match; got {q.dtype}, {k.dtype}, {v.dtype}. "
            f"Cast them to one dtype."
        )
    if not (q.device == k.device == v.device):
        raise GobrrrError(
            f"attention: q, k, v must be on one device; got {q.device}, {k.device}, {v.device}."
        )
    (b, h, s_q, d), (bk, hkv, s_k, dk) = q.shape, k.shape
    if k.shape != v.shape:
        raise GobrrrError(
            f"attention: k and v shapes must match; got {tuple(k.shape)} and {tuple(v.shape)}."
        )
    if bk != b or dk != d:
        raise GobrrrError(
            f"attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch and head_dim "
            f"(B, _, _, D)."
        )
    if not 1 <= d <= MAX_HEAD_DIM:
        raise GobrrrError(
            f"attention: head_dim D={d} is not supported; this kernel handles 1 <= D <= "
            f"{MAX_HEAD_DIM}. Use torch.nn.functional.scaled_dot_product_attention for larger D."
        )
    if hkv == 0 or h % hkv != 0:
        raise GobrrrError(
            f"attention: query heads H={h} must be a multiple of key/value heads Hkv={hkv} "
            f"(grouped-query attention). Choose Hkv dividing H."
        )
    if s_k == 0 and s_q > 0:
        raise GobrrrError("attention: k and v have sequence length 0; softmax over no keys.")
    if causal and s_q != s_k:
        raise GobrrrError(
            f"attention: causal=True needs equal query and key lengths; got S_q={s_q}, S_k={s_k}. "
            f"Pass causal=False, or slice q/k/v to one length."
        )


def _check_scale(scale: float) -> None:
    if not (math.isfinite(scale) and scale > 0):
        raise GobrrrError(
            f"attention: scale={scale} must be a finite positive number (default 1/sqrt(D))."
        )


_MODULES: tuple = ()  # (_attention_fwd, _attention_bwd) once imported


def _kernels():
    """Import the Triton launchers on first use (Triton stays optional for tracing)."""
    global _MODULES
    if _MODULES:
        return _MODULES
    try:
        from gobrrr.kernels import _attention_bwd, _attention_fwd  # lazy: they import triton
    except ImportError as e:
        raise GobrrrError(
            f"attention: the Triton kernels could not be imported ({e}). Install triton "
            f"(pip install triton) to run attention on real tensors."
        ) from e
    _MODULES = (_attention_fwd, _attention_bwd)
    return _MODULES


def _check_runnable(t: torch.Tensor) -> None:
    fwd, _ = _kernels()
    if t.device.type != "cuda" and not fwd.INTERPRET:
        raise GobrrrError(
            f"attention: the Triton kernels run on a CUDA GPU, but the tensors are on {t.device}. "
            f"Move q, k, v to a GPU, or set TRITON_INTERPRET=1 before importing triton to run the "
            f"(slow) Triton interpreter on the CPU."
        )


def _forward(q, k, v, causal, scale):
    """The forward on checked inputs: (out, lse)."""
    b, h, s_q, _ = q.shape
    if q.numel() == 0:
        return torch.empty_like(q), q.new_empty((b, h, s_q), dtype=torch.float32)
    _check_runnable(q)
    return _kernels()[0].attention_forward(q, k, v, causal, scale)


def _backward(dout, q, k, v, out, lse, causal, scale):
    """The backward on checked inputs: (dq, dk, dv)."""
    if q.numel() == 0 or k.numel() == 0:
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)
    _check_runnable(q)
    return _kernels()[1].attention_backward(dout.to(q.dtype), q, k, v, out, lse, causal, scale)


@torch.library.custom_op(
    "gobrrr::attention_fwd",
    mutates_args=(),
    schema="(Tensor q, Tensor k, Tensor v, bool causal, float scale) -> (Tensor, Tensor)",
)
def attention_fwd(q, k, v, causal, scale):
    """Forward: returns out (like q: (B, H, S, D)) and lse (fp32, (B, H, S), natural log)."""
    _check_inputs(q, k, v, causal)
    _check_scale(scale)
    return _forward(q, k, v, causal, scale)


@attention_fwd.register_fake
def _(q, k, v, causal, scale):
    _check_inputs(q, k, v, causal)
    b, h, s_q, _ = q.shape
    return torch.empty_like(q), q.new_empty((b, h, s_q), dtype=torch.float32)


def _check_bwd_shapes(dout, q, out):
    if dout.shape != q.shape or out.shape != q.shape:
        raise GobrrrError(
            f"attention_bwd: dout {tuple(dout.shape)} and out {tuple(out.shape)} must have q's "
            f"shape {tuple(q.shape)}."
        )


@torch.library.custom_op(
    "gobrrr::attention_bwd",
    mutates_args=(),
    schema="(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, bool causal, "
    "float scale) -> (Tensor, Tensor, Tensor)",
)
def attention_bwd(dout, q, k, v, out, lse, causal, scale):
    """Backward (FlashAttention-2): returns dq, dk, dv shaped like q, k, v."""
    _check_inputs(q, k, v, causal)
    _check_bwd_shapes(dout, q, out)
    return _backward(dout, q, k, v, out, lse, causal, scale)


@attention_bwd.register_fake
def _(dout, q, k, v, out, lse, causal, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


class _Attention(torch.autograd.Function):
    """Autograd glue around the two ops (cheaper per call than torch.library.register_autograd,
    which matters at short sequences where a step is a few hundred microseconds)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale):
        if direct(q):  # inputs were checked by attention()
            out, lse = _forward(q, k, v, causal, scale)
        else:
            out, lse = _FWD(q, k, v, causal, scale)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.causal, ctx.scale = causal, scale
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse = ctx.saved_tensors
        if direct(dout) and dout.shape == q.shape:
            dq, dk, dv = _backward(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        else:
            dq, dk, dv = _BWD(dout, q, k, v, out, lse, ctx.causal, ctx.scale)
        return dq, dk, dv, None, None


_FWD = torch.ops.gobrrr.attention_fwd.default
_BWD = torch.ops.gobrrr.attention_bwd.default


def attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool = False,
    scale: float | None = None,
) -> torch.Tensor:
    """Scaled dot-product attention softmax(q kᵀ · scale [+ causal mask]) v, fused and tiled.

    q: (B, H, S, D); k, v: (B, Hkv, S_k, D) with H % Hkv == 0 (grouped-query attention: query
    head h reads key/value head h // (H // Hkv); K/V are never repeated in memory). D <= 128.
    causal: top-left aligned mask (query i sees keys j <= i), needs S == S_k; same as
    `F.scaled_dot_product_attention(is_causal=True)`. scale: multiplies the scores before the
    softmax (dimensionless, default 1/sqrt(D)). Any strides are accepted.
    Returns out: (B, H, S, D), q's dtype. Differentiable in q, k, v.
    """
    _check_inputs(q, k, v, causal)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else float(scale)
    _check_scale(scale)
    return _Attention.apply(q, k, v, bool(causal), scale)
