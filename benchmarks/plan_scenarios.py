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


def llama_5b(batch_size: int = 8, seq_len: int = 4096):
    """Llama-3 8B's layer shape (dim 4096, GQA 32/8 heads, SwiGLU 14336, 128256-token vocab,
    untied head) at 20 layers: 5.4B parameters, whose fp32 weights, gradients and AdamW
    states (16 bytes a parameter, 86 GB) alone exceed an 80 GB GPU: nothing fits at the
    user's numerics; 8-bit states or offloaded states make it fit."""
    from gobrrr.models.registry import get_workload

    return get_workload("llama3-8b", batch_size, seq_len, n_layer=20)
