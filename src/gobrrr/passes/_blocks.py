"""What the checkpoint pass needs to know about each checkpointed block, read off a graph
traced without checkpointing: its forward ops, what its autograd nodes saved (meta.autograd),
where torch's recomputation stops, where backward first unpacks it, and when each saved
tensor would have died had it not been saved (`python_death`)."""

from __future__ import annotations

from dataclasses import dataclass, field

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, TensorInfo
from gobrrr.graph.meta import SavedRow
from gobrrr.training.checkpointing import SELECTIVE_SAVE

DETACH = "aten.detach.default"


@dataclass(frozen=True)
class Save:
    """One tensor an autograd node saved: forward op `op`, after it ran (an output) or before,
    the view saved, whether it requires grad (a detach is dispatched when it is packed during
    recomputation and when it is unpacked)."""

    op: int
    after: bool
    requires_grad: bool
    view: TensorInfo

    @staticmethod
    def from_row(row: SavedRow) -> Save:
        op, sid, after, rg, shape, stride, dtype, offset = row
        return Save(
            op, bool(after), bool(rg), TensorInfo(tuple(shape), tuple(stride), dtype, sid, offset)
        )


@dataclass
class Block:
    """One checkpointed block. Indices are op indices of the original graph."""

    name: str
    policy: str
    lo: int  # its first forward op
    hi: int  # its last forward op
    saves: list[Save]
    stop: tuple[int, bool] = (-1, False)  # the last pack: (op, after it ran)
    created: set[int] = field(default_factory=set)  # storages its forward ops create
    held: set[int] = field(default_factory=set)  # ... that its nodes save
    kept: dict[int, int] = field(default_factory=dict)  # selective: kept output -> its op
    place: dict[int, int] = field(default_factory=dict)  # node (forward op) -> unpacked at
    node_end: dict[int, int] = field(default_factory=dict)  # node -> its last backward op
    trigger: int = -1  # the backward op before which it is recomputed
    end: int = -1  # the backward op after which its last node is released
    copies: dict[int, int] = field(default_factory=dict)  # storage -> its recomputed copy
    last: int = -1  # new graph: the last op of its recomputation

    def inside(self, module: str) -> bool:
        return module == self.name or module.startswith(self.name + ".")

    def recomputed(self, i: int) -> bool:
        """Op i runs again during the recomputation (up to the last pack)."""
        op, after = self.stop
        return self.lo <= i < op or (i == op and after)

    def cached(self, i: int, node: OpNode) -> bool:
        """Selective: op i's outputs come from the forward, not from running it again."""
        return self.policy == "selective" and node.op in SELECTIVE_SAVE and self.lo <= i <= self.hi


class Facts:
    """Per-storage facts of the original graph the pass reads."""

    def __init__(self, graph: StepGraph) -> None:
        self.graph = graph
        nodes = graph.nodes
        self.first_bwd = next((n.index for n in nodes if n.phase != "forward"), len(nodes))
        self.modules: dict[str, list[int]] = {}  # module -> [first, last, count] forward ops
        for n in nodes[: self.first_bwd]:
            parts = n.module.split(".") if n.module else []
            for k in range(1, len(parts) + 1):
                m = self.modules.setdefault(".".join(parts[:k]), [n.index, n.index, 0])
                m[1], m[2] = n.index, m[2] + 1
        self.readers: dict[int, list[int]] = {}
        for n in nodes:
            for sid in {t.storage for t in n.inputs}:
                self.readers.setdefault(sid, []).append(n.index)
        self.saves: dict[int, list[Save]] = {}
        autograd = graph.meta.autograd
        for row in autograd.saved:
            s = Save.from_row(row)
            self.saves.setdefault(s.op, []).append(s)
        self.saved_by: dict[int, set[int]] = {}
        for op, rows in self.saves.items():
            for s in rows:
                self.saved_by.setdefault(s.view.storage, set()).add(op)
        self.spans: dict[int, list[tuple[int, int]]] = {}
        self.owner: dict[int, int] = {}  # backward op -> the forward op whose node ran it
        for op, first, last in autograd.node_spans:
            self.spans.setdefault(op, []).append((first, last))
            self.owner.update(dict.fromkeys(range(first, last + 1), op))
        self.let_go = dict(autograd.unreferenced)
        self.block_inputs = {k: set(v) for k, v in autograd.block_inputs.items()}
        self.autocast = graph.meta.precision.is_mixed

    def fwd_reads(self, sid: int) -> list[int]:
        return [i for i in self.readers.get(sid, ()) if i < self.first_bwd]

    def bwd_reads(self, sid: int, start: int) -> list[int]:
        return [i for i in self.readers.get(sid, ()) if i >= max(start, self.first_bwd)]


def make_block(facts: Facts, name: str, policy: str) -> Block:
    """The block `name`'s forward range, saves, stop point and backward positions."""
    nodes = facts.graph.nodes
    if name not in facts.modules:
        raise GobrrrError(
            f"checkpoint: no forward op ran in module {name!r}; name a block "
            f"from the graph's meta.blocks ({_listed(facts)})"
        )
    lo, hi, count = facts.modules[name]
    ops = range(lo, hi + 1)
    if hi - lo + 1 != count:
        raise GobrrrError(
            f"checkpoint: module {name!r} runs more than once in the forward "
            "(or is interleaved with other modules); only blocks called once "
            "can be checkpointed by this pass"
        )
    b = Block(
        name,
        policy,
        lo,
        hi,
        [s for i in ops for s in sorted(facts.saves.get(i, ()), key=lambda s: s.after)],
    )
    if not b.saves:
        return b
    b.stop = max((s.op, s.after) for s in b.saves)
    b.created = {sid for i in ops for sid in nodes[i].allocs}
    b.held = {s.view.storage for s in b.saves} & b.created
    if policy == "selective":
        b.kept = {sid: i for i in ops if nodes[i].op in SELECTIVE_SAVE for sid in nodes[i].allocs}
    _place_nodes(facts, b)
    return b


def _listed(facts: Facts) -> str:
    blocks = facts.graph.meta.blocks or ()
    return ", ".join(blocks[:3]) + (", ..." if len(blocks) > 3 else "") or "none recorded"


def _place_nodes(facts: Facts, b: Block) -> None:
    """When backward runs each of the block's nodes (the trace recorded it): recomputation
    starts as the first one unpacks; the block's last node done, the checkpoint lets go."""
    nodes = facts.graph.nodes
    for op in {s.op for s in b.saves}:
        for first, last in facts.spans.get(op, ()):
            b.place[op] = min(b.place.get(op, first), first)
            b.node_end[op] = max(b.node_end.get(op, -1), _end_of_apply(nodes, first, last))
            b.end = max(b.end, last)
    if b.place:
        b.trigger = min(b.place.values())


# what autograd's engine runs on a node's gradients after the node returns (validate_outputs:
# sum_to a broadcast input's shape, cast to its dtype); the node's locals are gone by then
_AFTER_APPLY = ("aten.sum.dim_IntList", "aten.view.default", "aten._to_copy.default")


def _end_of_apply(nodes, first: int, last: int) -> int:
    """The last op a node's backward function runs itself (its span less the engine's
    reshaping of its results): the unpacked saved tensors die with its locals there."""
    while last >= first and nodes[last].op in _AFTER_APPLY:
        last -= 1
    return max(last, first)


# --------------------------------------------------------------------- when tensors would die
def python_death(facts: Facts, sid: int) -> int | None:
    """The forward op after which storage `sid` (made in the forward, saved for backward in
    the original graph) dies once nothing saves it: where the trace saw Python let go of it
    (meta.autograd.unreferenced), except autocast's cast of a parameter, which
    autocast's cache keeps to the end of the forward. None: Python held it into backward."""
    nodes = facts.graph.nodes
    made = nodes[facts.graph.storages[sid].created]
    if (
        facts.autocast
        and made.name == "_to_copy"
        and made.inputs
        and facts.graph.storages[made.inputs[0].storage].kind == "parameter"
    ):
        return facts.first_bwd - 1
    return facts.let_go.get(sid)
