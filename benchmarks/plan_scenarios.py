"""Workloads of the planner's measured scenarios that are not gobrrr built-ins, as
"file.py:function" specs (each takes batch_size, as `gobrrr plan` needs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from zoo.vision import torchvision_model  # noqa: E402


def resnet50(batch_size: int = 256, seq_len: int | None = None):
    """torchvision ResNet-50, channels_last, 224 x 224 images, cross-entropy, AdamW."""
    return torchvision_model(batch_size, None, arch="resnet50", channels_last=True)
