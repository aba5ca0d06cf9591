"""Plans made with knobs the grid a careful user tries does not hold (`--allow compile`,
`fp8`, ...), applied on a GPU beside that grid's best point and the plan made without them,
in one run, each configuration in a fresh process.

    # 1. on any CPU (planning a compiled variant takes minutes):
    PYTHONPATH=src:. python benchmarks/plan/plan_allow.py plan PLANS.json \
        --allow compile --scenarios llama3-1b-seq16k,llama3-3b-seq4k
    # 2. on the GPU:
    PYTHONPATH=src:. python benchmarks/plan/plan_allow.py measure OUT.json --plans PLANS.json \
        [--scenarios NAME,...]
    # 2b. on the GPU machine's CPU, where the plans were made under another torch (a compiled
    #     step's saved tensors are the partitioner's choice, which moves between versions):
    PYTHONPATH=src:. python benchmarks/plan/plan_allow.py repredict AGAIN.json --plans PLANS.json \
        [--scenarios NAME,...]
    # 3. the summary of one or more OUT files:
    PYTHONPATH=src:. python benchmarks/plan/plan_allow.py summary OUT.json ... \
        [--repredicted AGAIN.json] [--out SUMMARY.json]

Scenarios are `zoo.scenarios.SCENARIOS`; the grid's best point and the plan without the
extra knobs are read from the scenario's recorded `bench_plan.py` result
(`tests/fixtures/plan_h100_*.json`) and measured again here, so the three are timed on one
GPU in one run (`bench_plan.measure`: build at the global batch, `gobrrr.apply`, 2 warm-up
steps, then 3 timed, CUDA events, median; max_memory_allocated).
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(HERE.parent), str(ROOT / "benchmarks"), str(ROOT), str(ROOT / "src")]

import bench_plan as bp  # noqa: E402

from zoo.scenarios import SCENARIOS  # noqa: E402

#: scenario -> its recorded grid (bench_plan.py)
RECORDED = {
    "llama3-1b-seq16k": "plan_h100_llama1b",
    "llama3-3b-seq4k": "plan_h100_llama3b",
    "gpt2-xl-seq1k": "plan_h100_gpt2xl",
    "resnet50-cl-b2048": "plan_h100_resnet50",
    "vit-l16-b512": "plan_h100_vit",
}


def _planner(name: str, allow: list[str]):
    """The scenario's Planner, as `gobrrr plan --allow` makes it on an H100."""
    from gobrrr.plan.search import Planner

    source, seq, g, precision, *_ = SCENARIOS[name]
    return Planner(source, "h100", global_batch=g, seq=seq, precision=precision, allow=allow)


def _predicted(p) -> dict:
    """A Plan's predicted step, throughput and peaks, as the files keep them."""
    return {
        "step_s": p.step_s,
        "units_per_s": p.units_per_s,
        "peak": p.peak_bytes,
        "reserved": p.reserved_bytes,
    }


def plan(out: Path, names: list[str], allow: list[str]) -> dict:
    """The best plan of each scenario with `allow`, as `gobrrr plan --allow` makes it."""
    doc = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        t = time.perf_counter()
        best = _planner(name, allow).run().plans[0]
        doc[name] = {
            "allow": allow,
            "plan_s": time.perf_counter() - t,
            "best": best.knobs.to_dict(),
            "changes": list(best.changes),
            "predicted": _predicted(best),
        }
        out.write_text(json.dumps(doc, indent=1))
        print(name, best.changes, f"{best.units_per_s:,.0f} /s predicted", flush=True)
    return doc


def repredict(out: Path, plans: dict, names: list[str]) -> dict:
    """Each plan in `plans` costed again by this machine's torch (`Planner.cost`): the
    partitioner's choice of what a compiled forward saves is torch's, and moves between
    versions, so a plan measured with one torch is predicted with that torch."""
    import torch

    from gobrrr.plan.knobs import Knobs

    doc = json.loads(out.read_text()) if out.exists() else {}
    for name in names:
        t = time.perf_counter()
        now = _planner(name, plans[name]["allow"]).cost(Knobs.from_dict(plans[name]["best"]))
        doc[name] = {
            "torch": torch.__version__,
            "cost_s": time.perf_counter() - t,
            "predicted": _predicted(now),
        }
        out.write_text(json.dumps(doc, indent=1))
        print(name, torch.__version__, doc[name]["predicted"], flush=True)
    return doc


def recorded(name: str) -> tuple[dict, dict]:
    """(the grid's best row, the plan's row) of the scenario's recorded run."""
    rec = json.loads((ROOT / f"tests/fixtures/{RECORDED[name]}.json").read_text())
    rows = rec["scenarios"][name]["configs"]
    grid = [c for c in rows if c["role"] == "grid" and "step_s" in c["measured"]]
    return max(grid, key=lambda c: c["measured"]["units_per_s"]), next(
        c for c in rows if c["role"] == "plan#1"
    )


class _Args:  # bench_plan.measure's
    warmup, steps, device, timeout = 2, 3, "cuda", 280


def measure(out: Path, plans: dict, names: list[str]) -> dict:
    from gobrrr.plan.knobs import Knobs

    doc = {"environment": bp.child_environment(), "scenarios": {}}
    for name in names:
        source, seq, g, precision, *_ = SCENARIOS[name]
        grid_best, plan_eager = recorded(name)
        rows = {}
        for role, knobs in (
            ("plan_allowed", plans[name]["best"]),
            ("grid_best", grid_best["knobs"]),
            ("plan_without", plan_eager["knobs"]),
        ):
            m = bp.measure(_Args, source, seq, g, precision, Knobs.from_dict(knobs))
            rows[role] = {"knobs": knobs, "measured": m}
            doc["scenarios"][name] = {"plan": plans[name], "rows": rows}
            out.write_text(json.dumps(doc, indent=1))
            print(name, role, {k: m.get(k) for k in ("step_s", "peak_allocated", "error")})
    return doc


def summary(files: list[Path], repredicted: dict | None = None) -> dict:
    """Per scenario: the allowed plan's throughput over the grid's best and over the plan
    without the knobs (same run), its predicted throughput and peak against the measured:
    as planned, and where `repredicted` (`repredict`'s output) has the scenario, as the
    torch that ran it predicts it (then the figures' `torch`)."""
    repredicted = repredicted or {}
    out = {}
    for f in files:
        doc = json.loads(f.read_text())
        for name, s in doc["scenarios"].items():
            r = s["rows"]
            t = {k: r[k]["measured"].get("step_s") for k in r}
            planned = s["plan"]["predicted"]
            again = repredicted.get(name)
            p = again["predicted"] if again else planned
            without = t.get("plan_without")
            out[name] = {
                "device": doc["environment"].get("device"),
                "allow": s["plan"]["allow"],
                "changes": s["plan"]["changes"],
                "over_grid_best": t["grid_best"] / t["plan_allowed"],
                # None where not measured
                "over_plan_without": without / t["plan_allowed"] if without else None,
                "throughput_error": t["plan_allowed"] / p["step_s"] - 1,
                "peak_error": p["peak"] / r["plan_allowed"]["measured"]["peak_allocated"] - 1,
                "predicted_with_torch": again["torch"] if again else None,
                "as_planned": {
                    "throughput_error": t["plan_allowed"] / planned["step_s"] - 1,
                    "peak_error": planned["peak"] / r["plan_allowed"]["measured"]["peak_allocated"]
                    - 1,
                },
            }
    ratios = [v["over_grid_best"] for v in out.values()]
    return {
        "scenarios": out,
        "geomean_over_grid_best": math.exp(sum(map(math.log, ratios)) / len(ratios)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("plan", "measure", "repredict", "summary"))
    ap.add_argument("files", nargs="+", type=Path)
    ap.add_argument("--allow", default="compile")
    ap.add_argument("--plans", type=Path)
    ap.add_argument("--scenarios", default="llama3-1b-seq16k,llama3-3b-seq4k")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--repredicted", type=Path, help="summary: repredict's output")
    a = ap.parse_args()
    names = a.scenarios.split(",")
    if a.what == "plan":
        plan(a.files[0], names, a.allow.split(","))
    elif a.what == "measure":
        measure(a.files[0], json.loads(a.plans.read_text()), names)
    elif a.what == "repredict":
        repredict(a.files[0], json.loads(a.plans.read_text()), names)
    else:
        again = json.loads(a.repredicted.read_text()) if a.repredicted else None
        s = summary(a.files, again)
        print(json.dumps(s, indent=1))
        if a.out:
            a.out.write_text(json.dumps(s, indent=1))


if __name__ == "__main__":
    main()
