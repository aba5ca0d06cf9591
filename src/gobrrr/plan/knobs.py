"""What a plan changes in a training step: the knobs, one frozen dataclass.

The same `Knobs` drive the graph passes (to predict the step) and `gobrrr.apply` (to run it),
so what is predicted and what runs are one decision.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

from gobrrr.errors import GobrrrError

#: Activation-checkpointing policies for one block.
#: "full": save the block's inputs only, recompute its whole forward in backward.
#: "selective": save the outputs of matmuls, convolutions and attention; recompute the
#:     pointwise and normalisation ops between them.
#: (A block with no entry is not checkpointed: everything backward needs stays saved.)
CHECKPOINT_POLICIES = ("full", "selective")

#: Optimizer-state storage. "as-is": what the user's optimizer keeps (AdamW in the parameters'
#: dtype). "bf16": moments in bfloat16, the update computed in fp32. "8bit": block-wise
#: quantised moments (torchao's AdamW8bit).
OPTIMIZER_STATES = ("as-is", "bf16", "8bit")

#: Weight storage. "as-is": the user's numerics. "bf16": the model's parameters (and so its
#: gradients and torch's optimizer states) in bfloat16, the step run in pure bf16 without
#: autocast (gobrrr precision "bf16"); a change of numerics, planned only when allowed.
WEIGHTS = ("as-is", "bf16")


@dataclass(frozen=True)
class Knobs:
    """One training configuration of a workload, at the user's global batch.

    Fields:
        micro_batch: samples per forward/backward.
        accumulation: micro-batches per optimizer step (micro_batch * accumulation is the
            user's global batch).
        checkpoint: (block name, policy) for each checkpointed block, block names as
            `model.named_modules()` gives them (e.g. "transformer.h.3"); blocks not listed
            are not checkpointed.
        optimizer_states: one of OPTIMIZER_STATES.
        offload: optimizer states live in host memory and the update runs on the CPU.
        fused_loss: the model's output projection and cross-entropy run as gobrrr's fused
            linear + cross-entropy kernel (no logits tensor).
        compile: the model runs under torch.compile (the optimizer stays eager).
        weights: one of WEIGHTS.
    """

    micro_batch: int
    accumulation: int = 1
    checkpoint: tuple[tuple[str, str], ...] = ()
    optimizer_states: str = "as-is"
    offload: bool = False
    fused_loss: bool = False
    compile: bool = False
    weights: str = "as-is"

    def __post_init__(self) -> None:
        if self.micro_batch < 1 or self.accumulation < 1:
            raise GobrrrError(
                f"micro_batch and accumulation must be >= 1, got "
                f"{self.micro_batch} and {self.accumulation}"
            )
        for name, policy in self.checkpoint:
            if policy not in CHECKPOINT_POLICIES:
                raise GobrrrError(
                    f"unknown checkpoint policy {policy!r} for block {name!r}: "
                    f"choose {', '.join(CHECKPOINT_POLICIES)}"
                )
        if self.optimizer_states not in OPTIMIZER_STATES:
            raise GobrrrError(
                f"unknown optimizer_states {self.optimizer_states!r}: choose "
                f"{', '.join(OPTIMIZER_STATES)}"
            )
        if self.weights not in WEIGHTS:
            raise GobrrrError(f"unknown weights {self.weights!r}: choose {', '.join(WEIGHTS)}")

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation

    def precision(self, user: str) -> str:
        """The precision the step runs in: the user's, or pure bf16 with bf16 weights."""
        return "bf16" if self.weights == "bf16" else user

    def policy(self, block: str) -> str:
        """The checkpoint policy of `block`: "full", "selective" or "none"."""
        return dict(self.checkpoint).get(block, "none")

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["checkpoint"] = [list(c) for c in self.checkpoint]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Knobs:
        d = dict(d)
        d["checkpoint"] = tuple((str(n), str(p)) for n, p in d.get("checkpoint", ()))
        return Knobs(**d)


def every_kth(blocks: list[str], k: int, policy: str = "full") -> tuple[tuple[str, str], ...]:
    """Checkpoint every k-th of `blocks` (the first, the (k+1)-th, ...) with `policy`."""
    if k < 1:
        raise GobrrrError(f"checkpoint every k-th block needs k >= 1, got {k}")
    return tuple((b, policy) for i, b in enumerate(blocks) if i % k == 0)


__all__ = ["CHECKPOINT_POLICIES", "OPTIMIZER_STATES", "WEIGHTS", "Knobs", "every_kth"]
