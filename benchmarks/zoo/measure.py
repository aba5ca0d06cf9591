"""Measure the zoo on a real GPU: the ground truth gobrrr's predictions are held against.

    PYTHONUNBUFFERED=1 python benchmarks/zoo/measure.py OUT.json [--cases NAME,NAME]
        [--start I --stop J] [--append] [--device cuda] [--timeout 300]
    python benchmarks/zoo/measure.py /tmp/dry.json --device cpu --cases gpt2-124m \
        --batch 1 --seq 64 --warmup 1 --steps 2          # a dry run on the CPU

Each case runs in a fresh process of this script (`--one NAME`): build the case on the device,
prepare it and step it as gobrrr's profile runner does (gobrrr.profile.runner.prepare and
run_step), 3 warm-up steps (5 when compiled), reset the peak-memory stats, 10 steps timed with
CUDA events (median, min, max); then `max_memory_allocated`, `max_memory_reserved` over the
timed steps and the allocator's segment counts; then one more step under a dispatch mode that
counts the ATen ops that ran (which SDPA backend, which convolution ops CUDA chose). PyTorch's
own defaults stay in force (TF32 off for matmuls, on for cuDNN convolutions), as a user gets
them. An exception is recorded (type, message, traceback tail; out-of-memory flagged), never
fatal. OUT.json is rewritten after every case, so a killed run keeps what it measured.
`--start I --stop J` takes CASES[I:J].
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import subprocess
import sys
import time
import traceback
from collections import Counter
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parents[1])]

import torch  # noqa: E402
from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

from gobrrr.errors import GobrrrError  # noqa: E402
from gobrrr.profile.runner import prepare, run_step, time_steps  # noqa: E402
from zoo.cases import CASES, ZooCase, get_case  # noqa: E402

VERSION = 1
LIBRARIES = ("transformers", "torchvision", "timm")


# -- the child: one case ----------------------------------------------------------------------


class OpCounter(TorchDispatchMode):
    """Counts every ATen op that runs under it: {"aten.mm.default": n, ...}."""

    def __init__(self) -> None:
        super().__init__()
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[str(func)] += 1
        return func(*args, **(kwargs or {}))


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def backend_flags() -> dict:
    """The PyTorch switches that decide which kernels run: TF32, SDPA backends."""
    sdp = {
        k: getattr(torch.backends.cuda, f"{k}_sdp_enabled")()
        for k in ("flash", "mem_efficient", "math", "cudnn")
        if hasattr(torch.backends.cuda, f"{k}_sdp_enabled")
    }
    return {
        "matmul_allow_tf32": torch.backends.cuda.matmul.allow_tf32,
        "cudnn_allow_tf32": torch.backends.cudnn.allow_tf32,
        "float32_matmul_precision": torch.get_float32_matmul_precision(),
        "cudnn_benchmark": torch.backends.cudnn.benchmark,
        "sdp_enabled": sdp,
    }


def model_facts(wl) -> dict:
    """Parameter counts (all, trainable) and the attention implementation a HF model chose."""
    params = list(wl.model.parameters())
    cfg = getattr(wl.model, "config", None)
    return {
        "params": sum(p.numel() for p in params),
        "trainable_params": sum(p.numel() for p in params if p.requires_grad),
        "attn_implementation": getattr(cfg, "_attn_implementation", None),
        "class": type(wl.model).__name__,
    }


def memory_record(device: str) -> dict:
    """Peaks since the last reset, and the allocator's current/peak counters (segments,
    blocks, bytes per pool) and retry/OOM counts."""
    if not device.startswith("cuda"):
        return {}
    stats = torch.cuda.memory_stats()
    keep = {
        k: v for k, v in stats.items() if k.endswith((".current", ".peak")) or k.startswith("num_")
    }
    return {
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
        "stats": keep,
    }


def _timed(step, n: int, device: str) -> dict:
    times = time_steps(step, n, device)
    return {
        "step_s": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "step_times": times,
    }


def run_case(
    case: ZooCase, device: str, batch: int, seq: int | None, warmup: int, steps: int
) -> dict:
    """Build, warm up, time and count one case; the JSON-ready row (an `error` on failure)."""
    row: dict = {
        "name": case.name,
        "spec": case.spec(),
        "batch": batch,
        "seq": seq,
        "device": device,
        "backends": backend_flags(),
    }
    t0 = time.perf_counter()
    try:
        _measure_into(row, case, device, batch, seq, warmup, steps)
    except Exception as e:  # recorded, not fatal: one case must not sink the run
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        row["error"] = {
            "type": type(e).__name__,
            "message": str(e)[:2000],
            "oom": oom,
            "traceback": traceback.format_exc().splitlines()[-12:],
        }
        if device.startswith("cuda"):
            row["error"]["memory"] = memory_record(device)
    row["wall_s"] = time.perf_counter() - t0
    return row


def _measure_into(row: dict, case, device, batch, seq, warmup, steps) -> None:
    torch.manual_seed(0)
    t = time.perf_counter()
    with torch.device(device):
        wl = case.build(batch, seq)
    row["model"] = model_facts(wl)
    wl, opt, scaler = prepare(wl, device, case.precision, "none", case.compile)
    step = lambda: run_step(wl, opt, case.precision, scaler, device.split(":")[0])
    row["build_s"] = time.perf_counter() - t
    t = time.perf_counter()
    for _ in range(warmup + (2 if case.compile else 0)):
        step()
    _sync(device)
    row["warmup_s"] = time.perf_counter() - t
    if device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
        row["allocated_before_timed"] = torch.cuda.memory_allocated()
    row["measured"] = {**_timed(step, steps, device), **memory_record(device)}
    t = time.perf_counter()
    try:  # after the measurements: a failure here keeps them
        with OpCounter() as counter:
            step()
            _sync(device)
        row["aten_ops"] = dict(sorted(counter.counts.items()))
    except Exception as e:
        row["aten_ops_error"] = f"{type(e).__name__}: {str(e)[:500]}"
    row["count_step_s"] = time.perf_counter() - t


# -- the parent: every case in its own process ------------------------------------------------


def environment(device: str) -> dict:
    """Device, driver, CUDA, torch and the zoo libraries' versions, date."""
    if device.startswith("cuda"):
        from suite.bench_estimate_suite import environment as gpu_environment

        env = gpu_environment()
    else:
        env = {
            "device": platform.processor() or platform.machine(),
            "torch": torch.__version__,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        }
    for lib in LIBRARIES:
        try:
            env[lib] = __import__(lib).__version__
        except ImportError:
            env[lib] = None
    return env


def child_environment(args) -> dict:
    """`environment` from a fresh process, so this one never holds a CUDA context."""
    cmd = [sys.executable, str(HERE), args.out, "--env", "--device", args.device]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=_child_env())
    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ENV ")]
    if not rows:
        raise GobrrrError(f"reading the environment failed: {proc.stderr.strip()[-500:]}")
    return json.loads(rows[-1])


def select(args) -> list[ZooCase]:
    if args.cases:
        return [get_case(n.strip()) for n in args.cases.split(",") if n.strip()]
    return CASES[args.start : args.stop]


def child_command(args, name: str) -> list[str]:
    cmd = [
        sys.executable,
        str(HERE),
        args.out,
        "--one",
        name,
        "--device",
        args.device,
        "--warmup",
        str(args.warmup),
        "--steps",
        str(args.steps),
    ]
    for flag in ("batch", "seq"):
        if getattr(args, flag) is not None:
            cmd += [f"--{flag}", str(getattr(args, flag))]
    return cmd


def run_child(args, case: ZooCase) -> dict:
    """One case in a fresh process; its row, or a row saying how the process died."""
    return run_command(child_command(args, case.name), case, args.timeout)


def run_command(cmd: list[str], case: ZooCase, timeout: float) -> dict:
    """Run `cmd` (a child printing "ROW <json>") in a fresh process: its last row, or a row
    for `case` saying how the process died (timeout, exit code, out of memory)."""
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, env=_child_env()
        )
    except subprocess.TimeoutExpired as e:
        tail = (e.stderr or b"")[-1500:]
        return {
            "name": case.name,
            "spec": case.spec(),
            "wall_s": time.perf_counter() - t0,
            "error": {
                "type": "Timeout",
                "message": f"no result in {timeout} s",
                "oom": False,
                "traceback": _text(tail).splitlines()[-12:],
            },
        }
    rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
    if rows:
        return json.loads(rows[-1])
    return {
        "name": case.name,
        "spec": case.spec(),
        "wall_s": time.perf_counter() - t0,
        "error": {
            "type": "ProcessDied",
            "message": f"exit code {proc.returncode}",
            "oom": "out of memory" in proc.stderr,
            "traceback": proc.stderr.splitlines()[-12:],
        },
    }


def _text(b) -> str:
    return b.decode(errors="replace") if isinstance(b, bytes) else b


def _child_env() -> dict:
    import os

    return {**os.environ, "PYTHONUNBUFFERED": "1"}


def summary(row: dict) -> str:
    head = f"{row['name']:28s}"
    if "error" in row:
        err = row["error"]
        msg = err["message"].splitlines()[0][:140] if err["message"] else ""
        return f"{head} {'OOM' if err.get('oom') else 'ERROR'} {err['type']}: {msg}"
    m, gib = row["measured"], 2**30
    mem = (
        f"alloc {m['peak_allocated'] / gib:7.3f} GiB  reserved "
        f"{m['peak_reserved'] / gib:7.3f} GiB  "
        if "peak_allocated" in m
        else ""
    )
    spread = f"[{m['step_s_min'] * 1e3:.2f}-{m['step_s_max'] * 1e3:.2f}]"
    return f"{head} {mem}step {m['step_s'] * 1e3:8.2f} ms {spread}  wall {row['wall_s']:.0f} s"


def write(out: str, doc: dict) -> None:
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(doc, indent=1))
    tmp.replace(out)


def run_all(args) -> None:
    cases = select(args)
    env = child_environment(args)
    print(
        f"{len(cases)} cases on {env['device']} (torch {env['torch']}, transformers "
        f"{env['transformers']}, torchvision {env['torchvision']}, timm {env['timm']})",
        flush=True,
    )
    doc = {
        "version": VERSION,
        "environment": env,
        "settings": {
            "device": args.device,
            "warmup": args.warmup,
            "steps": args.steps,
            "batch_override": args.batch,
            "seq_override": args.seq,
        },
        "cases": [],
    }
    if args.append and Path(args.out).exists():
        doc = json.loads(Path(args.out).read_text())
    t0 = time.perf_counter()
    for case in cases:
        row = run_child(args, case)
        doc["cases"] = [r for r in doc["cases"] if r["name"] != case.name] + [row]
        print(summary(row), flush=True)
        write(args.out, doc)
    print(f"done: {len(cases)} cases in {time.perf_counter() - t0:.0f} s -> {args.out}", flush=True)


def parse(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the results JSON, rewritten after every case")
    ap.add_argument("--cases", help="comma-separated case names")
    ap.add_argument("--start", type=int, default=0, help="first case index (CASES[start:stop])")
    ap.add_argument("--stop", type=int, default=None, help="one past the last case index")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--batch", type=int, default=None, help="override every case's batch")
    ap.add_argument("--seq", type=int, default=None, help="override every case's seq")
    ap.add_argument("--timeout", type=int, default=300, help="seconds per case")
    ap.add_argument(
        "--append",
        action="store_true",
        help="keep the cases already in OUT.json (a case measured again replaces "
        "its row): run the zoo in parts into one file",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--env", action="store_true", help=argparse.SUPPRESS)
    return ap.parse_args(argv)


def main(argv=None) -> int:
    args = parse(argv)
    try:
        if args.env:
            print("ENV " + json.dumps(environment(args.device)))
            return 0
        if args.one is not None:  # child: one case, its row on the last line
            case = get_case(args.one)
            seq = args.seq if args.seq is not None and case.seq is not None else case.seq
            row = run_case(
                case, args.device, args.batch or case.batch, seq, args.warmup, args.steps
            )
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
