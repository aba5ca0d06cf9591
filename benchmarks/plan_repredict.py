"""The planner's measured configurations predicted again with the shipped calibration.

    python benchmarks/plan_repredict.py [--out benchmarks/results/plan_h100_repredicted.json]
        [--scenarios NAME ...]

Reads benchmarks/results/plan_h100_*.json (bench_plan.py's GPU runs), costs every
configuration that ran with `Planner.cost` as the planner does now (on this machine's CPU), and
prints each beside the prediction recorded in the run and the measurement: step time and
tokens/s errors, allocated and reserved peaks. Errors are predicted / measured - 1.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[1]
sys.path[:0] = [str(ROOT / "src"), str(HERE.parent)]

from bench_plan import SCENARIOS  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"


def repredict(path: Path, names: list[str] | None = None) -> list[dict]:
    from gobrrr.plan.knobs import Knobs
    from gobrrr.plan.search import Planner

    data = json.loads(path.read_text())
    rows = []
    for name, sc in data["scenarios"].items():
        if names and name not in names:
            continue
        source, seq, g, precision, *rest = SCENARIOS[name]
        allow = rest[0] if rest else ()
        t = time.perf_counter()
        planner = Planner(source, "h100", global_batch=g, seq=seq, precision=precision,
                          allow=allow)
        for c in sc["configs"]:
            m = c["measured"]
            if "step_s" not in m:
                continue
            now = planner.cost(Knobs.from_dict(c["knobs"]))
            rows.append({
                "file": path.name, "scenario": name, "role": c["role"],
                "changes": c["changes"], "measured_step_s": m["step_s"],
                "recorded_step_s": c["predicted"]["step_s"], "predicted_step_s": now.step_s,
                "step_err": now.step_s / m["step_s"] - 1,
                "recorded_step_err": c["predicted"]["step_s"] / m["step_s"] - 1,
                "units_per_s_err": m["step_s"] / now.step_s - 1,
                "alloc_err": now.peak_bytes / m["peak_allocated"] - 1,
                "reserved_err": now.reserved_bytes / m["peak_reserved"] - 1})
        print(f"{name}: {time.perf_counter() - t:.1f} s", file=sys.stderr)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--scenarios", nargs="*", default=None)
    args = ap.parse_args(argv)
    rows = []
    for path in sorted(RESULTS.glob("plan_h100_*.json")):
        if path.name == "plan_h100_repredicted.json":
            continue
        rows += repredict(path, args.scenarios)
    for r in rows:
        print(f"{r['scenario']:24s} {r['role']:7s} step {r['measured_step_s'] * 1e3:8.1f} ms  "
              f"recorded {r['recorded_step_err']:+6.1%} now {r['step_err']:+6.1%}  tokens/s "
              f"{r['units_per_s_err']:+6.1%}  alloc {r['alloc_err']:+6.2%}  reserved "
              f"{r['reserved_err']:+6.2%}  {'; '.join(r['changes'])}")
    errs = [abs(r["units_per_s_err"]) for r in rows]
    if errs:
        print(f"tokens/s |error|: median {statistics.median(errs):.1%}, worst {max(errs):.1%},"
              f" {sum(e <= 0.10 for e in errs)} of {len(errs)} within 10%")
    if args.out:
        from gobrrr.kernels.bench import write_json

        write_json(args.out, {"benchmark": "plan predictions recomputed", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
