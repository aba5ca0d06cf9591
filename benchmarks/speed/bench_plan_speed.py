"""How long `gobrrr plan` takes on this machine's CPU, end to end (a fresh process each).

    python benchmarks/speed/bench_plan_speed.py OUT.json

Targets: `--model llama3-70b --seq 4096` under 60 s and `--model gpt2` under 15 s on a 2-core
CPU. Each command runs 3 times; the median wall time is reported, with how many step graphs
were traced and how many configurations were costed. (llama3-70b does not fit one H100 in
any configuration: the command exits 1, listing the closest.)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

COMMANDS = [
    ("gpt2", ["--model", "gpt2"], 15.0),
    ("gpt2 global batch 64", ["--model", "gpt2", "--global-batch", "64"], None),
    (
        "llama3-1b seq 16384 global batch 4",
        ["--model", "llama3-1b", "--seq", "16384", "--global-batch", "4"],
        None,
    ),
    ("llama3-70b seq 4096", ["--model", "llama3-70b", "--seq", "4096"], 60.0),
]


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the results JSON to write")
    out_path = Path(ap.parse_args(argv).out)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    rows = []
    for name, args, target in COMMANDS:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "gobrrr", "plan", *args, "--json"],
                capture_output=True,
                text=True,
                env=env,
            )
            times.append(time.perf_counter() - t0)
            if proc.returncode not in (0, 1):
                raise SystemExit(f"{name} failed: {proc.stderr}")
        out = json.loads(proc.stdout)
        med = statistics.median(times)
        rows.append(
            {
                "case": name,
                "args": args,
                "median_s": med,
                "times_s": times,
                "exit": proc.returncode,
                "traces": out["traces"],
                "considered": out["considered"],
                "fits": out["fits"],
                "target_s": target,
                "met": target is None or med < target,
            }
        )
        print(
            f"{name:36s} {med:6.2f} s  ({out['traces']} traces, {out['considered']} "
            f"configurations)" + (f"  target < {target} s" if target else "")
        )
    result = {
        "version": 1,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cases": rows,
    }
    out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
