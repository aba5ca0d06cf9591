"""Where the host waits for the GPU inside a training step: the CUDA runtime calls that block
(stream and device synchronisations, synchronous copies, event waits), by the step's phase;
and the GPU's kernel time (Inductor's Triton kernels apart) and span in the same step.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/host_waits.py OUT.json \
        [--configs gpt2:1024:8:8bit,gpt2:1024:8:as-is]

A configuration is "<built-in workload>:<seq>:<global batch>:<optimizer states>" in
bf16-mixed, applied with `gobrrr.apply` (states "as-is" | "8bit" | "bf16"), each in a fresh
process: 3 warm-up steps, 5 steps timed with CUDA events (median), then the forward and loss,
the backward and the optimizer step (with zero_grad) each timed on the host's clock without
synchronising in between, over 5 steps (medians), then one step under torch.profiler: every
runtime call whose name says it can block, with its count and host time, by phase. A step
whose optimizer waits for the backward's kernels runs them one after the other instead of
overlapping the optimizer's host work with the GPU's backlog.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

from child_rows import child_flags, env_row, run_row, serve_child  # noqa: E402

VERSION = 1
BLOCKING = ("Synchronize", "cudaMemcpy", "cudaEventQuery", "cudaStreamWait", "cudaFree",
            "cudaMalloc", "cudaHostAlloc")
CONFIGS = ("gpt2:1024:8:8bit", "gpt2:1024:8:as-is", "gpt2:256:1:8bit")


def run_one(config: str, device: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from gobrrr.estimate import workload_factory
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs
    from gobrrr.profile.runner import time_steps

    source, seq, g, states = config.split(":")
    torch.manual_seed(0)
    with torch.device(device):
        wl = workload_factory(source, int(g), int(seq))()
    knobs = Knobs(micro_batch=int(g), accumulation=1, optimizer_states=states)
    step = apply(wl, knobs, precision="bf16-mixed")
    train, batch = step._step, wl.batch  # its phases: forward under autocast, backward, step
    for _ in range(3):
        step(batch)
    times = time_steps(lambda: step(batch), 5, device)

    def sync():
        if device == "cuda":
            torch.cuda.synchronize()

    phases: dict[str, list[float]] = {"forward": [], "backward": [], "optimizer": []}
    for _ in range(5):
        sync()
        t0 = time.perf_counter()
        loss = train.forward(batch)
        t1 = time.perf_counter()
        train.backward(loss)
        t2 = time.perf_counter()
        train.optimizer_step()
        t3 = time.perf_counter()
        sync()
        for k, v in zip(phases, (t1 - t0, t2 - t1, t3 - t2), strict=True):
            phases[k].append(v)
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device == "cuda" else [])
    with profile(activities=acts) as prof:
        with record_function("phase:forward"):
            loss = train.forward(batch)
        with record_function("phase:backward"):
            train.backward(loss)
        with record_function("phase:optimizer"):
            train.optimizer_step()
        sync()
    events = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CPU]
    spans = {e.name.split(":", 1)[1]: (e.time_range.start, e.time_range.end)
             for e in events if e.name.startswith("phase:")}
    waits: dict[str, dict[str, list[float]]] = {p: {} for p in spans}
    for e in events:
        if not any(b in e.name for b in BLOCKING):
            continue
        phase = next((p for p, (s, t) in spans.items() if s <= e.time_range.start < t),
                     "after")
        w = waits.setdefault(phase, {}).setdefault(e.name, [0, 0.0])
        w[0] += 1
        w[1] += (e.time_range.end - e.time_range.start) * 1e-6
    kernels: dict[str, list[float]] = {}
    first = last = None
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA or "#" in e.name:
            continue  # (a user annotation mirrored on the GPU's timeline is not a kernel)
        k = kernels.setdefault("triton" if e.name.startswith("triton_") else "other", [0, 0.0])
        k[0] += 1
        k[1] += (e.time_range.end - e.time_range.start) * 1e-6
        first = e.time_range.start if first is None else min(first, e.time_range.start)
        last = e.time_range.end if last is None else max(last, e.time_range.end)
    gpu = {"kernels": {n: {"count": c, "s": s} for n, (c, s) in kernels.items()},
           "span_s": (last - first) * 1e-6 if first is not None else 0.0}
    return {"gpu": gpu, "config": config, "step_s": statistics.median(times), "step_times": times,
            "host_phase_s": {k: statistics.median(v) for k, v in phases.items()},
            "waits": {p: {n: {"calls": c, "s": s} for n, (c, s) in d.items()}
                      for p, d in waits.items()}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", nargs="?")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--timeout", type=int, default=300)
    child_flags(ap)
    args = ap.parse_args()
    if serve_child(args, lambda config: run_one(config, args.device)):
        return
    out = {"version": VERSION, "environment": env_row(str(HERE)), "rows": []}
    for config in args.configs.split(","):
        row = run_row([sys.executable, str(HERE), "--one", config, "--device", args.device],
                      args.timeout)
        out["rows"].append({"config": config, **row})
        print(config, {k: row.get(k) for k in ("step_s", "host_phase_s", "gpu", "error")},
              flush=True)
        for phase, d in row.get("waits", {}).items():
            for name, w in sorted(d.items(), key=lambda kv: -kv[1]["s"])[:4]:
                print(f"   {phase:10s} {name[:50]:50s} {w['calls']:5d} {w['s'] * 1e3:8.2f} ms")
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")


if __name__ == "__main__":
    main()
