"""bitsandbytes' 4-bit linear layers (QLoRA's base model) traced as a CUDA GPU runs them.

A `bnb.nn.Linear4bit` holds its weight as packed 4-bit codes (uint8, numel/2 bytes) and a
`QuantState` beside it: absmax per block of 64 elements, with double quantization those in
8 bits plus an fp32 scale per 256 of them, an offset and two code books. Its forward is
`bitsandbytes::gemm_4bit` inside an autograd function whose backward dequantizes the weight
again for the input's gradient (the weight has none).

On CUDA (bitsandbytes 0.50, `backends/cuda/ops.py`) gemm_4bit with more than FUSED_MAX_M
rows, or an inner dimension the block size does not divide, is not one kernel: the 8-bit
absmax are dequantized (`dequantize_blockwise`) and the offset added, the weight dequantized
to the compute dtype (`dequantize_4bit`, a temporary of the weight's full size) and
`F.linear` run on it. Fewer rows take the fused kernel (one op, the weight read packed) where
bitsandbytes' per-GPU heuristic picks it; the trace always does.
Within `cuda_4bit()` the trace does the same: gemm_4bit on CPU tensors runs those ops, each
recorded with its own tensors.

The quantization state is no parameter or buffer of the layer, so the capture fakes it
(`fake_quant_states`) and registers its tensors as parameter storage (`quant_tensors`)
itself; a weight that lost its state on the way (made fake, cast) gets its layer's again at
forward, where bitsandbytes would wrap it in a `Params4bit`, which a fake tensor cannot be.
"""

from __future__ import annotations

import contextlib
import logging
import math
import sys
import warnings
from collections.abc import Callable, Iterator
from typing import Any

import torch
import torch.nn.functional as F

from gobrrr.capture.assume import Values
from gobrrr.capture.dropout import cpu_composite

#: rows above which CUDA's gemm_4bit dequantizes and calls F.linear (bitsandbytes 0.50:
#: backends.cuda.ops._gemm_4bit_custom_max_m, which is not importable without a GPU)
FUSED_MAX_M = 1536
#: absmax per scale in double quantization (bitsandbytes: state2.blocksize, the only one
#: its fused kernel accepts)
NESTED_BLOCK = 256
#: the quantization state's tensors, as attribute paths of a QuantState
FIELDS = (("absmax",), ("code",), ("offset",), ("state2", "absmax"), ("state2", "code"))


class _CpuKernelNotice(logging.Filter):
    """Drops bitsandbytes' notice, at import on CPUs with AVX512-BF16, that its optional CPU
    4-bit kernel is not installed: the trace runs CUDA's ops, never that kernel."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Failed to load CPU gemm_4bit_forward")


logging.getLogger("bitsandbytes.backends.cpu.ops").addFilter(_CpuKernelNotice())


def _states(model: torch.nn.Module) -> list[tuple[str, Any]]:
    """(layer name, QuantState) of each bitsandbytes 4-bit layer of `model`, each state once."""
    bnb = sys.modules.get("bitsandbytes")
    if bnb is None:
        return []
    out, seen = [], set()
    for name, m in model.named_modules():
        state = getattr(m, "quant_state", None)
        if isinstance(m, bnb.nn.Linear4bit) and state is not None and id(state) not in seen:
            seen.add(id(state))
            out.append((name, state))
    return out


def _fields(state: Any) -> Iterator[tuple[str, Any, str, torch.Tensor]]:
    """(path, owner, attribute, tensor) of each tensor of a QuantState."""
    for path in FIELDS:
        owner = state
        for step in path[:-1]:
            owner = getattr(owner, step, None)
        t = getattr(owner, path[-1], None) if owner is not None else None
        if isinstance(t, torch.Tensor):
            yield ".".join(path), owner, path[-1], t


def elements(model: torch.nn.Module) -> dict[int, int]:
    """id(weight) -> the elements a 4-bit weight stands for (its packed tensor holds two a
    byte), for every 4-bit layer of `model`."""
    out = {}
    for name, state in _states(model):
        layer = model.get_submodule(name)
        out[id(layer.weight)] = math.prod(state.shape)
    return out


def quant_tensors(model: torch.nn.Module) -> list[tuple[str, torch.Tensor]]:
    """(label, tensor) of every 4-bit layer's quantization state, labelled after its weight
    ("layers.0.q_proj.weight.quant_state.absmax")."""
    return [
        (f"{name}.weight.quant_state.{path}", t)
        for name, state in _states(model)
        for path, _, _, t in _fields(state)
    ]


def fake_quant_states(model: torch.nn.Module, fake: Callable[[torch.Tensor], Any]) -> None:
    """Replace the real tensors of every 4-bit layer's quantization state by fake(t), in
    place (a tensor two states share stays shared)."""
    memo: dict[int, Any] = {}
    for _, state in _states(model):
        for _, owner, attr, t in list(_fields(state)):
            if not isinstance(t, torch._subclasses.FakeTensor):
                if id(t) not in memo:
                    memo[id(t)] = fake(t)
                setattr(owner, attr, memo[id(t)])


def _state_on_weight(module: torch.nn.Module) -> None:
    """bitsandbytes' fix_4bit_weight_quant_state_from_module for fake weights: the layer's
    state set on the weight it lost it from, which stays what it is."""
    if getattr(module.weight, "quant_state", None) is None:
        module.weight.quant_state = module.quant_state


def _gemm_4bit(
    A, B, shapeB, absmax, blocksize, quant_type, bias=None, absmax_8bit=None, absmax_code=None,
    absmax_offset=None,
):  # fmt: skip
    """bitsandbytes::gemm_4bit as CUDA dispatches it (see the module's docstring).
    A (..., K) @ dequantized B (N, K).T -> (..., N)."""
    rows = A.numel() // max(A.shape[-1], 1)
    if rows <= FUSED_MAX_M and A.shape[-1] % blocksize == 0:  # the fused kernel
        with torch._C._AutoDispatchBelowAutograd():
            return torch.ops.bitsandbytes.gemm_4bit.default(
                A, B, shapeB, absmax, blocksize, quant_type, bias=bias, absmax_8bit=absmax_8bit,
                absmax_code=absmax_code, absmax_offset=absmax_offset,
            )  # fmt: skip
    absmax_dq = None  # as in bitsandbytes' _dequant_linear_fallback: alive until it returns
    if absmax_8bit is not None:  # double quantization: the absmax first
        absmax_dq = torch.ops.bitsandbytes.dequantize_blockwise.default(
            absmax_8bit, absmax, absmax_code, NESTED_BLOCK, torch.float32
        )
        absmax = absmax_dq + absmax_offset
    weight = torch.ops.bitsandbytes.dequantize_4bit.default(
        B, absmax, blocksize, quant_type, list(shapeB), A.dtype
    )
    return F.linear(A, weight, bias)


def _real(fn: Callable) -> Callable:
    """`fn` run on real tensors: an 8-bit code book, a constant whose making reads values."""

    def real(*args, **kwargs):
        with torch._subclasses.fake_tensor.unset_fake_temporarily():
            return fn(*args, **kwargs)

    return real


def _after_last_op(values: Values | None) -> None:
    """The host waits for the GPU after the last op recorded (none: not recording)."""
    _, _, n = values.where() if values is not None else ("", "", None)
    if n:
        values.syncs.append(n - 1)


@contextlib.contextmanager
def cuda_4bit(values: Values | None = None) -> Iterator[None]:
    """Within this context bitsandbytes' 4-bit layers run as on CUDA (module docstring) and
    its optimizers step as there: their code books made real (constants whose making reads
    values), the host waiting for the GPU after each parameter's update
    (`torch.cuda.synchronize`, noted in `values.syncs`), the paged ones keeping their states in
    plain tensors (as bitsandbytes does on the CPU) without warning. Nothing changes where
    bitsandbytes was not imported."""
    modules = sys.modules.get("bitsandbytes.nn.modules")
    if modules is None or not hasattr(torch.ops.bitsandbytes, "gemm_4bit"):
        yield
        return
    optim = sys.modules.get("bitsandbytes.optim.optimizer")
    functional = sys.modules["bitsandbytes.functional"]
    saved = [
        (modules, "fix_4bit_weight_quant_state_from_module", _state_on_weight),
        (functional, "create_dynamic_map", _real(functional.create_dynamic_map)),
    ]
    if optim is not None and hasattr(optim, "sync_gpu"):
        saved.append((optim, "sync_gpu", lambda t: _after_last_op(values)))
    originals = [getattr(m, name) for m, name, _ in saved]
    for m, name, new in saved:
        setattr(m, name, new)
    try:
        with cpu_composite("gemm_4bit", _gemm_4bit, ns="bitsandbytes"), warnings.catch_warnings():
            warnings.filterwarnings("ignore", "Paged optimizers are not supported on CPU")
            yield
    finally:
        for (m, name, _), old in zip(saved, originals, strict=True):
            setattr(m, name, old)
