"""A deep model's step graph built from traces of the same model with fewer blocks.

A transformer's step is its repeated blocks' ops, once per block, between the ops of what
surrounds them (embedding, head, loss, the optimizer over every parameter). Tracing Llama-3-70B
runs its 80 identical blocks through fake-tensor dispatch one by one; a trace with five blocks
and one with six say everything the 80-block graph holds:

    deepen(shallow, deeper, depth)   # shallow: a blocks, deeper: a + 1, a >= 5

Every op, storage, list entry and meta row is tagged with the block it belongs to (by module
path, by parameter label, by the op that first used a storage, by the tensors a foreach list
entry holds); the middle block m = 2 is the template. The deep graph is the shallow one with
each run of template items repeated depth - a + 1 times in place (in the direction the blocks
run there: forward and the optimizer up, backward down), the blocks after it renumbered, and
every reference (storage id, op index, a list entry, a row) rewritten relative to the block
that holds it: a template copy's reference to the block before it names the copy before it.
Counts that grow with the depth (parameters, optimizer tensors, attention calls) grow by the
difference between the two traces. The transformation is checked on the traces themselves:
`shallow` deepened by one block must equal `deeper` (`StepGraph` equality, every field), or
`NotRepeated` is raised and the caller traces the whole model (`capture_deep`).
"""

from __future__ import annotations

import re
from collections.abc import Callable, Mapping
from typing import Any

from gobrrr.capture import capture
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo, evolve
from gobrrr.graph.meta import Autograd, ModelOutput, NodeSpan, SavedRow, Unreferenced

#: blocks the shallow trace has: the template (block 2) and the blocks beside it are interior
#: (neither the first nor the last), so a copy's references to its neighbours line up
SHALLOW = 5
TEMPLATE = 2
#: blocks from which two shallow traces cost less than the whole model's: each also runs what
#: surrounds the blocks (embedding, head, loss, the optimizer's state), and 11 blocks in all
#: (gpt2's 12 blocks: 0.8-1.0 CPU-s whole, 0.9-1.2 as two traces and `deepen`; llama3-1b's
#: 16: 1.6 whole, 1.4 made)
DEEP_FROM = 16


class NotRepeated(Exception):  # noqa: N818 - a condition, not a failure of gobrrr
    """The traces do not show the step as repeated blocks (the caller traces the whole model)."""


class _Layout:
    """The shallow graph's items by block, and where each lands in the deep one."""

    def __init__(self, graph: StepGraph, depth: int) -> None:
        self.prefix = _prefix(graph)
        self.a = len(graph.meta.blocks or ())
        self.r = depth - self.a + 1  # copies of the template block
        if self.r < 1:
            raise NotRepeated(f"depth {depth} is below the trace's {self.a} blocks")
        self.block_of = _block_of(self.prefix)
        self.rename = _renamer(self.prefix)
        self.node_block, self.store_block = _tags(graph, self.block_of)
        self.by = {"node": _by_block(self.node_block), "store": _by_block(self.store_block)}
        self.blocks = {"node": self.node_block, "store": self.store_block}
        self.rank = {
            k: {i: p for ids in v.values() for p, i in enumerate(ids)} for k, v in self.by.items()
        }
        for kind, by in self.by.items():  # the interior blocks must line up item for item
            sizes = {len(by.get(b, ())) for b in range(1, self.a - 1)}
            if len(sizes) != 1:
                raise NotRepeated(f"the interior blocks hold different numbers of {kind}s: {sizes}")
        self.order = {k: _spread(v, self.r) for k, v in self.blocks.items()}
        self.at = {
            k: {(i, c): new for new, (i, c, _) in enumerate(v)} for k, v in self.order.items()
        }

    def ref(self, kind: str, old: int, ctx: int | None) -> int:
        """The deep graph's index of op / storage `old` as an item `ctx` blocks on refers
        to it (a template copy: its copy; None: a fixed item, which may not refer to the
        template's items one by one)."""
        b = self.blocks[kind][old]
        if b is None:
            return self.at[kind][(old, None)]
        if ctx is None:
            if b == TEMPLATE:
                raise NotRepeated(f"a fixed item refers to the template's {kind} {old}")
            return self.at[kind][(old, None)]
        t = b + ctx
        if TEMPLATE <= t < TEMPLATE + self.r:
            o, copy = TEMPLATE, t - TEMPLATE
        else:
            o, copy = (t, None) if t < TEMPLATE else (t - self.r + 1, None)
        ids = self.by[kind].get(o, ())
        pos = self.rank[kind][old]
        if pos >= len(ids):
            raise NotRepeated(f"{kind} {old} of block {b} has no match in block {o}")
        return self.at[kind][(ids[pos], copy)]

    def own(self, kind: str, old: int, copy: int | None) -> int:
        """The deep graph's index of `old` itself (of its copy `copy` in the template)."""
        return self.at[kind][(old, copy)]


def _by_block(tags: list[int | None]) -> dict[int, list[int]]:
    by: dict[int, list[int]] = {}
    for i, b in enumerate(tags):
        if b is not None:
            by.setdefault(b, []).append(i)
    return by


def _spread(blocks: list[int | None], r: int) -> list[tuple[int, int | None, int | None]]:
    """Entries of a sequence whose i-th entry belongs to blocks[i], in the deep graph's
    order: (i, copy, shift). Each run of template entries is repeated r times, up where the
    blocks run up beside it, down where they run down; copy is None outside the template,
    where shift is how far the entry's block moves (None: no block's)."""
    out: list[tuple[int, int | None, int | None]] = []
    i, n = 0, len(blocks)
    while i < n:
        b = blocks[i]
        if b != TEMPLATE:
            out.append((i, None, None if b is None else (0 if b < TEMPLATE else r - 1)))
            i += 1
            continue
        j = i
        while j < n and blocks[j] == TEMPLATE:
            j += 1
        copies = range(r) if _rising(blocks, i, j) else range(r - 1, -1, -1)
        out.extend((k, c, c) for c in copies for k in range(i, j))
        i = j
    return out


def _rising(blocks: list[int | None], i: int, j: int) -> bool:
    """Whether the blocks run up around the template's run blocks[i:j]."""
    before = next((b for b in reversed(blocks[:i]) if b is not None), None)
    if before is not None:
        return before < TEMPLATE
    after = next((b for b in blocks[j:] if b is not None), None)
    return after is None or after > TEMPLATE


def _pattern(prefix: str) -> re.Pattern:
    return re.compile(re.escape(prefix) + r"\.(\d+)(?=\.|$)")


def _renamer(prefix: str) -> Callable[[str, int | None], str]:
    """(name, shift) -> the name with its block index moved on by shift ("layers.3.mlp", 2
    -> "layers.5.mlp"); a name outside the blocks is kept."""
    pat = _pattern(prefix)

    def rename(name: str, shift: int | None) -> str:
        if not shift:
            return name
        return pat.sub(lambda mt: f"{prefix}.{int(mt.group(1)) + shift}", name, count=1)

    return rename


def _block_of(prefix: str) -> Callable[[str], int | None]:
    pat = _pattern(prefix)

    def block(name: str) -> int | None:
        mt = pat.match(name)
        return int(mt.group(1)) if mt else None

    return block


def _prefix(graph: StepGraph) -> str:
    blocks = graph.meta.blocks or ()
    if len(blocks) < SHALLOW:
        raise NotRepeated(f"{len(blocks)} repeated blocks, fewer than {SHALLOW}")
    prefix = blocks[0].rpartition(".")[0]
    if list(blocks) != [f"{prefix}.{i}" for i in range(len(blocks))]:
        raise NotRepeated(f"blocks {blocks[:3]}... are not one list run in order")
    return prefix


def _tags(graph: StepGraph, block) -> tuple[list[int | None], list[int | None]]:
    """Each op's and each storage's block (None: outside the blocks). A storage made before
    the step (a parameter, its optimizer state) by its label; an op by its module, an op
    between two blocks' ops of one phase (their boundary in backward) joining the block it
    follows, an optimizer op outside any module the one block its tensors' storages name;
    a storage made in the step by the op that first used it (a foreach op's output: the
    block of its list entry)."""
    store: list[int | None] = [None] * len(graph.storages)
    for s in graph.storages:
        if s.created < 0:
            store[s.id] = block(s.label)
    nodes = [block(n.module) for n in graph.nodes]
    for n in graph.nodes:
        if nodes[n.index] is None and n.phase == "optimizer":
            names = {store[t.storage] for t in n.inputs} - {None}
            if len(names) == 1 and not any(isinstance(x, list) for x in n.args):
                nodes[n.index] = names.pop()
    _boundaries(graph, nodes)
    seen = {s.id for s in graph.storages if s.created < 0}
    for n in graph.nodes:
        entry = _entry_blocks(n, store) if nodes[n.index] is None else None
        for j, t in enumerate((*n.inputs, *n.outputs)):
            if t.storage in seen:
                continue
            seen.add(t.storage)
            k = j - len(n.inputs)
            if nodes[n.index] is not None:
                store[t.storage] = nodes[n.index]
            elif entry is not None and 0 <= k < len(entry) and len(entry) == len(n.outputs):
                store[t.storage] = entry[k]
    return nodes, store


def _boundaries(graph: StepGraph, tags: list[int | None]) -> None:
    """Give an op between two different blocks' ops of its phase the block it follows."""
    nxt: list[tuple[int, str] | None] = [None] * len(tags)
    after = None
    for i in range(len(tags) - 1, -1, -1):
        nxt[i] = after
        if tags[i] is not None:
            after = (tags[i], graph.nodes[i].phase)
    before = None
    for i, n in enumerate(graph.nodes):
        if tags[i] is not None:
            before = (tags[i], n.phase)
        elif before is not None and nxt[i] is not None:
            if before[1] == n.phase == nxt[i][1] and before[0] != nxt[i][0]:
                tags[i] = before[0]


def _entry_blocks(node: OpNode, store: list[int | None]) -> list[int | None] | None:
    """The blocks of a foreach op's first tensor list's entries (its outputs line up)."""
    for a in node.args:
        if _tensor_list(a):
            return [store[node.inputs[x["t"]].storage] for x in a]
    return None


def _tensor_list(a: Any) -> bool:
    return isinstance(a, list) and bool(a) and all(isinstance(x, dict) and "t" in x for x in a)


# -- the deep graph ----------------------------------------------------------------------


def _storage(lay: _Layout, s: StorageInfo, new: int, ctx: int | None) -> StorageInfo:
    created = s.created if s.created < 0 else lay.ref("node", s.created, ctx)
    freed = s.freed if s.freed is None or s.freed < 0 else lay.ref("node", s.freed, ctx)
    return StorageInfo(
        id=new,
        nbytes=s.nbytes,
        kind=s.kind,
        created=created,
        freed=freed,
        label=lay.rename(s.label, ctx),
        module=lay.rename(s.module, ctx),
    )


def _tensor(t: TensorInfo, storage: int) -> TensorInfo:
    return t if t.storage == storage else evolve(t, storage=storage)


def _node(lay: _Layout, n: OpNode, new: int, ctx: int | None) -> OpNode:
    if ctx is not None or not _touches_template(lay, n):
        return _moved_node(lay, n, new, ctx)
    return _spread_node(lay, n, new)


def _touches_template(lay: _Layout, n: OpNode) -> bool:
    sb = lay.store_block
    return any(
        sb[s] == TEMPLATE
        for s in (
            *(t.storage for t in n.inputs),
            *(t.storage for t in n.outputs),
            *n.allocs,
            *n.frees,
        )
    )


def _moved_node(lay: _Layout, n: OpNode, new: int, ctx: int | None) -> OpNode:
    """An op of a block (or a fixed op of no template tensor), its references moved."""
    ref = lay.ref
    return evolve(
        n,
        index=new,
        module=lay.rename(n.module, ctx),
        inputs=tuple(_tensor(t, ref("store", t.storage, ctx)) for t in n.inputs),
        outputs=tuple(_tensor(t, ref("store", t.storage, ctx)) for t in n.outputs),
        allocs=tuple(ref("store", s, ctx) for s in n.allocs),
        frees=tuple(ref("store", s, ctx) for s in n.frees),
    )


def _spread_node(lay: _Layout, n: OpNode, new: int) -> OpNode:
    """A fixed op over every block's tensors (a foreach op of the optimizer): its lists'
    template entries repeated, its inputs the tensors its arguments name in their order."""
    sb = lay.store_block
    keys: dict[tuple[int, int | None], int] = {}

    def key(t: int, copy: int | None) -> dict:
        return {"t": keys.setdefault((t, copy), len(keys))}

    def one(a: Any, lists: dict[int, list]) -> Any:
        if isinstance(a, dict) and "t" in a:
            if sb[n.inputs[a["t"]].storage] == TEMPLATE:
                raise NotRepeated(f"{n.op} names a template tensor outside a list")
            return key(a["t"], None)
        if not isinstance(a, list) or not a:
            return a
        blocks = lists.get(len(a))
        if _tensor_list(a):
            blocks = [sb[n.inputs[x["t"]].storage] for x in a]
        if blocks is None:
            return a
        return [
            key(a[i]["t"], c) if _tensor_list(a) else a[i] for i, c, _ in _spread(blocks, lay.r)
        ]

    lists = {len(a): [sb[n.inputs[x["t"]].storage] for x in a] for a in n.args if _tensor_list(a)}
    args = tuple(one(a, lists) for a in n.args)
    kwargs = {k: one(v, lists) for k, v in n.kwargs.items()}
    inputs = [None] * len(keys)
    for (t, copy), i in keys.items():
        old = n.inputs[t]
        inputs[i] = _tensor(old, lay.at["store"][(old.storage, copy)])

    def spread_ids(ids) -> tuple[int, ...]:
        return tuple(
            lay.own("store", ids[i], c) for i, c, _ in _spread([sb[s] for s in ids], lay.r)
        )

    outs = [n.outputs[i] for i, _, _ in _spread([sb[t.storage] for t in n.outputs], lay.r)]
    copies = [c for _, c, _ in _spread([sb[t.storage] for t in n.outputs], lay.r)]
    return evolve(
        n,
        index=new,
        inputs=tuple(inputs),
        outputs=tuple(
            _tensor(t, lay.own("store", t.storage, c)) for t, c in zip(outs, copies, strict=True)
        ),
        args=args,
        kwargs=kwargs,
        allocs=spread_ids(n.allocs),
        frees=spread_ids(n.frees),
    )


# -- what the meta says ------------------------------------------------------------------

#: meta fields that hold op indices, storage ids or block names (rebuilt here); the others
#: are counts and facts, equal in both traces or growing by a constant per block
_STRUCTURE = frozenset({"syncs", "autograd", "outputs", "blocks"})
#: meta fields a repeated graph may not have (a pass ran, or a compiled step)
_NEVER = ("compiled_regions", "repeat", "cuda_graph", "passes", "micro_batch", "accumulation")


def _rows(lay: _Layout, kind: str, items: list, old_of: Callable[[Any], int]) -> list:
    """(item, copy, ctx) of a meta list whose items belong to op / storage old_of(item)."""
    blocks = [lay.blocks[kind][old_of(x)] for x in items]
    return [(items[i], c, ctx) for i, c, ctx in _spread(blocks, lay.r)]


def _autograd(lay: _Layout, ag: Autograd) -> Autograd:
    ref = lay.ref
    saved = [
        SavedRow(lay.own("node", row.op, c), ref("store", row.storage, ctx), *row[2:])
        for row, c, ctx in _rows(lay, "node", list(ag.saved), lambda x: x.op)
    ]
    spans = []
    for sp, c, ctx in _rows(lay, "node", list(ag.node_spans), lambda x: x.op):
        last = ref("node", sp.last, ctx) if sp.last >= 0 else sp.last
        first = ref("node", sp.first, ctx) if sp.first <= sp.last else last + 1
        spans.append(NodeSpan(lay.own("node", sp.op, c), first, last))
    unref = [
        Unreferenced(lay.own("store", u.storage, c), ref("node", u.op, ctx))
        for u, c, ctx in _rows(lay, "store", list(ag.unreferenced), lambda x: x.storage)
    ]
    names = list(ag.block_inputs)
    order = _spread([lay.block_of(k) for k in names], lay.r)
    inputs = {
        lay.rename(names[i], ctx): [ref("store", s, ctx) for s in ag.block_inputs[names[i]]]
        for i, _, ctx in order
    }
    return Autograd(ag.version, ag.hooked, tuple(saved), tuple(spans), tuple(unref), inputs)


def _structure(lay: _Layout, meta) -> dict[str, Any]:
    """The meta fields that name ops, storages and blocks, for the deep graph."""
    out: dict[str, Any] = {}
    if meta.syncs is not None:
        out["syncs"] = tuple(
            lay.own("node", i, c) for i, c, _ in _rows(lay, "node", list(meta.syncs), int)
        )
    if meta.autograd is not None:
        out["autograd"] = _autograd(lay, meta.autograd)
    if meta.outputs is not None:
        out["outputs"] = tuple(
            ModelOutput(lay.own("node", o.returned, c), lay.ref("store", o.storage, ctx), *o[2:])
            for o, c, ctx in _rows(lay, "node", list(meta.outputs), lambda x: x.returned)
        )
    names = list(meta.blocks)
    out["blocks"] = tuple(
        lay.rename(names[i], ctx) for i, _, ctx in _spread([lay.block_of(b) for b in names], lay.r)
    )
    return out


def _grown(a: Any, b: Any, steps: int, field: str) -> Any:
    """A count at `steps` blocks past the deeper trace's, from the two traces' values (equal:
    it does not grow; numbers: by their difference a block); anything else must be equal."""
    if a == b:
        return a
    if type(a) is int and type(b) is int:
        return b + (b - a) * steps
    if isinstance(a, Mapping) and isinstance(b, Mapping) and a.keys() == b.keys():
        return {k: _grown(a[k], b[k], steps, f"{field}.{k}") for k in a}
    raise NotRepeated(f"meta {field} differs between the traces: {a!r} and {b!r}")


def _meta(lay: _Layout, shallow, deeper, depth: int):
    """The deep graph's meta: counts grown from the two traces' (`_grown`), the rest rebuilt
    from the shallow graph's."""
    for f in _NEVER:
        if getattr(shallow, f) is not None:
            raise NotRepeated(f"the trace's meta has {f}")
    da, db = shallow.to_dict(), deeper.to_dict()
    if da.keys() != db.keys():
        raise NotRepeated("the two traces' meta hold different fields")
    steps = depth - lay.a - 1
    grown = {k: _grown(da[k], db[k], steps, k) for k in da if k not in _STRUCTURE}
    meta = type(shallow).from_dict({**grown, **{k: da[k] for k in _STRUCTURE if k in da}})
    return meta.replace(**_structure(lay, shallow))


def _synth(shallow: StepGraph, deeper_meta, depth: int) -> StepGraph:
    lay = _Layout(shallow, depth)
    storages = tuple(
        _storage(lay, shallow.storages[i], new, ctx)
        for new, (i, _, ctx) in enumerate(lay.order["store"])
    )
    nodes = tuple(
        _node(lay, shallow.nodes[i], new, ctx) for new, (i, _, ctx) in enumerate(lay.order["node"])
    )
    meta = _meta(lay, shallow.meta, deeper_meta, depth)
    return StepGraph(nodes=nodes, storages=storages, meta=meta, version=shallow.version)


def deepen(shallow: StepGraph, deeper: StepGraph, depth: int) -> StepGraph:
    """The step graph of the model with `depth` blocks, from its traces with a (at least
    SHALLOW) and a + 1 blocks: equal, every field, to the graph a trace at `depth` makes,
    where `shallow` deepened by one block is `deeper` (checked: else NotRepeated)."""
    a = len(shallow.meta.blocks or ())
    if len(deeper.meta.blocks or ()) != a + 1:
        raise NotRepeated(f"traces of {a} and {len(deeper.meta.blocks or ())} blocks")
    try:
        if _synth(shallow, deeper.meta, a + 1) != deeper:
            raise NotRepeated("the trace with one block more is not the shallow one deepened")
        return _synth(shallow, deeper.meta, depth)
    except (LookupError, ValueError, TypeError) as e:  # a graph laid out unlike the tagging
        raise NotRepeated(f"{type(e).__name__}: {e}") from e


def capture_deep(make: Callable[[int], Any], depth: int, **kwargs: Any) -> StepGraph:
    """`capture(make(depth), **kwargs)`, traced as SHALLOW and SHALLOW + 1 blocks and
    deepened (`deepen`); where the traces do not show repeated blocks, the whole model is
    traced. `make(blocks)`: the workload source with that many blocks."""
    if depth < DEEP_FROM:
        return capture(make(depth), **kwargs)
    shallow = capture(make(SHALLOW), **kwargs)
    deeper = capture(make(SHALLOW + 1), **kwargs)
    try:
        return deepen(shallow, deeper, depth)
    except NotRepeated:
        return capture(make(depth), **kwargs)
