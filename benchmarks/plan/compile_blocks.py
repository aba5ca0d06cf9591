"""Eager vs torch.compile(model) vs torch.compile per block, measured and predicted, one GPU.

    PYTHONUNBUFFERED=1 python benchmarks/plan/compile_blocks.py OUT.json [--cases NAME,NAME]
        [--gpu h100] [--steps 10]
    python benchmarks/plan/compile_blocks.py /tmp/cb.json --device cpu --tiny   # dry run

Cases: two zoo workloads (gpt2-124m b8 s1024, llama3.2-1b b2 s2048, bf16-mixed) x compile
"none" | "model" | "blocks" x checkpointing "plain" | "full" (every repeated block), named
e.g. "llama3.2-1b/blocks/full". Each runs in a fresh process: the workload is built (its
Hugging Face model with `config.use_cache = False`, as a training loop sets it: a KV cache
written by every layer makes dynamo recompile each block), `gobrrr.apply` applies the knobs
(compile "blocks": each block's forward compiled, inside its checkpoint), and its step runs:
the first step's wall seconds (compilation included), then `--steps` timed steps (CUDA
events), the peaks of the steady-state steps (max_memory_allocated / reserved after the
first two). Then, in the same process, gobrrr's prediction of the same step on `--gpu`
(`gobrrr.estimate(compile=..., checkpoint=...)`, traced on the CPU; its trace seconds are
`capture_s`); a prediction that cannot be made (whole-model compile with checkpointing is not
modelled) is recorded as its error. OUT.json is rewritten after every case.

`--device cpu --tiny`: the same cases at tiny sizes on the CPU, each block compiled with the
"aot_eager" backend (Inductor's CPU code generation would take minutes): the logic, not the
figures.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parents[1])]

from child_rows import run_row  # noqa: E402

VERSION = 1

#: zoo case -> its batch and sequence as measured
WORKLOADS = {"gpt2-124m": (8, 1024), "llama3.2-1b": (2, 2048)}
COMPILE = ("none", "model", "blocks")
CHECKPOINT = ("plain", "full")
CASES = [f"{w}/{c}/{k}" for w in WORKLOADS for c in COMPILE for k in CHECKPOINT]

#: --tiny: each zoo model's config shrunk (its layers stay repeated blocks)
TINY = {
    "gpt2-124m": dict(n_layer=3, n_embd=64, n_head=2, vocab_size=256, n_positions=64),
    "llama3.2-1b": dict(
        num_hidden_layers=3,
        hidden_size=64,
        intermediate_size=128,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
    ),
}


def factory(name: str, tiny: bool):
    """(batch_size, seq_len) -> the zoo case's workload, trained without a KV cache."""
    from zoo.cases import get_case

    case = get_case(name)
    overrides = TINY[name] if tiny else {}

    def workload(batch_size: int, seq_len: int):
        w = case.build(batch_size, seq_len, **overrides)
        w.model.config.use_cache = False
        return w

    return case, workload


def measure(workload, knobs, precision: str, device: str, steps: int) -> dict:
    """The applied step on `device`: first step (compile included), steady steps, peaks."""
    import torch

    from gobrrr.plan.apply import apply
    from gobrrr.workload import map_tensors

    torch.manual_seed(0)
    w = workload
    w.model.to(device)
    w.batch = map_tensors(w.batch, lambda t: t.to(device))
    t = time.perf_counter()
    step = apply(w, knobs, precision)
    cuda = device.startswith("cuda")

    def sync():
        if cuda:
            torch.cuda.synchronize()

    step()
    sync()
    first_s = time.perf_counter() - t
    step()
    sync()
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(steps):
        if cuda:
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            step()
            e.record()
            sync()
            times.append(s.elapsed_time(e) / 1e3)
        else:
            t0 = time.perf_counter()
            step()
            times.append(time.perf_counter() - t0)
    step_s = statistics.median(times)
    return {
        "changes": list(step.changes),
        "first_step_s": first_s,
        "compile_s": max(first_s - 2 * step_s, 0.0),  # the first step less an ordinary one
        "step_s": step_s,
        "times_s": times,
        "alloc_peak": torch.cuda.max_memory_allocated() if cuda else None,
        "reserved_peak": torch.cuda.max_memory_reserved() if cuda else None,
    }


def predict(workload_fn, batch: int, seq: int, precision: str, compile: str, ckpt: str, gpu):
    """gobrrr's prediction of the same step (traced on the CPU)."""
    import gobrrr
    from gobrrr.errors import GobrrrError

    t = time.perf_counter()
    try:
        est = gobrrr.estimate(
            workload_fn,
            gpu,
            batch=batch,
            seq=seq,
            precision=precision,
            checkpoint="full" if ckpt == "full" else "none",
            compile=compile,
            loop="drops-output",  # apply's step frees the model's output before backward
        )
    except GobrrrError as e:
        return {"error": str(e), "capture_s": time.perf_counter() - t}
    return {
        "step_s": est.time.step_s,
        "alloc_peak": est.memory.peak,
        "reserved_peak": est.memory.reserved,
        "capture_s": est.capture_s,
        "compiled_graphs": dict(est.graph.meta.compiled_graphs or {}),
        "compiled_regions": len(est.graph.meta.compiled_regions or ()),
    }


def one(name: str, device: str, tiny: bool, steps: int, gpu: str) -> dict:
    import torch

    from gobrrr.plan.knobs import Knobs, every_kth
    from gobrrr.training.checkpointing import block_names

    case_name, compile, ckpt = name.split("/")
    case, make = factory(case_name, tiny)
    batch, seq = (2, 32) if tiny else WORKLOADS[case_name]
    if tiny:  # Inductor's CPU code generation takes minutes: AOTAutograd's graphs, eagerly
        real = torch.compile
        torch.compile = lambda f, **kw: real(f, **{"backend": "aot_eager", **kw})
    w = make(batch, seq)
    knobs = Knobs(
        micro_batch=batch,
        compile=compile,
        checkpoint=every_kth(block_names(w.model), 1) if ckpt == "full" else (),
    )
    row = {"case": case_name, "compile": compile, "checkpoint": ckpt, "batch": batch, "seq": seq}
    row["measured"] = measure(w, knobs, case.precision, device, steps)
    row["predicted"] = predict(make, batch, seq, case.precision, compile, ckpt, gpu)
    return row


def report(row: dict) -> None:
    if "error" in row:
        print(f"{row['name']}: {row['error']}", flush=True)
        return
    m, p = row["measured"], row["predicted"]
    said = (
        f"predicted {p['step_s'] * 1e3:.1f} ms, {p['alloc_peak'] / 2**30:.2f} GiB"
        if "step_s" in p
        else f"not predicted: {p['error'][:80]}"
    )
    peak = f", {m['alloc_peak'] / 2**30:.2f} GiB" if m["alloc_peak"] else ""
    print(
        f"{row['name']}: compile {m['compile_s']:.1f} s, step {m['step_s'] * 1e3:.1f} ms"
        f"{peak}; {said}",
        flush=True,
    )


def _environment(device: str) -> dict:
    """The GPU and versions (the suite's record), or the versions alone on the CPU."""
    if device.startswith("cuda"):
        from suite.bench_estimate_suite import environment

        return environment()
    import torch

    return {"device": device, "torch": torch.__version__}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--cases", default=",".join(CASES))
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--tiny", action="store_true")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--gpu", default="h100", help="the GPU gobrrr predicts for")
    ap.add_argument("--timeout", type=float, default=900.0, help="seconds per case")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    steps = min(args.steps, 2) if args.tiny else args.steps
    if args.one:
        print("ROW " + json.dumps(one(args.one, args.device, args.tiny, steps, args.gpu)))
        return 0
    doc = {"version": VERSION, "environment": _environment(args.device), "rows": []}
    flags = ["--device", args.device, "--steps", str(steps), "--gpu", args.gpu]
    for name in args.cases.split(","):
        cmd = [sys.executable, str(HERE), args.out, "--one", name, *flags]
        row = {"name": name, **run_row(cmd + (["--tiny"] if args.tiny else []), args.timeout)}
        doc["rows"].append(row)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        report(row)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
