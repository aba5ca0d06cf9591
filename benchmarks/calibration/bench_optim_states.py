"""8-bit optimizer states (torchao's AdamW8bit) measured on a GPU: the calibration section the
cost model reads, and real training steps with and without 8-bit states.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/calibration/bench_optim_states.py \\
        --out tests/fixtures/optim8_h100.json [--steps 5] [--warmup 3]

1. The `optim8` calibration section (gobrrr.calibrate.sections.optim): torchao's AdamW8bit step
   over parameter sizes x parameters per step — device seconds, host seconds and kernels per
   update, the bytes an update allocates and frees.
2. Real steps, bf16-mixed, each configuration in a fresh process (benchmarks/plan/bench_plan.py's
   child: gobrrr.apply, warm-up — the first 8-bit step compiles —, peak stats reset, `--steps`
   steps timed with CUDA events, median): gobrrr's gpt2 and a Llama-3 1B shape, optimizer
   states as-is (fused-less AdamW, foreach) and 8-bit. The predictions are computed apart on
   a CPU from the same knobs and held against these (`--compare OUT.json`, which also sets
   the section in a calibration file with `--into`).
3. `--probe-only`: the 8-bit optimizer step alone on those models, its host seconds per
   update with the GPU idle and busy (behind a ~100 ms spin), and a whole step's host
   seconds to issue against its seconds to finish.
Every item records its own error instead of ending the run; OUT is rewritten after each.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
# src/, the repository root (zoo/), benchmarks/ (child_rows, suite/, plan/) and this folder
sys.path[:0] = [
    str(HERE.parents[2] / "src"),
    str(HERE.parents[2]),
    str(HERE.parents[1]),
    str(HERE.parent),
]

VERSION = 1

#: name -> (workload source, seq, global batch = micro-batch), bf16-mixed.
CASES = {
    "gpt2-b8-s1024": ("gpt2", 1024, 8),
    "gpt2-b1-s256": ("gpt2", 256, 1),  # host-bound: the per-parameter host cost shows
    "llama3-1b-b2-s2048": ("llama3-1b", 2048, 2),
}
STATES = ("as-is", "8bit")
PRECISION = "bf16-mixed"
BUDGET_S = 215  # stop starting new items after this long (the whole run stays under 4 min)


def section_child() -> dict:
    """The optim8 section, measured in this (fresh) process."""
    import torch

    from gobrrr.calibrate.sections.optim import optim8_section

    t0 = time.perf_counter()
    out = optim8_section(torch.device("cuda"))
    out["seconds"] = time.perf_counter() - t0
    return out


def run_child(
    flag: str, payload: str, timeout: int, extra: list[str] = (), output_code: bool = False
) -> dict:
    """One child process; `output_code`: with Inductor's generated code logged, whose
    buffer allocations and kernel calls are kept (what the compiled update allocates)."""
    cmd = [sys.executable, str(HERE), flag, payload, *extra]
    env = {**os.environ, **({"TORCH_LOGS": "output_code"} if output_code else {})}
    t = time.perf_counter()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired:
        return {"error": {"type": "timeout", "seconds": timeout}}
    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    row = (
        json.loads(rows[-1])
        if rows
        else {"error": {"type": "crash", "message": proc.stderr[-2000:]}}
    )
    row["wall_s"] = time.perf_counter() - t
    if output_code:
        row["inductor_calls"] = _wrapper_lines(proc.stderr)
    return row


def _wrapper_lines(log: str, limit: int = 400) -> list[str]:
    """The generated wrappers' allocations, kernel launches and frees, in order."""
    keep = ("def call(", "empty_strided_cuda(", ".run(", "del buf", "return (")
    out = [
        ln.split("[__output_code]", 1)[1].strip()
        for ln in log.splitlines()
        if "[__output_code]" in ln and any(k in ln for k in keep)
    ]
    return out[:limit]


def case_child(spec: list, warmup: int, steps: int) -> dict:
    from plan.bench_plan import run_one

    source, seq, g, states = spec
    knobs = {"micro_batch": g, "accumulation": 1, "optimizer_states": states}
    return run_one(source, seq, g, PRECISION, knobs, warmup, steps, "cuda")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument(
        "--compare",
        metavar="RESULTS.json",
        help="predict the measured cases and write the errors into RESULTS.json",
    )
    ap.add_argument(
        "--into",
        metavar="CALIBRATION.json",
        help="with --compare: set the measured optim8 section in this calibration",
    )
    ap.add_argument(
        "--probe-only",
        action="store_true",
        help="only the probe: the 8-bit optimizer's host time, GPU idle and busy",
    )
    ap.add_argument("--probe", help=argparse.SUPPRESS)
    ap.add_argument("--section", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args, _ = ap.parse_known_args()
    if args.section or args.one or args.probe:
        try:
            if args.probe:
                row = probe_child(json.loads(args.probe), args.warmup)
            else:
                row = (
                    section_child()
                    if args.section
                    else case_child(json.loads(args.one), args.warmup, args.steps)
                )
        except Exception as e:  # recorded by the parent
            row = {
                "error": {
                    "type": type(e).__name__,
                    "message": str(e)[:2000],
                    "traceback": traceback.format_exc().splitlines()[-12:],
                }
            }
        print("ROW " + json.dumps(row))
        return
    if args.compare:
        compare(args.compare, args.into)
        return
    if not args.out:
        ap.error("--out PATH.json is required")
    run(args)


def run(args) -> None:
    from plan.bench_plan import child_environment

    t0 = time.perf_counter()
    path = Path(args.out)
    out: dict = {
        "version": VERSION,
        "benchmark": "optim8",
        "precision": PRECISION,
        "settings": {"warmup": args.warmup, "steps": args.steps},
        "cases": {},
    }

    def save() -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)

    out["environment"] = _guard(child_environment)
    save()
    if args.probe_only:
        out["probes"] = {}
        for name in args.cases.split(","):
            row = run_child(
                "--probe", json.dumps(list(CASES[name])), 150, ["--warmup", str(args.warmup)]
            )
            out["probes"][name] = row
            print(name, row, flush=True)
            save()
        return
    out["section"] = run_child("--section", "1", 150, output_code=True)
    print(
        "section:", {k: out["section"].get(k) for k in ("seconds", "wall_s", "error")}, flush=True
    )
    save()
    for name in args.cases.split(","):
        source, seq, g = CASES[name]
        for states in STATES:
            key = f"{name}:{states}"
            if time.perf_counter() - t0 > BUDGET_S:
                out["cases"][key] = {"skipped": f"past the {BUDGET_S} s budget"}
                continue
            spec = json.dumps([source, seq, g, states])
            row = run_child(
                "--one", spec, 120, ["--warmup", str(args.warmup), "--steps", str(args.steps)]
            )
            row.update(source=source, seq=seq, batch=g, states=states)
            out["cases"][key] = row
            print(
                key,
                {
                    k: row.get(k)
                    for k in ("step_s", "peak_allocated", "peak_reserved", "wall_s", "error")
                },
                flush=True,
            )
            save()
    out["total_s"] = time.perf_counter() - t0
    save()


# -- the probe: the 8-bit optimizer's host time with the GPU idle and busy --------------------
PROBE_SPIN = 200_000_000  # cycles of torch.cuda._sleep: ~100 ms of a busy GPU


def probe_child(spec: list, warmup: int) -> dict:
    """One workload with 8-bit states: the optimizer step alone (gradients of zeros kept),
    its host seconds with the GPU idle and behind a ~100 ms spin kernel, per update; and a
    whole step's host seconds to issue it against its seconds to finish."""
    import torch

    from gobrrr.estimate import workload_factory
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs

    source, seq, g = spec
    torch.manual_seed(0)
    with torch.device("cuda"):
        wl = workload_factory(source, g, seq)()
    step = apply(wl, Knobs(micro_batch=g, optimizer_states="8bit"), precision=PRECISION)
    for _ in range(warmup):
        step(wl.batch)
    params = [p for grp in step.optimizer.param_groups for p in grp["params"]]
    out: dict = {"updates": len(params)}
    out["step_issue_s"], out["step_s"] = _issue_and_finish(lambda: step(wl.batch))
    for p in params:
        p.grad = torch.zeros_like(p)
    for busy in (False, True):
        times = []
        for _ in range(5):
            torch.cuda.synchronize()
            if busy:
                torch.cuda._sleep(PROBE_SPIN)
            t0 = time.perf_counter()
            step.optimizer.step()
            times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        out["host_per_update_" + ("busy" if busy else "idle")] = sorted(times)[2] / len(params)
    return out


def _issue_and_finish(fn, reps: int = 5) -> tuple[float, float]:
    """Median host seconds to issue fn() and seconds until the GPU finished it."""
    import torch

    issue, done = [], []
    for _ in range(reps):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        issue.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
        done.append(time.perf_counter() - t0)
    return sorted(issue)[reps // 2], sorted(done)[reps // 2]


# -- after the run, on any machine: the predictions beside the measurements --------------------
def compare(results: str | Path, into: str | Path | None = None) -> dict:
    """Predict every measured case on the CPU (traced on fake tensors, costed on the shipped
    H100 calibration with the optim8 section just measured), write the comparison into the
    results file, and, given `into`, set that section in a calibration file."""
    from dataclasses import replace

    from gobrrr.calibrate.sections.optim import summarize
    from gobrrr.hardware import Calibration
    from gobrrr.plan.knobs import Knobs
    from gobrrr.plan.search import Planner

    path = Path(results)
    data = json.loads(path.read_text())
    measured = data["section"]["optim8"]  # summarised again: as the section's code does now
    section = summarize(measured["points"], measured["host_distinct"])
    base = Calibration.load(into or HERE.parents[2] / "src/gobrrr/data/calibration/h100-sxm.json")
    cal = replace(base, optim8=section)
    planners: dict = {}
    out = {}
    for key, row in data["cases"].items():
        if "step_s" not in row:
            continue
        spec = (row["source"], row["seq"], row["batch"])
        if spec not in planners:
            planners[spec] = Planner(
                spec[0],
                "h100",
                global_batch=spec[2],
                seq=spec[1],
                precision=PRECISION,
                allow=["8bit-states"],
                calibration=cal,
            )
        p = planners[spec].cost(Knobs(micro_batch=spec[2], optimizer_states=row["states"]))
        out[key] = {
            "step_s": p.step_s,
            "peak_allocated": p.peak_bytes,
            "peak_reserved": p.reserved_bytes,
            "step_error": p.step_s / row["step_s"] - 1,
            "peak_error": p.peak_bytes / row["peak_allocated"] - 1,
            "reserved_error": p.reserved_bytes / row["peak_reserved"] - 1,
        }
        print(key, {k: round(v, 4) for k, v in out[key].items() if k.endswith("error")})
    data["predicted"] = out
    path.write_text(json.dumps(data, indent=1))
    if into:
        env = data.get("environment", {})
        replace(cal, meta={**base.meta, "optim8": {**env, "results": path.name}}).save(into)
    return out


def _guard(fn) -> dict:
    try:
        return fn()
    except Exception as e:
        return {"error": {"type": type(e).__name__, "message": str(e)[:1000]}}


if __name__ == "__main__":
    main()
