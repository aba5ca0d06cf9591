"""The CUDA graph pass: the step captured once and replayed, as `gobrrr.apply` runs it.

    graph = cuda_graph(accumulate(step, n))     # the last pass: nothing renumbers after it

`Knobs.cuda_graph` captures the whole optimizer step, every micro-batch's forward and backward
and the optimizer, as one graph (gobrrr.training.cudagraph.CapturedStep). Each step the
host copies the batch it is given into the static input buffers the graph reads (one copy
per input tensor, issued eagerly), then replays the graph. So this pass:

- puts a copy op per input storage in front of the step, from a new storage (the batch as
  given, on the device: kind "input", alive all step) into the static one the ops read;
- marks the step's own ops as captured (`StepMeta.cuda_graph`): the time model charges one
  graph launch for them (`cost.cudagraph.graphed_times`), the memory replay puts their
  allocations in the graph's private pool after emptying the warm-ups' cache
  (`memory.replay`), as apply empties it before capturing.
"""

from __future__ import annotations

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo, evolve
from gobrrr.graph.meta import Captured


def cuda_graph(graph: StepGraph) -> StepGraph:
    """`graph` replayed as one captured CUDA graph each step, fed by copies of the batch into
    its static inputs. A GobrrrError where the step syncs the host (a captured step cannot)
    or was replayed already."""
    if graph.meta.cuda_graph is not None:
        raise GobrrrError("this step graph is captured as a CUDA graph already")
    if graph.meta.syncs:
        op = graph.nodes[graph.meta.syncs[0]].op
        raise GobrrrError(
            f"the step waits for the GPU after {op} (a host sync), which a CUDA graph "
            "cannot capture: leave cuda_graph off for this step"
        )
    inputs = [s for s in graph.storages if s.kind == "input" and s.created < 0 and s.nbytes > 0]
    k = len(inputs)
    storages = [_shifted(s, k) for s in graph.storages]
    copies = []
    for i, s in enumerate(inputs):
        given = StorageInfo(len(storages), s.nbytes, "input", -1, None, f"batch given: {s.label}")
        storages.append(given)
        view = _flat(graph, s)
        copies.append(
            OpNode(
                index=i,
                op="aten.copy_.default",
                phase="forward",
                module="",
                inputs=(view, evolve(view, storage=given.id)),
                outputs=(view,),
                args=({"t": 0}, {"t": 1}),
            )
        )
    nodes = (*copies, *(evolve(n, index=n.index + k) for n in graph.nodes))
    meta = graph.meta.with_ops_moved(lambda i: i + k)
    if meta.repeat is not None:
        r = meta.repeat
        meta = meta.replace(repeat=r._replace(start=r.start + k, end=r.end + k))
    meta = meta.with_pass({"pass": "cuda_graph", "graphs": 1}, cuda_graph=Captured(k, 1))
    return StepGraph(nodes=nodes, storages=tuple(storages), meta=meta)


def _shifted(s: StorageInfo, k: int) -> StorageInfo:
    """A storage's lifetime with every op index from 0 on moved k later."""
    created = s.created + k if s.created >= 0 else s.created
    freed = s.freed + k if s.freed is not None and s.freed >= 0 else s.freed
    if created == s.created and freed == s.freed:
        return s
    return evolve(s, created=created, freed=freed)


def _flat(graph: StepGraph, s: StorageInfo) -> TensorInfo:
    """The whole storage `s` as one flat tensor, in the dtype the step reads it in."""
    dtype = next(
        (t.dtype for n in graph.nodes for t in n.inputs if t.storage == s.id),
        "uint8",
    )
    size = TensorInfo((1,), (1,), dtype, s.id).itemsize
    return TensorInfo((s.nbytes // size,), (1,), dtype, s.id)


__all__ = ["cuda_graph"]
