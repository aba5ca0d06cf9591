"""A MobileNetV2-style CNN (Sandler et al. 2018): inverted residual blocks, each a 1x1
expansion, a 3x3 depthwise convolution and a 1x1 projection, with batch norm and ReLU6.

    gobrrr estimate examples/mobilenet.py:workload --batch 64 --precision bf16-mixed
    gobrrr profile examples/mobilenet.py:workload --batch 64 --compare

Depthwise convolutions (one input channel per group) are not GEMMs: cuDNN runs them on CUDA
cores, bound by memory, and a calibration measures them apart from dense convolutions.
"""

import torch
from torch import nn

import gobrrr


def conv_bn(
    c_in: int, c_out: int, k: int, stride: int = 1, groups: int = 1, act: bool = True
) -> nn.Sequential:
    layers = [
        nn.Conv2d(c_in, c_out, k, stride, k // 2, groups=groups, bias=False),
        nn.BatchNorm2d(c_out),
    ]
    return nn.Sequential(*layers, nn.ReLU6()) if act else nn.Sequential(*layers)


class InvertedResidual(nn.Module):
    def __init__(self, c_in: int, c_out: int, stride: int, expand: int):
        super().__init__()
        hidden = c_in * expand
        self.block = nn.Sequential(
            conv_bn(c_in, hidden, 1),
            conv_bn(hidden, hidden, 3, stride, groups=hidden),  # depthwise
            conv_bn(hidden, c_out, 1, act=False),
        )
        self.residual = stride == 1 and c_in == c_out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.block(x)
        return x + y if self.residual else y


class MobileNetV2(nn.Module):
    # (expansion, output channels, blocks, first stride), as in the paper's Table 2
    STAGES = (
        (1, 16, 1, 1),
        (6, 24, 2, 2),
        (6, 32, 3, 2),
        (6, 64, 4, 2),
        (6, 96, 3, 1),
        (6, 160, 3, 2),
        (6, 320, 1, 1),
    )

    def __init__(self, num_classes: int = 1000):
        super().__init__()
        layers, c = [conv_bn(3, 32, 3, 2)], 32
        for t, c_out, n, s in self.STAGES:
            for i in range(n):
                layers.append(InvertedResidual(c, c_out, s if i == 0 else 1, t))
                c = c_out
        layers.append(conv_bn(c, 1280, 1))
        self.features = nn.Sequential(*layers)
        self.head = nn.Linear(1280, num_classes)

    def forward(self, images: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
        x = self.features(images).mean(dim=(2, 3))  # (B, 1280)
        return nn.functional.cross_entropy(self.head(x), labels)


def workload(batch_size: int = 64) -> gobrrr.Workload:
    return gobrrr.Workload(
        model=MobileNetV2(),
        batch=(torch.randn(batch_size, 3, 224, 224), torch.randint(0, 1000, (batch_size,))),
        loss=None,
        optimizer=lambda params: torch.optim.SGD(params, lr=0.05, momentum=0.9),
        name="mobilenet-v2",
    )
