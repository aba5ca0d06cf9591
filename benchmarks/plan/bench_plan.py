"""The planner against the grid a careful user would try by hand, measured on a real GPU.

    PYTHONUNBUFFERED=1 python benchmarks/plan/bench_plan.py OUT.json [--scenarios NAME,NAME]
        [--warmup 2] [--steps 5] [--device cuda]

For each scenario (a workload, a sequence length and a global batch where memory binds):
1. `gobrrr.plan` on this machine's CPU (traced on fake tensors, costed on the GPU's
   calibration): the plans, best first, and the predicted step of every grid point.
2. The grid, measured: every micro-batch that divides the global batch, with gradient
   accumulation to it, x activation checkpointing of every block on / off, at the user's
   precision — and the planner's best plan (and the next two), applied with `gobrrr.apply`.
   Each configuration runs in a fresh process: build on the GPU at the global batch, warm up,
   reset the peak-memory stats, time `--steps` optimizer steps with CUDA events (median), read
   max_memory_allocated / max_memory_reserved. Out of memory is recorded, not fatal.
3. The figures: the plan's measured throughput over the grid's best, and the prediction's
   error (throughput, allocated peak, reserved peak) for every configuration that ran.
OUT.json is rewritten after every configuration.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
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

from zoo.scenarios import SCENARIOS  # noqa: E402

VERSION = 1

#: The grid's micro-batches: those that divide the global batch with at most this many
#: accumulation steps (what a careful user would try by hand).
GRID_ACCUMULATION = 8


def grid(planner) -> list:
    """Micro-batch x (no checkpointing | every block full), accumulation to the global batch."""
    from gobrrr.plan.knobs import Knobs, every_kth
    from gobrrr.plan.search import divisors

    g = planner.req.global_batch
    full = every_kth(planner.blocks, 1) if planner.blocks else None
    out = []
    for m in (d for d in divisors(g) if g // d <= GRID_ACCUMULATION):
        out.append(Knobs(micro_batch=m, accumulation=g // m))
        if full:
            out.append(Knobs(micro_batch=m, accumulation=g // m, checkpoint=full))
    return out


# -- the child: one configuration ------------------------------------------------------------
def run_one(
    source: str,
    seq: int | None,
    g: int,
    precision: str,
    knobs: dict,
    warmup: int,
    steps: int,
    device: str,
) -> dict:
    import torch

    from gobrrr.estimate import workload_factory
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs
    from gobrrr.profile.runner import time_steps

    row: dict = {}
    try:
        torch.manual_seed(0)
        with torch.device(device):
            wl = workload_factory(source, g, seq)()
        step = apply(wl, Knobs.from_dict(knobs), precision=precision)
        batch = wl.batch
        for _ in range(warmup):
            step(batch)
        cuda = torch.device(device).type == "cuda"
        if cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
        times = time_steps(lambda: step(batch), steps, device)
        row.update(step_s=statistics.median(times), step_times=times)
        if cuda:  # a dry run on the CPU has no allocator peaks to read
            row.update(
                peak_allocated=torch.cuda.max_memory_allocated(),
                peak_reserved=torch.cuda.max_memory_reserved(),
            )
    except Exception as e:  # recorded: one configuration must not sink the run
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        row["error"] = {
            "type": type(e).__name__,
            "message": str(e)[:1000],
            "oom": oom,
            "traceback": traceback.format_exc().splitlines()[-8:],
        }
    return row


# -- the parent --------------------------------------------------------------------------------
def measure(args, source, seq, g, precision, knobs) -> dict:
    cmd = [
        sys.executable,
        str(HERE),
        "--one",
        json.dumps([source, seq, g, precision, knobs.to_dict()]),
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
        "--device",
        args.device,
    ]
    return run_row(cmd, args.timeout)


def child_environment() -> dict:
    """Device and versions, read in a fresh process (`child_rows.env_row`), with the model
    libraries' versions."""
    env = env_row(str(HERE))
    for lib in ("transformers", "torchvision"):
        try:
            env[lib] = __import__(lib).__version__
        except ImportError:
            env[lib] = None
    return env


def scenario(args, name: str, out: dict, save) -> None:
    from gobrrr.plan.search import Planner

    source, seq, g, precision, *rest = SCENARIOS[name]
    allow, grid_mode = (list(rest) + [(), "all"][len(rest) :])[:2]
    t = time.perf_counter()
    planner = Planner(source, "h100", global_batch=g, seq=seq, precision=precision, allow=allow)
    result = planner.run()
    rec = {
        "source": Path(source).name if "/" in source else source,
        "seq": seq,
        "global_batch": g,
        "precision": precision,
        "allow": list(allow),
        "grid": grid_mode,
        "plan_s": time.perf_counter() - t,
        "plan": result.to_dict(top=5),
        "configs": [],
    }
    out["scenarios"][name] = rec
    chosen = [p.knobs for p in result.plans[:3] if p.fits]
    points = grid(planner)
    if grid_mode == "least":
        points = [min(points, key=lambda k: (k.micro_batch, not k.checkpoint))]
    configs = [(k, "grid") for k in points]
    configs += [(k, f"plan#{i + 1}") for i, k in enumerate(chosen)]
    measured: dict = {}  # a configuration the grid and the plan share runs once
    for knobs, role in configs:
        pred = planner.cost(knobs)
        row = {
            "role": role,
            "knobs": knobs.to_dict(),
            "changes": list(pred.changes),
            "predicted": {
                "step_s": pred.step_s,
                "units_per_s": pred.units_per_s,
                "peak_allocated": pred.peak_bytes,
                "peak_reserved": pred.reserved_bytes,
                "fits": pred.fits,
            },
            "measured": measured.get(knobs) or measure(args, source, seq, g, precision, knobs),
        }
        if knobs in measured:
            row["same_as_grid"] = True
        measured[knobs] = row["measured"]
        m = row["measured"]
        if "step_s" in m:
            m.setdefault("units_per_s", pred.units_per_s * pred.step_s / m["step_s"])
        rec["configs"].append(row)
        print(
            name,
            role,
            knobs.to_dict(),
            "->",
            {k: m.get(k) for k in ("step_s", "peak_allocated", "error")},
        )
        save()
    rec["summary"] = summarize(rec["configs"])
    save()


def summarize(configs: list[dict]) -> dict:
    """The plan over the grid's best, and the prediction's errors, from what ran."""
    ran = [c for c in configs if "step_s" in c["measured"]]
    grid_best = max(
        (c["measured"]["units_per_s"] for c in ran if c["role"] == "grid"), default=None
    )
    plan = next((c for c in configs if c["role"] == "plan#1"), None)
    out: dict = {
        "grid_best_units_per_s": grid_best,
        "grid_oom": sum(
            1 for c in configs if c["role"] == "grid" and c["measured"].get("error", {}).get("oom")
        ),
    }
    if plan is not None:
        m = plan["measured"]
        out["plan_ran"] = "step_s" in m
        out["plan_oom"] = bool(m.get("error", {}).get("oom"))
        if "step_s" in m and grid_best:
            out["plan_over_grid_best"] = m["units_per_s"] / grid_best
    errs = []
    for c in ran:
        p, m = c["predicted"], c["measured"]
        if "peak_allocated" not in m:  # measured on the CPU: time only
            continue
        errs.append(
            {
                "role": c["role"],
                "changes": c["changes"],
                "throughput_error": p["units_per_s"] / m["units_per_s"] - 1,
                "peak_error": p["peak_allocated"] / m["peak_allocated"] - 1,
                "reserved_error": p["peak_reserved"] / m["peak_reserved"] - 1,
            }
        )
    out["errors"] = errs
    wrong_fit = [
        c["changes"]
        for c in configs
        if c["predicted"]["fits"] and c["measured"].get("error", {}).get("oom")
    ]
    out["predicted_fit_but_oom"] = wrong_fit
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--scenarios", default=",".join(SCENARIOS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=int, default=300)
    child_flags(ap)
    args = ap.parse_args()
    if serve_child(
        args, lambda spec: run_one(*json.loads(spec), args.warmup, args.steps, args.device)
    ):
        return
    out = {
        "version": VERSION,
        "environment": child_environment(),
        "scenarios": {},
        "settings": {"warmup": args.warmup, "steps": args.steps},
    }
    path = Path(args.out)

    def save() -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)

    for name in args.scenarios.split(","):
        scenario(args, name, out, save)


if __name__ == "__main__":
    main()
