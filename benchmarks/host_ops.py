"""Where the host's time goes in each phase of a training step, by top-level op, on a GPU.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/host_ops.py OUT.json \
        [--cases NAME,NAME]     # on the GPU machine; zoo cases or "model:batch:seq:checkpoint"

Each case in a fresh process, prepared and warmed up as benchmarks/host_phases.py does it.
First 7 steps timed per phase with the host's clock (as host_phases.py: the host's issue time
of forward and loss, backward, optimizer step and zero_grad); then 3 steps under
torch.profiler (CPU activity only, no CUDA tracing), each phase inside a record_function
marker. For each phase: its top-level ops (the ATen calls the model's Python makes in
forward and in the optimizer; the autograd engine's node evaluations in backward), how many,
their summed duration, and the gaps before them (Python between two ops: the model's own
code, module calls, autocast's casts cache), grouped by op name. The profiler's own cost
per event is part of what it shows; the unprofiled phase times are beside it.
"""

from __future__ import annotations

import statistics
import sys
from collections import defaultdict
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

from child_rows import cases_main  # noqa: E402
from host_phases import PHASES, _prepared, timed_step  # noqa: E402

VERSION = 1
CASES = ("efficientnet_v2_s-tv-cl", "mobilenet_v3_large-tv", "resnet50-tv-cl", "gpt2-124m",
         "vit_small-timm", "distilbert-mlm", "gpt2:8:1024:none", "gpt2-xl:4:1024:none")
MARK = "gobrrr.phase."


def _phase_ops(events, marker) -> dict:
    """The top-level ops inside one phase marker: on the marker's thread, its direct
    children; on another thread (autograd's), the events without a parent inside its span."""
    lo, hi = marker.time_range.start, marker.time_range.end
    tops = [e for e in events if e.cpu_parent is marker]
    tops += [e for e in events if e.thread != marker.thread and e.cpu_parent is None
             and lo <= e.time_range.start and e.time_range.end <= hi]
    tops.sort(key=lambda e: e.time_range.start)
    by: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "op_us": 0.0,
                                                           "gap_us": 0.0})
    prev = lo
    for e in tops:
        row = by[e.name]
        row["count"] += 1
        row["op_us"] += e.time_range.end - e.time_range.start
        row["gap_us"] += max(e.time_range.start - prev, 0.0)
        prev = max(prev, e.time_range.end)
    return {"span_us": hi - lo, "ops": len(tops), "tail_us": max(hi - prev, 0.0),
            "by_op": dict(by)}


def one(name: str) -> dict:
    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    prepared = _prepared(name)

    def step(mark: bool) -> dict[str, float]:
        if not mark:
            return timed_step(*prepared)
        return timed_step(*prepared, region=lambda phase: record_function(MARK + phase))

    for _ in range(3):
        step(False)
    torch.cuda.synchronize()
    plain = [step(False) for _ in range(7)]
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        for _ in range(3):
            step(True)
    events = list(prof.events())
    phases: dict[str, list[dict]] = defaultdict(list)
    for m in events:
        if m.name.startswith(MARK):
            phases[m.name[len(MARK):]].append(_phase_ops(events, m))
    profiled = {}
    for phase, runs in phases.items():
        names = {n for r in runs for n in r["by_op"]}
        profiled[phase] = {
            "span_us": statistics.median(r["span_us"] for r in runs),
            "ops": statistics.median(r["ops"] for r in runs),
            "tail_us": statistics.median(r["tail_us"] for r in runs),
            "by_op": {n: {k: statistics.median(r["by_op"].get(n, {}).get(k, 0.0) for r in runs)
                          for k in ("count", "op_us", "gap_us")} for n in sorted(names)}}
    return {"name": name, "precision": prepared[0],
            **{k: statistics.median(r[k] for r in plain) for k in (*PHASES, "step")},
            "profiled": profiled}


def report(row: dict) -> None:
    if "error" in row:
        print(row["name"], row["error"], flush=True)
        return
    pr = row["profiled"]
    print(row["name"], " ".join(
        f"{p} {row[p] * 1e3:.1f}ms/{pr[p]['ops']:.0f} ops "
        f"(profiled {pr[p]['span_us'] / 1e3:.1f})"
        for p in PHASES if p in pr), flush=True)


def main(argv=None) -> int:
    return cases_main(argv, __doc__, str(HERE), CASES, VERSION, one, report)


if __name__ == "__main__":
    sys.exit(main())
