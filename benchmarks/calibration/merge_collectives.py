"""Merge measured NCCL collectives into a shipped calibration's `collectives` section.

    python benchmarks/calibration/merge_collectives.py \
        src/gobrrr/data/calibration/h100-sxm.json \
        tests/fixtures/collectives_h100_x4.json tests/fixtures/collectives_h100_x2of4.json

Each source is a `gobrrr.calibrate.sections.collectives` result ({"meta", "points", ...});
every point of every source is kept (op, dtype, bytes, ranks, seconds and the spread), the
section replaced as a whole, and the calibration's meta["collectives"] says which files they
came from and where those were measured. Re-running with the same sources gives the same file.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

KEEP = ("op", "dtype", "bytes", "ranks", "iters", "seconds", "min_s", "max_s")


def merge(calibration: Path, sources: list[Path]) -> dict:
    """The calibration's JSON object with its `collectives` section made from `sources`."""
    cal = json.loads(calibration.read_text())
    points, origin = [], []
    for src in sources:
        data = json.loads(src.read_text())
        points += [{k: p[k] for k in KEEP if k in p} for p in data["points"]]
        m = data.get("meta", {})
        origin.append(
            {
                "file": src.name,
                **{k: m.get(k) for k in ("date", "device", "torch", "nccl", "world_size")},
                "env": m.get("env", {}),
            }
        )
    cal["collectives"] = sorted(points, key=lambda p: (p["op"], p["dtype"], p["ranks"], p["bytes"]))
    cal.setdefault("meta", {})["collectives"] = {
        "from": origin,
        "how": "benchmarks/calibration/merge_collectives.py: every point of the files kept",
    }
    return cal


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("calibration", type=Path)
    ap.add_argument("sources", type=Path, nargs="+")
    args = ap.parse_args()
    cal = merge(args.calibration, args.sources)
    args.calibration.write_text(json.dumps(cal, indent=2))
    print(f"{args.calibration}: {len(cal['collectives'])} collective points")


if __name__ == "__main__":
    main()
