"""FSDP2's per-rank memory, predicted on the CPU against the measured steps.

    PYTHONPATH=src python benchmarks/multigpu/fsdp_memory.py [--cases NAME ...]

For every FSDP case of `benchmarks/results/multigpu_steps_h200_x4.json` and `_x2of4.json`:
the one-rank step traced as `benchmarks/multigpu/steps.py` builds it (the `transformers`
config of its SHAPES, seq 8192, the per-rank batch, the model's own non-reentrant
checkpointing, cross-entropy on `.float()` logits with the logits dropped before backward)
with precision "bf16" (FSDP2's param_dtype: weights and compute in bf16, no autocast), then
`passes.fsdp.fsdp` at the case's world size and reshard_after_forward, replayed by
`memory.replay.step_memory` on the H200. Prints measured vs predicted per-rank allocated and
reserved peaks and writes `benchmarks/results/multigpu_fsdp_memory.json`. Traces are cached
under /tmp/fsdp_graphs (keyed by shape, batch, checkpointing).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import gobrrr
from gobrrr.capture import capture
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import get_gpu
from gobrrr.memory.replay import step_memory
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.fsdp import fsdp

sys.path.insert(0, str(Path(__file__).parent))
from steps import SHAPES  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
RESULTS = [
    ROOT / "benchmarks/results/multigpu_steps_h200_x4.json",
    ROOT / "benchmarks/results/multigpu_steps_h200_x2of4.json",
]
OUT = ROOT / "benchmarks/results/multigpu_fsdp_memory.json"
CACHE = Path("/tmp/fsdp_graphs")


def workload(shape: str, batch: int, seq: int, checkpoint: bool) -> gobrrr.Workload:
    """The case's model and torchtitan's loss (steps.py's step_fn, one micro-batch)."""
    import transformers

    cls, kw = SHAPES[shape]
    config = getattr(transformers, cls)(**kw)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    model.train()
    tokens = torch.randint(0, config.vocab_size, (batch, seq + 1))

    def step(m, b):
        x, y = b[:, :-1], b[:, 1:]
        logits = m(input_ids=x).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), y.flatten())

    return gobrrr.Workload(
        model=model,
        batch=tokens,
        step=step,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
        tokens=batch * seq,
        seq_len=seq,
        name=shape,
    )


def traced(shape: str, batch: int, seq: int, checkpoint: bool) -> StepGraph:
    """The one-rank bf16 step graph, from the cache when there."""
    path = CACHE / f"{shape}-b{batch}-s{seq}{'-ckpt' if checkpoint else ''}.json"
    if path.exists():
        return StepGraph.load(path)
    t = time.perf_counter()
    graph = capture(lambda: workload(shape, batch, seq, checkpoint), precision="bf16")
    CACHE.mkdir(parents=True, exist_ok=True)
    graph.save(path)
    print(f"  traced {path.name} in {time.perf_counter() - t:.0f} s", flush=True)
    return graph


def cases() -> list[dict]:
    out = []
    for path in RESULTS:
        for key, row in json.loads(path.read_text())["cases"].items():
            if row.get("parallel") == "fsdp" and "measured" in row:
                out.append({"key": key, **row})
    return out


def predict(case: dict) -> dict:
    graph = traced(case["shape"], case["batch"], case["seq"], case["checkpoint"])
    if case["accumulation"] > 1:
        graph = accumulate(graph, case["accumulation"])
    sharded = fsdp(graph, case["world"], reshard_after_forward=case["reshard"])
    mem = step_memory(sharded, get_gpu("h200"), None)
    m = case["measured"]
    return {
        "case": case["key"],
        "world": case["world"],
        "measured_allocated": m["peak_allocated"],
        "predicted_allocated": mem.peak,
        "allocated_error": mem.peak / m["peak_allocated"] - 1,
        "measured_reserved": m["peak_reserved"],
        "predicted_reserved": mem.reserved,
        "reserved_error": mem.reserved / m["peak_reserved"] - 1,
        "peak_op": mem.peak_op,
        "peak_phase": mem.peak_phase,
        "peak_module": mem.peak_module,
        "at_peak": mem.at_peak,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", help="case keys (default: every FSDP case)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()
    rows = []
    gib = 2**30
    for case in cases():
        if args.cases and case["key"] not in args.cases:
            continue
        r = predict(case)
        rows.append(r)
        print(
            f"{r['case']:45s} allocated {r['measured_allocated'] / gib:6.2f} -> "
            f"{r['predicted_allocated'] / gib:6.2f} GiB ({r['allocated_error']:+.1%})  "
            f"reserved {r['measured_reserved'] / gib:6.2f} -> "
            f"{r['predicted_reserved'] / gib:6.2f} GiB ({r['reserved_error']:+.1%})  "
            f"peak at {r['peak_phase']} {r['peak_module']}",
            flush=True,
        )
    if rows:
        a = [abs(r["allocated_error"]) for r in rows]
        s = [abs(r["reserved_error"]) for r in rows]
        summary = {
            "allocated_max": max(a),
            "allocated_median": statistics.median(a),
            "reserved_max": max(s),
            "reserved_median": statistics.median(s),
        }
        print(
            f"allocated |error| max {summary['allocated_max']:.1%} median "
            f"{summary['allocated_median']:.1%}; reserved max {summary['reserved_max']:.1%} "
            f"median {summary['reserved_median']:.1%}"
        )
        Path(args.out).write_text(json.dumps({"summary": summary, "cases": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
