"""The step graph: one training step as the ordered list of ATen ops that ran.

Every other part of gobrrr reads this. A node is one ATen op with its phase, the module that
ran it, its tensor inputs and outputs (shape, stride, dtype, storage identity) and its
non-tensor arguments. Storages carry their size, what they are (parameter, gradient, ...)
and their exact lifetime in op indices, as observed while the step ran on fake tensors.

Serialized as versioned JSON (never pickle).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from gobrrr.errors import GobrrrError
from gobrrr.graph.meta import StepMeta

SCHEMA_VERSION = 1

PHASES = ("forward", "backward", "recompute", "optimizer")
# What a storage holds; "activation" = created in forward and still alive when backward starts
# (saved for backward), "temporary" = everything else created during the step.
KINDS = (
    "parameter",
    "buffer",
    "gradient",
    "optimizer_state",
    "input",
    "activation",
    "temporary",
)

_ITEMSIZE = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint8": 1,
    "bool": 1,
    "complex64": 8,
    "complex128": 16,
    "uint16": 2,
    "uint32": 4,
    "uint64": 8,
}


def itemsize(dtype: str) -> int:
    """Bytes per element of a dtype named as in `str(torch.float32)` without the prefix."""
    return _ITEMSIZE.get(dtype, 4)


R = TypeVar("R")

_OP_NAMES: dict[str, str] = {}  # OpNode.op -> OpNode.name


def evolve(record: R, **changes: Any) -> R:
    """`record` with `changes` to its fields: `dataclasses.replace` for the step graph's frozen
    records (TensorInfo, StorageInfo, OpNode; `gobrrr.cost.roofline.OpTime`), which have no
    `__post_init__` to run, without its walk over the fields and call of `__init__` (several
    times the cost; the passes and the power limit copy every op of a step, and the planner
    does that for every candidate). `changes` must name fields of the record."""
    new = object.__new__(type(record))
    new.__dict__.update(record.__dict__)
    new.__dict__.update(changes)
    return new


@dataclass(frozen=True)
class TensorInfo:
    """One tensor argument or result of an op. `storage` is an id into StepGraph.storages."""

    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: str
    storage: int
    offset: int = 0

    @property
    def numel(self) -> int:
        n = 1
        for s in self.shape:
            n *= s
        return n

    @property
    def itemsize(self) -> int:
        return itemsize(self.dtype)

    @property
    def nbytes(self) -> int:
        """Bytes of the elements this view covers (what a kernel reading it once moves)."""
        return self.numel * self.itemsize

    def is_dense(self) -> bool:
        """Non-overlapping and dense (torch's is_non_overlapping_and_dense): the strides,
        sorted, step through every element exactly once (in some order of the dims)."""
        expected = 1
        for st, sz in sorted(
            (st, sz) for sz, st in zip(self.shape, self.stride, strict=False) if sz > 1
        ):
            if st != expected:
                return False
            expected *= sz
        return True

    def is_contiguous(self) -> bool:
        expected = 1
        for size, stride in reversed(list(zip(self.shape, self.stride, strict=False))):
            if size != 1 and stride != expected:
                return False
            expected *= size
        return True


@dataclass(frozen=True)
class StorageInfo:
    """One allocation. `created`/`freed` are op indices: -1 = before the step, None = it
    survives the step."""

    id: int
    nbytes: int
    kind: str
    created: int
    freed: int | None
    label: str = ""  # e.g. the parameter name; empty for anonymous activations
    module: str = ""  # module of the op that created it
    # what the previous step left alive (a kept output, last step's gradients: `passes.loop`),
    # allocated by op 0 from the second step on: the process's first step has none
    carried: bool = False


@dataclass(frozen=True)
class OpNode:
    """One ATen op. `args`/`kwargs` are the op's non-tensor arguments, tensors replaced by
    {"t": i} (index into `inputs`), lists of tensors by lists of such references."""

    index: int
    op: str  # "aten.mm.default"
    phase: str
    module: str  # fully qualified name, "" for the top level
    inputs: tuple[TensorInfo, ...]
    outputs: tuple[TensorInfo, ...]
    args: tuple[Any, ...] = ()
    kwargs: dict[str, Any] = field(default_factory=dict)
    allocs: tuple[int, ...] = ()  # storages this op created
    frees: tuple[int, ...] = ()  # storages that died right after this op
    stream: str = "compute"  # the stream it runs on (gobrrr.schedule.streams)
    # tensors its autograd node saved for backward (a forward op of a trace that read
    # autograd's graph; None where unknown): a checkpoint's saved-tensor hook runs once each
    saved: int | None = None

    @property
    def name(self) -> str:
        """ "aten.mm.default" -> "mm" (once per op name: the replay's scratch tables ask
        for every op's, candidate after candidate)."""
        name = _OP_NAMES.get(self.op)
        if name is None:
            parts = self.op.split(".")
            name = _OP_NAMES[self.op] = parts[1] if len(parts) >= 2 else self.op
        return name

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        """Positional argument i, or keyword `name`, of the op's schema."""
        if name in self.kwargs:
            return self.kwargs[name]
        return self.args[i] if i < len(self.args) else default

    def tensor(self, ref: Any) -> TensorInfo | None:
        """Resolve a {"t": i} reference found in args."""
        if isinstance(ref, dict) and "t" in ref:
            return self.inputs[ref["t"]]
        return None


@dataclass(frozen=True)
class StepGraph:
    """One full training step. `meta` says what was traced: model, batch, seq, precision,
    tokens per step, parameter counts, the device the ops were traced on, and what the
    passes did (`gobrrr.graph.meta.StepMeta`)."""

    nodes: tuple[OpNode, ...]
    storages: tuple[StorageInfo, ...]
    meta: StepMeta
    version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if not isinstance(self.meta, StepMeta):  # a dict would be read by key, untyped
            raise TypeError(
                f"StepGraph.meta must be a StepMeta, got {type(self.meta).__name__}"
                ": build it with StepMeta(...) or StepMeta.from_dict(d)"
            )

    def storage(self, sid: int) -> StorageInfo:
        return self.storages[sid]

    def phase_nodes(self, phase: str) -> list[OpNode]:
        return [n for n in self.nodes if n.phase == phase]

    def allocated_by(self) -> dict[int, int]:
        """Storage id -> index of the op that allocates it (its `allocs`)."""
        return {sid: n.index for n in self.nodes for sid in n.allocs}

    @property
    def repeat(self) -> tuple[int, int, int] | None:
        """(start, end, times): nodes[start:end] stand for `times` identical runs of
        themselves (the later micro-batches of an accumulated step; `passes.accumulate`),
        or None. Memory needs them once; time and FLOPs count them `times` times."""
        r = self.meta.repeat
        return (r.start, r.end, r.times) if r else None

    def weights(self) -> list[int]:
        """How many times each node runs in the step (see `repeat`)."""
        w = [1] * len(self.nodes)
        if (r := self.repeat) is not None:
            w[r[0] : r[1]] = [r[2]] * (r[1] - r[0])
        return w

    # -- JSON ------------------------------------------------------------------------------
    def to_json(self) -> str:
        data = {
            "nodes": [asdict(n) for n in self.nodes],
            "storages": [asdict(s) for s in self.storages],
            "meta": self.meta.to_dict(),
            "version": self.version,
        }
        return json.dumps(data, separators=(",", ":"))

    def save(self, path: str | Path) -> None:
        """Write atomically: a half-written graph never exists on disk."""
        path = Path(path)
        tmp = path.with_name(path.name + ".tmp")
        try:
            tmp.write_text(self.to_json())
            tmp.replace(path)
        except OSError as e:
            tmp.unlink(missing_ok=True)
            raise GobrrrError(f"cannot write step graph {path}: {e.strerror}") from None

    @staticmethod
    def from_json(text: str) -> StepGraph:
        data = json.loads(text)
        version = data.get("version")
        if version != SCHEMA_VERSION:
            raise GobrrrError(
                f"step graph has schema version {version!r}, this gobrrr reads {SCHEMA_VERSION}: "
                "re-capture it with this version"
            )

        def tinfo(d: dict) -> TensorInfo:
            return TensorInfo(
                tuple(d["shape"]), tuple(d["stride"]), d["dtype"], d["storage"], d.get("offset", 0)
            )

        nodes = tuple(
            OpNode(
                index=n["index"],
                op=n["op"],
                phase=n["phase"],
                module=n["module"],
                inputs=tuple(tinfo(t) for t in n["inputs"]),
                outputs=tuple(tinfo(t) for t in n["outputs"]),
                args=tuple(n["args"]),
                kwargs=n["kwargs"],
                allocs=tuple(n["allocs"]),
                frees=tuple(n["frees"]),
                stream=n.get("stream", "compute"),
                saved=n.get("saved"),
            )
            for n in data["nodes"]
        )
        storages = tuple(StorageInfo(**s) for s in data["storages"])
        return StepGraph(
            nodes=nodes, storages=storages, meta=StepMeta.from_dict(data["meta"]), version=version
        )

    @staticmethod
    def load(path: str | Path) -> StepGraph:
        try:
            text = Path(path).read_text()
        except OSError as e:
            raise GobrrrError(f"cannot read step graph {path}: {e.strerror}") from None
        return StepGraph.from_json(text)
