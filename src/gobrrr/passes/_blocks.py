"""What the checkpoint pass needs to know about each checkpointed block, read off a graph
traced without checkpointing: its forward ops, what its autograd nodes saved (meta["saved"]),
where torch's recomputation stops, where backward first unpacks it, and when each saved
tensor would have died had it not been saved (`python_death`)."""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

from gobrrr.errors import GobrrrError
from gobrrr.graph import OpNode, StepGraph, TensorInfo
from gobrrr.transforms import SELECTIVE_SAVE

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
    def from_row(row: list) -> Save:
        op, sid, after, rg, shape, stride, dtype, offset = row
        return Save(op, bool(after), bool(rg),
                    TensorInfo(tuple(shape), tuple(stride), dtype, sid, offset))


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
        self.readers: dict[int, list[int]] = {}
        for n in nodes:
            for sid in {t.storage for t in n.inputs}:
                self.readers.setdefault(sid, []).append(n.index)
        self.saves: dict[int, list[Save]] = {}
        for row in graph.meta.get("saved") or ():
            s = Save.from_row(row)
            self.saves.setdefault(s.op, []).append(s)
        self.saved_by: dict[int, set[int]] = {}
        for op, rows in self.saves.items():
            for s in rows:
                self.saved_by.setdefault(s.view.storage, set()).add(op)
        self.autocast = str(graph.meta.get("precision", "")).endswith("-mixed")

    def fwd_reads(self, sid: int) -> list[int]:
        return [i for i in self.readers.get(sid, ()) if i < self.first_bwd]

    def bwd_reads(self, sid: int, start: int) -> list[int]:
        return [i for i in self.readers.get(sid, ()) if i >= max(start, self.first_bwd)]


def make_block(facts: Facts, name: str, policy: str) -> Block:
    """The block `name`'s forward range, saves, stop point and backward positions."""
    nodes = facts.graph.nodes
    ops = [n.index for n in nodes[:facts.first_bwd]
           if n.module == name or n.module.startswith(name + ".")]
    if not ops:
        raise GobrrrError(f"checkpoint: no forward op ran in module {name!r}; name a block "
                          f"from the graph's meta['blocks'] ({_listed(facts)})")
    if ops[-1] - ops[0] + 1 != len(ops):
        raise GobrrrError(f"checkpoint: module {name!r} runs more than once in the forward "
                          "(or is interleaved with other modules); only blocks called once "
                          "can be checkpointed by this pass")
    b = Block(name, policy, ops[0], ops[-1],
              [s for i in ops for s in sorted(facts.saves.get(i, ()), key=lambda s: s.after)])
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
    blocks = facts.graph.meta.get("blocks") or []
    return ", ".join(blocks[:3]) + (", ..." if len(blocks) > 3 else "") or "none recorded"


def _place_nodes(facts: Facts, b: Block) -> None:
    """Where backward runs each of the block's nodes: from the first backward op reading what
    it saved (storages only it saved, else any the block made, else anything, read by an op
    of the block) to its last such read before the next node starts."""
    nodes = facts.graph.nodes
    saved = {op: {s.view.storage for s in b.saves if s.op == op} for op in {s.op for s in b.saves}}
    for op, sids in saved.items():
        own = sids & b.created
        alone = {sid for sid in own if facts.saved_by[sid] == {op}}  # no other node saved
        reads = _reads(facts, b, alone or own or sids)
        if reads:
            b.place[op] = _node_start(nodes, reads[0], (sids - b.created) | alone)
    if not b.place:
        return
    b.trigger = min(b.place.values())
    marks = sorted(set(b.place.values()))
    for op, sids in saved.items():
        at = b.place.setdefault(op, b.trigger)  # saved, never read: unpacked with the first
        nxt = marks[bisect.bisect_right(marks, at)] if at < marks[-1] else len(nodes)
        end = max((j for j in _reads(facts, b, sids) if at <= j < nxt), default=at)
        b.node_end[op] = _past_transpose(nodes, end)
    b.end = max(b.node_end.values())


def _past_transpose(nodes, j: int) -> int:
    """A matmul's gradient (mm_mat2_backward) transposes its result before it returns and its
    node lets go of the saved tensors: that `t` is still the node's."""
    nxt = nodes[j + 1] if j + 1 < len(nodes) else None
    if nxt is not None and nxt.op == "aten.t.default" and nodes[j].name == "mm" and \
            nxt.inputs[0].storage == nodes[j].outputs[0].storage:
        return j + 1
    return j


def _reads(facts: Facts, b: Block, sids: set[int]) -> list[int]:
    """Backward ops reading `sids`, in order, but autograd's own detaches of unpacking (the
    pass replaces them); storages the block did not make count only where an op of the block
    reads them."""
    nodes = facts.graph.nodes
    return sorted({j for sid in sids for j in facts.bwd_reads(sid, 0) if nodes[j].op != DETACH
                   and (sid in b.created or b.inside(nodes[j].module))})


def _node_start(nodes, j: int, sids: set[int]) -> int:
    """The first op of the backward node whose op j reads what it saved: back over the ops
    just before j in the same module, to the earliest that reads one of `sids` (a matmul's
    gradient reads its weight before its saved input)."""
    start, k = j, j - 1
    while k >= 0 and nodes[k].module == nodes[j].module and nodes[k].phase == nodes[j].phase:
        if any(t.storage in sids for t in nodes[k].inputs):
            start = k
        k -= 1
    return start


# --------------------------------------------------------------------- when tensors would die
def python_death(facts: Facts, sid: int) -> int:
    """The forward op after which storage `sid` (made in the forward, saved for backward in
    the original graph) dies once nothing saves it: autocast's cast of a parameter lives in
    autocast's cache to the end of the forward; an output no later op reads dies at once;
    otherwise at the end of the call that last holds it: the module whose forward made the
    last use, if that module also holds it as a local (it made or received it), else the
    child call that took it as an argument."""
    nodes = facts.graph.nodes
    st = facts.graph.storages[sid]
    made = nodes[st.created]
    if facts.autocast and made.name == "_to_copy" and made.inputs and \
            facts.graph.storages[made.inputs[0].storage].kind == "parameter":
        return facts.first_bwd - 1
    uses = [i for i in facts.fwd_reads(sid) if i > st.created]
    if not uses:
        return st.created
    u = uses[-1]
    scope = _scope(made.module, nodes[u].module)
    return _end_of_call(nodes, scope, u, facts.first_bwd)


def _scope(maker: str, user: str) -> str:
    """The innermost call holding a tensor made in `maker` and last used in `user`: their
    common ancestor if the use is its own op, else that ancestor's child toward `user`."""
    a, b = maker.split(".") if maker else [], user.split(".") if user else []
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return ".".join(b[:k] if k == len(b) else b[:k + 1])


def _end_of_call(nodes, scope: str, u: int, stop: int) -> int:
    """The last op of the call of `scope` that op u runs in."""
    e = u
    while e + 1 < stop and _within(scope, nodes[e + 1].module):
        e += 1
    return e


def _within(scope: str, module: str) -> bool:
    return not scope or module == scope or module.startswith(scope + ".")
