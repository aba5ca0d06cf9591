"""Measure the built-in workloads on a real GPU: peak memory and step time, per case.

    python benchmarks/bench_estimate_suite.py OUT.json [--cases 0-9] [--calibration CAL.json]

For each case: build the workload on the GPU, 3 warm-up steps, reset the peak-memory stats,
one step for the peak, then 10 timed steps (CUDA events, median). Recorded per case: the
real `max_memory_allocated` (and requested/reserved bytes), the step times, and in the same
run the predictions of gobrrr (datasheet and calibrated) and of PyTorch's RuntimeEstimator
in its roofline mode. `tests/test_recorded_suite.py` recomputes gobrrr's predictions on the
CPU from this file and holds them against the measurements.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import platform
import statistics
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gobrrr.estimate import estimate  # noqa: E402
from gobrrr.hardware import Calibration, match_device_name  # noqa: E402
from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.profile.runner import matmul_precision, prepare, run_step  # noqa: E402

# (model, batch, seq, precision, checkpoint, compile)
CASES = [
    ("gpt2", 8, 1024, "fp32", "none", False),
    ("gpt2", 16, 1024, "fp32", "none", False),
    ("gpt2", 8, 1024, "bf16-mixed", "none", False),
    ("gpt2", 16, 1024, "bf16-mixed", "none", False),
    ("gpt2", 8, 1024, "fp32", "full", False),
    ("gpt2", 16, 1024, "bf16-mixed", "full", False),
    ("gpt2", 16, 1024, "bf16", "none", False),
    ("gpt2", 8, 1024, "fp16-mixed", "none", False),
    ("gpt2", 1, 256, "bf16-mixed", "none", False),
    ("gpt2-medium", 4, 1024, "fp32", "none", False),
    ("gpt2-medium", 8, 1024, "bf16-mixed", "none", False),
    ("gpt2-medium", 4, 1024, "bf16-mixed", "none", False),
    ("gpt2-medium", 8, 1024, "bf16-mixed", "full", False),
    ("gpt2-medium", 4, 1024, "fp32", "full", False),
    ("llama3-1b", 1, 2048, "bf16-mixed", "none", False),
    ("llama3-1b", 2, 2048, "bf16-mixed", "full", False),
    ("mlp", 1024, None, "fp32", "none", False),
    ("mlp", 1024, None, "bf16-mixed", "none", False),
    ("convnet", 32, None, "fp32", "none", False),
    ("convnet", 64, None, "bf16-mixed", "none", False),
    ("gpt2", 16, 1024, "bf16-mixed", "none", True),
]


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        import triton

        triton_version = triton.__version__
    except ImportError:
        triton_version = None
    driver = None
    try:
        import subprocess

        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {"device": torch.cuda.get_device_name(), "memory_bytes": props.total_memory,
            "sms": props.multi_processor_count, "driver": driver, "cuda": torch.version.cuda,
            "torch": torch.__version__, "triton": triton_version,
            "python": platform.python_version(),
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def _free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def measure_case(name, batch, seq, precision, checkpoint, compile_, steps=10, warmup=3) -> dict:
    _free()
    base = torch.cuda.memory_allocated()
    with torch.device("cuda"):
        wl = get_workload(name, batch_size=batch, seq_len=seq)
    wl, opt, scaler = prepare(wl, "cuda", precision, checkpoint, compile_)
    step = lambda: run_step(wl, opt, precision, scaler, "cuda")
    with matmul_precision(precision):
        for _ in range(warmup if not compile_ else warmup + 2):
            step()
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
        step()
        torch.cuda.synchronize()
        stats = torch.cuda.memory_stats()
        times = []
        for _ in range(steps):
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            step()
            b.record()
            b.synchronize()
            times.append(a.elapsed_time(b) * 1e-3)
    out = {"peak_allocated": stats["allocated_bytes.all.peak"],
           "requested_peak": stats.get("requested_bytes.all.peak"),
           "reserved_peak": stats["reserved_bytes.all.peak"], "allocated_before_step": before,
           "allocated_before_build": base, "step_s": statistics.median(times),
           "step_s_min": min(times), "step_s_max": max(times), "step_times": times}
    return out  # the workload dies with this frame; the next case frees the cache


def runtime_estimator(name, batch, seq, precision, checkpoint) -> float | None:
    """PyTorch's own roofline estimate of the step (ms -> s), or None if it cannot run."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    with FakeTensorMode():
        with torch.device("cuda"):
            wl = get_workload(name, batch_size=batch, seq_len=seq)
        wl, opt, scaler = prepare(wl, "cuda", precision, checkpoint, False)
        est = RuntimeEstimator()
        with matmul_precision(precision), est("operator-level-cost-model"):
            from gobrrr.profile.runner import autocast_for

            with autocast_for(precision, "cuda"):
                loss = wl.compute_loss(wl.batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return est.total_runtime * 1e-3


def ours(name, batch, seq, precision, checkpoint, cal: Calibration | None) -> dict:
    est = estimate(name, "h100", batch=batch, seq=seq, precision=precision,
                   checkpoint=checkpoint, calibration=False)
    out = {"peak": est.memory.peak, "step_s": est.time.step_s, "capture_s": est.capture_s}
    if cal is not None:
        cest = estimate(name, "h100", batch=batch, seq=seq, precision=precision,
                        checkpoint=checkpoint, calibration=cal)
        out.update(peak_calibrated=cest.memory.peak, step_s_calibrated=cest.time.step_s)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--cases", default=None, help="a range like 0-9")
    ap.add_argument("--calibration", default=None)
    args = ap.parse_args()
    cases = CASES
    if args.cases:
        lo, hi = (int(x) for x in args.cases.split("-"))
        cases = CASES[lo:hi + 1]
    cal = Calibration.load(args.calibration) if args.calibration else None
    env = environment()
    spec = match_device_name(env["device"])
    print("device:", env["device"], "gpu spec:", spec.name if spec else None)
    results = []
    for case in cases:
        name, batch, seq, precision, checkpoint, compile_ = case
        row = {"model": name, "batch": batch, "seq": seq, "precision": precision,
               "checkpoint": checkpoint, "compile": compile_}
        t0 = time.time()
        try:
            row["measured"] = measure_case(*case)
        except torch.cuda.OutOfMemoryError:
            row["measured"] = {"oom": True}
            _free()
        for key, fn in (("runtime_estimator_s", lambda c=case: runtime_estimator(*c[:5])),
                        ("gobrrr", lambda c=case: ours(*c[:5], cal))):
            if compile_ and key == "runtime_estimator_s":
                continue
            try:
                row[key] = fn()
            except Exception as e:  # recorded, not fatal: one case must not sink the run
                row[key + "_error"] = f"{type(e).__name__}: {e}"
                traceback.print_exc(limit=2)
        row["wall_s"] = time.time() - t0
        results.append(row)
        m, g = row.get("measured", {}), row.get("gobrrr", {})
        if "peak_allocated" in m and g:
            print(f"{name:12s} b={batch:<5} s={seq} {precision:10s} ck={checkpoint:4s} "
                  f"c={int(compile_)} peak {m['peak_allocated'] / 2**30:7.3f} GiB pred "
                  f"{g['peak'] / 2**30:7.3f} ({g['peak'] / m['peak_allocated'] - 1:+.1%})  step "
                  f"{m['step_s'] * 1e3:8.2f} ms pred {g['step_s'] * 1e3:8.2f} "
                  f"({g['step_s'] / m['step_s'] - 1:+.0%}) RE "
                  f"{(row.get('runtime_estimator_s') or 0) * 1e3:8.2f}", flush=True)
        tmp = Path(args.out + ".tmp")  # rewritten after every case: a cut run keeps its cases
        tmp.write_text(json.dumps({"version": 1, "environment": env, "cases": results}, indent=1))
        tmp.replace(args.out)


if __name__ == "__main__":
    main()
