"""What holds memory at a real step's allocated peak, with the Python that allocated it.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/peak_trace.py --out OUT.json \
        gpt2:256:1:8bit [gpt2:256:1:as-is ...]

Each case (a built-in model `source:seq:micro-batch:states`, bf16-mixed, states "as-is" or
"8bit") runs in a fresh process as benchmarks/bench_optim_states.py runs its steps: built on
the GPU, `gobrrr.apply` with those knobs, 3 warm-up steps, the peak stats reset; then one step
under `torch.cuda.memory._record_memory_history` (allocation stacks, Python frames). Kept per
case: `max_memory_allocated`, the peak replayed from the trace and at which event, and every
block of 1 MiB or more alive at the peak: its bytes, whether it was allocated in this step or
before, and the innermost Python frames that allocated it. An error is recorded per case.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

VERSION = 1
PRECISION = "bf16-mixed"
MIN_BLOCK = 2**20
FRAMES = 8


def _frames(entry: dict) -> list[str]:
    """The innermost Python frames of an allocation, outside torch's own autograd plumbing."""
    out = []
    for f in entry.get("frames") or []:
        name = f.get("filename", "")
        if name.endswith(("torch/autograd/graph.py", "torch/_tensor.py")) and out:
            continue
        out.append(f"{Path(name).name}:{f.get('line')}:{f.get('name')}")
        if len(out) >= FRAMES:
            break
    return out


def peak_of(trace: list[dict], before: dict[int, int]) -> dict:
    """Replay one step's events (alloc / free_completed) from the blocks alive at its start
    (`before`: address -> bytes): the peak, its event, and the blocks alive then."""
    live = {a: {"bytes": n, "when": "before", "frames": []} for a, n in before.items()}
    cur = sum(before.values())
    best, at, snap = cur, -1, dict(live)
    for i, e in enumerate(trace):
        if e["action"] == "alloc":
            live[e["addr"]] = {"bytes": e["size"], "when": "step", "frames": _frames(e)}
            cur += e["size"]
            if cur > best:
                best, at, snap = cur, i, dict(live)
        elif e["action"] == "free_completed" and e["addr"] in live:
            cur -= live.pop(e["addr"])["bytes"]
    blocks = sorted((b for b in snap.values() if b["bytes"] >= MIN_BLOCK),
                    key=lambda b: -b["bytes"])
    return {"peak": best, "event": at, "events": len(trace), "blocks": blocks}


def one(spec: str) -> dict:
    import torch

    from gobrrr.estimate import workload_factory
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs

    source, seq, mb, states = spec.split(":")
    torch.manual_seed(0)
    with torch.device("cuda"):
        wl = workload_factory(source, int(mb), int(seq))()
    knobs = Knobs(micro_batch=int(mb), optimizer_states="8bit" if states == "8bit" else "as-is")
    step = apply(wl, knobs, precision=PRECISION)
    for _ in range(3):
        step(wl.batch)
    torch.cuda.synchronize()
    before = {s["address"] + off: b["size"] for s in torch.cuda.memory_snapshot()
              for off, b in _offsets(s) if b["state"] == "active_allocated"}
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.memory._record_memory_history(enabled="all", context="alloc", stacks="python",
                                             max_entries=1_000_000)
    step(wl.batch)
    torch.cuda.synchronize()
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = snap["device_traces"][torch.cuda.current_device()]
    return {"case": spec, "max_memory_allocated": torch.cuda.max_memory_allocated(),
            "max_memory_reserved": torch.cuda.max_memory_reserved(),
            "allocated_before": sum(before.values()), **peak_of(trace, before)}


def _offsets(segment: dict):
    off = 0
    for b in segment["blocks"]:
        yield off, b
        off += b["size"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("cases", nargs="*", default=["gpt2:256:1:8bit", "gpt2:256:1:as-is"])
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        try:
            row = one(args.one)
        except Exception as e:  # recorded, not fatal
            row = {"case": args.one, "error": f"{type(e).__name__}: {e}",
                   "traceback": traceback.format_exc()[-2000:]}
        print("ROW " + json.dumps(row))
        return 0
    from bench_estimate_suite import environment

    doc = {"version": VERSION, "environment": environment(), "rows": []}
    for spec in args.cases:
        proc = subprocess.run([sys.executable, str(HERE), "--out", args.out, "--one", spec],
                              capture_output=True, text=True)
        rows = [ln[4:] for ln in proc.stdout.splitlines() if ln.startswith("ROW ")]
        row = json.loads(rows[-1]) if rows else {"case": spec, "error": proc.stderr[-2000:]}
        doc["rows"].append(row)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(spec, row.get("error") or f"peak {row['peak'] / 2**20:.1f} MiB "
              f"(max_memory_allocated {row['max_memory_allocated'] / 2**20:.1f})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
