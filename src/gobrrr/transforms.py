"""Transforms of a user's model that the estimate, the profiler and the planner share."""

from __future__ import annotations

import functools

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint


def repeated_blocks(model: nn.Module) -> list[nn.Module]:
    """The blocks a transformer (or ResNet) repeats: the children of the outermost
    nn.ModuleList/nn.Sequential whose children are two or more modules of one class."""
    found: list[nn.Module] = []
    claimed: set[int] = set()
    for _name, mod in model.named_modules():
        if id(mod) in claimed or not isinstance(mod, (nn.ModuleList, nn.Sequential)):
            continue
        kids = list(mod.children())
        if len(kids) >= 2 and len({type(k) for k in kids}) == 1 and _has_params(kids[0]):
            found.extend(kids)
            claimed.update(id(m) for m in mod.modules())
    return found


def _has_params(m: nn.Module) -> bool:
    return any(True for _ in m.parameters())


def apply_checkpointing(model: nn.Module) -> list[nn.Module]:
    """Wrap each repeated block's forward in non-reentrant activation checkpointing: only the
    block's inputs are saved, and its forward runs again during backward. Returns the blocks."""
    blocks = repeated_blocks(model)
    for block in blocks:
        if getattr(block, "_gobrrr_checkpointed", False):
            continue
        inner = block.forward

        @functools.wraps(inner)
        def forward(*args, _inner=inner, **kwargs):
            if not torch.is_grad_enabled():
                return _inner(*args, **kwargs)
            return checkpoint(_inner, *args, use_reentrant=False, **kwargs)

        block.forward = forward
        block._gobrrr_checkpointed = True
    return blocks
