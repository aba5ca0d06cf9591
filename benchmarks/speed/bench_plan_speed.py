"""How long `gobrrr plan` takes on this machine's CPU, end to end (a fresh process each).

    python benchmarks/speed/bench_plan_speed.py results/plan_speed_cpu.json [--runs 3]

Targets, whole-process wall time on an idle 2-core CPU: `--model gpt2` under 10 s,
`--model llama3-70b --seq 4096` under 30 s, and each with `--allow compile` under twice its
plain target (a compiled variant is traced under dynamo and AOTAutograd). llama3-70b fits no
compiled variant, so only gpt2's `--allow compile` traces one. Each
command runs `--runs` times (3); the median wall time is reported with every run's, how many
step graphs were traced and how many configurations were costed. The commands run with
`--json` (the counts come from it), which adds the charts' data to the plain command's work.
The machine's load average is recorded before and after each case: on a shared machine the
times are upper bounds. llama3-70b does not fit one H100 in any configuration: it exits 1,
listing the closest.

Runs from a fresh clone after `bash .ci/setup`: `.venv/bin/python benchmarks/speed/...`
(gobrrr is imported from this checkout's src/).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import resource
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
from benchmarks.plan.multigpu_plan_time import cpu_model  # noqa: E402

#: (case, arguments after `gobrrr plan`, target in seconds)
COMMANDS = [
    ("gpt2", ["--model", "gpt2", "--gpu", "h100"], 10.0),
    ("llama3-70b seq 4096", ["--model", "llama3-70b", "--seq", "4096", "--gpu", "h100"], 30.0),
    ("gpt2 allow compile", ["--model", "gpt2", "--gpu", "h100", "--allow", "compile"], 20.0),
    (
        "llama3-70b seq 4096 allow compile",
        ["--model", "llama3-70b", "--seq", "4096", "--gpu", "h100", "--allow", "compile"],
        60.0,
    ),
]


def run_case(args: list[str], runs: int, env: dict[str, str]) -> dict:
    """The case's wall times (s) over `runs` fresh processes, and its last run's JSON."""
    times, cpu, loads, out, code = [], [], [], {}, 0
    for _ in range(runs):
        loads.append(os.getloadavg()[0])
        before = resource.getrusage(resource.RUSAGE_CHILDREN)
        t0 = time.perf_counter()
        proc = subprocess.run(
            [sys.executable, "-m", "gobrrr", "plan", *args, "--json"],
            capture_output=True,
            text=True,
            env=env,
            cwd=ROOT,
        )
        times.append(time.perf_counter() - t0)
        after = resource.getrusage(resource.RUSAGE_CHILDREN)
        cpu.append(after.ru_utime - before.ru_utime + after.ru_stime - before.ru_stime)
        if proc.returncode not in (0, 1):  # refused (exit 2): recorded, not timed further
            return {"times_s": times, "load_1min": loads, "error": proc.stderr.strip()}
        out, code = json.loads(proc.stdout), proc.returncode
    loads.append(os.getloadavg()[0])
    return {"times_s": times, "cpu_s": cpu, "load_1min": loads, "json": out, "exit": code}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", help="the results JSON to write")
    ap.add_argument("--runs", type=int, default=3, help="runs per command (median reported)")
    a = ap.parse_args(argv)
    env = dict(os.environ, PYTHONPATH=str(ROOT / "src"))
    rows = []
    for name, args, target in COMMANDS:
        got = run_case(args, a.runs, env)
        if "error" in got:
            rows.append({"case": name, "args": args, "error": got["error"], "target_s": target})
            print(f"{name:34s} refused: {got['error']}")
            continue
        med = statistics.median(got["times_s"])
        out = got["json"]
        rows.append(
            {
                "case": name,
                "args": args,
                "median_s": round(med, 2),
                "times_s": [round(t, 2) for t in got["times_s"]],
                "cpu_s": [round(t, 1) for t in got["cpu_s"]],
                "load_1min": [round(x, 2) for x in got["load_1min"]],
                "exit": got["exit"],
                "traces": out["traces"],
                "considered": out["considered"],
                "fits": out["fits"],
                "target_s": target,
                "met": med < target,
            }
        )
        print(
            f"{name:34s} {med:6.2f} s  ({out['traces']} traces, {out['considered']} "
            f"configurations)  target < {target} s  load {got['load_1min'][0]:.1f}"
        )
    result = {
        "version": 2,
        "cpu": platform.processor() or platform.machine(),
        "cpu_model": cpu_model(),
        "cores": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "trace_processes": os.environ.get("GOBRRR_TRACE_PROCESSES", "default"),
        "cases": rows,
    }
    Path(a.out).parent.mkdir(parents=True, exist_ok=True)
    Path(a.out).write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
