"""Where the host's time goes in a zoo model's optimizer step, on a GPU: torch.profiler's CPU
view of one `optimizer.step(); zero_grad(set_to_none=True)` after warm-up steps.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/optimizer_host_profile.py OUT.json \
        [--cases NAME,NAME]

Per case (built and prepared as benchmarks/zoo/measure.py does, 3 warm-up steps, then one
forward and backward): the optimizer's class and its parameter tensors, the host seconds of
the step unprofiled (median of 5, each after a fresh forward and backward) and, from one
profiled step, the CPU ops by self time (name, calls, self and total seconds).
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

from child_rows import cases_main  # noqa: E402

VERSION = 1
CASES = ("efficientnet_v2_s-tv-cl", "resnet50-tv-cl", "gpt2-124m")


def one(name: str) -> dict:
    import torch

    from gobrrr.profile.runner import run_step
    from gobrrr.training.step import autocast_for
    from zoo.cases import prepared

    case, wl, opt, scaler = prepared(name)
    for _ in range(3):
        run_step(wl, opt, case.precision, scaler)

    def grads() -> None:
        with autocast_for(case.precision, "cuda"):
            loss = wl.compute_loss(wl.batch)
        loss.backward()
        torch.cuda.synchronize()

    def step() -> None:
        opt.step()
        opt.zero_grad(set_to_none=True)

    times = []
    for _ in range(5):
        grads()
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
        torch.cuda.synchronize()
    grads()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        step()
        torch.cuda.synchronize()
    rows = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:25]
    groups = opt.param_groups
    return {"name": name, "optimizer": type(opt).__name__,
            "foreach": [g.get("foreach") for g in groups],
            "fused": [g.get("fused") for g in groups],
            "tensors": sum(len(g["params"]) for g in groups),
            "step_host_s": statistics.median(times),
            "ops": [{"name": e.key, "calls": e.count, "self_s": e.self_cpu_time_total * 1e-6,
                     "total_s": e.cpu_time_total * 1e-6} for e in rows]}


def report(row: dict) -> None:
    if "error" in row:
        print(row["name"], row["error"], flush=True)
        return
    print(f"{row['name']}: {row['optimizer']} foreach={row['foreach']} fused={row['fused']} "
          f"tensors {row['tensors']} step host {row['step_host_s'] * 1e3:.2f} ms", flush=True)
    for o in row["ops"][:12]:
        print(f"   {o['name'][:60]:60s} x{o['calls']:5d} self {o['self_s'] * 1e3:7.2f} ms "
              f"total {o['total_s'] * 1e3:7.2f}", flush=True)


def main(argv=None) -> int:
    return cases_main(argv, __doc__, str(HERE), CASES, VERSION, one, report)


if __name__ == "__main__":
    sys.exit(main())
