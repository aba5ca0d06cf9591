"""FP8 training of the linear layers (`Knobs.fp8`, torchao's float8 recipe) on a real GPU,
beside the prediction.

    PYTHONUNBUFFERED=1 python benchmarks/plan/fp8.py OUT.json [--cases NAME,NAME]
    python benchmarks/plan/fp8.py GRID.json --grid [--into CALIBRATION.json]
    python benchmarks/plan/fp8.py OUT.json --dry-run     # the logic on the CPU, tiny sizes

Cases: Llama-3.2-1B and Llama-3.2-3B (transformers configs, random weights; the 3B's shape
from its published config: 3072 wide, 28 layers, 24 heads over 8 KV heads, 8192 FFN, tied
head) at sequence 4096 and 8192, micro-batch 1, bf16 autocast, AdamW; each eager and under
torch.compile(model) (torchao's float8 casts are separate kernels in eager mode, fused under
compile), each without and with fp8, each in a fresh process: the model built (seed 0),
`gobrrr.apply` of the knobs, 3 warm-up steps, then 10 timed steps (CUDA events; the median),
`max_memory_allocated` and `max_memory_reserved`; beside it the prediction for the GPU
present (`Tracer` of the same knobs, `evaluate` with the shipped calibration): step seconds,
peak and reserved bytes, and the notes on how FP8 matmuls were costed. OUT.json is rewritten
after every case. A case that runs out of memory is recorded as such.

`--grid` measures the calibration's FP8 matmul grid (`calibrate.sections.fp8`, torch._scaled_mm
over the bf16 grid's shapes) and, with `--into`, sets it as matmul_grid["fp8"] of that
calibration file. Runs under plain `python` or `torchrun --nproc-per-node 1`.
"""

from __future__ import annotations

import gc
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parents[1])]

VERSION = 1
DRY = os.environ.get("FP8_DRY") == "1"

LLAMA32_3B = dict(hidden_size=3072, num_hidden_layers=28, num_attention_heads=24)
TINY = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
)

#: name -> (model, seq, compile, fp8)
CASES = {
    f"{model}/s{seq}/{compile}/{'fp8' if on else 'bf16'}": (model, seq, compile, on)
    for model in ("llama3.2-1b", "llama3.2-3b")
    for seq in (4096, 8192)
    for compile in ("eager", "compile")
    for on in (False, True)
}


def build(model: str, seq: int):
    """The case's workload (micro-batch 1): the zoo's Llama-3.2-1B config, or the 3B's shape."""
    from zoo import hf
    from zoo.cases import LLAMA32_1B

    config = dict(LLAMA32_1B, **(LLAMA32_3B if model == "llama3.2-3b" else {}))
    if DRY:
        config.update(TINY)
    return hf.causal_lm(1, 64 if DRY else seq, **config)


def predicted(model: str, seq: int, knobs) -> dict:
    """The prediction of the case on the GPU present (the H100's without one)."""
    import torch

    from gobrrr.evaluate import evaluate
    from gobrrr.hardware import Target
    from gobrrr.plan.search import fp8_notes
    from gobrrr.plan.trace import Tracer

    gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else "h100"
    target = Target.resolve(gpu)
    tracer = Tracer(
        lambda batch_size=1, seq_len=None: build(model, seq),
        seq=None,
        precision="bf16-mixed",
        target=target,
        variant=knobs,
    )
    est = evaluate(tracer.trace(1), target)
    return {
        "gpu": target.gpu.name,
        "step_s": est.time.step_s,
        "peak_bytes": est.memory.peak,
        "reserved_bytes": est.memory.reserved,
        "regime_s": est.time.regime_s,
        "notes": fp8_notes(target) if knobs.fp8 else [],
    }


def measured(model: str, seq: int, knobs, steps: int = 10) -> dict:
    """The applied step on this machine's GPU (the CPU when dry)."""
    import torch

    from gobrrr.plan.apply import apply
    from gobrrr.profile.timing import time_steps
    from gobrrr.workload import map_tensors

    device = "cpu" if DRY else "cuda"
    torch.manual_seed(0)
    w = build(model, seq)
    w.model.config.use_cache = False
    w.model.to(device)
    w.batch = map_tensors(w.batch, lambda t: t.to(device))
    step = apply(w, knobs, "bf16-mixed")
    for _ in range(3):
        loss = step()
    if not DRY:
        torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, 2 if DRY else steps, device)
    out = {
        "changes": list(step.changes),
        "times_s": times,
        "step_s": statistics.median(times),
        "loss": float(loss),
    }
    if not DRY:
        out["peak_bytes"] = torch.cuda.max_memory_allocated()
        out["reserved_bytes"] = torch.cuda.max_memory_reserved()
    return out


def one(name: str) -> dict:
    """One case: measured and predicted, or how it failed (an OOM is a result too)."""
    import torch

    from gobrrr.plan.knobs import Knobs

    model, seq, compile, on = CASES[name]
    knobs = Knobs(micro_batch=1, compile="model" if compile == "compile" else "none", fp8=on)
    row = {"model": model, "seq": seq, "compile": compile, "fp8": on, "dry": DRY}
    row["predicted"] = predicted(model, seq, knobs)
    gc.collect()
    try:
        row["measured"] = measured(model, seq, knobs)
    except torch.OutOfMemoryError as e:
        row["measured"] = {"error": {"type": "oom", "oom": True, "message": str(e)[:300]}}
    pm = row["measured"].get("step_s")
    if pm:
        row["predicted_over_measured"] = row["predicted"]["step_s"] / pm - 1
    return row


def report(row: dict) -> None:
    m, p = row.get("measured", {}), row.get("predicted", {})
    if "step_s" not in m:
        print(f"{row['name']}: {row.get('error') or m.get('error')}", flush=True)
        return
    print(
        f"{row['name']}: measured {m['step_s'] * 1e3:.1f} ms, predicted "
        f"{p['step_s'] * 1e3:.1f} ms ({row['predicted_over_measured']:+.1%})",
        flush=True,
    )


def grid(out: Path, into: str | None = None) -> None:
    """Measure the FP8 matmul grid into `out` (and into --into's calibration, if given)."""
    import json

    import torch

    from gobrrr.calibrate.sections.fp8 import fp8_matmul_grid
    from gobrrr.hardware import Calibration

    dev = torch.device("cpu" if DRY else "cuda")
    points = fp8_matmul_grid(dev, (128, 256), (64, 256)) if DRY else fp8_matmul_grid(dev)
    name = torch.cuda.get_device_name() if not DRY else "cpu"
    out.write_text(json.dumps({"version": VERSION, "device": name, "matmul_grid": points}) + "\n")
    if into and points:
        from dataclasses import replace

        cal = Calibration.load(into)
        meta = {**cal.meta, "matmul_grid_fp8": {"device": name, "torch": torch.__version__}}
        replace(cal, matmul_grid={**cal.matmul_grid, **points}, meta=meta).save(into)
    print(f"fp8 grid: {len(points.get('fp8', []))} points on {name}", flush=True)


def run(out: Path, names: list[str]) -> dict:
    """Each case in a fresh process (`child_rows.run_row`), OUT rewritten after each."""
    import json

    from child_rows import run_row

    env = {"dry": True} if DRY else _environment()
    doc = {"version": VERSION, "environment": env, "rows": []}
    for name in names:
        cmd = [sys.executable, str(HERE), str(out), "--one", name]
        row = {"name": name, **run_row(cmd, timeout=600)}
        doc["rows"].append(row)
        out.write_text(json.dumps(doc, indent=1) + "\n")
        report(row)
    return doc


def _environment() -> dict:
    from suite.bench_estimate_suite import environment

    return environment()


def main(argv: list[str]) -> int:
    import argparse
    import json

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--cases", default=",".join(CASES), help="names, comma-separated")
    ap.add_argument("--dry-run", action="store_true", help="the logic on the CPU, tiny sizes")
    ap.add_argument("--grid", action="store_true", help="measure the FP8 matmul grid instead")
    ap.add_argument("--into", help="with --grid: the calibration file to set it in")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:  # children inherit it
        os.environ["FP8_DRY"] = "1"
        globals()["DRY"] = True
    unknown = [n for n in args.cases.split(",") if n not in CASES]
    if unknown:
        ap.error(f"--cases {','.join(unknown)}: unknown; choose from {', '.join(CASES)}")
    if args.grid:
        grid(args.out, args.into)
    elif args.one:
        print("ROW " + json.dumps(one(args.one)))
    else:
        run(args.out, args.cases.split(","))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
