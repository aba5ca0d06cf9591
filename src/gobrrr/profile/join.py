"""Join a profiler trace: GPU kernels -> the ATen op that launched them -> module, phase,
step-graph node.

Reads the Chrome-trace JSON that `torch.profiler` exports (live runs and stored fixtures go
through the same code). The links used:

1. kernel -> runtime call: a kernel (cat "kernel", "gpu_memcpy", "gpu_memset") carries the
   `correlation` id of the cudaLaunchKernel / cuLaunchKernel / cudaMemcpyAsync that issued it.
2. runtime call -> ATen op: the runtime event sits, by time, inside a stack of CPU events on
   its thread; the launching op is the **dispatch-level** ATen op of that stack: the outermost
   `aten::` op that is not CompositeImplicitAutograd (e.g. `aten::linear` -> `aten::addmm`,
   `aten::to` -> `aten::_to_copy`), which is the op a dispatch-mode trace (our StepGraph) sees.
3. module: the innermost `gobrrr.module::<fqn>` range (pushed by forward hooks) on the stack.
   Backward ops run on the autograd thread, outside any module range: the autograd node's
   `Sequence number` names the forward op that created it, and that op's module is used.
4. phase / step: `gobrrr::forward|backward|optimizer` and `gobrrr::step` ranges on the main
   thread, matched by time (the autograd thread's events fall inside "backward" by time).
   A module range inside "backward" means a forward that runs again: phase "recompute".

Kernels with no ATen op on their stack (Triton kernels of a torch.compile'd region) become
ops of their own named `compiled::<kernel>`, labelled with the compiled region.
"""

from __future__ import annotations

import difflib
import gzip
import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from gobrrr.graph.ir import StepGraph

MODULE_PREFIX = "gobrrr.module::"
PHASE_PREFIX = "gobrrr::"
STEP_LABEL = "gobrrr::step"
PHASE_NAMES = ("forward", "backward", "optimizer")
_DEVICE_CATS = ("kernel", "gpu_memcpy", "gpu_memset")
_RUNTIME_CATS = ("cuda_runtime", "cuda_driver")
_CPU_CATS = ("cpu_op", "user_annotation")
_COMPILED_MARKS = (
    "CompiledFunction",
    "Torch-Compiled Region",
    "CompiledFxGraph",
    "## Call CompiledFxGraph",
    "torch_compile",
)
US = 1e-6  # trace timestamps are microseconds


@dataclass
class Kernel:
    """One device activity. Times in seconds from the trace origin."""

    name: str
    ts: float
    dur: float
    stream: int
    op: int = -1  # index into JoinedTrace.ops, -1 when no op launched it
    gap_before: float = 0.0  # seconds the device sat idle right before this kernel


@dataclass
class TraceOp:
    """One dispatch-level ATen op call (or one compiled-region kernel)."""

    index: int
    op: str  # "aten::addmm", or "compiled::triton_poi_fused_cos_0"
    phase: str  # forward | backward | recompute | optimizer | other
    module: str
    ts: float  # host start, seconds
    host_s: float  # host duration of the call, seconds
    tid: int
    input_dims: list = field(default_factory=list)
    input_types: list = field(default_factory=list)
    kernels: list[int] = field(default_factory=list)
    compiled: str = ""  # the compiled region's label when the op ran inside one
    step: int = 0

    @property
    def family(self) -> str:
        return op_family(self.op)


@dataclass
class JoinedTrace:
    """Ops in host order, kernels in device order, and the ranges that were found."""

    ops: list[TraceOp]
    kernels: list[Kernel]
    phases: dict[str, list[tuple[float, float]]]  # phase -> its ranges (one per step)
    steps: list[tuple[float, float]]
    unattributed: int  # kernels with neither an ATen op nor a compiled region
    has_device: bool

    def device_span(self) -> tuple[float, float]:
        """(first kernel start, last kernel end) in seconds; (0, 0) without kernels."""
        if not self.kernels:
            return 0.0, 0.0
        return self.kernels[0].ts, max(k.ts + k.dur for k in self.kernels)

    def busy_s(self) -> float:
        """Seconds at least one kernel ran (the union of kernel intervals)."""
        busy, end = 0.0, float("-inf")
        for k in self.kernels:
            start, stop = max(k.ts, end), k.ts + k.dur
            if stop > start:
                busy += stop - start
            end = max(end, stop)
        return busy


def load_trace(path: str | Path) -> dict[str, Any]:
    """A Chrome trace from .json or .json.gz."""
    p = Path(path)
    raw = p.read_bytes()
    if raw[:2] == b"\x1f\x8b":
        raw = gzip.decompress(raw)
    return json.loads(raw)


# -- op names ---------------------------------------------------------------------------------

_IMPLICIT_FALLBACK = frozenset(
    {
        "linear",
        "matmul",
        "to",
        "contiguous",
        "reshape",
        "layer_norm",
        "group_norm",
        "dropout",
        "scaled_dot_product_attention",
        "cross_entropy_loss",
        "log_softmax",
        "softmax",
        "flatten",
        "type_as",
        "einsum",
        "conv2d",
        "batch_norm",
        "nll_loss_nd",
        "chunk",
        "split",
    }
)


@lru_cache(maxsize=4096)
def is_composite_implicit(name: str) -> bool:
    """True when `aten::name` only decomposes into other ops (it launches nothing itself)."""
    short = name.split("::", 1)[-1]
    try:
        import torch

        packet = getattr(torch.ops.aten, short)
        overloads = [o for o in packet.overloads() if "out" not in o]
        if not overloads:
            return short in _IMPLICIT_FALLBACK
        has = torch._C._dispatch_has_kernel_for_dispatch_key
        names = [f"aten::{short}" + ("" if o == "default" else f".{o}") for o in overloads]
        return all(has(n, "CompositeImplicitAutograd") for n in names)
    except (AttributeError, RuntimeError):
        return short in _IMPLICIT_FALLBACK


_FAMILIES = {
    "matmul": ("mm", "addmm", "bmm", "baddbmm", "addbmm", "matmul", "linear", "_scaled_mm"),
    "copy": ("copy", "_to_copy", "clone", "contiguous", "to"),
    "view": (
        "view",
        "_unsafe_view",
        "reshape",
        "t",
        "transpose",
        "permute",
        "expand",
        "as_strided",
        "unsqueeze",
        "squeeze",
        "slice",
        "select",
        "split",
        "alias",
        "split_with_sizes",
        "detach",
        "_reshape_alias",
        "unbind",
        "chunk",
    ),
}


def op_family(op: str) -> str:
    """A name that survives renames between the CPU trace and a CUDA run: "aten::addmm" and
    "aten.mm.default" -> "matmul", any SDPA backend -> "attention" / "attention_backward",
    "aten::add_" -> "add"."""
    name = op.split("::", 1)[-1]
    if name.startswith("aten."):
        name = name.split(".")[1]
    if op.startswith("compiled::"):
        return "compiled"
    if any(
        s in name
        for s in ("scaled_dot_product", "flash_attention", "efficient_attention", "cudnn_attention")
    ):
        return "attention_backward" if "backward" in name else "attention"
    for fam, names in _FAMILIES.items():
        if name in names or name.rstrip("_") in names:
            return fam
    return name.strip("_") or name


# -- the join -----------------------------------------------------------------------------------


def join_trace(trace: dict[str, Any], has_device: bool | None = None) -> JoinedTrace:
    """Attribute every kernel of a profiler trace to its op, module and phase.

    `has_device` False treats the trace as a CPU run (no kernels; op time = host time).
    """
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X"]
    cpu = [e for e in events if e.get("cat") in _CPU_CATS + _RUNTIME_CATS]
    dev = [e for e in events if e.get("cat") in _DEVICE_CATS]
    if has_device is None:
        has_device = bool(dev)
    parents = _parent_links(cpu)
    phases, steps = _ranges(cpu)
    dispatch = _dispatch_level(cpu, parents)
    seq_module = _forward_seq_modules(cpu, parents, phases)
    ops: list[TraceOp] = []
    op_of_event: dict[int, int] = {}
    for i in sorted(dispatch, key=lambda i: cpu[i]["ts"]):
        op_of_event[i] = len(ops)
        ops.append(_make_op(len(ops), cpu, i, parents, phases, steps, seq_module))
    kernels, unattributed = _attach_kernels(
        cpu, dev, parents, dispatch, op_of_event, ops, phases, steps, seq_module
    )
    return JoinedTrace(
        ops=ops,
        kernels=kernels,
        phases=phases,
        steps=steps,
        unattributed=unattributed,
        has_device=has_device,
    )


def _parent_links(cpu: list[dict]) -> list[int]:
    """Parent index of each CPU event: the innermost enclosing event on its thread."""
    parents = [-1] * len(cpu)
    by_tid: dict[Any, list[int]] = {}
    for i, e in enumerate(cpu):
        by_tid.setdefault((e.get("pid"), e.get("tid")), []).append(i)
    for idx in by_tid.values():
        idx.sort(key=lambda i: (cpu[i]["ts"], -cpu[i].get("dur", 0)))
        stack: list[int] = []
        for i in idx:
            ts = cpu[i]["ts"]
            end = ts + cpu[i].get("dur", 0)
            while stack and cpu[stack[-1]]["ts"] + cpu[stack[-1]].get("dur", 0) < end - 1e-3:
                stack.pop()
            parents[i] = stack[-1] if stack else -1
            if cpu[i].get("cat") in _CPU_CATS:
                stack.append(i)
    return parents


def _chain(i: int, parents: list[int]):
    """Ancestors of event i, innermost first."""
    i = parents[i]
    while i >= 0:
        yield i
        i = parents[i]


def _ranges(cpu: list[dict]) -> tuple[dict[str, list], list[tuple[float, float]]]:
    phases: dict[str, list[tuple[float, float]]] = {}
    steps: list[tuple[float, float]] = []
    for e in cpu:
        if e.get("cat") != "user_annotation":
            continue
        span = (e["ts"] * US, (e["ts"] + e.get("dur", 0)) * US)
        if e["name"] == STEP_LABEL:
            steps.append(span)
        elif e["name"].startswith(PHASE_PREFIX) and e["name"][len(PHASE_PREFIX) :] in PHASE_NAMES:
            phases.setdefault(e["name"][len(PHASE_PREFIX) :], []).append(span)
    steps.sort()
    return phases, steps


def _phase_at(t: float, phases: dict[str, list[tuple[float, float]]]) -> str:
    for name, spans in phases.items():
        if any(a <= t <= b for a, b in spans):
            return name
    return "other"


def _step_at(t: float, steps: list[tuple[float, float]]) -> int:
    for k, (a, b) in enumerate(steps):
        if a <= t <= b:
            return k
    return -1 if steps else 0


def _dispatch_level(cpu: list[dict], parents: list[int]) -> set[int]:
    """Indices of the outermost non-implicit aten:: op of each stack."""
    out: set[int] = set()
    for i, e in enumerate(cpu):
        if e.get("cat") != "cpu_op" or not e["name"].startswith("aten::"):
            continue
        if is_composite_implicit(e["name"]):
            continue
        inner = any(
            cpu[a]["name"].startswith("aten::") and not is_composite_implicit(cpu[a]["name"])
            for a in _chain(i, parents)
        )
        if not inner:
            out.add(i)
    return out


def _module_on_stack(i: int, cpu: list[dict], parents: list[int]) -> str | None:
    for a in _chain(i, parents):
        name = cpu[a]["name"]
        if cpu[a].get("cat") == "user_annotation" and name.startswith(MODULE_PREFIX):
            return name[len(MODULE_PREFIX) :]
    return None


def _forward_seq_modules(cpu, parents, phases) -> dict[int, str]:
    """Autograd sequence number -> module of the forward op that recorded it."""
    out: dict[int, str] = {}
    for i, e in enumerate(cpu):
        seq = e.get("args", {}).get("Sequence number")
        if seq is None or not e["name"].startswith("aten::"):
            continue
        if phases and _phase_at(e["ts"] * US, phases) != "forward":
            continue
        mod = _module_on_stack(i, cpu, parents)
        if mod is not None:
            out.setdefault(seq, mod)
    return out


def _backward_module(i: int, cpu, parents, seq_module: dict[int, str]) -> str | None:
    for a in _chain(i, parents):
        args = cpu[a].get("args", {})
        if "Fwd thread id" in args and not cpu[a]["name"].startswith("aten::"):
            return seq_module.get(args.get("Sequence number"))
    return None


def _compiled_region(i: int, cpu, parents) -> str:
    for a in _chain(i, parents):
        name = cpu[a]["name"]
        if any(m in name for m in _COMPILED_MARKS):
            return name
    return ""


def _make_op(index, cpu, i, parents, phases, steps, seq_module) -> TraceOp:
    e = cpu[i]
    t = e["ts"] * US
    phase = _phase_at(t, phases)
    own = _module_on_stack(i, cpu, parents)
    module = own
    if phase == "backward":
        if own is not None:
            phase = "recompute"
        else:
            module = _backward_module(i, cpu, parents, seq_module)
    args = e.get("args", {})
    return TraceOp(
        index=index,
        op=e["name"],
        phase=phase,
        module=module or "",
        ts=t,
        host_s=e.get("dur", 0) * US,
        tid=e.get("tid", 0),
        input_dims=args.get("Input Dims", []),
        input_types=args.get("Input type", []),
        compiled=_compiled_region(i, cpu, parents),
        step=_step_at(t, steps),
    )


def _attach_kernels(cpu, dev, parents, dispatch, op_of_event, ops, phases, steps, seq_module):
    runtime = {
        e.get("args", {}).get("correlation"): i
        for i, e in enumerate(cpu)
        if e.get("cat") in _RUNTIME_CATS
    }
    dev = sorted(dev, key=lambda e: e["ts"])
    kernels: list[Kernel] = []
    unattributed = 0
    end = None
    for e in dev:
        k = Kernel(
            name=e["name"],
            ts=e["ts"] * US,
            dur=e.get("dur", 0) * US,
            stream=int(e.get("args", {}).get("stream", e.get("tid", 0)) or 0),
        )
        k.gap_before = 0.0 if end is None else max(0.0, k.ts - end)
        end = k.ts + k.dur if end is None else max(end, k.ts + k.dur)
        r = runtime.get(e.get("args", {}).get("correlation"))
        k.op = _owner(r, cpu, parents, dispatch, op_of_event, ops, phases, steps, seq_module, k)
        if k.op < 0:
            unattributed += 1
        else:
            ops[k.op].kernels.append(len(kernels))
        kernels.append(k)
    return kernels, unattributed


def _owner(r, cpu, parents, dispatch, op_of_event, ops, phases, steps, seq_module, k) -> int:
    """The op index that launched kernel k through runtime event r (new op if compiled)."""
    if r is None:
        return -1
    for a in _chain(r, parents):
        if a in dispatch:
            return op_of_event[a]
    region = _compiled_region(r, cpu, parents)
    if not region:
        return -1
    op = _make_op(len(ops), cpu, r, parents, phases, steps, seq_module)
    op.op, op.compiled, op.host_s = f"compiled::{k.name}", region, 0.0
    ops.append(op)
    return op.index


# -- graph alignment ----------------------------------------------------------------------------


def align_graph(ops: list[TraceOp], graph: StepGraph) -> tuple[list[int], float]:
    """Graph node index for each trace op (-1 when unmatched) and the fraction of the
    kernel-launching ops that matched.

    Per phase, the op-family sequences of trace and graph are aligned with difflib's
    longest-matching-blocks (order preserving, like an LCS). "recompute" ops align with the
    graph's recompute nodes when it has them.
    """
    nodes_of = {
        p: [n for n in graph.nodes if n.phase == p]
        for p in ("forward", "backward", "recompute", "optimizer")
    }
    match = [-1] * len(ops)
    for phase, nodes in nodes_of.items():
        idx = [i for i, o in enumerate(ops) if o.phase == phase and not o.compiled]
        a = [ops[i].family for i in idx]
        b = [op_family(n.op) for n in nodes]
        sm = difflib.SequenceMatcher(a=a, b=b, autojunk=False)
        for blk in sm.get_matching_blocks():
            for j in range(blk.size):
                match[idx[blk.a + j]] = nodes[blk.b + j].index
    launching = [i for i, o in enumerate(ops) if o.kernels or not o.compiled]
    launching = [i for i in launching if ops[i].kernels] or launching
    got = sum(1 for i in launching if match[i] >= 0)
    return match, (got / len(launching) if launching else 0.0)
