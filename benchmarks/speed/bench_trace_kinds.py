"""What one trace of a step costs on this CPU, eager and under torch.compile, and how much of a
compiled trace is the compile (dynamo and AOTAutograd) rather than the traced step.

    python benchmarks/speed/bench_trace_kinds.py benchmarks/results/trace_kinds_cpu.json \
        [--model gpt2] [--micro-batches 1,2,4] [--runs 2]

Each trace runs in a fresh process, as a planner's worker runs its first: `capture` of the
built-in model at one micro-batch, bf16-mixed, with compile "none" (eager), "blocks" (each
repeated block compiled on its own) and "model" (torch.compile(model)). Recorded per trace:
wall and CPU seconds (user + system), and for a compiled one the seconds dynamo's own timers
put on its phases (`torch._dynamo.utils.compilation_time_metrics`, read before the capture
resets dynamo): `_compile.compile_inner` (tracing the bytecode and everything under it),
`bytecode_tracing`, `create_aot_dispatcher_function` (AOTAutograd: the joint graph,
Inductor's joint-graph passes, the min-cut partition), `aot_trace_joint_graph`,
`min_cut_rematerialization_partition`, `_recursive_joint_graph_passes`. A plan with
`--allow compile` traces each compiled variant at three micro-batches (docs/planning-time.md);
these figures bound what sharing one compile between them could save.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KINDS = ("none", "blocks", "model")
PHASES = (
    "_compile.compile_inner",
    "bytecode_tracing",
    "create_aot_dispatcher_function",
    "aot_trace_joint_graph",
    "min_cut_rematerialization_partition",
    "_recursive_joint_graph_passes",
)


def one(model: str, micro_batch: int, kind: str) -> dict:
    """One trace in this process (the child): its wall and CPU seconds and dynamo's phases."""
    t = time.perf_counter()
    r0 = resource.getrusage(resource.RUSAGE_SELF)
    import torch._dynamo
    import torch._dynamo.utils as dynamo_utils

    from gobrrr.capture import capture
    from gobrrr.models import get_workload

    phases: dict[str, float] = {}
    reset = torch._dynamo.reset

    def keep_then_reset() -> None:  # the capture resets dynamo, and its timers with it
        for name, times in dynamo_utils.compilation_time_metrics.items():
            phases[name] = phases.get(name, 0.0) + sum(times)
        reset()

    torch._dynamo.reset = keep_then_reset
    imported = time.perf_counter()
    c0 = resource.getrusage(resource.RUSAGE_SELF)
    graph = capture(
        get_workload(model, batch_size=micro_batch),
        precision="bf16-mixed",
        compile=False if kind == "none" else kind,
    )
    c1 = resource.getrusage(resource.RUSAGE_SELF)
    done = time.perf_counter()
    return {
        "model": model,
        "micro_batch": micro_batch,
        "compile": kind,
        "ops": len(graph.nodes),
        "import_s": imported - t,
        "trace_wall_s": done - imported,
        "trace_cpu_s": (c1.ru_utime - c0.ru_utime) + (c1.ru_stime - c0.ru_stime),
        "process_cpu_s": (c1.ru_utime - r0.ru_utime) + (c1.ru_stime - r0.ru_stime),
        "compile_phases_s": {p: phases[p] for p in PHASES if p in phases},
    }


def run_child(model: str, micro_batch: int, kind: str) -> dict:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    cmd = [sys.executable, __file__, "--one", model, str(micro_batch), kind]
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=600)
    lines = [x for x in p.stdout.splitlines() if x.startswith("{")]
    if p.returncode or not lines:
        raise SystemExit(f"trace {model} b{micro_batch} {kind} failed: {p.stderr[-2000:]}")
    return json.loads(lines[-1])


def summary(rows: list[dict]) -> dict:
    """Per kind: the median trace's wall and CPU seconds over micro-batches and runs, and the
    median compile_inner (the compile itself) of the compiled kinds."""
    out = {}
    for kind in KINDS:
        mine = [r for r in rows if r["compile"] == kind]
        if not mine:
            continue
        inner = [r["compile_phases_s"].get("_compile.compile_inner", 0.0) for r in mine]
        out[kind] = {
            "traces": len(mine),
            "trace_wall_s_median": statistics.median(r["trace_wall_s"] for r in mine),
            "trace_cpu_s_median": statistics.median(r["trace_cpu_s"] for r in mine),
            "compile_inner_s_median": statistics.median(inner),
            "rest_cpu_s_median": statistics.median(
                r["trace_cpu_s"] - i for r, i in zip(mine, inner, strict=True)
            ),
        }
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", nargs="?", type=Path)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--micro-batches", default="1,2,4")
    ap.add_argument("--runs", type=int, default=2)
    ap.add_argument("--one", nargs=3, metavar=("MODEL", "MICRO_BATCH", "KIND"))
    args = ap.parse_args(argv)
    if args.one:
        model, mb, kind = args.one
        print(json.dumps(one(model, int(mb), kind)))
        return 0
    if args.out is None:
        ap.error("give the output JSON's path")
    from benchmarks.plan.multigpu_plan_time import environment

    micro_batches = [int(m) for m in args.micro_batches.split(",")]
    rows = []
    for _ in range(args.runs):
        for kind in KINDS:
            for m in micro_batches:
                row = run_child(args.model, m, kind)
                print(
                    f"{kind:6s} b{m}: trace {row['trace_wall_s']:.2f} s wall, "
                    f"{row['trace_cpu_s']:.2f} CPU-s, compile "
                    f"{row['compile_phases_s'].get('_compile.compile_inner', 0.0):.2f} s",
                    flush=True,
                )
                rows.append(row)
    result = {
        "version": 1,
        "environment": environment(),  # multigpu_plan_time's: commit, versions, CPU, load
        "model": args.model,
        "precision": "bf16-mixed",
        "rows": rows,
        "summary": summary(rows),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT), str(ROOT / "src")]
    sys.exit(main())
