"""What every zoo builder shares: optional libraries, inputs, optimizers."""

from __future__ import annotations

import functools
import importlib
from dataclasses import dataclass
from types import ModuleType

import torch

from gobrrr.errors import GobrrrError

INSTALL = "pip install 'gobrrr[zoo]'"


def require(module: str) -> ModuleType:
    """Import an optional zoo library, or one line naming what to install."""
    try:
        return importlib.import_module(module)
    except ImportError as e:
        raise GobrrrError(
            f"this zoo case needs {module.split('.')[0]}, which is not installed ({e}): {INSTALL}"
        ) from None


@functools.cache
def available(module: str) -> bool:
    """Whether an optional zoo library imports here (a missing or broken install: False)."""
    try:
        importlib.import_module(module)
    except ImportError:
        return False
    return True


@dataclass(frozen=True)
class SgdMomentum:
    """The CNN recipe's optimizer factory: params -> SGD with momentum and weight decay."""

    lr: float = 0.1
    momentum: float = 0.9
    weight_decay: float = 1e-4

    def __call__(self, params) -> torch.optim.Optimizer:
        return torch.optim.SGD(
            params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay
        )


def padded_mask(batch: int, seq: int) -> torch.Tensor:
    """(batch, seq) int64 attention mask: every other row has its last 25% padded (0)."""
    mask = torch.ones(batch, seq, dtype=torch.long)
    mask[::2, seq - seq // 4 :] = 0
    return mask


def mlm_labels(ids: torch.Tensor, fraction: float = 0.15) -> torch.Tensor:
    """Masked-LM labels: the token where a random `fraction` of positions is predicted, -100
    (ignored) elsewhere."""
    return ids.masked_fill(torch.rand(ids.shape, device=ids.device) >= fraction, -100)
