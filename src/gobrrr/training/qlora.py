"""A model's linear layers in 4 bits through bitsandbytes (QLoRA's base model), built from a
model in memory: what `from_pretrained(..., quantization_config=BitsAndBytesConfig(...))`
builds from a checkpoint, without one.

    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model = load_in_4bit(model)      # NF4, double quantization, bf16 compute (QLoRA's recipe)
    model = prepare_model_for_kbit_training(model)
    model = get_peft_model(model, LoraConfig(...))

transformers' own quantizer picks the layers (every `nn.Linear` but the output head and the
modules the config skips) and replaces them by `bnb.nn.Linear4bit`; each weight is then
quantized as loading quantizes it: packed 4-bit codes (uint8, numel/2 bytes) and a
`QuantState` (one absmax per block of 64 elements; with double quantization those absmax in
8 bits, one fp32 scale per 256 of them, and their mean as an offset).

On real tensors the weight is bitsandbytes' `Params4bit`, as loading makes it. A fake tensor
(gobrrr's trace) cannot be wrapped in a `Params4bit`, so there (and on the meta device, where
`Params4bit` would not quantize) the weight is a plain frozen parameter holding the same packed
codes, with the same quantization state on it and on its layer (`gobrrr.capture.bnb` runs the
layer as on the GPU).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from gobrrr.errors import GobrrrError

INSTALL = {
    "bitsandbytes": "pip install 'gobrrr[qlora]' (bitsandbytes >= 0.45)",
    "peft": "pip install 'gobrrr[lora]' (peft >= 0.13)",
}


def missing(name: str, what: str) -> GobrrrError:
    """The one-line error for a library a workload needs that is not installed."""
    return GobrrrError(f"{what} needs {name}, which is not installed", hint=INSTALL[name])


def qlora_config(compute_dtype: torch.dtype = torch.bfloat16) -> Any:
    """QLoRA's quantization: NF4 codes, double quantization, `compute_dtype` matmuls (a
    transformers `BitsAndBytesConfig`)."""
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=compute_dtype,
    )


def load_in_4bit(model: nn.Module, quantization_config: Any = None) -> nn.Module:
    """`model` (a transformers `PreTrainedModel`) with its linear layers in 4 bits, as
    `from_pretrained(..., quantization_config=...)` loads them; in place, returned.
    `quantization_config`: a `BitsAndBytesConfig` with `load_in_4bit=True` (default:
    `qlora_config()`)."""
    try:
        import bitsandbytes as bnb
        from transformers.quantizers import AutoHfQuantizer
    except ModuleNotFoundError as e:
        raise missing(e.name or "bitsandbytes", "load_in_4bit (a QLoRA base model)") from e
    config = quantization_config or qlora_config()
    if not getattr(config, "load_in_4bit", False):
        raise GobrrrError(
            f"load_in_4bit got a quantization config without load_in_4bit=True ({config!r})",
            hint="pass BitsAndBytesConfig(load_in_4bit=True, ...) or none for QLoRA's NF4",
        )
    _real_qmap(bnb)
    quantizer = AutoHfQuantizer.from_config(config, pre_quantized=False)
    weights = {n: (m.weight, m.bias) for n, m in model.named_modules() if type(m) is nn.Linear}
    with torch._subclasses.fake_tensor.unset_fake_temporarily():  # a fake one cannot be a
        quantizer.preprocess_model(model, device_map=None)  # Params4bit: Linear4bit on meta
    for name, layer in model.named_modules():
        if isinstance(layer, bnb.nn.Linear4bit) and name in weights:
            _load(bnb, layer, *weights[name])
    quantizer.postprocess_model(model)
    model.hf_quantizer = quantizer
    return model


def _load(bnb: Any, layer: nn.Module, weight: torch.Tensor, bias: torch.Tensor | None) -> None:
    """Quantize `weight` into `layer` (a meta Linear4bit), as loading a checkpoint does."""
    w = weight.detach()
    attrs = dict(layer.weight.__dict__)  # blocksize, quant_type, compress_statistics, ...
    if isinstance(w, torch._subclasses.FakeTensor) or w.is_meta:  # a trace, the planner's probe
        layer.weight = nn.Parameter(_fake_4bit(bnb, w, attrs, layer), requires_grad=False)
        layer.weight.__dict__.update(attrs, quant_state=layer.quant_state, bnb_quantized=True)
    else:
        layer.weight = bnb.nn.Params4bit(w, requires_grad=False, **attrs).to(w.device)
    if bias is not None:
        layer.bias = nn.Parameter(bias.detach(), requires_grad=False)


def _fake_4bit(bnb: Any, w: torch.Tensor, attrs: dict, layer: nn.Module) -> torch.Tensor:
    """`Params4bit._quantize` on a fake tensor: the packed codes, the state on the layer."""
    packed, state = bnb.functional.quantize_4bit(
        w.contiguous(),
        blocksize=attrs.get("blocksize") or 64,
        compress_statistics=attrs.get("compress_statistics", True),
        quant_type=attrs.get("quant_type", "nf4"),
        quant_storage=attrs.get("quant_storage", torch.uint8),
    )
    layer.quant_state = state
    attrs.pop("module", None)
    attrs.pop("quant_state", None)
    return packed


def _real_qmap(bnb: Any) -> None:
    """bitsandbytes caches the code book of double quantization in a module-level dict the
    first time it quantizes: made inside a trace it would be a fake tensor, which every later
    model (real or traced under another fake mode) would then be handed. Make it real first."""
    qmaps = bnb.functional.name2qmap
    if "dynamic" not in qmaps:
        with torch._subclasses.fake_tensor.unset_fake_temporarily(), torch.device("cpu"):
            qmaps["dynamic"] = bnb.functional.create_dynamic_map()
