"""nn.Module wrappers over the functional kernels: drop-in layers for a model definition."""

from __future__ import annotations

import torch
from torch import nn

from gobrrr.kernels.attention import attention
from gobrrr.kernels.linear_cross_entropy import linear_cross_entropy
from gobrrr.kernels.norms import layer_norm, rms_norm
from gobrrr.kernels.pointwise import swiglu


class RMSNorm(nn.Module):
    """RMSNorm over the last dim with a learned scale (init 1), as torch.nn.RMSNorm."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return rms_norm(x, self.weight, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class LayerNorm(nn.Module):
    """LayerNorm over the last dim with learned scale (init 1) and optional bias (init 0)."""

    def __init__(self, dim: int, eps: float = 1e-5, bias: bool = True):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = nn.Parameter(torch.zeros(dim)) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return layer_norm(x, self.weight, self.bias, self.eps)

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}, bias={self.bias is not None}"


class LinearCrossEntropy(nn.Module):
    """The output projection and the loss in one: forward(hidden, targets) -> mean loss.

    Holds weight (vocab, in_features) like nn.Linear; tie it to an embedding by assigning
    `module.weight = embedding.weight`.
    """

    def __init__(
        self,
        in_features: int,
        vocab: int,
        bias: bool = False,
        ignore_index: int = -100,
        label_smoothing: float = 0.0,
    ):
        super().__init__()
        lin = nn.Linear(in_features, vocab, bias=bias)  # nn.Linear's initialisation
        self.weight = lin.weight
        self.bias = lin.bias
        self.ignore_index = ignore_index
        self.label_smoothing = label_smoothing

    def forward(self, hidden: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        return linear_cross_entropy(
            hidden,
            self.weight,
            targets,
            self.bias,
            self.ignore_index,
            label_smoothing=self.label_smoothing,
        )


class Attention(nn.Module):
    """Flash attention over (B, H, S, D) q and (B, Hkv, S, D) k, v; no parameters."""

    def __init__(self, scale: float | None = None):
        super().__init__()
        self.scale = scale

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool = False
    ) -> torch.Tensor:
        return attention(q, k, v, causal=causal, scale=self.scale)


class SwiGLU(nn.Module):
    """The Llama MLP: down(silu(gate(x)) * up(x)), with the gate fused in one kernel."""

    def __init__(self, dim: int, hidden: int, bias: bool = False):
        super().__init__()
        self.gate = nn.Linear(dim, hidden, bias=bias)
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down(swiglu(self.gate(x), self.up(x)))
