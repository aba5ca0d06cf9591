"""Scale on paper: how long `gobrrr estimate` takes, as a whole process on this CPU, to
predict one rank of a large data-parallel job, and what it predicts.

    PYTHONPATH=src python benchmarks/multigpu/scale_on_paper.py [--out F] [--only NAME ...]

Each case is one `python -m gobrrr estimate ... --json` process, timed from its start to its
exit (imports, tracing Llama-3 70B on fake tensors, the FSDP2 pass, the evaluation); the
machine's CPU count and load are recorded beside it. Writes
`benchmarks/results/scale_on_paper_cpu.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
OUT = HERE.parent / "results" / "scale_on_paper_cpu.json"

#: name -> the estimate's arguments (seq 8192, batch 1 a GPU, H100s, 8 a node)
CASES = {
    "llama3-8b-fsdp-8": "--model llama3-8b --gpu h100 --gpus 8 --parallel fsdp --seq 8192 "
    "--batch 1",
    "llama3-70b-fsdp-64x8": "--model llama3-70b --gpu h100 --gpus 64 --nodes 8 "
    "--parallel fsdp --seq 8192",
    "llama3-70b-fsdp-512x64": "--model llama3-70b --gpu h100 --gpus 512 --nodes 64 "
    "--parallel fsdp --seq 8192",
    "llama3-70b-fsdp-64x8-ckpt": "--model llama3-70b --gpu h100 --gpus 64 --nodes 8 "
    "--parallel fsdp --seq 8192 --checkpoint full",
    "llama3-70b-hsdp-64x8-ckpt": "--model llama3-70b --gpu h100 --gpus 64 --nodes 8 "
    "--parallel hsdp --seq 8192 --checkpoint full",
    "llama3-70b-hsdp-512x64-ckpt": "--model llama3-70b --gpu h100 --gpus 512 --nodes 64 "
    "--parallel hsdp --seq 8192 --checkpoint full",
}
#: the issue's bound on a 2-core CPU, and the one past which the slow part is looked for
TARGET_S, LOOK_S = 60.0, 30.0
#: what was found slow and fixed
NOTE = (
    "The CPU is shared (load_average_before): capture (tracing on fake tensors) takes most of "
    "each run and grows with the load. Under cProfile, before the fix, the scheduler's "
    "comm_waits took 24 of the 32 s evaluating the 70B HSDP step over 512 GPUs (a scan of the "
    "whole step from each of its collectives, run three times by the power-limit loop); it "
    "now bisects each storage's compute ops: the same waits, and evaluate's share of the 70B "
    "runs fell from 10-26 s to 11-14 s of wall time under a higher load."
)


def run_case(args: str) -> dict:
    """One estimate process: its wall seconds and the figures it printed."""
    env = {
        **os.environ,
        "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{os.environ.get('PYTHONPATH', '')}",
    }
    cmd = [sys.executable, "-m", "gobrrr", "estimate", *args.split(), "--json"]
    load = os.getloadavg()[0]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, cwd=ROOT)
    wall = time.perf_counter() - t0
    if done.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({done.returncode}): {done.stderr.strip()}")
    d = json.loads(done.stdout)
    par, t, m = d["parallel"], d["time"], d["memory"]
    return {
        "command": "gobrrr estimate " + args,
        "wall_s": wall,
        "capture_s": d["capture_s"],
        "load_average_before": load,
        "predicted": {
            "peak_allocated_bytes": m["peak_bytes"],
            "peak_reserved_bytes": m["reserved_bytes"],
            "fits": m["fits"],
            "step_s": t["step_s"],
            "tokens_per_s_per_gpu": par["tokens_per_s_per_gpu"],
            "tokens_per_s_job": par["tokens_per_s_job"],
            "mfu": t.get("mfu"),
            "comm_s": par["comm_s"],
            "exposed_comm_s": par["exposed_comm_s"],
            "per_rank_state": par["per_rank_state"],
        },
    }


def machine() -> dict:
    return {
        "cpus": os.cpu_count(),
        "cpus_usable": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "processor": platform.processor() or platform.machine(),
        "python": platform.python_version(),
        "commit": subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, cwd=ROOT
        ).stdout.strip(),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=OUT)
    ap.add_argument("--only", nargs="*", choices=list(CASES), help="cases to run (default all)")
    a = ap.parse_args()
    rows = {}
    for name in a.only or CASES:
        rows[name] = run_case(CASES[name])
        r = rows[name]
        p = r["predicted"]
        flag = "" if r["wall_s"] <= LOOK_S else f"  (over {LOOK_S:.0f} s)"
        print(
            f"{name:30s} {r['wall_s']:6.1f} s (capture {r['capture_s']:.1f} s){flag} · peak "
            f"{p['peak_allocated_bytes'] / 2**30:.1f} GiB, fits {p['fits']} · step "
            f"{p['step_s']:.2f} s · {p['tokens_per_s_per_gpu']:,.0f} tok/s/GPU",
            flush=True,
        )
    doc = {
        "what": "wall seconds of one `gobrrr estimate ... --json` process per case, on this CPU",
        "target_s": TARGET_S,
        "note": NOTE,
        "machine": machine(),
        "cases": rows,
    }
    a.out.write_text(json.dumps(doc, indent=2) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
