"""FP8 training of a model's linear layers: torchao's float8 recipe (tensorwise scaling).

    n = use_fp8(model)            # each eligible nn.Linear becomes torchao's Float8Linear

What changes: each eligible linear layer's three matmuls (forward, grad input, grad weight)
run as `torch._scaled_mm` on float8 operands: the input and the weight cast to
float8_e4m3fn, the output's gradient to float8_e5m2, each with one scale per tensor
(its absolute maximum: an `abs`, a `max` and a few scalar ops, then a scale, a clamp and the
cast). The weights, gradients and optimizer states keep their dtypes (fp32 under bf16
autocast, bf16 with bf16 weights); what backward keeps is the layer's high-precision input,
as for nn.Linear, and the casts run again in backward (torchao's default).

Which linears: as torchtitan's float8 converter chooses, every nn.Linear but the model's
output head (its logits feed the loss, and its width is the vocabulary) and those whose
in_features or out_features is not a multiple of 16 (`torch._scaled_mm` needs both).
"""

from __future__ import annotations

import importlib.util
from collections.abc import Callable

import torch
from torch import nn

from gobrrr.errors import GobrrrError

#: `torch._scaled_mm` needs every matmul dimension a multiple of this
FP8_MULTIPLE = 16

#: names of an output head in the models gobrrr knows (its own, transformers', torchtitan's)
HEAD_NAMES = ("lm_head", "output", "head")

#: the class torchao's float8 recipe swaps in, by its qualified name (torchao not imported)
FLOAT8_LINEAR = "torchao.float8.float8_linear.Float8Linear"


def torchao_float8_refusal() -> str | None:
    """Why FP8 training cannot be applied in this process (None: it can): torchao's float8
    package must be importable."""
    if importlib.util.find_spec("torchao") is None:
        return "FP8 training uses torchao's float8 recipe, and torchao is not installed: " + (
            "pip install torchao (or 'gobrrr[optim]')"
        )
    if importlib.util.find_spec("torchao.float8") is None:
        return "this torchao has no torchao.float8: pip install -U torchao"
    return None


#: the CUDA compute capability from which GPUs have FP8 tensor cores (Ada, Hopper and later)
FP8_CAPABILITY = (8, 9)


def device_refusal(device: torch.device) -> str | None:
    """Why FP8 matmuls cannot run on `device` (None: they can): a CUDA GPU needs FP8 tensor
    cores (compute capability 8.9 or later); the CPU runs `torch._scaled_mm` as a reference
    kernel (slow, for tests)."""
    if device.type != "cuda":
        return None
    cap = torch.cuda.get_device_capability(device)
    if tuple(cap) >= FP8_CAPABILITY:
        return None
    name = torch.cuda.get_device_name(device)
    return (
        f"fp8=True on {name} (compute capability {cap[0]}.{cap[1]}): FP8 training needs FP8 "
        "tensor cores (8.9 or later: L4, L40S, RTX 4090, H100, H200, B200); drop fp8"
    )


def head_names(model: nn.Module) -> set[str]:
    """Fully qualified names of the model's output head(s): a linear named as HEAD_NAMES
    (at any depth: a PEFT wrapper's base_model.model.lm_head), and transformers'
    get_output_embeddings() where the model has one."""
    names = {n for n, _ in model.named_modules() if n.rsplit(".", 1)[-1] in HEAD_NAMES}
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is not None:
        names |= {n for n, m in model.named_modules() if m is head}
    return names


def fp8_filter(model: nn.Module) -> Callable[[nn.Module, str], bool]:
    """The `module_filter_fn` torchao's convert_to_float8_training takes: True for an
    nn.Linear that is not the output head and whose dims are multiples of FP8_MULTIPLE."""
    heads = head_names(model)

    def keep(mod: nn.Module, fqn: str) -> bool:
        if not isinstance(mod, nn.Linear) or fqn in heads:
            return False
        return mod.in_features % FP8_MULTIPLE == 0 and mod.out_features % FP8_MULTIPLE == 0

    return keep


def eligible(model: nn.Module) -> list[str]:
    """Names of the linears FP8 training converts, in `named_modules` order."""
    keep = fp8_filter(model)
    return [n for n, m in model.named_modules() if keep(m, n)]


def fp8_refusal(model: nn.Module) -> str | None:
    """Why FP8 training does not apply to `model` (None: it does): it needs at least one
    linear layer it converts."""
    if eligible(model):
        return None
    return (
        f"{type(model).__name__} has no nn.Linear but its output head with both dims "
        f"multiples of {FP8_MULTIPLE}, which is what FP8 training converts: drop fp8"
    )


def use_fp8(model: nn.Module) -> str:
    """Convert the eligible linears of `model` in place to torchao's Float8Linear (the
    tensorwise recipe, torchao's default config); returns what changed, in words."""
    why = torchao_float8_refusal() or fp8_refusal(model)
    if why:
        raise GobrrrError(why)
    from torchao.float8 import convert_to_float8_training

    names = eligible(model)
    convert_to_float8_training(model, module_filter_fn=fp8_filter(model))
    return f"fp8 training of {len(names)} linear layer(s) (torchao float8, tensorwise)"


def traced_fp8(model: nn.Module) -> str:
    """`use_fp8` as a fake-tensor trace runs it: under bf16 autocast on the GPU, Float8Linear
    casts its input to autocast's dtype before scaling it (`torch.is_autocast_enabled()`,
    which asks about CUDA); a trace runs CUDA's autocast rules under CPU autocast, so each
    converted layer casts its input the same way here first."""
    what = use_fp8(model)
    for mod in model.modules():
        if _qualname(type(mod)) == FLOAT8_LINEAR:
            # one hook function for every layer: compiled per block, each block's guards
            # hold the same function (a wrapper per layer made each block a recompile)
            mod.register_forward_pre_hook(_cast_input)
    return what


def _cast_input(module: nn.Module, args: tuple) -> tuple | None:
    """The input cast to CPU autocast's dtype where CPU autocast stands for CUDA's."""
    if torch.is_autocast_enabled("cpu") and not torch.is_autocast_enabled():
        return (args[0].to(torch.get_autocast_dtype("cpu")), *args[1:])
    return None


def _qualname(cls: type) -> str:
    return f"{cls.__module__}.{cls.__qualname__}"


__all__ = [
    "FP8_CAPABILITY",
    "FP8_MULTIPLE",
    "device_refusal",
    "eligible",
    "fp8_filter",
    "fp8_refusal",
    "head_names",
    "torchao_float8_refusal",
    "traced_fp8",
    "use_fp8",
]
