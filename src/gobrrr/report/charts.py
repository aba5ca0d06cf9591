"""The data of an estimate's charts, JSON-ready and compact (`gobrrr estimate --json`'s
"charts"; the HTML report draws from it and nothing else, so the page and the JSON agree).

- roofline: every op with FLOPs at its arithmetic intensity (FLOP/byte) and predicted FLOP/s,
  or, beyond `EVERY_OP` ops, op classes (the same op in the same phase in the same module,
  its layer number dropped: `h.*.attn`), with the GPU's compute and bandwidth roofs.
- memory: bytes allocated while each op runs, stacked by kind, downsampled to about
  `MEMORY_POINTS` ops that keep the peak and each bucket's low and high.
- modules: predicted time per module and every module above it, for a treemap.
- phases: the phases as op ranges and as spans of the predicted step (s); the collectives'
  spans on the comm stream of a multi-GPU step.
A plan's (`plan_charts`): every configuration costed, and the memory of the step as given
and of the chosen plan.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from typing import Any

from gobrrr.cost._ops_comm import KIND as COMM_KIND
from gobrrr.evaluate import Estimate, evaluate
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Calibration, GpuSpec
from gobrrr.memory.replay import MemoryResult, round_alloc
from gobrrr.plan.knobs import Knobs
from gobrrr.plan.result import PlanResult
from gobrrr.plan.search import Planner
from gobrrr.schedule.streams import COMM

CHARTS_VERSION = 1
EVERY_OP = 500  # beyond this many ops with FLOPs, the roofline shows op classes
MEMORY_POINTS = 600  # buckets of the memory series: each keeps its lowest and highest op
TREE_NODES = 1500  # the most modules the treemap holds; deeper levels are cut beyond it
MATMUL_MODES = ("bf16", "fp16", "fp8", "tf32", "fp32")
KINDS = ("parameter", "buffer", "gradient", "optimizer_state", "input", "activation", "temporary")
POINT_KEYS = ("op", "module", "phase", "regime", "math")
OTHER = "workspace"  # BLAS workspaces, kernels' scratch and the allocator's block rounding


def estimate_charts(est: Estimate) -> dict[str, Any]:
    """The charts' data of `est` (bytes, seconds, FLOPs, FLOP/s)."""
    return {
        "version": CHARTS_VERSION,
        "roofline": roofline(est),
        "memory": memory_series(est.graph, est.memory),
        "modules": module_tree(est),
        "phases": phase_spans(est),
    }


def json_text(result: dict[str, Any]) -> str:
    """`result` as the command line prints it: indented, its "charts" on one line (thousands
    of numbers, for programs, that would otherwise take a line each)."""
    if "charts" not in result:
        return json.dumps(result, indent=2)
    mark = "__gobrrr_charts__"
    text = json.dumps({**result, "charts": mark}, indent=2)
    return text.replace(f'"{mark}"', json.dumps(result["charts"], separators=(",", ":")), 1)


# ------------------------------------------------------------------------------- roofline
def roofline(est: Estimate) -> dict[str, Any]:
    """Ops (or op classes) with FLOPs as columns (`op_points`), the roofs, and the time of
    the ops the chart leaves out (without FLOPs: copies, views; the collectives), s."""
    rows, left_s = [], 0.0
    for o, w in zip(est.time.ops, est.graph.weights(), strict=True):
        if o.device_s <= 0 or o.kind == COMM_KIND:
            continue
        if o.flops > 0 and o.bytes > 0:
            rows.append(
                (o.op, o.module, o.phase, o.regime, o.math, w, o.device_s, o.flops, o.bytes)
            )
        else:
            left_s += o.device_s * w
    return {
        **op_points(rows),
        "roofs": roofs(est.gpu, est.cal, {r[4] for r in rows}),
        "left_out_s": left_s,
    }


def op_points(rows: list[tuple]) -> dict[str, Any]:
    """Rows (op, module, phase, regime, math, runs, time s, FLOPs, bytes) of one op each as
    columns op, module, phase, regime, math, count, time_s, flops, bytes: one per op, or,
    beyond EVERY_OP rows, one per op class (sums over the class, each op times its runs)."""
    grouped = len(rows) > EVERY_OP
    groups: dict[tuple, list] = {}
    for i, (op, module, phase, regime, math, runs, time_s, flops, nbytes) in enumerate(rows):
        key = (op, layer_class(module) if grouped else module, phase, regime, math)
        acc = groups.setdefault(key if grouped else (*key, i), [0, 0.0, 0.0, 0.0])
        acc[0] += runs
        acc[1] += time_s * runs
        acc[2] += flops * runs
        acc[3] += nbytes * runs
    names = (*POINT_KEYS, "count", "time_s", "flops", "bytes")
    cols: dict[str, list] = {k: [] for k in names}
    for key, sums in groups.items():
        for name, v in zip(names, (*key[:5], *sums), strict=True):
            cols[name].append(v)
    return {"grouped": grouped, "ops": cols}


def layer_class(module: str) -> str:
    """A module's name with its layer numbers dropped: "h.3.attn" -> "h.*.attn"."""
    return re.sub(r"(?<=\.)\d+(?=\.|$)|^\d+(?=\.|$)", "*", module)


def roofs(gpu: GpuSpec, cal: Calibration | None, maths: set[str]) -> dict[str, Any]:
    """The GPU's roofs (FLOP/s, bytes/s): each matmul math mode the ops use, measured by the
    calibration (or the datasheet peak x the spec's efficiency without one), the CUDA cores'
    fp32 datasheet peak, and HBM's bandwidth measured and on the datasheet."""
    compute = {}
    for mode in MATMUL_MODES:
        if mode not in maths:
            continue
        if cal and mode in cal.matmul_flops:
            compute[f"{mode} matmul, measured"] = cal.matmul_flops[mode]
        elif mode in gpu.peak_flops:
            compute[f"{mode} matmul, datasheet x {gpu.matmul_efficiency:g}"] = (
                gpu.peak_flops[mode] * gpu.matmul_efficiency
            )
    compute["fp32 vector, datasheet"] = gpu.peak_flops["fp32"]
    measured = cal.copy_bandwidth if cal else gpu.bandwidth * gpu.bandwidth_efficiency
    return {
        "compute": compute,
        "bandwidth": {
            ("HBM copy, measured" if cal else "HBM, datasheet x efficiency"): measured,
            "HBM, datasheet": gpu.bandwidth,
        },
    }


# -------------------------------------------------------------------------------- memory
def memory_series(graph: StepGraph, memory: MemoryResult) -> dict[str, Any]:
    """Bytes allocated while each kept op runs: `total` is the allocator replay's (the
    figure the peak is), stacked as the storages alive by kind plus `workspace` (the rest:
    BLAS workspaces, scratch, block rounding). `x`: op indices kept (all of them up to
    2 x MEMORY_POINTS ops)."""
    n = len(graph.nodes)
    by_kind = _alive_by_kind(graph, n)
    total = list(memory.timeline)
    keep = downsample(total, MEMORY_POINTS, memory.peak_index)
    kinds = {k: [v[i] for i in keep] for k, v in by_kind.items() if any(v)}
    kinds[OTHER] = [total[i] - sum(v[i] for v in by_kind.values()) for i in keep]
    nodes = graph.nodes
    return {
        "ops": n,
        "x": keep,
        "total": [total[i] for i in keep],
        "kinds": kinds,
        "op": [nodes[i].name for i in keep],
        "module": [nodes[i].module for i in keep],
        "phases": phase_ranges(graph),
        "peak": {
            "index": memory.peak_index,
            "bytes": memory.peak,
            "op": memory.peak_op,
            "module": memory.peak_module,
            "phase": memory.peak_phase,
            "at_peak": memory.at_peak,
        },
        "reserved_bytes": memory.reserved,
        "budget_bytes": memory.budget,
        "oom_op_index": memory.oom_index,
    }


def _alive_by_kind(graph: StepGraph, n: int) -> dict[str, list[int]]:
    """{kind: bytes alive while each op runs}, each storage rounded as the allocator rounds
    a request. What the step keeps (freed None) is alive all through the measured step: the
    previous step's until this step makes its own."""
    diff: dict[str, list[int]] = defaultdict(lambda: [0] * (n + 1))
    for s in graph.storages:
        if s.nbytes <= 0 or (s.created < 0 and s.freed is not None and s.freed < 0):
            continue
        start = max(s.created, 0) if s.freed is not None else 0
        end = n - 1 if s.freed is None else s.freed
        d = diff[s.kind]
        d[start] += round_alloc(s.nbytes)
        d[end + 1] -= round_alloc(s.nbytes)
    out = {}
    for kind in sorted(diff, key=lambda k: KINDS.index(k) if k in KINDS else len(KINDS)):
        live, series = 0, []
        for v in diff[kind][:n]:
            live += v
            series.append(live)
        out[kind] = series
    return out


def downsample(values: list[int], buckets: int, peak: int) -> list[int]:
    """Indices of `values` to draw: all of them when few, else the first, the last, `peak`
    and the lowest and highest of each of `buckets` equal runs (so no local extreme that
    spans a bucket is lost), in order."""
    n = len(values)
    if n <= 2 * buckets:
        return list(range(n))
    keep = {0, n - 1} | ({peak} if 0 <= peak < n else set())
    for b in range(buckets):
        lo, hi = b * n // buckets, (b + 1) * n // buckets
        run = range(lo, hi)
        keep.add(min(run, key=values.__getitem__))
        keep.add(max(run, key=values.__getitem__))
    return sorted(keep)


def phase_ranges(graph: StepGraph) -> list[list]:
    """[[phase, first op, last op], ...]: each run of ops of one phase, in order."""
    out: list[list] = []
    for node in graph.nodes:
        if out and out[-1][0] == node.phase:
            out[-1][2] = node.index
        else:
            out.append([node.phase, node.index, node.index])
    return out


# ------------------------------------------------------------------------- modules, phases
def module_tree(est: Estimate) -> dict[str, Any]:
    """Predicted device time (s) of every module and each module above it, as columns id
    (the module's name; "" is the step), parent, time_s. Ops count as often as they run; the
    collectives (on their own stream) not. Deeper levels are cut while over TREE_NODES."""
    weights = est.graph.weights()
    own: dict[str, float] = defaultdict(float)
    for o, w in zip(est.time.ops, weights, strict=True):
        if o.kind != COMM_KIND:  # ops outside every module (the optimizer's): "<top>"
            own[o.module or "<top>"] += o.device_s * w
    depth = max((m.count(".") + 1 for m in own if m), default=0)
    while True:
        tree = _rollup(own, depth)
        if len(tree) <= TREE_NODES or depth <= 1:
            break
        depth -= 1
    ids = sorted(tree)
    return {
        "id": ids,
        "parent": [_parent(i) for i in ids],
        "time_s": [tree[i] for i in ids],
        "depth": depth,
    }


def _rollup(own: dict[str, float], depth: int) -> dict[str, float]:
    tree: dict[str, float] = defaultdict(float)
    for module, s in own.items():
        parts = module.split(".")[:depth] if module else []
        tree[""] += s
        for k in range(1, len(parts) + 1):
            tree[".".join(parts[:k])] += s
    return dict(tree)


def _parent(module: str) -> str | None:
    if not module:
        return None
    return module.rpartition(".")[0]


def phase_spans(est: Estimate) -> dict[str, Any]:
    """The phases in the predicted step: [[phase, start s, end s], ...] of each run of ops
    (from its first kernel's start to its last one's end on the compute stream), and the
    collectives' [[start s, end s, op index], ...] on the comm stream."""
    tl = est.time.timeline
    if tl is None:
        return {"spans": [], "comm": []}
    nodes = est.graph.nodes
    spans: list[list] = []
    comm = []
    for span in tl.ops:
        if span.start is None:
            continue
        if span.stream == COMM:
            comm.append([span.start, span.end, span.index])
            continue
        phase = nodes[span.index].phase
        if spans and spans[-1][0] == phase:
            spans[-1][1] = min(spans[-1][1], span.start)
            spans[-1][2] = max(spans[-1][2], span.end)
        else:
            spans.append([phase, span.start, span.end])
    return {"spans": spans, "comm": comm}


# ---------------------------------------------------------------------------------- plan
def plan_charts(planner: Planner, result: PlanResult) -> dict[str, Any]:
    """The plan's charts: every configuration costed (`candidates`) and the memory over the
    step as given and with the chosen plan (when one fits), each re-evaluated from the
    planner's traces as the search evaluated it."""
    memory = {}
    if result.user is not None:  # a multi-GPU search need not cost the step as given
        memory["as given"] = _plan_memory(planner, result.user.knobs)
    if result.best is not None:
        memory["chosen"] = _plan_memory(planner, result.best.knobs)
    return {
        "version": CHARTS_VERSION,
        "candidates": candidates(result),
        "memory": memory,
        "usable_bytes": planner.req.usable,
    }


def _plan_memory(planner: Planner, knobs: Knobs) -> dict[str, Any]:
    # the graph `_Search.cost` evaluates for these knobs (plan/search.py); a data-parallel
    # search's own (`plan/parallel.py`: sharded after checkpointing and accumulation)
    g = planner.search.sharded(knobs) if knobs.distributed else planner.search.step_graph(knobs)
    known = planner.search.memory.get(knobs)  # the search's replay of this very graph
    return memory_series(g, known if known is not None else evaluate(g, planner.target).memory)


def candidates(result: PlanResult) -> dict[str, Any]:
    """Every configuration costed as columns (per_s in `unit`, step_s, peak_bytes,
    reserved_bytes, fits, changes), the step as given among them (`user`: its index) and the
    chosen plan's index (`chosen`, None when nothing fits)."""
    plans = list(result.plans)
    if result.user is not None and result.user not in plans:
        plans.append(result.user)
    return {
        "unit": plans[0].unit if plans else "",
        "per_s": [p.units_per_s for p in plans],
        "step_s": [p.step_s for p in plans],
        "peak_bytes": [p.peak_bytes for p in plans],
        "reserved_bytes": [p.reserved_bytes for p in plans],
        "fits": [p.fits for p in plans],
        "changes": [list(p.changes) for p in plans],
        "user": plans.index(result.user) if result.user is not None else None,
        "chosen": 0 if result.best is not None else None,
    }
