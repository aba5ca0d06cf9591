"""The planner's measured scenarios as a table, from the committed results.

    python benchmarks/plan/plan_report.py [--readme [docs/accuracy.md]]

Reads tests/fixtures/plan_h100_*.json (written by bench_plan.py on an H100) and prints, per
scenario: the grid a careful user would try (micro-batch x every block checkpointed or not,
at most 8 accumulation steps) with how many of its points ran out of memory and its best
measured throughput; the plan; the plan's measured throughput over the grid's best; and the
prediction's errors over every configuration that ran. `--readme` writes the table into
docs/accuracy.md (or the file given) between its plan-table markers.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT / "src"), str(ROOT / "benchmarks")]

from readme_block import write_table  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
START = "<!-- plan-table: start (benchmarks/plan/plan_report.py --readme) -->"
END = "<!-- plan-table: end -->"


REPREDICTED = RESULTS / "plan_h100_repredicted.json"


def repredicted() -> dict[tuple[str, str], list[dict]]:
    """{(file, scenario): rows} of plan_repredict.py's file: each configuration that ran,
    predicted again with the calibration as shipped now; empty without the file."""
    if not REPREDICTED.exists():
        return {}
    out: dict[tuple[str, str], list[dict]] = {}
    for r in json.loads(REPREDICTED.read_text())["rows"]:
        out.setdefault((r["file"], r["scenario"]), []).append(r)
    return out


def rows() -> list[dict]:
    out = []
    again = repredicted()
    for path in sorted((ROOT / "tests" / "fixtures").glob("plan_h100_*.json")):
        if path == REPREDICTED:
            continue
        data = json.loads(path.read_text())
        for name, sc in data["scenarios"].items():
            s = sc["summary"]
            plan = next(c for c in sc["configs"] if c["role"] == "plan#1")
            errs = s["errors"]
            out.append(
                {
                    "file": path.name,
                    "name": name,
                    "global_batch": sc["global_batch"],
                    "seq": sc.get("seq"),
                    "grid_points": sum(1 for c in sc["configs"] if c["role"] == "grid"),
                    "grid_oom": s["grid_oom"],
                    "grid_best": s["grid_best_units_per_s"],
                    "plan": ", ".join(plan["changes"]) or "as given",
                    "plan_units": plan["measured"].get("units_per_s"),
                    "ratio": s.get("plan_over_grid_best"),
                    "plan_oom": s["plan_oom"],
                    "plan_tput_err": next(
                        (e["throughput_error"] for e in errs if e["role"] == "plan#1"), None
                    ),
                    "plan_peak_err": next(
                        (e["peak_error"] for e in errs if e["role"] == "plan#1"), None
                    ),
                    "worst_tput": max(errs, key=lambda e: abs(e["throughput_error"])),
                    "worst_peak": max(errs, key=lambda e: abs(e["peak_error"])),
                    "ran": len({tuple(e["changes"]) for e in errs}),
                    "fit_but_oom": len(s["predicted_fit_but_oom"]),
                    "device": data["environment"].get("device"),
                    "allow": sc.get("allow") or [],
                    "grid_mode": sc.get("grid", "all"),
                    "now": again.get((path.name, name), []),
                }
            )
    return out


def _now(rows: list[dict]) -> str:
    if not rows:
        return "—"
    plan = next((x for x in rows if x["role"] == "plan#1"), None)
    worst = max(rows, key=lambda x: abs(x["units_per_s_err"]))
    return (
        f"{plan['units_per_s_err']:+.1%}" if plan else "—"
    ) + f", {worst['units_per_s_err']:+.1%}"


def _run(file: str) -> str:
    """ ", run N" for a scenario's rerun (`plan_h100_<name>_runN.json`), else ""."""
    m = re.search(r"_run(\d+)\.json$", file)
    return f", run {m.group(1)}" if m else ""


def table(rs: list[dict]) -> str:
    lines = [
        "| scenario (global batch) | grid: OOM / points, best | plan | plan / grid best "
        "| plan: predicted tok/s, peak | all that ran: worst tok/s, worst peak "
        "| predicted now: plan tok/s, worst tok/s |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rs:
        unit = "tok/s" if r["seq"] else "img/s"  # a workload without a sequence: images
        best = (
            f"{r['grid_best']:,.0f} {unit}"
            if r["grid_best"]
            else "none ran"
            + (" (its least-memory point only)" if r["grid_mode"] == "least" else "")
        )
        ratio = f"**{r['ratio']:.3f}x**" if r["ratio"] else "only the plan runs"
        allow = f" with --allow {','.join(r['allow'])}" if r["allow"] else ""
        lines.append(
            f"| {r['name']} ({r['global_batch']}){_run(r['file'])} | {r['grid_oom']} / "
            f"{r['grid_points']}, "
            f"{best} | {r['plan']}{allow} | {ratio} | "
            f"{r['plan_tput_err']:+.1%}, {r['plan_peak_err']:+.2%} | "
            f"{r['worst_tput']['throughput_error']:+.1%}, {r['worst_peak']['peak_error']:+.2%} "
            f"({r['ran']} configurations) | {_now(r['now'])} |"
        )
    n_oom = sum(r["plan_oom"] for r in rs)
    now = [x for r in rs for x in r["now"]]
    wrong = sum(r["fit_but_oom"] for r in rs)
    lines.append("")
    names = {r["name"] for r in rs}
    again = (
        f" ({len(rs) - len(names)} measured again on another host)" if len(rs) > len(names) else ""
    )
    lines.append(
        f"{len(names)} scenarios{again} on {rs[0]['device']}; the plan ran out of "
        f"memory in "
        f"{n_oom}; configurations predicted to fit that ran out of memory: {wrong}. "
        "Errors are predicted / measured - 1: throughput in the workload's unit, "
        "peak = `max_memory_allocated`. Files: "
        + ", ".join(f"`{f}`" for f in sorted({r["file"] for r in rs}))
        + "."
    )
    if now:
        within = sum(abs(x["units_per_s_err"]) <= 0.10 for x in now)
        lines.append(
            f"Predicted now: every configuration that ran, costed again with the "
            f"calibration as shipped (`benchmarks/plan/plan_repredict.py`, "
            f"`{REPREDICTED.name}`): {within} of {len(now)} within 10% of the "
            f"measured throughput."
        )
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--readme", nargs="?", const=str(ROOT / "docs" / "accuracy.md"), default=None)
    args = ap.parse_args()
    text = table(rows())
    print(text)
    if args.readme:
        write_table(Path(args.readme), START, END, text)


if __name__ == "__main__":
    main()
