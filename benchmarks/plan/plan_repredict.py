"""The planner's measured configurations predicted again with the shipped calibration.

    python benchmarks/plan/plan_repredict.py [--out benchmarks/results/plan_h100_repredicted.json]
        [--scenarios NAME ...]

Reads tests/fixtures/plan_h100_*.json (bench_plan.py's GPU runs), costs every
configuration that ran with `Planner.cost` as the planner does now (on this machine's CPU), and
prints each beside the prediction recorded in the run and the measurement: step time and
tokens/s errors, allocated and reserved peaks. Errors are predicted / measured - 1.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT)]

from zoo.scenarios import repredict  # noqa: E402

RUNS = ROOT / "tests" / "fixtures"  # plan_h100_*.json: the GPU runs, which tests read too


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None)
    ap.add_argument("--scenarios", nargs="*", default=None)
    args = ap.parse_args(argv)
    rows = []
    for path in sorted(RUNS.glob("plan_h100_*.json")):
        rows += repredict(path, args.scenarios)
    for r in rows:
        print(
            f"{r['scenario']:24s} {r['role']:7s} step {r['measured_step_s'] * 1e3:8.1f} ms  "
            f"recorded {r['recorded_step_err']:+6.1%} now {r['step_err']:+6.1%}  tokens/s "
            f"{r['units_per_s_err']:+6.1%}  alloc {r['alloc_err']:+6.2%}  reserved "
            f"{r['reserved_err']:+6.2%}  {'; '.join(r['changes'])}"
        )
    errs = [abs(r["units_per_s_err"]) for r in rows]
    if errs:
        print(
            f"tokens/s |error|: median {statistics.median(errs):.1%}, worst {max(errs):.1%},"
            f" {sum(e <= 0.10 for e in errs)} of {len(errs)} within 10%"
        )
    if args.out:
        from gobrrr.kernels.bench import write_json

        write_json(args.out, {"benchmark": "plan predictions recomputed", "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
