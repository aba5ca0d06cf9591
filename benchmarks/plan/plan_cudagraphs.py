"""`plan --allow cudagraphs` on host-bound built-in steps: the best plan applied against the step
as given on one GPU, 15 interleaved rounds of 10 steps (median), and each one's peaks in a fresh
process (5 warm-up steps, capture included, then the peaks of 3 more).

    PYTHONPATH=src python benchmarks/plan/plan_cudagraphs.py \
        benchmarks/results/plan_cudagraphs_h100.json

Replayed, `max_memory_allocated` no longer sees the step's activations (the graph's pool holds
them without allocating again): hold the reserved peak to the prediction."""

import functools
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parent)]
import torch  # noqa: E402
from cudagraph import timed  # noqa: E402  (benchmarks/plan/cudagraph.py)

import gobrrr  # noqa: E402
from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.plan.apply import apply  # noqa: E402
from gobrrr.plan.knobs import Knobs  # noqa: E402

CASES = [("gpt2", 1, 256), ("convnet", 32, None), ("llama3-1b", 1, 512)]


def build(name, b, s):
    torch.manual_seed(0)
    with torch.device("cuda"):
        return get_workload(name, b, s)


def one_peak(name, b, s, knobs):
    wl = build(name, b, s)
    step = apply(wl, Knobs.from_dict(knobs))
    for _ in range(5):
        step()
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    for _ in range(3):
        step()
    torch.cuda.synchronize()
    return {
        "peak_allocated": torch.cuda.max_memory_allocated(),
        "peak_reserved": torch.cuda.max_memory_reserved(),
    }


def main(out):
    if len(sys.argv) > 2 and sys.argv[2] == "--peak":
        name, b, s, knobs = json.loads(sys.argv[3])
        print("PEAK", json.dumps(one_peak(name, b, s, knobs)))
        return
    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for name, b, s in CASES:
        t = time.perf_counter()
        r = gobrrr.plan(
            functools.partial(get_workload, name, b, s),
            gpu="h100",
            global_batch=b,
            allow=["cudagraphs"],
        )
        plan_s = time.perf_counter() - t
        best = r.plans[0]
        given = next(p for p in r.plans if not p.changes or p.knobs == Knobs(micro_batch=b))
        runners = {"given": Knobs(micro_batch=b), "plan": best.knobs}
        steps = {k: apply(build(name, b, s), kn) for k, kn in runners.items()}
        for st in steps.values():
            for _ in range(5):
                st()
        torch.cuda.synchronize()
        rounds = {k: [] for k in steps}
        for i in range(15):
            for k in list(steps) if i % 2 == 0 else list(steps)[::-1]:
                rounds[k].append(timed(steps[k], 10, "cuda"))
        del steps
        torch.cuda.empty_cache()
        peaks = {}
        for k, kn in runners.items():
            p = subprocess.run(
                [sys.executable, __file__, out, "--peak", json.dumps([name, b, s, kn.to_dict()])],
                capture_output=True,
                text=True,
            )
            line = [l for l in p.stdout.splitlines() if l.startswith("PEAK")]
            peaks[k] = json.loads(line[0][5:]) if line else {"error": p.stderr[-500:]}
        row = {
            "case": name,
            "batch": b,
            "seq": s,
            "plan_s": plan_s,
            "best": best.knobs.to_dict(),
            "changes": list(best.changes),
            "predicted": {
                "given": {
                    "step_s": given.step_s,
                    "peak": given.peak_bytes,
                    "reserved": given.reserved_bytes,
                },
                "plan": {
                    "step_s": best.step_s,
                    "peak": best.peak_bytes,
                    "reserved": best.reserved_bytes,
                },
            },
            "measured": {
                k: {"step_s": statistics.median(v), "rounds_s": v, **peaks[k]}
                for k, v in rounds.items()
            },
        }
        res["cases"].append(row)
        m = row["measured"]
        print(
            name,
            best.changes,
            f"given {m['given']['step_s'] * 1e3:.2f} (pred {given.step_s * 1e3:.2f})",
            f"plan {m['plan']['step_s'] * 1e3:.3f} (pred {best.step_s * 1e3:.3f})",
            f"x{m['given']['step_s'] / m['plan']['step_s']:.2f}",
            peaks,
            flush=True,
        )
        open(out, "w").write(json.dumps(res, indent=1))


main(sys.argv[1])
