"""Where an applied plan's step spends its GPU time, kernel class by kernel class, beside the
prediction: for a plan whose measured step is off, which kernels are.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/plan/plan_step_kernels.py OUT.json \
        --from tests/fixtures/plan_h100_llama5b.json --roles plan#1,plan#3   # on the GPU
    python benchmarks/plan/plan_step_kernels.py OUT.json --compare   # on any machine: predictions

For each configuration (a scenario and role of a committed bench_plan.py result), in a fresh
process: build the workload on the GPU at the global batch, `gobrrr.apply` the knobs, 2 warm-up
steps, 3 steps timed with CUDA events (median), then one step under torch.profiler: every CUDA
kernel's and copy's device time, summed by class (matmul, attention, the optimizer's update
kernels, elementwise, reduction and norm, copy), and the time the device was busy (the union
of the kernel intervals). `--compare` adds gobrrr's predicted device seconds per op kind and
step for the same knobs (`Planner.cost`'s graph through `evaluate`), and the same kinds with
compute at its burst rates (no power limit).
"""

from __future__ import annotations

import argparse
import json
import re
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
# src/, the repository root (zoo/), benchmarks/ (child_rows, suite/, plan/) and this folder
sys.path[:0] = [
    str(HERE.parents[2] / "src"),
    str(HERE.parents[2]),
    str(HERE.parents[1]),
    str(HERE.parent),
]

from child_rows import child_flags, env_row, run_row, serve_child  # noqa: E402

from zoo import scenarios  # noqa: E402
from zoo.scenarios import SCENARIOS  # noqa: E402

FIXTURES = HERE.parents[2] / "tests" / "fixtures"  # plan_h100_*.json, which tests read too

VERSION = 1

#: kernel class -> pattern on the kernel's name (first match wins; the rest is "other")
CLASSES = (
    ("attention", r"flash|fmha|attention|sdpa"),
    ("matmul", r"gemm|cutlass|nvjet|xmma|sm90|wgmma|splitk"),
    ("optimizer", r"adam|_fused_|multi_tensor|foreach|optim"),
    ("triton", r"^triton_"),
    ("copy", r"memcpy|memset|copy|cat|fill"),
    ("reduction", r"reduce|norm|softmax|sum|mean|max|cross_entropy|nll"),
    ("elementwise", r"elementwise|vectorized|unrolled|pointwise"),
)


def kernel_class(name: str) -> str:
    low = name.lower()
    return next((c for c, pat in CLASSES if re.search(pat, low)), "other")


def busy_seconds(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (any unit), in that unit."""
    total, end = 0.0, float("-inf")
    for s, e in sorted(intervals):
        if s > end:
            total += e - s
            end = e
        elif e > end:
            total += e - end
            end = e
    return total


def run_one(source: str, seq: int | None, g: int, precision: str, knobs: dict, device: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from gobrrr.estimate import workload_factory
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs
    from gobrrr.profile.runner import time_steps

    torch.manual_seed(0)
    with torch.device(device):
        wl = workload_factory(source, g, seq)()
    step = apply(wl, Knobs.from_dict(knobs), precision=precision)
    batch = wl.batch
    for _ in range(2):
        step(batch)
    times = time_steps(lambda: step(batch), 3, device)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        step(batch)
        if device == "cuda":
            torch.cuda.synchronize()
    by_class: dict[str, list[float]] = {}
    top: dict[str, list[float]] = {}
    intervals = []
    for ev in prof.events():
        if ev.device_type != torch.autograd.DeviceType.CUDA:
            continue
        us = ev.device_time_total if hasattr(ev, "device_time_total") else ev.cuda_time_total
        cls = kernel_class(ev.name)
        by_class.setdefault(cls, [0, 0.0])
        by_class[cls][0] += 1
        by_class[cls][1] += us * 1e-6
        t = top.setdefault(ev.name[:120], [0, 0.0])
        t[0] += 1
        t[1] += us * 1e-6
        intervals.append((ev.time_range.start, ev.time_range.end))
    return {
        "step_s": statistics.median(times),
        "step_times": times,
        "busy_s": busy_seconds(intervals) * 1e-6,
        "by_class": {k: {"kernels": n, "s": s} for k, (n, s) in by_class.items()},
        "top_kernels": [
            {"name": k, "kernels": n, "s": s}
            for k, (n, s) in sorted(top.items(), key=lambda kv: -kv[1][1])[:40]
        ],
    }


def configs(path: Path, roles: list[str]):
    doc = json.loads(path.read_text())
    for name, rec in doc["scenarios"].items():
        for c in rec["configs"]:
            if c["role"] in roles and not c.get("same_as_grid"):
                yield name, rec, c


def predicted(rec: dict, knobs: dict) -> dict:
    """gobrrr's device seconds per op kind, and its step, for these knobs; the kinds also
    with every kernel at its burst rate (the calibration without `power_duty`)."""
    from dataclasses import replace

    from gobrrr.evaluate import evaluate
    from gobrrr.hardware import Target
    from gobrrr.passes.checkpoint import checkpoint as checkpoint_pass
    from gobrrr.plan.knobs import Knobs
    from gobrrr.plan.search import Planner

    name = next(
        n
        for n, s in SCENARIOS.items()
        if s[0].rsplit(":", 1)[-1] == rec["source"].rsplit(":", 1)[-1]
        and s[1] == rec["seq"]
        and s[2] == rec["global_batch"]
    )
    source, seq, g, precision, *rest = SCENARIOS[name]
    planner = Planner(
        source, "h100", global_batch=g, seq=seq, precision=precision, allow=(list(rest) + [()])[0]
    )
    k = Knobs.from_dict(knobs)
    g = planner.search.graph(k)  # one micro-batch: its ops run `accumulation` times
    if k.checkpoint:
        g = checkpoint_pass(g, dict(k.checkpoint))
    burst = Target(planner.target.gpu, replace(planner.target.cal, power_duty={}))
    out = {"step_s": planner.cost(k).step_s}
    for key, target in (
        ("device_by_kind_s", planner.target),
        ("device_by_kind_at_burst_rates_s", burst),
    ):
        kinds: dict[str, float] = {}
        for o in evaluate(g, target).time.ops:
            times = 1 if o.phase == "optimizer" else k.accumulation
            kinds[o.kind] = kinds.get(o.kind, 0.0) + o.device_s * times
        out[key] = kinds
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--from", dest="src", default=str(FIXTURES / "plan_h100_llama5b.json"))
    ap.add_argument("--roles", default="plan#1")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=int, default=500)
    ap.add_argument("--compare", action="store_true")
    child_flags(ap)
    args = ap.parse_args()
    if serve_child(args, lambda spec: run_one(*json.loads(spec), args.device)):
        return
    path = Path(args.out)
    if args.compare:
        doc = json.loads(path.read_text())
        for row in doc["rows"]:
            src = json.loads((FIXTURES / row["file"]).read_text())
            rec = src["scenarios"][row["scenario"]]
            row["predicted"] = predicted(rec, row["knobs"])
        path.write_text(json.dumps(doc, indent=1) + "\n")
        return
    out = {"version": VERSION, "environment": env_row(str(HERE)), "rows": []}
    for name, rec, c in configs(Path(args.src), args.roles.split(",")):
        source = rec["source"]
        if source.startswith("plan_scenarios.py"):  # recorded before it moved to zoo/
            source = f"{scenarios.HERE}:{source.split(':', 1)[1]}"
        cmd = [
            sys.executable,
            str(HERE),
            "x",
            "--one",
            json.dumps([source, rec["seq"], rec["global_batch"], rec["precision"], c["knobs"]]),
            "--device",
            args.device,
        ]
        row = {
            "file": Path(args.src).name,
            "scenario": name,
            "role": c["role"],
            "knobs": c["knobs"],
            "changes": c["changes"],
            "measured": run_row(cmd, args.timeout),
        }
        out["rows"].append(row)
        print(
            name,
            c["role"],
            {k: row["measured"].get(k) for k in ("step_s", "busy_s", "error")},
            flush=True,
        )
        path.write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
