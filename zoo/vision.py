"""torchvision and timm image classifiers, random weights, 224x224 ImageNet-shaped batches.

The step is written out (`Workload.step`): logits = model(images), cross-entropy against the
labels, which the model's forward does not take.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

import gobrrr
from zoo.common import require


def _classify(model, images, labels):
    return F.cross_entropy(model(images), labels)


def _images(batch: int, channels_last: bool) -> tuple[torch.Tensor, torch.Tensor]:
    images = torch.randn(batch, 3, 224, 224)
    if channels_last:
        images = images.contiguous(memory_format=torch.channels_last)
    return images, torch.randint(0, 1000, (batch,))


def _workload(
    model, name: str, batch: int, channels_last: bool, optimizer, label_smoothing: float = 0.0
) -> gobrrr.Workload:
    model = model.train()
    if channels_last:
        model = model.to(memory_format=torch.channels_last)
    if label_smoothing:
        step = lambda m, b: F.cross_entropy(m(b[0]), b[1], label_smoothing=label_smoothing)
    else:
        step = lambda m, b: _classify(m, *b)
    return gobrrr.Workload(
        model=model,
        batch=_images(batch, channels_last),
        step=step,
        optimizer=optimizer,
        tokens=batch,
        name=name,
    )


def torchvision_model(
    batch: int,
    seq: int | None,
    *,
    arch: str,
    channels_last: bool = False,
    optimizer=None,
    label_smoothing: float = 0.0,
) -> gobrrr.Workload:
    """`torchvision.models.<arch>(weights=None)` on a (batch, 3, 224, 224) batch; `optimizer`
    a params -> Optimizer callable (None: AdamW)."""
    models = require("torchvision.models")
    model = getattr(models, arch)(weights=None)
    return _workload(model, arch, batch, channels_last, optimizer, label_smoothing)


def inception_v3(batch: int, seq: int | None, *, aux_weight: float = 0.4) -> gobrrr.Workload:
    """torchvision's Inception-v3 (weights=None, aux logits on) on (batch, 3, 299, 299), the
    loss as torchvision's reference recipe trains it: CE(logits) + aux_weight * CE(aux)."""
    models = require("torchvision.models")
    model = models.inception_v3(weights=None, aux_logits=True, init_weights=False).train()
    images = torch.randn(batch, 3, 299, 299)
    labels = torch.randint(0, 1000, (batch,))

    def step(m, b):
        out = m(b[0])
        return F.cross_entropy(out.logits, b[1]) + aux_weight * F.cross_entropy(
            out.aux_logits, b[1]
        )

    return gobrrr.Workload(
        model=model, batch=(images, labels), step=step, tokens=batch, name="inception_v3"
    )


def timm_model(
    batch: int,
    seq: int | None,
    *,
    arch: str,
    channels_last: bool = False,
    optimizer=None,
    grad_ckpt: bool = False,
    **kwargs,
) -> gobrrr.Workload:
    """`timm.create_model(arch, pretrained=False, **kwargs)`; grad_ckpt: timm's own
    `model.set_grad_checkpointing()`."""
    timm = require("timm")
    model = timm.create_model(arch, pretrained=False, **kwargs)
    if grad_ckpt:
        model.set_grad_checkpointing(True)
    return _workload(model, arch, batch, channels_last, optimizer)
