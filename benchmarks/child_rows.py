"""A benchmark's configurations each in a fresh process: the child prints one line
"ROW <json>" (or "ENV <json>"), the parent reads the last one or records how the child died.
Used by bench_plan.py, bench_offload.py, host_waits.py and plan_step_kernels.py."""

from __future__ import annotations

import json
import subprocess
import sys
import time


def run_row(cmd: list[str], timeout: float) -> dict:
    """The last "ROW" of `cmd` run in a fresh process, with its wall seconds; a row with an
    error ("timeout", or "crash" and the end of stderr) when it printed none."""
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": {"type": "timeout", "oom": False}, "wall_s": timeout}
    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    row = (
        json.loads(rows[-1])
        if rows
        else {"error": {"type": "crash", "oom": False, "message": proc.stderr[-1500:]}}
    )
    row["wall_s"] = time.perf_counter() - t
    return row


def env_row(script: str) -> dict:
    """Device and versions as `script --env` prints them in a fresh process (the parent
    never holds a CUDA context: it would take memory from what it measures)."""
    proc = subprocess.run(
        [sys.executable, script, "--env"], capture_output=True, text=True, timeout=120
    )
    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ENV ")]
    return json.loads(rows[-1]) if rows else {"error": proc.stderr[-500:]}


def child_flags(ap) -> None:
    """The flags of a benchmark's child process: `--one SPEC`, one configuration, printed as
    "ROW <json>"; `--env`, the device and versions, printed as "ENV <json>"."""
    import argparse

    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--env", action="store_true", help=argparse.SUPPRESS)


def serve_child(args, one) -> bool:
    """In a child process (`child_flags` given): print its line, `one(SPEC)`'s row or the
    environment, and return True; False in the parent."""
    if args.env:
        from suite.bench_estimate_suite import environment

        print("ENV " + json.dumps(environment()))
        return True
    if args.one is not None:
        print("ROW " + json.dumps(one(args.one)))
        return True
    return False


def run_cases(script: str, out: str, names: list[str], version: int, report) -> dict:
    """Each of `names` run as `script out --one NAME` in a fresh process, its row (with its
    name) appended to {"version", "environment", "rows"}, which is rewritten to `out` after
    each; `report(row)` prints it. Returns the document."""
    from pathlib import Path

    from suite.bench_estimate_suite import environment

    doc = {"version": version, "environment": environment(), "rows": []}
    for name in names:
        row = {"name": name, **run_row([sys.executable, script, out, "--one", name], timeout=300)}
        doc["rows"].append(row)
        Path(out).write_text(json.dumps(doc, indent=1) + "\n")
        report(row)
    return doc


def cases_main(
    argv, doc: str, script: str, cases, version: int, one, report, actions: dict | None = None
) -> int:
    """The command line of a benchmark whose cases each run in a fresh process: `OUT
    [--cases NAME,NAME]` runs `cases` (or those named) through `run_cases`, `--one NAME` (the
    child) prints one(NAME)'s row; `actions` ({"--flag": fn(OUT)}) adds flags that each do
    their own work on OUT instead. `doc`: the script's docstring."""
    import argparse
    from pathlib import Path

    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--cases", default=",".join(cases))
    for flag in actions or {}:
        ap.add_argument(flag, action="store_true")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    for flag, fn in (actions or {}).items():
        if getattr(args, flag.lstrip("-").replace("-", "_")):
            fn(Path(args.out))
            return 0
    if args.one:
        print("ROW " + json.dumps(one(args.one)))
        return 0
    run_cases(script, args.out, args.cases.split(","), version, report)
    return 0
