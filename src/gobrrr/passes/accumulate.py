"""Gradient accumulation as a graph pass: one optimizer step over `n` micro-batches.

From the graph of a one-micro-batch step (forward, backward, optimizer) this builds the
accumulated step as PyTorch runs it (`loss / n` backward per micro-batch, one
`optimizer.step()`):

- micro-batch 1 runs as traced: each gradient is created by the backward op that produces it
  (AccumulateGrad keeps the incoming tensor as `.grad`);
- micro-batches 2..n run with every gradient already allocated: the op that produced a
  gradient now produces a temporary, and AccumulateGrad adds it in place (`grad += new`,
  one `aten.add_` right after the gradient's last producer), then frees it;
- the optimizer runs once, at the end.

Micro-batches 2..n are identical, so the graph holds two micro-batches and marks the second
as standing for n - 1 runs (`StepMeta.repeat`): memory replays it once (its peak is every later
micro-batch's), time and FLOPs count it n - 1 times. The batch lives on the device whole, as
the global batch the step is given: input storages grow n-fold (the micro-batches are views
of it). The `loss / n` scaling (one scalar op per micro-batch) is left out of the graph.
"""

from __future__ import annotations

import dataclasses

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo, evolve

SHARED = ("parameter", "buffer", "optimizer_state", "input")  # the same tensors every micro-batch


def accumulate(graph: StepGraph, n: int) -> StepGraph:
    """The step `graph` with its forward and backward run over `n` micro-batches before the
    optimizer step. n = 1 returns the graph unchanged."""
    if n < 1:
        raise GobrrrError(f"gradient accumulation needs n >= 1 micro-batches, got {n}")
    if n == 1:
        return graph
    if graph.repeat is not None:
        raise GobrrrError(
            "this step graph is accumulated already; apply `accumulate` to the "
            "one-micro-batch graph"
        )
    split = next((x.index for x in graph.nodes if x.phase == "optimizer"), len(graph.nodes))
    storages = list(graph.storages)
    remap = _second_storages(graph, split, storages)
    grads = {s.id for s in graph.storages if s.kind == "gradient"}
    last_ref = _last_refs(graph.nodes[:split], grads)
    second: list[OpNode] = []
    pos: dict[int, int] = {}  # op index in micro-batch 1 -> the same op's in micro-batch 2
    added: dict[int, int] = {}  # gradient's temporary -> its add_ (where it is freed)
    for node in graph.nodes[:split]:
        pos[node.index] = split + len(second)
        second.append(_moved(node, pos[node.index], remap))
        for g in last_ref.get(node.index, ()):
            add = _accumulate_grad(node, g, remap[g], split + len(second))
            second.append(add)
            added[remap[g]] = add.index
    shift = len(second)
    rest = [_moved(x, x.index + shift, {}) for x in graph.nodes[split:]]
    copies = {new: graph.storages[old] for old, new in remap.items()}
    storages = [
        _placed(s, split, shift, n) if s.id not in copies else _copied(s, copies[s.id], pos, added)
        for s in storages
    ]
    return StepGraph(
        nodes=(*graph.nodes[:split], *second, *rest),
        storages=tuple(storages),
        meta=graph.meta.with_repeated(split, shift, pos, n),
    )


def _second_storages(graph: StepGraph, split: int, storages: list[StorageInfo]) -> dict[int, int]:
    """New storage ids for what the second micro-batch allocates (everything created in
    forward and backward, gradients included: there they are temporaries)."""
    remap: dict[int, int] = {}
    for s in graph.storages:
        if s.kind in SHARED or not 0 <= s.created < split:
            continue
        remap[s.id] = len(storages)
        kind = "temporary" if s.kind == "gradient" else s.kind
        storages.append(evolve(s, id=len(storages), kind=kind, label=""))
    return remap


def _last_refs(nodes: tuple[OpNode, ...], grads: set[int]) -> dict[int, list[int]]:
    """{node index: gradients whose last forward/backward reference it is}."""
    last: dict[int, int] = {}
    for x in nodes:
        for t in (*x.inputs, *x.outputs):
            if t.storage in grads:
                last[t.storage] = x.index
    out: dict[int, list[int]] = {}
    for g, i in last.items():
        out.setdefault(i, []).append(g)
    return out


def _moved(node: OpNode, index: int, remap: dict[int, int]) -> OpNode:
    """`node` at `index`, on the storages `remap` gives (`evolve`: the pass copies every op
    of the step)."""
    if not remap:
        return evolve(node, index=index)

    def t(x: TensorInfo) -> TensorInfo:
        sid = remap.get(x.storage)
        return x if sid is None else evolve(x, storage=sid)

    return evolve(
        node,
        index=index,
        inputs=tuple(t(x) for x in node.inputs),
        outputs=tuple(t(x) for x in node.outputs),
        allocs=tuple(remap.get(s, s) for s in node.allocs),
        frees=tuple(remap.get(s, s) for s in node.frees),
    )


def _accumulate_grad(producer: OpNode, grad: int, new: int, index: int) -> OpNode:
    """`grad += new` (AccumulateGrad on an existing .grad), then `new` is freed."""
    view = next(t for t in (*producer.outputs, *producer.inputs) if t.storage == grad)
    g = dataclasses.replace(view, storage=grad, offset=0)
    x = dataclasses.replace(view, storage=new, offset=0)
    return OpNode(
        index=index,
        op="aten.add_.Tensor",
        phase="backward",
        module=producer.module,
        inputs=(g, x),
        outputs=(g,),
        args=({"t": 0}, {"t": 1}),
        frees=(new,),
    )


def _placed(s: StorageInfo, split: int, shift: int, n: int) -> StorageInfo:
    """A storage of micro-batch 1 or of the optimizer, in the accumulated graph."""
    c = s.created + shift if s.created >= split else s.created
    f = s.freed + shift if s.freed is not None and s.freed >= split else s.freed
    nbytes = s.nbytes * n if s.kind == "input" else s.nbytes
    if (c, f, nbytes) == (s.created, s.freed, s.nbytes):
        return s
    return evolve(s, created=c, freed=f, nbytes=nbytes)


def _copied(
    s: StorageInfo, orig: StorageInfo, pos: dict[int, int], added: dict[int, int]
) -> StorageInfo:
    """Micro-batch 2's copy of `orig`: the same lifetime, one micro-batch later; a gradient's
    temporary dies at its add_."""
    freed = added.get(s.id, pos.get(orig.freed) if orig.freed is not None else None)
    return evolve(s, created=pos[orig.created], freed=freed)
