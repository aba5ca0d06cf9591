"""How much one sweep of the collective calibration differs from the next on the same host,
at the sizes where NCCL's latency dominates.

    python benchmarks/calibration/collectives_spread.py \
        benchmarks/results/collectives_repeat_h200_x4_run1.json [more ...] \
        [--out benchmarks/results/collectives_spread_h200_x4.json]

Each input is several sweeps (`sweep`) of `gobrrr.calibrate.sections.collectives.measure_op`
over the same (collective, dtype, size) points on one 4-GPU host, taken in one job, sizes
ascending and descending in turn. Per point: the median over the sweeps, each sweep's
deviation from it, and whether it lies within 10% of it; per file and overall: the share of
single sweeps within 10% of their point's median, by size band (below 8 MiB: latency-bound,
about 35-50 us a call; 8 MiB and over). A calibration is one sweep, so its points carry this
spread, and a re-measurement set against it carries it twice.
"""

from __future__ import annotations

import argparse
import json
import statistics
from collections import defaultdict
from pathlib import Path

MIB = 2**20


def spread(data: dict) -> dict:
    """Per point the sweeps' seconds, their median and deviations; per band the share within
    10% of the median."""
    by = defaultdict(list)
    for p in data["points"]:
        by[(p["op"], p["dtype"], p["bytes"])].append(p["seconds"])
    points, bands = [], defaultdict(lambda: [0, 0])
    for (op, dtype, nbytes), ts in sorted(by.items()):
        med = statistics.median(ts)
        dev = [t / med - 1 for t in ts]
        band = "below 8 MiB" if nbytes < 8 * MIB else "8 MiB and over"
        bands[band][0] += sum(abs(d) <= 0.10 for d in dev)
        bands[band][1] += len(dev)
        points.append(
            {
                "op": op,
                "dtype": dtype,
                "bytes": nbytes,
                "sweeps_s": ts,
                "median_s": med,
                "worst_deviation": max(dev, key=abs),
            }
        )
    return {
        "points": points,
        "within_10pct_of_median": {b: {"sweeps": n, "of": m} for b, (n, m) in bands.items()},
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("files", nargs="+")
    ap.add_argument("--out")
    args = ap.parse_args()
    out = {"files": {}}
    for f in args.files:
        data = json.loads(Path(f).read_text())
        s = spread(data)
        out["files"][Path(f).name] = {"meta": data["meta"], **s}
        print(Path(f).name, data["meta"].get("device"), s["within_10pct_of_median"])
        for p in s["points"]:
            if p["bytes"] in (MIB, 4 * MIB, 6 * MIB) and abs(p["worst_deviation"]) > 0.1:
                print(
                    f"  {p['op']} {p['dtype']} {p['bytes'] / MIB:g} MiB: "
                    + " ".join(f"{t * 1e6:.1f}" for t in p["sweeps_s"])
                    + f" us (worst {p['worst_deviation']:+.0%})"
                )
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
