"""Where a step's host time goes, on a GPU: inside ATen ops or in the model's Python between
them, and how much Python runs.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/host_attribution.py OUT.json \
        [--cases NAME,NAME]                      # on the GPU machine

Each case in a fresh process, built and warmed up as host_phases.py does (a zoo case by name,
a built-in model as "model:batch:seq:checkpoint"). Then:
- "phases": 7 steps timed per phase with the host's clock (host_phases.timed_step), medians;
- "profile": one step under torch.profiler (CPU activities only), the forward and backward
  each inside a record_function region: per phase its wall seconds, the ops directly under it
  (forward: ATen ops called by the model's code; backward: the autograd engine's
  evaluate_function nodes), their count and inclusive seconds, and what is left between them
  (the forward's Python, the engine's own work); per top-level op name its count and
  inclusive seconds;
- "python": one forward with sys.monitoring counting what the interpreter runs: Python
  function starts, lines and calls (Python and C);
- "reference": the host's speed on a pure-Python loop (ns per iteration of a small method call
  with attribute reads) and on back-to-back tiny CUDA adds (s per call), so hosts can be
  compared.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

from child_rows import cases_main  # noqa: E402
from host_phases import _prepared, phase_medians, timed_step  # noqa: E402

VERSION = 1
CASES = ("efficientnet_v2_s-tv-cl", "mobilenet_v3_large-tv", "resnet50-tv-cl",
         "vit_small-timm", "convnextv2_tiny-timm", "pythia-410m", "gpt2-124m",
         "distilbert-mlm", "gpt2:8:1024:none")


class _Probe:
    def __init__(self) -> None:
        self.scale = 1.5

    def value(self, x: float) -> float:
        return x * self.scale + 1.0


def python_reference(n: int = 200_000, rounds: int = 5) -> float:
    """Seconds per iteration of a loop calling a small method (least of `rounds`)."""
    probe = _Probe()
    best = float("inf")
    for _ in range(rounds):
        acc = 0.0
        t0 = time.perf_counter()
        for i in range(n):
            acc += probe.value(i)
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def add_reference(calls: int = 400, rounds: int = 5) -> float:
    """Seconds per call of a tiny CUDA add, as calibrate_host.per_call times it."""
    import torch

    from gobrrr.calibrate.sections.host import per_call

    dev = torch.device("cuda")
    a = torch.randn(8, device=dev)
    return per_call(lambda: a + a, dev, calls, rounds=rounds, warmup=20)


def _regions(precision, wl, opt, scaler):
    import torch

    def region(phase):
        return torch.profiler.record_function(f"phase::{phase}")

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        timed_step(precision, wl, opt, scaler, region)
    out = {}
    events = prof.events()
    for ev in events:
        if not ev.name.startswith("phase::"):
            continue
        phase = ev.name.removeprefix("phase::")
        lo, hi = ev.time_range.start, ev.time_range.end
        if phase == "backward":  # the engine's nodes run on its own thread
            top = [e for e in events if e.name.startswith("autograd::engine::evaluate_function")
                   and lo <= e.time_range.start <= hi]
        else:
            top = list(ev.cpu_children)
        by_name: dict[str, list[float]] = {}
        for e in top:
            by_name.setdefault(e.name, []).append(e.time_range.elapsed_us() * 1e-6)
        inside = sum(sum(v) for v in by_name.values())
        wall = (hi - lo) * 1e-6
        out[phase] = {"wall_s": wall, "ops": sum(len(v) for v in by_name.values()),
                      "ops_s": inside, "between_s": wall - inside,
                      "by_op": {k: [len(v), sum(v)] for k, v in
                                sorted(by_name.items(), key=lambda kv: -sum(kv[1]))}}
    return out


def _python_counts(precision, wl) -> dict[str, int]:
    from gobrrr.training.step import autocast_for

    mon = sys.monitoring
    tool = mon.PROFILER_ID
    counts = {"py_start": 0, "line": 0, "call": 0}

    def on_start(code, offset):
        counts["py_start"] += 1

    def on_line(code, line):
        counts["line"] += 1

    def on_call(code, offset, callable, arg0):
        counts["call"] += 1

    mon.use_tool_id(tool, "gobrrr-count")
    try:
        mon.register_callback(tool, mon.events.PY_START, on_start)
        mon.register_callback(tool, mon.events.LINE, on_line)
        mon.register_callback(tool, mon.events.CALL, on_call)
        mon.set_events(tool, mon.events.PY_START | mon.events.LINE | mon.events.CALL)
        with autocast_for(precision, "cuda"):
            loss = wl.compute_loss(wl.batch)
        mon.set_events(tool, 0)
    finally:
        mon.free_tool_id(tool)
    loss.backward()
    return counts


def one(name: str) -> dict:
    import torch

    prepared = _prepared(name)
    phases = phase_medians(prepared)
    _regions(*prepared)  # the profiler's first use warms it up
    torch.cuda.synchronize()
    profile = _regions(*prepared)
    torch.cuda.synchronize()
    precision, wl, opt, _ = prepared
    python = _python_counts(precision, wl)
    opt.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    return {"name": name, "phases": phases, "profile": profile, "python": python,
            "reference": {"python_iter_s": python_reference(), "cuda_add_s": add_reference()}}


def _report(row: dict) -> None:
    if "error" in row:
        print(row["name"], row["error"], flush=True)
        return
    f = row["profile"]["forward"]
    print(f"{row['name']:26s} fwd {row['phases']['forward'] * 1e3:6.1f} ms; profiled "
          f"{f['wall_s'] * 1e3:6.1f}: {f['ops']} ops {f['ops_s'] * 1e3:6.1f} ms, between "
          f"{f['between_s'] * 1e3:6.1f} ms; lines {row['python']['line']}, "
          f"py calls {row['python']['py_start']}; ref py "
          f"{row['reference']['python_iter_s'] * 1e9:.0f} ns, add "
          f"{row['reference']['cuda_add_s'] * 1e6:.1f} us", flush=True)


def main(argv=None) -> int:
    return cases_main(argv, __doc__, str(HERE), CASES, VERSION, one, _report)


if __name__ == "__main__":
    sys.exit(main())
