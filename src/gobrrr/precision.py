"""The training precisions gobrrr knows, and what each means: parsed once into a `Precision`.

p = Precision.parse("bf16-mixed")
p.autocast_dtype  # torch.bfloat16: forward and loss under autocast
p.peak_mode       # "bf16": the GPU's dense peak its matmuls run at
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from gobrrr.errors import GobrrrError

# fp32: no autocast, TF32 off. tf32: fp32 with TF32 matmuls. *-mixed: autocast over fp32
# weights. bf16: weights, gradients and optimizer states in bf16.
PRECISIONS = ("fp32", "tf32", "bf16-mixed", "fp16-mixed", "bf16")

_PEAK_MODE = {
    "fp32": "fp32",
    "tf32": "tf32",
    "bf16-mixed": "bf16",
    "fp16-mixed": "fp16",
    "bf16": "bf16",
}
_AUTOCAST = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}


@dataclass(frozen=True)
class Precision:
    """One of PRECISIONS, and what it means for the step. Build it with `Precision.parse`;
    `str(p)` is the user's spelling (what JSON and reports show)."""

    name: str

    @staticmethod
    def parse(text: str | Precision) -> Precision:
        """The precision `text` names (a Precision is returned as it is); a GobrrrError names
        the choices when it is none of PRECISIONS."""
        if isinstance(text, Precision):
            return text
        if text not in PRECISIONS:
            raise GobrrrError(f"unknown precision {text!r}: choose one of {', '.join(PRECISIONS)}")
        return _PARSED[text]

    def __str__(self) -> str:
        return self.name

    @property
    def autocast_dtype(self) -> torch.dtype | None:
        """The dtype autocast runs matmuls in, or None when the precision uses no autocast."""
        return _AUTOCAST.get(self.name)

    @property
    def is_mixed(self) -> bool:
        """Forward and loss run under autocast over fp32 weights ("bf16-mixed", "fp16-mixed")."""
        return self.name in _AUTOCAST

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the weights (and the batch's floating inputs): bfloat16 for pure
        "bf16", float32 otherwise."""
        return torch.bfloat16 if self.name == "bf16" else torch.float32

    @property
    def casts_weights(self) -> bool:
        """The model and its floating inputs are cast to `param_dtype` (pure "bf16")."""
        return self.param_dtype != torch.float32

    @property
    def tf32(self) -> bool:
        """TF32 tensor cores for fp32 matmuls and convolutions ("tf32")."""
        return self.name == "tf32"

    @property
    def needs_scaler(self) -> bool:
        """The loss is scaled (torch.amp.GradScaler): fp16 gradients underflow without it."""
        return self.name == "fp16-mixed"

    @property
    def peak_mode(self) -> str:
        """Which dense peak of a GPU (GpuSpec.peak_flops key) the precision's matmuls run at."""
        return _PEAK_MODE[self.name]

    @property
    def element_size(self) -> int:
        """Bytes per element of the tensors the step's matmuls read: 4 in fp32 and tf32, 2 in
        the 16-bit precisions (mixed ones included: autocast casts the inputs)."""
        return 4 if self.name in ("fp32", "tf32") else 2


_PARSED = {name: Precision(name) for name in PRECISIONS}
DEFAULT = _PARSED["bf16-mixed"]


def check_precision(precision: str | Precision) -> None:
    """Raise a GobrrrError naming the choices unless `precision` is one of PRECISIONS."""
    Precision.parse(precision)


def autocast_dtype(precision: str | Precision) -> torch.dtype | None:
    """The dtype autocast runs matmuls in, or None when the precision uses no autocast."""
    return Precision.parse(precision).autocast_dtype


def peak_mode(precision: str | Precision) -> str:
    """Which dense peak of a GPU (GpuSpec.peak_flops key) a precision's matmuls run at."""
    return Precision.parse(precision).peak_mode
