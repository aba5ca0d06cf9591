"""What a step trains and what it leaves frozen, read off its step graph.

A parameter trains when the optimizer steps it: its storage is read or written by an op of the
optimizer phase. The others are frozen (requires_grad False: LoRA's base model, a frozen
backbone or embedding): they hold their bytes and nothing else, while each trained one also
has a gradient and the optimizer's states. The split counts elements and bytes by dtype, as the
graph holds them (tied parameters once; one rank's shards after a sharding pass); gradients
are those the optimizer steps, states every optimizer-state storage (host-side step counters
hold no device bytes).

A 4-bit weight (QLoRA's base model through bitsandbytes) is counted in its format ("nf4" or
"fp4", as the ops that dequantize it say): two elements a byte of packed codes, its bytes
those codes and its quantization state (block absmax, their scales and code books, labelled
"<weight>.quant_state.<field>" by the capture).

    split = trainable(graph)     # or Estimate.trainable
    split.trained_elements, split.frozen_bytes, split.gradients_bytes, split.to_dict()
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

from gobrrr.graph.ir import StepGraph, itemsize

#: the dtypes as the output names them
SHORT = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16", "float64": "fp64"}
#: bitsandbytes' ops that read a packed 4-bit weight: (its argument position and name, the
#: position and name of its format)
FOUR_BIT_OPS = {
    "bitsandbytes.dequantize_4bit": ((0, "A"), (3, "quant_type")),
    "bitsandbytes.gemm_4bit": ((1, "B"), (5, "quant_type")),
}
STATE = ".quant_state."  # in the label of a 4-bit weight's quantization state


@dataclass(frozen=True)
class Params:
    """The parameters of one dtype on one side of the split: tensors, elements, bytes."""

    dtype: str
    tensors: int
    elements: int
    bytes: int


@dataclass(frozen=True)
class Trainable:
    """The step's parameters split into those the optimizer steps and those frozen, by dtype
    (largest first), with the bytes of what only the trained ones have."""

    trained: tuple[Params, ...]
    frozen: tuple[Params, ...]
    gradients_bytes: int
    """The gradients the optimizer steps."""
    optimizer_states_bytes: int
    optimizer: str | None
    """The optimizer's class ("AdamW"), None where the graph does not record it."""
    what: str
    """What trains, in words: "LoRA adapters", "all parameters", or the modules holding them."""

    @property
    def trained_elements(self) -> int:
        return sum(p.elements for p in self.trained)

    @property
    def trained_bytes(self) -> int:
        return sum(p.bytes for p in self.trained)

    @property
    def frozen_elements(self) -> int:
        return sum(p.elements for p in self.frozen)

    @property
    def frozen_bytes(self) -> int:
        return sum(p.bytes for p in self.frozen)

    @property
    def trained_share(self) -> float:
        """Trained elements over all parameter elements (0 without parameters)."""
        total = self.trained_elements + self.frozen_elements
        return self.trained_elements / total if total else 0.0

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready: each side's elements, bytes, tensors and the same by dtype."""

        def side(params: tuple[Params, ...]) -> dict[str, Any]:
            return {
                "elements": sum(p.elements for p in params),
                "bytes": sum(p.bytes for p in params),
                "tensors": sum(p.tensors for p in params),
                "by_dtype": {
                    p.dtype: {"elements": p.elements, "bytes": p.bytes, "tensors": p.tensors}
                    for p in params
                },
            }

        return {
            "trained": {**side(self.trained), "share": self.trained_share, "what": self.what},
            "frozen": side(self.frozen),
            "gradients_bytes": self.gradients_bytes,
            "optimizer_states_bytes": self.optimizer_states_bytes,
            "optimizer": self.optimizer,
        }


def trainable(graph: StepGraph) -> Trainable:
    """`graph`'s parameters split into trained (stepped by the optimizer) and frozen."""
    params = {s.id: s for s in graph.storages if s.kind == "parameter"}
    dtypes: dict[int, str] = {}
    stepped: set[int] = set()
    grads = {s.id for s in graph.storages if s.kind == "gradient"}
    stepped_grads: set[int] = set()
    for n in graph.nodes:
        for t in (*n.inputs, *n.outputs):
            if t.storage in params:
                dtypes.setdefault(t.storage, t.dtype)
                if n.phase == "optimizer":
                    stepped.add(t.storage)
            elif n.phase == "optimizer" and t.storage in grads:
                stepped_grads.add(t.storage)
    unread = str(graph.meta.precision.param_dtype).removeprefix("torch.")
    packed = four_bit(graph)
    formats = {params[sid].label: fmt for sid, fmt in packed.items() if sid in params}
    sides: dict[bool, dict[str, list[tuple[int, int]]]] = {
        True: defaultdict(list),
        False: defaultdict(list),
    }
    for sid, s in params.items():
        weight, is_state, _ = s.label.partition(STATE)
        if sid in packed or is_state:  # 4-bit codes: 2 a byte; their state: 0 elements
            fmt = packed.get(sid) or formats.get(weight, "4-bit")
            sides[sid in stepped][fmt].append((s.nbytes, 0 if is_state else 2 * s.nbytes))
            continue
        dtype = dtypes.get(sid, unread)
        sides[sid in stepped][dtype].append((s.nbytes, s.nbytes // itemsize(dtype)))
    opt = graph.meta.optimizer
    return Trainable(
        trained=_by_dtype(sides[True]),
        frozen=_by_dtype(sides[False]),
        gradients_bytes=sum(graph.storage(i).nbytes for i in stepped_grads),
        optimizer_states_bytes=sum(s.nbytes for s in graph.storages if s.kind == "optimizer_state"),
        optimizer=opt.key.split(":")[0] if opt else None,
        what=_what([params[i].label for i in sorted(stepped)], len(stepped) == len(params)),
    )


def _by_dtype(sizes: dict[str, list[tuple[int, int]]]) -> tuple[Params, ...]:
    """Params per dtype from (bytes, elements) per storage; a storage of no elements (a 4-bit
    weight's quantization state) adds bytes but is no tensor of its own."""
    out = [
        Params(d, sum(1 for _, e in b if e), sum(e for _, e in b), sum(n for n, _ in b))
        for d, b in sizes.items()
    ]
    return tuple(sorted(out, key=lambda p: -p.bytes))


def four_bit(graph: StepGraph) -> dict[int, str]:
    """Storage id -> format ("nf4", "fp4") of each packed 4-bit weight the step reads, from
    the bitsandbytes ops that read it."""
    out: dict[int, str] = {}
    for n in graph.nodes:
        where = FOUR_BIT_OPS.get(".".join(n.op.split(".")[:2]))
        if where is not None:
            (i, name), (j, fmt) = where
            t = n.tensor(n.arg(i, name))
            if t is not None:
                out[t.storage] = str(n.arg(j, fmt))
    return out


def _what(labels: list[str], everything: bool, shown: int = 3) -> str:
    """What the trained parameters are: all of them, LoRA adapters (peft names their
    matrices lora_A, lora_B), or the modules that hold them (up to `shown`)."""
    if everything:
        return "all parameters"
    if not labels:
        return "nothing"
    if all(".lora_" in f".{label}" for label in labels):
        return "LoRA adapters"
    modules = list(dict.fromkeys(label.rpartition(".")[0] or "<top>" for label in labels))
    more = f" and {len(modules) - shown} more modules" if len(modules) > shown else ""
    return ", ".join(modules[:shown]) + more
