"""A small ResNet-style CNN (He et al. 2016, the ResNet-18 layout) for 224×224 RGB images."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class ConvNetConfig:
    """Shape of the ConvNet.

    Fields:
        width: channels of the first stage; stages have width × (1, 2, 4, 8).
        num_classes: outputs of the linear head.
        image_size: input height and width in pixels.
        blocks_per_stage: basic blocks in each of the 4 stages.
    """

    width: int = 64
    num_classes: int = 1000
    image_size: int = 224
    blocks_per_stage: int = 2


class BasicBlock(nn.Module):
    """conv3x3-BN-ReLU-conv3x3-BN plus a shortcut (1x1 conv + BN when the shape changes)."""

    def __init__(self, c_in: int, c_out: int, stride: int):
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(c_out)
        self.shortcut = nn.Sequential()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(
                nn.Conv2d(c_in, c_out, 1, stride=stride, bias=False), nn.BatchNorm2d(c_out)
            )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.relu(self.bn1(self.conv1(x)))  # (B, C, H, W)
        out = self.bn2(self.conv2(out))
        return F.relu(out + self.shortcut(x))


class ConvNet(nn.Module):
    """Stem, 4 stages of basic blocks, global average pool, linear head.

    forward(images, labels) returns the mean cross-entropy loss.
    """

    def __init__(self, cfg: ConvNetConfig):
        super().__init__()
        self.config = cfg
        w = cfg.width
        self.stem = nn.Sequential(
            nn.Conv2d(3, w, 7, stride=2, padding=3, bias=False),
            nn.BatchNorm2d(w),
            nn.ReLU(),
            nn.MaxPool2d(3, stride=2, padding=1),
        )
        stages, c_in = [], w
        for i in range(4):
            c_out = w * 2**i
            for j in range(cfg.blocks_per_stage):
                stages.append(BasicBlock(c_in, c_out, stride=2 if i > 0 and j == 0 else 1))
                c_in = c_out
        self.stages = nn.Sequential(*stages)
        self.head = nn.Linear(c_in, cfg.num_classes)

    def forward(self, x: torch.Tensor, labels: torch.Tensor | None = None) -> torch.Tensor:
        x = self.stages(self.stem(x))  # (B, 8w, H/32, W/32)
        logits = self.head(x.mean(dim=(2, 3)))  # (B, classes)
        if labels is None:
            return logits
        return F.cross_entropy(logits, labels)


def convnet_params(width: int, num_classes: int, blocks_per_stage: int = 2) -> int:
    """Parameter count of ConvNet (scalars): convs, BatchNorm weight+bias, shortcuts, head."""
    w = width
    total = 3 * w * 49 + 2 * w  # stem conv 7x7 + BN
    c_in = w
    for i in range(4):
        c_out = w * 2**i
        for _ in range(blocks_per_stage):
            total += 9 * c_in * c_out + 9 * c_out * c_out + 4 * c_out
            if c_in != c_out:
                total += c_in * c_out + 2 * c_out
            c_in = c_out
    return total + c_in * num_classes + num_classes
