"""DistributedDataParallel as a graph pass over one rank's step.

Every rank holds the whole model and runs the traced step on its own batch; DDP's reducer
(torch/csrc/distributed/c10d/reducer.cpp) makes the gradients equal across ranks:

- buckets: the gradients in the order they become ready in backward (the reducer rebuilds
  its buckets after the first step from that order, `Reducer::rebuild_buckets`), grouped by
  dtype, cut once a bucket reaches its limit: `first_bucket_mb` for the first
  (`dist._DEFAULT_FIRST_BUCKET_BYTES`, 1 MiB), `bucket_cap_mb` (25 MiB) after
  (`_compute_bucket_assignment_by_size`);
- each bucket is one flat buffer of the gradients' dtype, allocated when DDP is built and
  kept (gradient_as_bucket_view=False, the default: `.grad` stays its own tensor, so the
  rank holds the gradients twice);
- a gradient, once ready (AccumulateGrad has run), is copied into its bucket and divided by
  the world size in one kernel (`mark_variable_ready_dense`: `at::mul_out(bucket_view, grad,
  1/world)`); a bucket whose gradients are all in is all-reduced on the comm stream
  (`c10d.allreduce_`), buckets in order;
- at the end of backward (`finalize_backward`) the compute stream waits for every bucket's
  all-reduce and copies each bucket back into the gradients (`copy_bucket_to_grad`:
  `grad.copy_(bucket_view)`); the optimizer then runs as traced.

Accumulation (a graph from `passes.accumulate`, `StepMeta.repeat`): the micro-batches before
the last run under `no_sync` (no reducer work); the last one copies its gradients into the
buckets and all-reduces them during its backward. The accumulated graph holds the first
micro-batch, then a segment standing for the n - 1 identical others (the last among them).
Over two micro-batches the segment runs once: it is the last micro-batch, and the copies and
all-reduces go at their own points in its backward, as PyTorch runs them (the last buckets'
all-reduces end the step). Over more, the segment cannot hold work done once; so the last
micro-batch's copies and all-reduces are put in the FIRST micro-batch's backward, at the same
points of the same ops, where they overlap the same backward compute as they do in the last
one, and write buffers that exist throughout (the buckets: no allocation moves). The copies
back into the gradients stay at the end of backward, after every micro-batch. One difference
remains there: the buckets all-reduced last can overlap the next micro-batch's forward, where
in PyTorch they end the step (4xH100, two micro-batches placed that way: 0.0-0.1 ms exposed
predicted against 1.1-3.4 ms measured).

Left out: the broadcast of module buffers before each forward (broadcast_buffers: small),
the reducer's host work beyond one op per copy.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo, itemsize
from gobrrr.graph.meta import Parallel
from gobrrr.schedule.streams import COMM

MIB = 1024 * 1024
ALL_REDUCE = "c10d.allreduce_.default"
COPY_IN = "aten.mul.out"  # at::mul_out(bucket_view, grad, 1 / world)
COPY_OUT = "aten.copy_.default"  # grad.copy_(bucket_view)


@dataclasses.dataclass(frozen=True)
class Grad:
    """One parameter's gradient: its storage, dtype, elements and the op after which it is
    ready (its last reference in backward)."""

    storage: int
    dtype: str
    numel: int
    ready: int

    @property
    def nbytes(self) -> int:
        return self.numel * itemsize(self.dtype)


def bucket_assignment(sizes: Sequence[tuple[str, int]], limits: Sequence[int]) -> list[list[int]]:
    """Indices of `sizes` ((dtype, bytes) in ready order) per bucket, as
    `_compute_bucket_assignment_by_size` with those indices as its order: per dtype a bucket
    is closed once it holds `limits[k]` bytes or more, k moving to the next limit (the last
    one kept); the open buckets after, in dtype order of first appearance."""
    open_: dict[str, list[int]] = {}
    held: dict[str, int] = {}
    at: dict[str, int] = {}
    out: list[list[int]] = []
    for i, (dtype, nbytes) in enumerate(sizes):
        open_.setdefault(dtype, []).append(i)
        held[dtype] = held.get(dtype, 0) + nbytes
        k = at.get(dtype, 0)
        if held[dtype] >= limits[k]:
            out.append(open_.pop(dtype))
            held[dtype] = 0
            at[dtype] = min(k + 1, len(limits) - 1)
    out += [b for b in open_.values() if b]
    return out


def gradients(graph: StepGraph) -> list[Grad]:
    """The gradients in the order they become ready: after their last reference before the
    optimizer (for an accumulated graph, the first micro-batch's storages)."""
    split = next((n.index for n in graph.nodes if n.phase == "optimizer"), len(graph.nodes))
    kinds = {s.id: s for s in graph.storages if s.kind == "gradient"}
    last: dict[int, int] = {}
    view: dict[int, TensorInfo] = {}
    for n in graph.nodes[:split]:
        for t in (*n.inputs, *n.outputs):
            if t.storage in kinds:
                last[t.storage] = n.index
                view.setdefault(t.storage, t)
    grads = [
        Grad(g, view[g].dtype, kinds[g].nbytes // itemsize(view[g].dtype), last[g]) for g in last
    ]
    return sorted(grads, key=lambda g: (g.ready, g.storage))


def ddp(
    graph: StepGraph,
    world: int,
    hosts: int = 1,
    bucket_cap_mb: float = 25,
    first_bucket_mb: float = 1,
) -> StepGraph:
    """One rank's step under DDP over `world` ranks on `hosts` hosts (see the module's
    docstring): bucket buffers, the copies into and out of them and an all-reduce per
    bucket on the comm stream."""
    _check(graph, world, hosts)
    grads = gradients(graph)
    limits = [int(first_bucket_mb * MIB), int(bucket_cap_mb * MIB)]
    buckets = [
        [grads[i] for i in b]
        for b in bucket_assignment([(g.dtype, g.nbytes) for g in grads], limits)
    ]
    storages = list(graph.storages)
    where: dict[int, tuple[int, int]] = {}  # grad storage -> (bucket storage, element offset)
    for k, b in enumerate(buckets):
        sid = len(storages)
        storages.append(
            StorageInfo(sid, sum(g.nbytes for g in b), "buffer", -1, None, f"ddp.bucket{k}")
        )
        offset = 0
        for g in b:
            where[g.storage] = (sid, offset)
            offset += g.numel
    inserts = _inserts(graph, buckets, where, world)
    return _rebuilt(graph, storages, inserts, world, hosts, bucket_cap_mb, first_bucket_mb)


def _check(graph: StepGraph, world: int, hosts: int) -> None:
    if world < 1 or hosts < 1 or world % hosts:
        raise GobrrrError(
            f"DDP needs world >= 1 ranks spread evenly over hosts >= 1, got world={world} "
            f"hosts={hosts}: give a world that is a multiple of the hosts"
        )
    if graph.meta.parallel is not None:
        raise GobrrrError(
            f"this step graph is already sharded ({graph.meta.parallel.kind}); apply ddp to "
            "the one-GPU graph"
        )


def _inserts(
    graph: StepGraph,
    buckets: list[list[Grad]],
    where: dict[int, tuple[int, int]],
    world: int,
) -> dict[int, list[OpNode]]:
    """{old op index: the new nodes to put after it} (index fields filled in later)."""
    split = next((n.index for n in graph.nodes if n.phase == "optimizer"), len(graph.nodes))
    # accumulated over more than two micro-batches: the last micro-batch's hooks, at their
    # points in the first micro-batch's backward; over two, the repeated segment runs once
    # and is the last micro-batch: its own points (see the module's docstring)
    r = graph.repeat
    ready = _first_ready(graph) if r is not None and r[2] > 1 else {}
    out: dict[int, list[OpNode]] = {}
    for b in buckets:
        for g in b:
            out.setdefault(ready.get(g.storage, g.ready), []).append(_copy_in(g, where, world))
        last = max(ready.get(g.storage, g.ready) for g in b)
        sid, _ = where[b[0].storage]
        flat = TensorInfo((sum(g.numel for g in b),), (1,), b[0].dtype, sid)
        out[last].append(OpNode(0, ALL_REDUCE, "backward", "", (flat,), (flat,), stream=COMM))
    end = split - 1  # finalize_backward: after backward's last op
    out.setdefault(end, []).extend(_copy_out(g, where) for b in buckets for g in b)
    return out


def _first_ready(graph: StepGraph) -> dict[int, int]:
    """{gradient storage: its last reference before the repeated segment}: where each gradient
    is ready in an accumulated graph's first micro-batch."""
    start = graph.repeat[0]
    grads = {s.id for s in graph.storages if s.kind == "gradient"}
    out: dict[int, int] = {}
    for n in graph.nodes[:start]:
        for t in (*n.inputs, *n.outputs):
            if t.storage in grads:
                out[t.storage] = n.index
    return out


def _views(g: Grad, where: dict[int, tuple[int, int]]) -> tuple[TensorInfo, TensorInfo]:
    sid, offset = where[g.storage]
    grad = TensorInfo((g.numel,), (1,), g.dtype, g.storage)
    return grad, TensorInfo((g.numel,), (1,), g.dtype, sid, offset)


def _copy_in(g: Grad, where: dict[int, tuple[int, int]], world: int) -> OpNode:
    grad, view = _views(g, where)
    return OpNode(0, COPY_IN, "backward", "", (grad,), (view,), args=({"t": 0}, 1.0 / world))


def _copy_out(g: Grad, where: dict[int, tuple[int, int]]) -> OpNode:
    grad, view = _views(g, where)
    return OpNode(0, COPY_OUT, "backward", "", (grad, view), (grad,), args=({"t": 0}, {"t": 1}))


def _rebuilt(
    graph: StepGraph,
    storages: list[StorageInfo],
    inserts: dict[int, list[OpNode]],
    world: int,
    hosts: int,
    bucket_cap_mb: float,
    first_bucket_mb: float,
) -> StepGraph:
    """The graph with `inserts` placed, every op index renumbered."""
    nodes: list[OpNode] = []
    pos: dict[int, int] = {}
    for n in graph.nodes:
        pos[n.index] = len(nodes)
        nodes.append(dataclasses.replace(n, index=len(nodes)))
        nodes += [
            dataclasses.replace(x, index=len(nodes) + j)
            for j, x in enumerate(inserts.get(n.index, ()))
        ]

    def at(i: int) -> int:
        return pos[i] if i >= 0 else i

    storages = [
        dataclasses.replace(
            s, created=at(s.created), freed=None if s.freed is None else at(s.freed)
        )
        for s in storages
    ]
    meta = graph.meta.with_ops_moved(at)
    if (r := graph.repeat) is not None:
        meta = meta.replace(
            repeat=graph.meta.repeat._replace(start=pos[r[0]], end=pos[r[1] - 1] + 1)
        )
    meta = meta.with_pass(
        {
            "pass": "ddp",
            "world": world,
            "hosts": hosts,
            "bucket_cap_mb": bucket_cap_mb,
            "first_bucket_mb": first_bucket_mb,
        },
        parallel=Parallel("ddp", world, hosts),
    )
    return StepGraph(nodes=tuple(nodes), storages=tuple(storages), meta=meta)
