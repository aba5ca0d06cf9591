"""What a plan changes in a training step: the knobs, one frozen dataclass.

The same `Knobs` drive the graph passes (to predict the step) and `gobrrr.apply` (to run it),
so what is predicted and what runs are one decision.
"""

from __future__ import annotations

import numbers
from collections.abc import Mapping
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

#: Data parallelism. "none": one GPU (every single-GPU plan). "ddp": DistributedDataParallel,
#: every rank holding the whole model, gradients all-reduced in buckets. "fsdp": FSDP2
#: (`fully_shard` on each repeated block, then the root) with torchtitan's
#: MixedPrecisionPolicy(param bf16, reduce fp32); over several hosts the plan costs it as
#: `passes.fsdp` does with hosts > 1.
PARALLEL = ("none", "ddp", "fsdp")

#: torch.compile. "none": eager. "model": torch.compile(model), the whole forward one graph.
#: "blocks": regional compilation, each repeated block's forward compiled on its own (one
#: compilation shared by all of them: seconds, not minutes), the rest of the model eager; a
#: checkpointed block is checkpointed around its compiled forward. The optimizer stays eager.
#: (The JSON form of older plans says True or False: read as "model" and "none".)
COMPILE = ("none", "model", "blocks")


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
        compile: one of COMPILE (True and False, as older plans wrote it, are read as
            "model" and "none").
        weights: one of WEIGHTS.
        parallel: one of PARALLEL. Not "none": micro_batch x accumulation is one rank's
            share of the job's batch (the job's global batch / its GPUs), and gradient sync
            is skipped on every micro-batch but the last (unless sync_each).
        reshard: FSDP2's reshard_after_forward (free each unit's gathered parameters after
            its forward, gather them again for backward); read with parallel "fsdp" only.
        sync_each: FSDP2's gradients reduce-scattered on every micro-batch and accumulated
            as shards (torchtitan's accumulation), instead of held unsharded in fp32 to the
            last; with parallel "fsdp" only.
        fp8: FP8 training: each linear layer but the output head (and those whose dims
            are not multiples of 16) runs its matmuls in float8, torchao's float8 recipe
            with tensorwise scales (gobrrr.training.fp8); the step's precision stays as it
            is around them (autocast, or bf16 weights). A change of numerics, planned only
            when allowed, on GPUs with FP8 tensor cores.
        cuda_graph: the whole optimizer step (every micro-batch's forward and backward,
            then the optimizer, as gobrrr.training.step runs it) captured once as one CUDA
            graph and replayed each step (gobrrr.training.cudagraph): the host issues one
            graph launch instead of every op. Same numerics; planned only where allowed and
            predicted faster, for steps that can be captured (plan.applicable).
    """

    micro_batch: int
    accumulation: int = 1
    checkpoint: tuple[tuple[str, str], ...] = ()
    optimizer_states: str = "as-is"
    offload: bool = False
    fused_loss: bool = False
    compile: str = "none"
    weights: str = "as-is"
    parallel: str = "none"
    reshard: bool = True
    sync_each: bool = False
    fp8: bool = False
    cuda_graph: bool = False

    def __post_init__(self) -> None:
        for name, unit in (("micro_batch", "samples"), ("accumulation", "micro-batches")):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Integral) or v < 1:
                raise GobrrrError(f"Knobs({name}={v!r}): give a whole number of {unit} >= 1")
            object.__setattr__(self, name, int(v))  # frozen: a numpy integer made an int
        if isinstance(self.compile, bool):  # the JSON form of plans from before "blocks"
            object.__setattr__(self, "compile", "model" if self.compile else "none")
        for name in ("offload", "fused_loss", "reshard", "sync_each", "fp8", "cuda_graph"):
            v = getattr(self, name)
            if not isinstance(v, bool):
                raise GobrrrError(f"Knobs({name}={v!r}) is not a bool: give True or False")
        # frozen: the checkpoint pairs normalised in place, as a tuple of (block, policy)
        object.__setattr__(self, "checkpoint", _checkpoint_pairs(self.checkpoint))
        self._check_choices()

    def _check_choices(self) -> None:
        for name, choices in (
            ("optimizer_states", OPTIMIZER_STATES),
            ("weights", WEIGHTS),
            ("parallel", PARALLEL),
            ("compile", COMPILE),
        ):
            v = getattr(self, name)
            if not isinstance(v, str) or v not in choices:
                raise GobrrrError(f"unknown {name} {v!r}: choose {', '.join(choices)}")
        if self.sync_each and self.parallel != "fsdp":
            raise GobrrrError(
                f"sync_each is FSDP2's way to accumulate, not parallel {self.parallel!r}: "
                "set parallel='fsdp' or sync_each=False"
            )

    @property
    def global_batch(self) -> int:
        return self.micro_batch * self.accumulation

    def precision(self, user: str) -> str:
        """The precision the step runs in: the user's, or pure bf16 with bf16 weights."""
        return "bf16" if self.weights == "bf16" else user

    def policy(self, block: str) -> str:
        """The checkpoint policy of `block`: "full", "selective" or "none"."""
        return dict(self.checkpoint).get(block, "none")

    @property
    def compiled(self) -> bool:
        """Whether any of the model runs under torch.compile."""
        return self.compile != "none"

    @property
    def distributed(self) -> bool:
        """Whether the step is data-parallel over several GPUs."""
        return self.parallel != "none"

    def to_dict(self) -> dict[str, Any]:
        """The JSON form; a one-GPU configuration's without the data-parallel fields, as it
        was before they existed."""
        d = asdict(self)
        d["checkpoint"] = [list(c) for c in self.checkpoint]
        if not self.distributed:
            del d["parallel"], d["reshard"]
        if not self.sync_each:
            del d["sync_each"]
        if not self.fp8:  # as plans wrote it before FP8 was a knob
            del d["fp8"]
        if not self.cuda_graph:  # as plans wrote it before CUDA graphs were a knob
            del d["cuda_graph"]
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> Knobs:
        d = dict(d)
        d["checkpoint"] = tuple((str(n), str(p)) for n, p in d.get("checkpoint", ()))
        return Knobs(**d)


def _checkpoint_pairs(checkpoint: Any) -> tuple[tuple[str, str], ...]:
    """`checkpoint` as (block, policy) pairs: a tuple or list of pairs, or a {block: policy}
    mapping; anything else, an unknown policy or a block named twice is a GobrrrError."""
    form = (
        "give (block, policy) pairs, e.g. checkpoint=every_kth(blocks, 1) or "
        "(('transformer.h.0', 'full'),), or () for none"
    )
    if isinstance(checkpoint, Mapping):
        checkpoint = tuple(checkpoint.items())
    if isinstance(checkpoint, (str, bytes)) or not isinstance(checkpoint, (tuple, list)):
        raise GobrrrError(f"Knobs(checkpoint={checkpoint!r}): {form}")
    pairs = []
    for pair in checkpoint:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise GobrrrError(f"Knobs(checkpoint=...) holds {pair!r}: {form}")
        name, policy = pair
        if not isinstance(name, str) or not name:
            raise GobrrrError(f"Knobs(checkpoint=...) names block {name!r}: {form}")
        if policy not in CHECKPOINT_POLICIES:
            raise GobrrrError(
                f"unknown checkpoint policy {policy!r} for block {name!r}: "
                f"choose {', '.join(CHECKPOINT_POLICIES)}"
            )
        pairs.append((name, policy))
    if len({n for n, _ in pairs}) < len(pairs):
        twice = next(n for i, (n, _) in enumerate(pairs) if n in dict(pairs[:i]))
        raise GobrrrError(
            f"Knobs(checkpoint=...) names block {twice!r} twice: give each block one policy"
        )
    return tuple(pairs)


def every_kth(blocks: list[str], k: int, policy: str = "full") -> tuple[tuple[str, str], ...]:
    """Checkpoint every k-th of `blocks` (the first, the (k+1)-th, ...) with `policy`."""
    if k < 1:
        raise GobrrrError(f"checkpoint every k-th block needs k >= 1, got {k}")
    return tuple((b, policy) for i, b in enumerate(blocks) if i % k == 0)


__all__ = [
    "CHECKPOINT_POLICIES",
    "COMPILE",
    "OPTIMIZER_STATES",
    "PARALLEL",
    "WEIGHTS",
    "Knobs",
    "every_kth",
]
