"""Fused linear + cross-entropy: loss(hidden @ weight.T + bias, targets) without the (N, V) logits.

The tokens are processed in chunks. For each chunk of C tokens:
  1. logits = h_chunk @ W^T (+ bias)                 (C, V), one cuBLAS matmul, input dtype
  2. a Triton kernel, one program per row, in fp32: online max / sum-exp over V, the row's loss
     (label smoothing, ignore_index), then the logits' gradient written in place
  3. dh_chunk = dlogits @ W, dW += dlogits^T @ h_chunk, db += sum(dlogits)
All gradients are computed in the forward pass (as Liger-Kernel does), so backward only scales the
stored dh / dW / db by grad_output. Peak extra memory: dh + dW + one chunk of logits.

dW accumulates in the weight's dtype (cuBLAS adds in fp32 and rounds once per chunk), so a
bf16 weight sees one bf16 rounding per chunk: one reason chunks are not made tiny.

Op: gobrrr::linear_cross_entropy(hidden, weight, targets, bias?, ignore_index, reduction,
label_smoothing, chunk_size, hidden_grad, weight_grad, bias_grad) -> (loss, dhidden, dweight,
dbias). A single op: the cost model sees the whole fused computation (3 matmuls of 2*N*d*V FLOPs
each plus one pass over the logits) as one node. A gradient is an empty (0,) tensor when its
input has none to take (an op cannot return None): dbias without a bias, and dweight, dbias or
dhidden where that input does not require grad (a frozen head under LoRA: no (V, d) dweight is
made, and its matmul is not run).
"""

from __future__ import annotations

import torch

from gobrrr.errors import GobrrrError
from gobrrr.kernels._util import (
    INDEX_DTYPES,
    cdiv,
    check_float,
    check_same_device,
    is_interpreter,
    jit,
    kernel_for,
    next_pow2,
    tl,
)

TUNING = {"block_v": 8192, "warps": 16, "min_chunk": 1024}  # benchmarks may sweep these
_REDUCTIONS = {"mean": 0, "sum": 1}


@jit
def _ce_kernel(
    LOGITS,
    stride_row,
    TARGETS,
    LOSS,
    N_VALID,
    V,
    ignore_index,
    smoothing,
    IS_MEAN: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    ptr = LOGITS + row * stride_row
    target = tl.load(TARGETS + row).to(tl.int64)
    valid = target != ignore_index
    # an out-of-range target poisons its row (NaN loss and gradient) instead of reading out of
    # bounds; checking on the host would cost a device sync per call
    poison = valid & ((target < 0) | (target >= V))
    valid = valid & (target >= 0) & (target < V)
    # pass 1: running max m, running sum of exp(x - m), sum of x (for label smoothing)
    m = float("-inf")
    d = 0.0
    sum_x = 0.0
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=float("-inf")).to(tl.float32)
        m_new = tl.maximum(m, tl.max(x, axis=0))
        d = d * tl.exp(m - m_new) + tl.sum(tl.exp(x - m_new), axis=0)
        sum_x += tl.sum(tl.where(cols < V, x, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(d)
    x_t = tl.load(ptr + target, mask=valid, other=0.0).to(tl.float32)
    loss = (1.0 - smoothing) * (lse - x_t) + smoothing * (lse - sum_x / V)
    tl.store(LOSS + row, tl.where(poison, float("nan"), tl.where(valid, loss, 0.0)))
    scale = 1.0
    if IS_MEAN:
        scale = 1.0 / tl.maximum(tl.load(N_VALID), 1.0)  # rows are all ignored if 0
    scale = tl.where(valid, scale, tl.where(poison, float("nan"), 0.0))
    # pass 2: dlogits = (softmax - (1 - eps) onehot - eps / V) * scale, in place
    for start in range(0, V, BLOCK_V):
        cols = start + tl.arange(0, BLOCK_V)
        x = tl.load(ptr + cols, mask=cols < V, other=0.0).to(tl.float32)
        g = tl.exp(x - lse) - smoothing / V
        g = tl.where(cols == target, g - (1.0 - smoothing), g)
        tl.store(ptr + cols, (g * scale).to(LOGITS.dtype.element_ty), mask=cols < V)


def default_chunk(n_tokens: int, hidden: int, vocab: int) -> int:
    """Tokens per chunk: the chunk's logits about the size of the hidden states (N*d elements),
    but at least TUNING['min_chunk'] tokens so the dW += dlogits^T @ h matmuls stay compute-bound
    rather than re-reading and re-writing dW for every small chunk.
    """
    by_size = next_pow2(cdiv(n_tokens * hidden, vocab))
    return max(1, min(n_tokens, max(by_size, TUNING["min_chunk"])))


def _ce_launch(logits, targets, loss_rows, n_valid, ignore_index, smoothing, is_mean):
    c, v = logits.shape
    if is_interpreter():
        block_v, warps = min(2048, next_pow2(v)), 4
    else:
        block_v, warps = min(TUNING["block_v"], next_pow2(v)), TUNING["warps"]
    kern = kernel_for(_ce_kernel, logits.device)
    kern[(c,)](
        logits,
        logits.stride(0),
        targets,
        loss_rows,
        n_valid,
        v,
        ignore_index,
        smoothing,
        IS_MEAN=is_mean,
        BLOCK_V=block_v,
        num_warps=warps,
    )


def _check_targets(targets: torch.Tensor, vocab: int, ignore_index: int) -> None:
    """Raise on targets outside [0, vocab) that are not ignore_index. CPU only: on a GPU this
    would sync the host every call, so there the kernel poisons such rows with NaN instead."""
    if targets.device.type != "cpu":
        return
    bad = ((targets < 0) | (targets >= vocab)) & (targets != ignore_index)
    if bool(bad.any()):
        value = int(targets[bad][0])
        raise GobrrrError(
            f"target {value} is outside [0, {vocab}) and is not ignore_index={ignore_index}; "
            "fix the targets or the vocabulary size"
        )


@torch.library.custom_op("gobrrr::linear_cross_entropy", mutates_args=())
def linear_cross_entropy_op(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None,
    ignore_index: int,
    reduction: int,
    label_smoothing: float,
    chunk_size: int,
    hidden_grad: bool = True,
    weight_grad: bool = True,
    bias_grad: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """hidden (N, d), weight (V, d), targets (N,), bias (V,) or None; reduction 0=mean, 1=sum;
    chunk_size 0 = default_chunk; *_grad: that gradient is wanted. Returns (loss fp32 scalar,
    dhidden (N, d), dweight (V, d), dbias (V,)): the gradients of loss, for grad_output = 1,
    each (0,) where not wanted (dbias also without a bias)."""
    n, d = hidden.shape
    v = weight.shape[0]
    _check_targets(targets, v, ignore_index)
    chunk = chunk_size or default_chunk(n, d, v)
    dev = hidden.device
    bias_grad = bias_grad and bias is not None
    dh = torch.empty((n, d) if hidden_grad else 0, dtype=hidden.dtype, device=dev)
    dw = torch.empty((v, d) if weight_grad else 0, dtype=weight.dtype, device=dev)
    db = torch.zeros(v if bias_grad else 0, dtype=torch.float32, device=dev)
    n_valid = (targets != ignore_index).sum().to(torch.float32)  # stays on device: no sync
    loss = torch.zeros((), dtype=torch.float32, device=dev)
    logits_buf = torch.empty((min(chunk, n), v), dtype=hidden.dtype, device=dev)
    loss_rows = torch.empty(min(chunk, n), dtype=torch.float32, device=dev)
    targets = targets.contiguous()
    for start in range(0, n, chunk):
        h = hidden[start : start + chunk]  # (C, d)
        c = h.shape[0]
        logits = logits_buf[:c]  # (C, V)
        if bias is None:
            torch.mm(h, weight.t(), out=logits)
        else:
            torch.addmm(bias, h, weight.t(), out=logits)
        _ce_launch(
            logits,
            targets[start : start + c],
            loss_rows,
            n_valid,
            ignore_index,
            label_smoothing,
            reduction == 0,
        )
        loss += loss_rows[:c].sum()
        if hidden_grad:
            torch.mm(logits, weight, out=dh[start : start + c])  # (C, d)
        if weight_grad and start == 0:
            torch.mm(logits.t(), h, out=dw)  # (V, d)
        elif weight_grad:
            dw.addmm_(logits.t(), h)
        if bias_grad:
            db += logits.sum(0, dtype=torch.float32)
    if reduction == 0:
        loss = loss / n_valid
    return loss, dh, dw, db.to(bias.dtype) if bias_grad else hidden.new_empty(0)


@linear_cross_entropy_op.register_fake
def _(
    hidden,
    weight,
    targets,
    bias,
    ignore_index,
    reduction,
    label_smoothing,
    chunk_size,
    hidden_grad=True,
    weight_grad=True,
    bias_grad=True,
):
    loss = hidden.new_empty((), dtype=torch.float32)
    db = bias.new_empty(bias.shape) if bias is not None and bias_grad else hidden.new_empty(0)
    dh = hidden.new_empty(hidden.shape if hidden_grad else 0)
    return loss, dh, weight.new_empty(weight.shape if weight_grad else 0), db


def _setup(ctx, inputs, output):
    # which gradients the op made (an empty one stands for none)
    ctx.made = [t.numel() > 0 for t in output[1:]]
    _, dh, dw, db = output
    # Without these, autograd would hand backward a zero tensor per unused output: a (V, d)
    # zeros for dweight, as large as the gradient itself.
    ctx.set_materialize_grads(False)
    ctx.mark_non_differentiable(dh, dw, db)
    ctx.save_for_backward(dh, dw, db)


def _backward(ctx, g_loss, _g_dh, _g_dw, _g_db):
    # Scale in place: a fresh copy of dW would add V*d elements to the peak, and autograd can
    # adopt these tensors as .grad without a copy once the graph releases them.
    if g_loss is None:
        return (None,) * 11
    saved = zip(ctx.saved_tensors, ctx.made, strict=True)
    dh, dw, db = (g.mul_(g_loss) if made else None for g, made in saved)
    return dh, dw, None, db, *(None,) * 7


linear_cross_entropy_op.register_autograd(_backward, setup_context=_setup)


def _autocast(hidden, weight, bias):
    """Under autocast, run the matmuls in the autocast dtype, as F.linear would."""
    dev = hidden.device.type
    if dev not in ("cuda", "cpu") or not torch.is_autocast_enabled(dev):
        return hidden, weight, bias
    dtype = torch.get_autocast_dtype(dev)
    return hidden.to(dtype), weight.to(dtype), None if bias is None else bias.to(dtype)


def _check(hidden, weight, targets, bias, reduction, label_smoothing):
    check_float("hidden", hidden)
    check_float("weight", weight, ndim=2)
    if hidden.dim() not in (2, 3):
        raise GobrrrError(f"hidden must be (N, d) or (B, S, d), got {tuple(hidden.shape)}")
    if hidden.shape[-1] != weight.shape[1]:
        raise GobrrrError(
            f"hidden's last dim {hidden.shape[-1]} != weight's dim 1 {weight.shape[1]}; "
            "weight must be (vocab, hidden)"
        )
    if targets.dtype not in INDEX_DTYPES or tuple(targets.shape) != tuple(hidden.shape[:-1]):
        raise GobrrrError(
            f"targets must be int64/int32 of shape {tuple(hidden.shape[:-1])}, got "
            f"{targets.dtype} {tuple(targets.shape)}"
        )
    if bias is not None:
        check_float("bias", bias, ndim=1)
        if bias.shape[0] != weight.shape[0]:
            raise GobrrrError(f"bias has {bias.shape[0]} entries, vocab is {weight.shape[0]}")
    check_same_device(hidden=hidden, weight=weight, targets=targets, bias=bias)
    if reduction not in _REDUCTIONS:
        raise GobrrrError(f"reduction={reduction!r}; use 'mean' or 'sum'")
    if not 0.0 <= label_smoothing <= 1.0:
        raise GobrrrError(f"label_smoothing={label_smoothing}; use a value in [0, 1]")


def linear_cross_entropy(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    bias: torch.Tensor | None = None,
    ignore_index: int = -100,
    reduction: str = "mean",
    label_smoothing: float = 0.0,
    chunk_size: int = 0,
) -> torch.Tensor:
    """cross_entropy(hidden @ weight.T + bias, targets) without materialising the logits.

    hidden: (N, d) or (B, S, d); weight: (V, d); targets: (N,) or (B, S) int; bias: (V,).
    reduction 'mean' divides by the number of targets != ignore_index. Returns an fp32 scalar.
    chunk_size: tokens per chunk (0 = default_chunk). Gradients are computed during the forward.
    """
    _check(hidden, weight, targets, bias, reduction, label_smoothing)
    hidden, weight, bias = _autocast(hidden, weight, bias)
    dtypes = {hidden.dtype, weight.dtype} | ({bias.dtype} if bias is not None else set())
    if len(dtypes) > 1:
        raise GobrrrError(
            f"hidden, weight, bias have dtypes {sorted(map(str, dtypes))}; cast them to one "
            "dtype or run under torch.autocast"
        )
    out = linear_cross_entropy_op(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1),
        bias,
        int(ignore_index),
        _REDUCTIONS[reduction],
        float(label_smoothing),
        int(chunk_size),
        *_wanted(hidden, weight, bias),
    )
    return out[0]


def _wanted(hidden, weight, bias) -> tuple[bool, bool, bool]:
    """Which of (dhidden, dweight, dbias) autograd will take: none where grad mode is off,
    and none for an input that does not require grad (a frozen head: its (V, d) dweight would
    be made in the forward, held to the backward, then thrown away)."""
    on = torch.is_grad_enabled()
    return tuple(on and x is not None and x.requires_grad for x in (hidden, weight, bias))
