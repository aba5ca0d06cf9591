"""How long `gobrrr estimate` takes on this machine's CPU, end to end (a fresh process each).

    python benchmarks/speed/bench_estimate_speed.py OUT.json

Targets: `--model llama3-70b --seq 4096` under 20 s and `--model gpt2` under 3 s on a 2-core
CPU. Each command runs 3 times; the median wall time is reported. Beside them, the floor no
estimate can go under: starting Python and importing torch, and that plus creating a
FakeTensorMode (which imports torch._dynamo).
"""

from __future__ import annotations

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

FLOORS = [
    ("python + import torch", "import torch"),
    (
        "... + FakeTensorMode()",
        "import torch\nfrom torch._subclasses.fake_tensor import FakeTensorMode\nFakeTensorMode()",
    ),
]
COMMANDS = [
    ("gpt2", ["--model", "gpt2"], 3.0),
    ("llama3-8b seq 4096", ["--model", "llama3-8b", "--seq", "4096"], None),
    ("llama3-70b seq 4096", ["--model", "llama3-70b", "--seq", "4096"], 20.0),
]


def main() -> None:
    out_path = Path(sys.argv[1])
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[2] / "src"))
    rows = []
    for name, args, target in COMMANDS:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            proc = subprocess.run(
                [sys.executable, "-m", "gobrrr", "estimate", *args, "--json"],
                capture_output=True,
                text=True,
                env=env,
            )
            times.append(time.perf_counter() - t0)
            if proc.returncode:
                raise SystemExit(f"{name} failed: {proc.stderr}")
        ops = json.loads(proc.stdout)["ops"]
        rows.append(
            {
                "case": name,
                "args": args,
                "median_s": statistics.median(times),
                "times_s": times,
                "ops": ops,
                "target_s": target,
                "met": target is None or statistics.median(times) < target,
            }
        )
        print(
            f"{name:22s} {statistics.median(times):6.2f} s  ({ops} ops)"
            + (f"  target < {target} s" if target else "")
        )
    floors = []
    for name, code in FLOORS:
        times = []
        for _ in range(3):
            t0 = time.perf_counter()
            subprocess.run([sys.executable, "-c", code], check=True)
            times.append(time.perf_counter() - t0)
        floors.append({"case": name, "median_s": statistics.median(times), "times_s": times})
        print(f"{name:22s} {statistics.median(times):6.2f} s")
    result = {
        "version": 1,
        "cpu": platform.processor() or platform.machine(),
        "cores": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "cases": rows,
        "floors": floors,
    }
    out_path.write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
