"""How long `gobrrr plan` takes to plan a 70B model over 64 GPUs on 8 nodes, on this CPU.

    python benchmarks/plan/multigpu_plan_time.py [--out benchmarks/results/plan_multigpu_time.json]

Times the whole process, as a user runs it (`python -m gobrrr plan --model llama3-70b --gpu h100
--gpus 64 --nodes 8 --global-batch 512 --seq 8192 --json`): the interpreter's start, the
imports, the probe, the traces, the passes and every evaluation. Records the wall and CPU
seconds (the child's user + system time: on a shared machine the wall time includes waiting
for a core), the machine's CPU count and load, the versions, and what the plan found (its
configurations costed, traces, notes and best). The target: under 60 s on a 2-core CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
COMMAND = [
    "plan",
    "--model",
    "llama3-70b",
    "--gpu",
    "h100",
    "--gpus",
    "64",
    "--nodes",
    "8",
    "--global-batch",
    "512",
    "--seq",
    "8192",
    "--json",
]
TARGET_S = 60.0


def run_once() -> dict:
    """One run of the command in a fresh process: wall and CPU seconds and its JSON."""
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    load = os.getloadavg()[0]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    t = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "gobrrr", *COMMAND],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    wall = time.perf_counter() - t
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    out = json.loads(proc.stdout)
    return {
        "wall_s": wall,
        "cpu_s": cpu,
        "load_average_1m_before": load,
        "exit_code": proc.returncode,
        "plan": _summary(out),
    }


def _summary(d: dict) -> dict:
    best = d.get("best")
    low = min(d.get("plans") or [{}], key=lambda p: p.get("reserved_bytes", 0))
    return {
        "fits": d.get("fits"),
        "error": d.get("error"),
        "considered": d.get("considered"),
        "traces": d.get("traces"),
        "took_s": d.get("took_s"),
        "notes": d.get("notes"),
        "best": {k: best[k] for k in ("parallel", "changes", "tokens_per_s", "peak_bytes")}
        if best
        else None,
        "smallest_reserved": {k: low.get(k) for k in ("parallel", "changes", "reserved_bytes")},
    }


def environment() -> dict:
    import torch

    commit = subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"], capture_output=True, text=True
    ).stdout.strip()
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": commit,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cpu_count": os.cpu_count(),
        "load_average_1m": os.getloadavg()[0],
    }


def cpu_model() -> str | None:
    """The CPU's model name (/proc/cpuinfo; None where there is none): hosts of one kind
    differ, and the times with them."""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return None


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks/results/plan_multigpu_time.json")
    ap.add_argument("--repeat", type=int, default=1, help="runs (default 1)")
    args = ap.parse_args()
    runs = [run_once() for _ in range(args.repeat)]
    result = {
        "version": 1,
        "command": "gobrrr " + " ".join(COMMAND),
        "target_s": TARGET_S,
        "environment": environment(),
        "runs": runs,
        "best_wall_s": min(r["wall_s"] for r in runs),
        "best_cpu_s": min(r["cpu_s"] for r in runs),
    }
    args.out.write_text(json.dumps(result, indent=1) + "\n")
    for r in runs:
        print(f"wall {r['wall_s']:.1f} s, cpu {r['cpu_s']:.1f} s, exit {r['exit_code']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
