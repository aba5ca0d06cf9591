"""Measure the built-in workloads on a real GPU: peak memory and step time, per case.

    python benchmarks/suite/bench_estimate_suite.py OUT.json [--cases 0-9] [--calibration CAL.json]
    python benchmarks/suite/bench_estimate_suite.py OUT.json --merge PART.json PART.json ...

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
import subprocess
import sys
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

from gobrrr.estimate import estimate  # noqa: E402
from gobrrr.hardware import Calibration, match_device_name  # noqa: E402
from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.profile.runner import matmul_precision, prepare, run_step, time_steps  # noqa: E402

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
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return {
        "device": torch.cuda.get_device_name(),
        "memory_bytes": props.total_memory,
        "sms": props.multi_processor_count,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "triton": triton_version,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


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
        times = time_steps(step, steps, "cuda")
    out = {
        "peak_allocated": stats["allocated_bytes.all.peak"],
        "requested_peak": stats.get("requested_bytes.all.peak"),
        "reserved_peak": stats["reserved_bytes.all.peak"],
        "allocated_before_step": before,
        "allocated_before_build": base,
        "step_s": statistics.median(times),
        "step_s_min": min(times),
        "step_s_max": max(times),
        "step_times": times,
    }
    return out  # the workload dies with this frame; the next case frees the cache


def runtime_estimator(name, batch, seq, precision, checkpoint) -> float | None:
    """PyTorch's own roofline estimate of the step (its ms -> s), traced on fake CUDA tensors."""
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.distributed._tools.runtime_estimator import RuntimeEstimator

    from gobrrr.capture import _convert_tensors
    from gobrrr.profile.runner import autocast_for
    from gobrrr.training.checkpointing import apply_checkpointing

    with FakeTensorMode(), torch.device("cuda"):
        wl = get_workload(name, batch_size=batch, seq_len=seq)
        if precision == "bf16":
            _convert_tensors(
                wl.model, lambda t: t.to(torch.bfloat16) if t.is_floating_point() else t
            )
        if checkpoint == "full":
            apply_checkpointing(wl.model)
        opt = wl.make_optimizer()
        est = RuntimeEstimator()
        with matmul_precision(precision), est("operator-level-cost-model"):
            with autocast_for(precision, "cuda"):
                loss = wl.compute_loss(wl.batch)
            loss.backward()
            opt.step()
            opt.zero_grad()
    return est.total_runtime * 1e-3


def ours(name, batch, seq, precision, checkpoint, compile_, cal: Calibration | None) -> dict:
    """gobrrr's prediction from the datasheet, and from the calibration when one is given."""
    from gobrrr.evaluate import evaluate
    from gobrrr.hardware import Target

    est = estimate(
        name,
        "h100",
        batch=batch,
        seq=seq,
        precision=precision,
        checkpoint=checkpoint,
        calibration=False,
        compile=compile_,
        loop="drops-output",  # measured with gobrrr's TrainStep
    )
    out = {"peak": est.memory.peak, "step_s": est.time.step_s, "capture_s": est.capture_s}
    if cal is not None:
        calibrated = evaluate(est.graph, Target(est.gpu, cal), compiled=compile_)
        out.update(peak_calibrated=calibrated.memory.peak, step_s_calibrated=calibrated.time.step_s)
    return out


def run_case(i: int, cal: Calibration | None) -> dict:
    case = CASES[i]
    name, batch, seq, precision, checkpoint, compile_ = case
    row = {
        "model": name,
        "batch": batch,
        "seq": seq,
        "precision": precision,
        "checkpoint": checkpoint,
        "compile": compile_,
    }
    t0 = time.time()
    try:
        row["measured"] = measure_case(*case)
    except torch.cuda.OutOfMemoryError:
        row["measured"] = {"oom": True}
        _free()
    for key, fn in (
        ("runtime_estimator_s", lambda: runtime_estimator(*case[:5])),
        ("gobrrr", lambda: ours(*case, cal)),
    ):
        if compile_ and key == "runtime_estimator_s":
            continue
        try:
            row[key] = fn()
        except Exception as e:  # recorded, not fatal: one case must not sink the run
            row[key + "_error"] = f"{type(e).__name__}: {e}"
            traceback.print_exc(limit=2)
    row["wall_s"] = time.time() - t0
    return row


def workspace_probe() -> dict:
    """Bytes the BLAS libraries keep allocated, in this fresh process: after a plain matmul
    (cuBLAS) and after an addmm with a bias (cuBLASLt), bf16 and fp32."""
    out = {"start": torch.cuda.memory_allocated()}
    a = torch.randn(256, 256, device="cuda")
    b = torch.randn(256, device="cuda")
    before = torch.cuda.memory_allocated()
    _ = a @ a
    torch.cuda.synchronize()
    out["after_mm"] = torch.cuda.memory_allocated() - before
    _ = torch.addmm(b, a, a)
    torch.cuda.synchronize()
    out["after_addmm"] = torch.cuda.memory_allocated() - before
    ab = a.bfloat16()
    base = torch.cuda.memory_allocated()
    _ = torch.addmm(b.bfloat16(), ab, ab)
    _ = ab @ ab
    torch.cuda.synchronize()
    out["after_bf16"] = torch.cuda.memory_allocated() - base
    return out


def _summary(row: dict) -> str:
    m, g = row.get("measured", {}), row.get("gobrrr", {})
    if "peak_allocated" not in m or not g:
        return f"{row['model']} {row['batch']} {row['precision']}: {row}"
    re_s = row.get("runtime_estimator_s") or 0.0
    cal_s = g.get("step_s_calibrated", float("nan"))
    return (
        f"{row['model']:12s} b={row['batch']:<5} s={row['seq']} {row['precision']:10s} "
        f"ck={row['checkpoint']:4s} c={int(row['compile'])} peak "
        f"{m['peak_allocated'] / 2**30:7.3f} GiB pred {g['peak'] / 2**30:7.3f} "
        f"({g['peak'] / m['peak_allocated'] - 1:+.1%})  step {m['step_s'] * 1e3:8.2f} ms "
        f"pred {g['step_s'] * 1e3:8.2f} cal {cal_s * 1e3:8.2f} "
        f"({cal_s / m['step_s'] - 1:+.0%}) RE {re_s * 1e3:8.2f} "
        f"({re_s / m['step_s'] - 1:+.0%})"
    )


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("out")
    ap.add_argument("--cases", default=None, help="a range like 0-9")
    ap.add_argument("--calibration", default=None)
    ap.add_argument("--one", type=int, default=None, help=argparse.SUPPRESS)
    ap.add_argument(
        "--merge",
        nargs="+",
        default=None,
        help="join runs of parts of the suite (--cases) into OUT.json",
    )
    args = ap.parse_args()
    if args.merge:
        merge(args.out, args.merge)
        return
    cal = Calibration.load(args.calibration) if args.calibration else None
    if args.one is not None:  # child: one case in a fresh process, JSON on the last line
        row = run_case(args.one, cal) if args.one >= 0 else workspace_probe()
        print("ROW " + json.dumps(row))
        return
    lo, hi = (int(x) for x in args.cases.split("-")) if args.cases else (0, len(CASES) - 1)
    env = environment()
    spec = match_device_name(env["device"])
    print("device:", env["device"], "gpu spec:", spec.name if spec else None, flush=True)
    results, probe = [], None
    for i in [-1, *range(lo, hi + 1)]:
        cmd = [sys.executable, __file__, args.out, "--one", str(i)]
        if args.calibration:
            cmd += ["--calibration", args.calibration]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        if not rows:
            print(f"case {i} failed:\n{proc.stderr[-2000:]}", flush=True)
            continue
        if i < 0:
            probe = json.loads(rows[-1])
            print("workspace probe:", probe, flush=True)
            continue
        results.append(json.loads(rows[-1]))
        print(_summary(results[-1]), flush=True)
        tmp = Path(args.out + ".tmp")  # rewritten after every case: a cut run keeps its cases
        tmp.write_text(
            json.dumps(
                {
                    "version": 1,
                    "environment": env,
                    "workspace": probe,
                    "calibration": args.calibration
                    and json.loads(Path(args.calibration).read_text()),
                    "cases": results,
                },
                indent=1,
            )
        )
        tmp.replace(args.out)


def merge(out: str, parts: list[str]) -> None:
    """One file from runs of parts of the suite: the cases of every part in order; the first
    part's environment, workspace probe and calibration at the top, and every part's
    environment and calibration under "parts" (each part's own cases were predicted with its
    own calibration)."""
    data = [json.loads(Path(p).read_text()) for p in parts]
    merged = {k: data[0][k] for k in ("version", "environment", "workspace", "calibration")}
    merged["parts"] = [
        {
            "file": Path(p).name,
            "environment": d["environment"],
            "calibration": d["calibration"],
            "cases": [f"{c['model']} b{c['batch']} {c['precision']}" for c in d["cases"]],
        }
        for p, d in zip(parts, data, strict=True)
    ]
    merged["cases"] = [c for d in data for c in d["cases"]]
    tmp = Path(out + ".tmp")
    tmp.write_text(json.dumps(merged, indent=1))
    tmp.replace(out)


if __name__ == "__main__":
    main()
