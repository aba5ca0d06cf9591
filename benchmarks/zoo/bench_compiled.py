"""Measure compiled training steps (torch.compile(model), optimizer eager) on a real GPU.

    PYTHONUNBUFFERED=1 python benchmarks/zoo/bench_compiled.py --out OUT.json [--cases A,B]
        [--budget 140] [--timeout 90]
    python benchmarks/zoo/bench_compiled.py --out /tmp/dry.json --device cpu --cases mlp-compiled \
        --warmup 1 --steps 2                                  # a dry run on the CPU

The ground truth for gobrrr's compiled-step prediction. Each case runs in a fresh process
(`--one NAME`), built and stepped as the zoo's harness does (benchmarks/zoo/measure.py:
gobrrr.profile.runner.prepare, 5 warm-up steps when compiled, peak stats reset, 10 steps timed
with CUDA events; max_memory_allocated / max_memory_reserved over them). Then, beyond the zoo:
- `phases`: one more step with the allocator read at each phase's edges: bytes allocated at the
  start and end of forward / backward / optimizer and the peak inside each;
- `forward_kept`: the allocator's active blocks at the end of forward that were not active at
  its start (torch.cuda.memory_snapshot): what the forward keeps for backward, plus the loss;
  their count, bytes (requested and as allocated) and the requested sizes, largest first;
- `phase_times`: median CUDA-event time of each phase over 5 steps;
- `dynamo`: graphs dynamo compiled and graph breaks (torch._dynamo.utils.counters).
Compiled cases run first, their eager twins after; a case that would start after `--budget`
seconds is recorded as skipped. An exception is recorded (type, message, traceback tail),
never fatal; OUT.json is rewritten after every case.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import statistics
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

import measure  # noqa: E402  (benchmarks/zoo/measure.py)
import torch  # noqa: E402

from gobrrr.errors import GobrrrError  # noqa: E402
from gobrrr.profile.runner import prepare  # noqa: E402
from gobrrr.training.step import TrainStep  # noqa: E402
from zoo.cases import ZooCase  # noqa: E402
from zoo.compiled import _BY_NAME, CASES, case_named  # noqa: E402

VERSION = 1
KEEP_SIZES = 600  # requested sizes listed per case in forward_kept


# -- the child: one case ----------------------------------------------------------------------


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def _active_blocks() -> dict[int, tuple[int, int]]:
    """address -> (allocated size, requested size) of every active allocator block."""
    out = {}
    for seg in torch.cuda.memory_snapshot():
        for b in seg["blocks"]:
            if b["state"] == "active_allocated":
                out[b["address"]] = (b["size"], b.get("requested_size", b["size"]))
    return out


class PhaseProbe:
    """TrainStep's phase context: allocator bytes and active blocks at each phase's edges."""

    def __init__(self) -> None:
        self.phases: dict[str, dict] = {}
        self.kept: dict | None = None

    @contextlib.contextmanager
    def __call__(self, name: str):
        torch.cuda.synchronize()
        before = _active_blocks() if name == "forward" else None
        start = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        yield
        torch.cuda.synchronize()
        self.phases[name] = {
            "allocated_start": start,
            "allocated_end": torch.cuda.memory_allocated(),
            "peak": torch.cuda.max_memory_allocated(),
        }
        if before is not None:
            new = [v for a, v in _active_blocks().items() if before.get(a) != v]
            sizes = sorted((r for _, r in new), reverse=True)
            self.kept = {
                "count": len(new),
                "bytes": sum(s for s, _ in new),
                "requested_bytes": sum(sizes),
                "requested_sizes": sizes[:KEEP_SIZES],
            }


class PhaseTimer:
    """TrainStep's phase context: CUDA events around each phase, seconds per phase."""

    def __init__(self) -> None:
        self.events: list[tuple[str, torch.cuda.Event, torch.cuda.Event]] = []

    @contextlib.contextmanager
    def __call__(self, name: str):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        yield
        b.record()
        self.events.append((name, a, b))

    def medians(self) -> dict[str, float]:
        torch.cuda.synchronize()
        times: dict[str, list[float]] = {}
        for name, a, b in self.events:
            times.setdefault(name, []).append(a.elapsed_time(b) * 1e-3)
        return {k: statistics.median(v) for k, v in times.items()}


def _dynamo_counters() -> dict:
    from torch._dynamo.utils import counters

    return {
        "stats": dict(counters["stats"]),
        "graph_break": dict(counters["graph_break"]),
        "inductor": {
            k: v
            for k, v in counters["inductor"].items()
            if k in ("fxgraph_cache_miss", "fxgraph_cache_hit")
        },
    }


def _measure_into(row: dict, case: ZooCase, device: str, warmup: int, steps: int) -> None:
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(device):
        wl = case.build(case.batch, case.seq)
    row["model"] = measure.model_facts(wl)
    wl, opt, scaler = prepare(wl, device, case.precision, "none", case.compile)
    dev = device.split(":")[0]
    make = lambda phase=None: TrainStep(
        wl, opt, case.precision, device_type=dev, scaler=scaler, phase=phase
    )
    step = make()
    row["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(warmup + (2 if case.compile else 0)):
        step()
    _sync(device)
    row["warmup_s"] = time.perf_counter() - t
    if case.compile:
        row["dynamo"] = _dynamo_counters()
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        row["allocated_before_timed"] = torch.cuda.memory_allocated()
    row["measured"] = {**measure._timed(step, steps, device), **measure.memory_record(device)}
    if device.startswith("cuda"):
        _probe_into(row, make)


def _probe_into(row: dict, make) -> None:
    """After the measurements (a failure here keeps them): phase memory, forward_kept, times."""
    try:
        probe = PhaseProbe()
        make(probe)()
        row["phases"], row["forward_kept"] = probe.phases, probe.kept
        timer = PhaseTimer()
        stepper = make(timer)
        for _ in range(5):
            stepper()
        row["phase_times"] = timer.medians()
    except Exception as e:
        row["probe_error"] = f"{type(e).__name__}: {str(e)[:500]}"


def run_case(case: ZooCase, device: str, warmup: int, steps: int) -> dict:
    """One case's JSON-ready row (an `error` on failure)."""
    row: dict = {
        "name": case.name,
        "spec": case.spec(),
        "batch": case.batch,
        "seq": case.seq,
        "device": device,
        "backends": measure.backend_flags(),
    }
    t0 = time.perf_counter()
    try:
        _measure_into(row, case, device, warmup, steps)
    except Exception as e:  # recorded, not fatal
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        row["error"] = {
            "type": type(e).__name__,
            "message": str(e)[:2000],
            "oom": oom,
            "traceback": traceback.format_exc().splitlines()[-12:],
        }
    row["wall_s"] = time.perf_counter() - t0
    return row


# -- the parent: every case in its own process ------------------------------------------------


def run_child(args, case: ZooCase) -> dict:
    cmd = [
        sys.executable,
        str(HERE),
        "--out",
        args.out,
        "--one",
        case.name,
        "--device",
        args.device,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    return measure.run_command(cmd, case, args.timeout)


def run_all(args) -> None:
    cases = (
        [case_named(n.strip()) for n in args.cases.split(",") if n.strip()] if args.cases else CASES
    )
    env_args = argparse.Namespace(out=args.out, device=args.device)
    try:
        env = measure.child_environment(env_args)
    except Exception as e:  # the measurements matter more than the header
        env = {"error": f"{type(e).__name__}: {e}"}
    doc = {
        "version": VERSION,
        "environment": env,
        "settings": {
            "device": args.device,
            "warmup": args.warmup,
            "steps": args.steps,
            "budget_s": args.budget,
            "timeout_s": args.timeout,
        },
        "cases": [],
    }
    t0 = time.perf_counter()
    for case in cases:
        if time.perf_counter() - t0 > args.budget:
            row = {
                "name": case.name,
                "spec": case.spec(),
                "skipped": f"over the {args.budget} s budget",
            }
        else:
            row = run_child(args, case)
        doc["cases"].append(row)
        print(
            measure.summary(row) if "skipped" not in row else f"{case.name:28s} skipped", flush=True
        )
        measure.write(args.out, doc)
    print(f"done: {len(cases)} cases in {time.perf_counter() - t0:.0f} s -> {args.out}", flush=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", required=True, help="the results JSON, rewritten after every case")
    ap.add_argument("--cases", help=f"comma-separated, of: {', '.join(_BY_NAME)}")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument(
        "--budget",
        type=float,
        default=140.0,
        help="seconds; cases that would start later are recorded as skipped",
    )
    ap.add_argument("--timeout", type=int, default=90, help="seconds per case")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.one is not None:
            row = run_case(case_named(args.one), args.device, args.warmup, args.steps)
            print("ROW " + json.dumps(row))
            return 0
        if args.device.startswith("cuda") and not torch.cuda.is_available():
            raise GobrrrError("--device cuda: no CUDA device here; use --device cpu for a dry run")
        run_all(args)
    except GobrrrError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
