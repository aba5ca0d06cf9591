"""CUDA's choice of scaled-dot-product-attention backend, reproduced in the CPU trace.

`F.scaled_dot_product_attention` picks its kernel at run time, by device: on the CPU (where the
trace runs) it takes the CPU flash kernel or the math path, which materialises the S x S score
matrix, its softmax and a dropout mask; on a CUDA GPU it takes cuDNN, FlashAttention-2 or the
memory-efficient (CUTLASS) kernel whenever their constraints allow, and none of those keeps an
S x S tensor. Traced as the CPU runs it, a model with attention dropout or a padding mask came
out up to twice its real memory. The memory-efficient kernel takes no grouped-query attention:
an fp32 call with `enable_gqa` and fewer K/V heads (HF transformers passes it whenever no mask
is given) runs the math path on CUDA, K and V repeated to the query heads and the S x S
probabilities kept for backward, and so it is traced.

While the trace runs, `cuda_sdpa(target)` intercepts every call (at the dispatcher, so
`nn.MultiheadAttention` and recomputed blocks are caught too), chooses the
backend as PyTorch's CUDA dispatcher would (aten/src/ATen/native/transformers/cuda/sdp_utils.cpp:
`select_sdp_backend` and each `can_use_*` gate), and calls that backend's ATen op, whose meta
kernel gives the CUDA outputs (output, logsumexp, RNG state) and whose autograd node saves
what CUDA's saves. What the composite does around the kernel is done too: a boolean mask
turned into an additive one, the memory-efficient kernel's mask padded to a multiple of 16,
FlashAttention's head dim padded to a multiple of 8. Autocast's cast to 16 bits comes before,
from CUDA's autocast rules (`gobrrr.capture.autocast`).
"""

from __future__ import annotations

import contextlib
import math
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from gobrrr.capture.autocast import EXCLUDE_AUTOCAST
from gobrrr.capture.dropout import cpu_composite

_HALF = (torch.float16, torch.bfloat16)


@dataclass(frozen=True)
class SdpaTarget:
    """What decides the backend on the target GPU.

    capability: CUDA compute capability (major, minor). cudnn_first: PyTorch tries cuDNN's
    attention before FlashAttention (sm90 and sm100 with cuDNN newer than 9.15, as the CUDA 13
    builds of torch ship; `TORCH_CUDNN_SDPA_DEPRIORITIZED=1` turns it off)."""

    capability: tuple[int, int] = (9, 0)
    cudnn_first: bool = True

    @property
    def order(self) -> tuple[str, ...]:
        if self.cudnn_first:
            return ("cudnn", "flash", "efficient", "math")
        return ("flash", "efficient", "math", "cudnn")


# compute capability by GPU (the spec's full name), for the gates that depend on it
_CAPABILITY = (
    ("H100", (9, 0)),
    ("H200", (9, 0)),
    ("GH200", (9, 0)),
    ("B200", (10, 0)),
    ("B100", (10, 0)),
    ("A100", (8, 0)),
    ("A10", (8, 6)),
    ("A40", (8, 6)),
    ("L40", (8, 9)),
    ("L4", (8, 9)),
    ("4090", (8, 9)),
    ("3090", (8, 6)),
    ("V100", (7, 0)),
    ("T4", (7, 5)),
)


def target_for(full_name: str) -> SdpaTarget:
    """The SDPA target of a GPU by its device name (`torch.cuda.get_device_name()`); Hopper's
    when the name is not known."""
    cap = next((c for key, c in _CAPABILITY if key in full_name), (9, 0))
    return SdpaTarget(cap, cudnn_first=cap[0] in (9, 10))


@dataclass(frozen=True)
class _Call:
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor | None
    dropout: float
    causal: bool
    scale: float | None
    gqa: bool

    @property
    def grad(self) -> bool:
        return torch.is_grad_enabled() and any(t.requires_grad for t in (self.q, self.k, self.v))


def _common(c: _Call) -> bool:
    """Gates every fused backend shares: 4-D dense inputs, non-empty sequences, unit stride in
    the head dim, and heads that match (or divide, with enable_gqa)."""
    if any(t.dim() != 4 for t in (c.q, c.k, c.v)) or c.q.dtype != c.k.dtype != c.v.dtype:
        return False
    if c.q.shape[-2] == 0 or c.k.shape[-2] == 0:
        return False
    if any(t.stride(-1) != 1 and t.shape[-1] != 1 for t in (c.q, c.k, c.v)):
        return False
    hq, hk = c.q.shape[1], c.k.shape[1]
    if c.q.shape[0] != c.k.shape[0] or c.k.shape[1] != c.v.shape[1]:
        return False
    return hq == hk or (c.gqa and hq % hk == 0)


def _cudnn(c: _Call, t: SdpaTarget) -> bool:
    if not torch.backends.cuda.cudnn_sdp_enabled() or t.capability < (8, 0):
        return False
    if c.q.dtype not in _HALF:  # (newer sources also want dropout in steps of 1/16; torch
        return False  # 2.11 on an H100 ran cuDNN at 0.1: sdpa_backends_h100.json)
    b, h, sq, dqk = c.q.shape
    sk, dv = c.k.shape[-2], c.v.shape[-1]
    if b > 65535 or h > 65535 or dqk % 8 or dv % 8 or sk == 1 or (c.dropout and sq == 1):
        return False
    hopper = t.capability[0] in (9, 10)
    if max(dqk, dv) > (256 if hopper else 128):
        return False
    if c.grad and hopper and not (max(dqk, dv) <= 128 or (dqk, dv) in ((192, 128), (256, 256))):
        return False
    return not torch.are_deterministic_algorithms_enabled()


def _flash(c: _Call, t: SdpaTarget) -> bool:
    if not torch.backends.cuda.flash_sdp_enabled() or c.mask is not None:
        return False
    if c.q.dtype not in _HALF or t.capability < (8, 0):
        return False
    d = c.q.shape[-1]
    if not (d == c.k.shape[-1] == c.v.shape[-1] and d <= 256):
        return False
    if c.causal and c.q.shape[-2] != c.k.shape[-2]:
        return False
    if c.grad and ((8, 6) <= t.capability <= (8, 9) or t.capability[0] == 12):
        return d <= 192 or (not c.dropout and d > 224)
    return True


def _gemm_alignment(dtype: torch.dtype, t: SdpaTarget) -> int:
    """Elements a head dim must be a multiple of for the memory-efficient kernel
    (`minimum_gemm_alignment`): 4 from sm80 on; where tensor cores run (sm80 on, or 16 bits
    on sm70-75) 128 bits of them: 8 in 16 bits, 4 in fp32; 1 otherwise."""
    half = dtype in _HALF
    tensor_cores = t.capability >= (8, 0) or (t.capability >= (7, 0) and half)
    align = 4 if t.capability >= (8, 0) else 1
    return max(align, 128 // (16 if half else 32)) if tensor_cores else align


def _efficient(c: _Call, t: SdpaTarget) -> bool:
    if not torch.backends.cuda.mem_efficient_sdp_enabled() or t.capability < (5, 0):
        return False
    if c.q.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    if c.q.dtype == torch.bfloat16 and t.capability < (8, 0):
        return False
    # no grouped-query attention in this kernel (check_batch_size_and_num_heads_dense<false>):
    # with enable_gqa and fewer K/V heads the call falls through to the math path, which
    # repeats K and V to the query heads and keeps the S x S probabilities
    if not c.q.shape[1] == c.k.shape[1] == c.v.shape[1]:
        return False
    align = _gemm_alignment(c.q.dtype, t)
    dqk, dv = c.q.shape[-1], c.v.shape[-1]
    if dqk != c.k.shape[-1] or dqk % align or dv % align:
        return False
    return all(t.stride(-1) == 1 for t in (c.q, c.k, c.v))


_GATES = {"cudnn": _cudnn, "flash": _flash, "efficient": _efficient}


def _mask_needs_grad(c: _Call) -> bool:
    """A mask that is learned (T5's relative position bias) needs a gradient the fused kernels
    do not give: on an H100 such calls ran the math path (zoo_h100.json, t5-base: 12 of its 36
    attention calls fused, the 24 with a learned bias not)."""
    return c.mask is not None and c.mask.requires_grad and torch.is_grad_enabled()


def choose(c: _Call, target: SdpaTarget) -> str:
    """The backend PyTorch's CUDA dispatcher runs this call on."""
    if _common(c) and not _mask_needs_grad(c):
        for name in target.order:
            if name == "math":
                break
            if _GATES[name](c, target):
                return name
    return "math"


def _additive(mask: torch.Tensor | None, dtype: torch.dtype) -> torch.Tensor | None:
    """A boolean mask (True = attend) as the additive float mask the kernels take (one new
    tensor, as `convert_boolean_attn_mask` makes it with `where`)."""
    if mask is None or mask.dtype != torch.bool:
        return mask
    zero = torch.scalar_tensor(0.0, dtype=dtype, device=mask.device)
    return torch.where(
        mask, zero, torch.scalar_tensor(float("-inf"), dtype=dtype, device=mask.device)
    )


def _pad_mask_16(mask: torch.Tensor, c: _Call) -> torch.Tensor:
    """The memory-efficient kernel reads its bias with rows aligned to 16 elements: a key
    length that is not a multiple of 16 gets a padded copy (then a view of it)."""
    sk = mask.shape[-1]
    if sk % 16:
        mask = F.pad(mask, (0, 16 - sk % 16))[..., :sk]
    b, h, sq = c.q.shape[0], c.q.shape[1], c.q.shape[2]
    return mask.expand(b, h, sq, sk)


def _run(backend: str, c: _Call) -> torch.Tensor:
    aten = torch.ops.aten
    if backend == "cudnn":
        mask = _additive(c.mask, c.q.dtype)
        return aten._scaled_dot_product_cudnn_attention(
            c.q, c.k, c.v, mask, c.grad, c.dropout, c.causal, False, scale=c.scale
        )[0]
    if backend == "flash":
        d = c.q.shape[-1]
        q, k, v = (F.pad(x, (0, -d % 8)) if d % 8 else x for x in (c.q, c.k, c.v))
        scale = c.scale if c.scale is not None else 1 / math.sqrt(d)
        out = aten._scaled_dot_product_flash_attention(
            q, k, v, c.dropout, c.causal, False, scale=scale
        )[0]
        return out[..., :d] if d % 8 else out
    if backend == "efficient":
        mask = _additive(c.mask, c.q.dtype)
        mask = _pad_mask_16(mask, c) if mask is not None else None
        return aten._scaled_dot_product_efficient_attention(
            c.q, c.k, c.v, mask, c.grad, c.dropout, c.causal, scale=c.scale
        )[0]
    # the math path is a composite: traced as it runs on CUDA (K and V repeat_interleave'd to
    # the query heads under enable_gqa, q and k scaled, the S x S scores, their softmax and
    # dropout mask materialised, the probabilities saved for backward)
    return aten._scaled_dot_product_attention_math(
        c.q, c.k, c.v, c.mask, c.dropout, c.causal, None, scale=c.scale, enable_gqa=c.gqa
    )[0]


@dataclass
class SdpaChoices:
    """The backends the traced step's attention calls were given, by count."""

    target: SdpaTarget
    chosen: Counter = field(default_factory=Counter)


@contextlib.contextmanager
def cuda_sdpa(target: SdpaTarget) -> Iterator[SdpaChoices]:
    """Within this context every F.scaled_dot_product_attention call on CPU tensors (the
    trace's fake ones) runs the backend CUDA would run on `target`; the choices are counted in
    the yielded SdpaChoices.

    The function is a composite op; its AutogradCPU kernel is replaced, so it runs after
    autocast's cast (CUDA's rules, `gobrrr.capture.autocast`) and wherever it is called from:
    the forward, a checkpointed block's recomputation, nn.MultiheadAttention."""
    choices = SdpaChoices(target)

    def kernel(
        query,
        key,
        value,
        attn_mask=None,
        dropout_p=0.0,
        is_causal=False,
        scale=None,
        enable_gqa=False,
    ):
        c = _Call(
            query, key, value, attn_mask, float(dropout_p), bool(is_causal), scale, bool(enable_gqa)
        )
        backend = choose(c, target)
        choices.chosen[backend] += 1
        with torch._C._ExcludeDispatchKeyGuard(EXCLUDE_AUTOCAST):
            return _run(backend, c)

    with cpu_composite("scaled_dot_product_attention", kernel):
        yield choices
