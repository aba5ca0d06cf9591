"""The shipped collective calibration against a later measurement of the same collectives.

    python benchmarks/calibration/collectives_recheck.py \
        benchmarks/results/collectives_h100_x4_rerun.json \
        [--calibration src/gobrrr/data/calibration/h100-sxm.json] \
        [--out benchmarks/results/collectives_recheck_h100_x4.json]

A re-measurement (`torchrun ... -m gobrrr.calibrate.sections.collectives`, on another day or
another host of the same kind) is set against what gobrrr predicts for each of its points
from the shipped calibration (`cost.collectives.data_parallel_time`: the shipped curve of that
collective, dtype and rank count, interpolated in log-log space), over the sizes the target
speaks of (1 MiB to 1 GiB of whole buffer). Two readings:

- `shipped`: the prediction from every shipped point, i.e. how well the calibration made on
  one day holds on another (run-to-run and host-to-host spread);
- `held_out`: each size predicted from the shipped curve without that size's point, so the
  interpolation between measured sizes is tested too (sizes at the ends are skipped: no
  neighbour on one side).

Writes per point the measured and predicted seconds and the error (predicted / measured - 1),
and per collective and dtype the median and worst |error|.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from gobrrr.cost.collectives import data_parallel_time

ROOT = Path(__file__).resolve().parents[2]
MIB, GIB = 2**20, 2**30


def predicted(points: list[dict], op: str, nbytes: int, dtype: str, ranks: int) -> float:
    return data_parallel_time(op, nbytes, dtype, ranks, 1, points)


def recheck(shipped: list[dict], measured: list[dict]) -> dict:
    """Every measured point in [1 MiB, 1 GiB] against the shipped calibration's prediction,
    with all of its points and with the point of that size left out."""
    rows = []
    for p in measured:
        if not MIB <= p["bytes"] <= GIB:
            continue
        key = (p["op"], p["dtype"], p["ranks"])
        same = [q for q in shipped if (q["op"], q["dtype"], q["ranks"]) == key]
        sizes = sorted(q["bytes"] for q in same)
        if not same:
            continue
        row = {
            "op": p["op"],
            "dtype": p["dtype"],
            "ranks": p["ranks"],
            "bytes": p["bytes"],
            "measured_s": p["seconds"],
            "shipped_s": predicted(shipped, p["op"], p["bytes"], p["dtype"], p["ranks"]),
        }
        row["shipped_error"] = row["shipped_s"] / p["seconds"] - 1
        if sizes[0] < p["bytes"] < sizes[-1]:
            rest = [
                q
                for q in shipped
                if not ((q["op"], q["dtype"], q["ranks"]) == key and q["bytes"] == p["bytes"])
            ]
            row["held_out_s"] = predicted(rest, p["op"], p["bytes"], p["dtype"], p["ranks"])
            row["held_out_error"] = row["held_out_s"] / p["seconds"] - 1
        rows.append(row)
    return {"points": rows, "summary": summary(rows)}


def summary(rows: list[dict]) -> dict:
    """{op dtype ranks: {reading: {median_abs, worst, n}}} and the same over every point."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['op']} {r['dtype']} x{r['ranks']}", []).append(r)
    groups["all"] = rows
    out = {}
    for name, rs in groups.items():
        out[name] = {}
        for reading in ("shipped", "held_out"):
            errs = [r[f"{reading}_error"] for r in rs if f"{reading}_error" in r]
            if errs:
                out[name][reading] = {
                    "median_abs": statistics.median(abs(e) for e in errs),
                    "worst": max(errs, key=abs),
                    "within_10pct": sum(abs(e) <= 0.10 for e in errs),
                    "n": len(errs),
                }
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("measured", type=Path)
    ap.add_argument(
        "--calibration", type=Path, default=ROOT / "src/gobrrr/data/calibration/h100-sxm.json"
    )
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    cal = json.loads(args.calibration.read_text())
    data = json.loads(args.measured.read_text())
    doc = {
        "measured": {"file": args.measured.name, **data.get("meta", {})},
        "shipped": {
            "file": args.calibration.name,
            "from": cal.get("meta", {}).get("collectives", {}).get("from", []),
        },
        **recheck(cal["collectives"], data["points"]),
    }
    for name, s in doc["summary"].items():
        print(
            f"{name:28s} "
            + "  ".join(
                f"{k}: median {v['median_abs']:.1%} worst {v['worst']:+.1%} "
                f"({v['within_10pct']}/{v['n']} within 10%)"
                for k, v in s.items()
            )
        )
    if args.out:
        args.out.write_text(json.dumps(doc, indent=1))
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
