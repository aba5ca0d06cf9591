"""The lecture's L-layer network y = σ(W_L … σ(W_1 x)), trained with a squared loss."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class MLPConfig:
    """Shape of the deep MLP.

    Fields:
        layers: number of weight matrices L (each width × width, no bias).
        width: features per layer.
    """

    layers: int = 8
    width: int = 4096


class DeepMLP(nn.Module):
    """L square Linear layers, each followed by ReLU; forward(x, target) returns the MSE loss."""

    def __init__(self, cfg: MLPConfig):
        super().__init__()
        self.config = cfg
        self.layers = nn.ModuleList(
            [nn.Linear(cfg.width, cfg.width, bias=False) for _ in range(cfg.layers)]
        )

    def forward(self, x: torch.Tensor, target: torch.Tensor | None = None) -> torch.Tensor:
        for layer in self.layers:
            x = F.relu(layer(x))  # (B, width)
        if target is None:
            return x
        return F.mse_loss(x, target)


def mlp_params(layers: int, width: int) -> int:
    """Parameter count of DeepMLP: L·width² scalars."""
    return layers * width * width
