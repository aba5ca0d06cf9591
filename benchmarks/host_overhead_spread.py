"""How steady `gobrrr calibrate`'s host-overhead measurement is, run after run.

    python benchmarks/host_overhead_spread.py OUT.json

Six back-to-back measurements in one process with each of two settings of
`calibrate_host.step_overhead`: one round of 20 steps per tiny model after 3 warm-up steps,
and five alternating rounds of 20 after 10 warm-up steps (the default). Host time per op per
phase, and each setting's spread (max / min - 1). In run 1 the second setting was labelled
"default"; it was the same five rounds.
"""

from __future__ import annotations

import json
import sys
import time
from datetime import UTC, datetime
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gobrrr.calibrate.sections.host import PHASES, step_overhead  # noqa: E402

SETTINGS = {"one round of 20": dict(reps=20, rounds=1, warmup=3),
            "five rounds of 20": dict(reps=20, rounds=5, warmup=10)}


def main() -> None:
    dev = torch.device("cuda")
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "date": datetime.now(UTC).isoformat(timespec="seconds"), "settings": {}}
    for name, kw in SETTINGS.items():
        runs = []
        for _ in range(6):
            t0 = time.perf_counter()
            runs.append({**step_overhead(dev, **kw), "seconds": time.perf_counter() - t0})
        spread = {p: max(r[p] for r in runs) / min(r[p] for r in runs) - 1 for p in PHASES}
        out["settings"][name] = {"kwargs": kw, "runs": runs, "spread": spread}
        print(name, [round(r["forward"] * 1e6, 1) for r in runs],
              {p: f"{v:.0%}" for p, v in spread.items()})
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
