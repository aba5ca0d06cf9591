"""Tracing a step whose model runs under torch.compile: the graphs AOTAutograd partitions.

    graph = capture(workload, precision="bf16-mixed", compile=True)

What a compiled step keeps and runs is decided by torch itself, and the trace asks it:
the model is wrapped in `torch.compile` with a backend (`recording_backend`) that is
Inductor's front half: AOTAutograd with Inductor's decompositions, Inductor's joint-graph
passes and its partitioner (`min_cut_rematerialization_partition`, which recomputes cheap
pointwise chains in backward and saves the cheapest tensors). In place of Inductor's code
generation, each partitioned forward and backward graph runs op by op on the trace's fake
tensors (`_Runner`), so the recorder sees the ATen ops the compiled step runs, the tensors
the forward saves for backward (the forward graph's extra outputs, alive until the backward
graph uses them) and the backward's recomputation. Graph breaks give several graphs, each
partitioned. Each run of a graph is a compiled region, recorded as an op index range
(`Regions`); what Inductor then fuses inside a region, so that it is never allocated, is
`gobrrr.passes.compile.inductor`'s to decide.

Two ways to compile (MODES): "model", torch.compile(model), the whole forward one graph (or
a few, at graph breaks); "blocks", regional compilation: each repeated block's forward
compiled on its own (`compile_blocks`), the rest of the model eager. The blocks share one
forward and one backward graph (dynamo compiles a block class's code once and guards on
its structure, not on which block), so each block's call and backward is one region of its
own, named by the block it ran for. A block checkpointed around its compiled forward
(checkpoint(compiled forward), `gobrrr.training.checkpointing`) runs that forward graph
again in backward: a forward region recorded in the recompute phase.

The trace's dispatch modes step aside while dynamo and AOTAutograd trace
(`ignore_compile_internals`: `active()` is true during a compiled capture) and see the
graphs' ops when they run.
"""

from __future__ import annotations

import contextlib
import contextvars
import functools
import re
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from gobrrr.errors import GobrrrError
from gobrrr.graph.meta import Region

_ACTIVE = contextvars.ContextVar("gobrrr_compiled_capture", default=False)
_MODULE: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gobrrr_compiled_module", default=None
)
_KIND: contextvars.ContextVar[str | None] = contextvars.ContextVar(
    "gobrrr_compiled_kind", default=None
)

#: How the model is compiled: "none" (eager), "model" (torch.compile(model)), "blocks" (each
#: repeated block's forward compiled on its own, the rest eager).
MODES = ("none", "model", "blocks")


def mode(value: object, name: str = "compile") -> str:
    """`value` as one of MODES: False -> "none", True -> "model" (the whole model, as the
    boolean meant before "blocks" existed); anything else is a GobrrrError naming it."""
    if value is False or value is None:
        return "none"
    if value is True:
        return "model"
    if isinstance(value, str) and value in MODES:
        return value
    raise GobrrrError(
        f"{name}={value!r}: choose {', '.join(repr(m) for m in MODES)} "
        "(True means 'model', False 'none')"
    )


def active() -> bool:
    """Whether a compiled capture is running (the trace's modes then ignore compilation)."""
    return _ACTIVE.get()


def current_module() -> str | None:
    """The module of the compiled graph's op now running (None: not inside a graph)."""
    return _MODULE.get()


def current_kind() -> str | None:
    """The kind of the compiled graph now running ("forward", "backward"; None: none)."""
    return _KIND.get()


@dataclass
class Regions:
    """The compiled graphs of one capture and the op index ranges their runs recorded.

    graphs: (kind, GraphModule) in the order AOTAutograd made them ("forward", "backward",
    "inference"). runs: [kind, first op, last op] of each graph's run (ops of the trace's
    recorder; an empty run is left out). `clock()` gives the index the next op will get.
    prefix: the module the graph now called runs for ("transformer.h.3" for a compiled
    block; "" for the whole model), which its ops' module names are relative to."""

    clock: Callable[[], int] = lambda: 0
    graphs: list[tuple[str, torch.fx.GraphModule]] = field(default_factory=list)
    runs: list[list[Any]] = field(default_factory=list)
    prefix: str = ""

    def meta(self) -> tuple[Region, ...]:
        return tuple(Region(*r) for r in self.runs)


class _Runner(torch.fx.Interpreter):
    """Runs one partitioned graph op by op (values freed after their last use, as the
    generated code frees buffers), telling the trace which module each op belongs to.
    Called boxed, as AOTAutograd calls compiled graphs: one list of arguments, which the run
    clears, so an input can be freed after its last use."""

    def __init__(self, gm: torch.fx.GraphModule, kind: str, regions: Regions) -> None:
        super().__init__(gm, garbage_collect_values=True)
        self.kind, self.regions, self.prefix = kind, regions, ""
        self.modules = {n: module_of(n) for n in gm.graph.nodes}

    def run_node(self, n: torch.fx.Node) -> Any:
        module = ".".join(p for p in (self.prefix, self.modules.get(n) or "") if p)
        token = _MODULE.set(module)
        try:
            return super().run_node(n)
        finally:
            _MODULE.reset(token)

    def __call__(self, args: list) -> Any:
        first = self.regions.clock()
        self.prefix = self.regions.prefix
        token = _KIND.set(self.kind)
        try:
            out = self.boxed_run(args)
        finally:
            _KIND.reset(token)
        self.env = {}  # the interpreter would keep the outputs referenced until its next run
        last = self.regions.clock() - 1
        if last >= first:
            self.regions.runs.append([self.kind, first, last])
        return out


def module_of(n: torch.fx.Node) -> str:
    """The module that made an FX node ("transformer.h.0.attn"), from dynamo's
    nn_module_stack (a backward node carries its forward node's, `fwd_nn_module_stack`)."""
    node_info = n.meta  # torch.fx's own per-node dict, not a step graph's StepMeta
    stack = node_info.get("nn_module_stack") or node_info.get("fwd_nn_module_stack")
    if not stack:
        return ""
    path = list(stack.values())[-1][0]
    return _fqn(path)


def _fqn(path: str) -> str:
    """dynamo's module path ("L['self'].transformer.h[0]", or with `._modules['h']`) as a
    named_modules name ("transformer.h.0")."""
    p = re.sub(r"^L\['[^']*'\]", "", path)  # the compiled module itself, whatever its name
    p = p.replace("['", ".").replace("']", "").replace("[", ".").replace("]", "")
    p = p.replace("._modules.", ".").replace("_modules.", "")
    return p.strip(".")


def _partition(gm: torch.fx.GraphModule, joint_inputs, **kwargs):
    """Inductor's partition: its joint-graph passes, then the min-cut partitioner as
    Inductor calls it."""
    from torch._guards import detect_fake_mode
    from torch._inductor import compile_fx
    from torch._inductor.virtualized import V

    with V.set_fake_mode(detect_fake_mode(joint_inputs)):  # as Inductor partitions
        fn = getattr(compile_fx, "partition_fn", None)
        if fn is not None:
            return fn(gm, joint_inputs, **kwargs)
        from torch._functorch.partitioners import min_cut_rematerialization_partition
        from torch._inductor.fx_passes.joint_graph import joint_graph_passes

        joint_graph_passes(gm)
        return min_cut_rematerialization_partition(gm, joint_inputs, compiler="inductor", **kwargs)


def recording_backend(regions: Regions) -> Callable:
    """A torch.compile backend: AOTAutograd with Inductor's decompositions and partition,
    each graph recorded in `regions` and run op by op (`_Runner`)."""
    import torch._inductor.compile_fx
    import torch._inductor.lowering  # noqa: F401  Inductor's decompositions consult its lowerings
    from torch._dynamo.backends.common import aot_autograd
    from torch._inductor.decomposition import select_decomp_table

    def compiler(kind: str):
        def compile_graph(gm: torch.fx.GraphModule, example_inputs) -> Callable:
            regions.graphs.append((kind, gm))
            runner = _Runner(gm, kind, regions)

            def run(args: list) -> Any:  # a function: torch's wrappers keep its attributes
                return runner(args)

            run._boxed_call = True  # type: ignore[attr-defined]
            return run

        return compile_graph

    return aot_autograd(
        fw_compiler=compiler("forward"),
        bw_compiler=compiler("backward"),
        inference_compiler=compiler("inference"),
        partition_fn=_partition,
        decompositions=select_decomp_table(),
    )


@contextlib.contextmanager
def compiling() -> Iterator[None]:
    """A compiled capture: the trace's modes ignore compilation, dynamo starts afresh (its
    caches hold no graph compiled for other fake tensors) and is reset again after."""
    import torch._dynamo

    token = _ACTIVE.set(True)
    torch._dynamo.reset()
    try:
        with warnings.catch_warnings():  # the trace's global module hooks are meant
            warnings.filterwarnings("ignore", message=r"Using `torch.compile\(module\)` when")
            yield
    finally:
        _ACTIVE.reset(token)
        torch._dynamo.reset()


def compile_model(model: torch.nn.Module, regions: Regions) -> torch.nn.Module:
    """`torch.compile(model)` as the trace runs it (see `recording_backend`)."""
    return torch.compile(model, backend=recording_backend(regions))


def compile_blocks(model: torch.nn.Module, blocks: list[str], regions: Regions) -> None:
    """Each named block's forward compiled on its own, in place, as the trace runs it (see
    `recording_backend`; one backend for all, so dynamo compiles the shared code once).
    The block's own call stays eager (its hooks run), and a checkpoint wrapper applied after
    wraps the compiled forward."""
    backend = recording_backend(regions)
    for name in blocks:
        block = model.get_submodule(name)
        block.forward = _for_block(name, torch.compile(block.forward, backend=backend), regions)


def _for_block(name: str, fn: Callable, regions: Regions) -> Callable:
    """`fn` (a block's compiled forward) with its graphs' runs named by the block: the
    forward (and a checkpoint's recompute) by the call, the backward by a hook on the
    outputs' autograd nodes, which run just before the block's compiled backward."""

    def name_backward(grad_outputs):
        regions.prefix = name

    @functools.wraps(fn)
    def forward(*args, **kwargs):
        # restored after: a recompute runs inside the block's backward, which follows it
        outer, regions.prefix = regions.prefix, name
        try:
            out = fn(*args, **kwargs)
        finally:
            regions.prefix = outer
        for t in _tensors(out):
            if t.grad_fn is not None:
                t.grad_fn.register_prehook(name_backward)
        return out

    return forward


def _tensors(out: Any) -> Iterator[torch.Tensor]:
    """The tensors of a block's output (a tensor, or a tuple or list holding some)."""
    if isinstance(out, torch.Tensor):
        yield out
    elif isinstance(out, (tuple, list)):
        for o in out:
            yield from _tensors(o)


def tag(graph, regions: Regions):
    """The captured graph with its compiled regions in meta: "compiled": True,
    "compiled_regions": [[kind, first op, last op], ...], "compiled_graphs": graphs made by
    kind (several forwards: graph breaks)."""
    import dataclasses

    if not regions.runs:
        raise GobrrrError(
            "torch.compile ran no compiled graph in the traced step (dynamo skipped the model "
            f"under torch {torch.__version__}'s dispatch modes): estimate it without compile"
        )
    made = Counter(kind for kind, _ in regions.graphs)
    return dataclasses.replace(
        graph,
        meta=graph.meta.replace(
            compiled=True,
            compiled_regions=regions.meta(),
            compiled_graphs=dict(made),
            sdpa_backends=_backends(graph),
        ),
    )


_SDPA = {
    "_scaled_dot_product_cudnn_attention": "cudnn",
    "_scaled_dot_product_flash_attention": "flash",
    "_scaled_dot_product_efficient_attention": "efficient",
}


def _backends(graph) -> dict[str, int]:
    """The fused attention calls of the recorded forward, by backend (the choice was made
    while the graphs were traced; the math path is decomposed into plain ops)."""
    out: Counter = Counter()
    for n in graph.nodes:
        if n.phase == "forward" and n.name in _SDPA:
            out[_SDPA[n.name]] += 1
    return dict(out)


def ignore_compile_internals(cls) -> bool:
    """For the trace's dispatch modes (see torch's TorchDispatchMode): step aside while a
    compiled capture's graphs are traced, see their ops when they run."""
    return active()


__all__ = [
    "MODES",
    "Regions",
    "active",
    "compile_blocks",
    "compile_model",
    "compiling",
    "current_kind",
    "current_module",
    "ignore_compile_internals",
    "mode",
    "module_of",
    "recording_backend",
    "tag",
]
