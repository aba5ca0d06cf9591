"""CPU offload of the optimizer states on a real GPU: the calibration section it is costed
from, and real offloaded steps to hold the prediction against.

    PYTHONUNBUFFERED=1 python benchmarks/calibration/bench_offload.py --out OUT.json [--steps 4]

1. The "offload" calibration section (gobrrr.calibrate.sections.offload): pinned D2H / H2D
   bandwidth over sizes, the CPU's fused AdamW time per parameter size (fp32, bf16), the host
   cost of queueing a copy, the CPU threads.
2. Real steps, each configuration in a fresh process (`--one`): gobrrr.apply with
   offload=True (torchao's CPUOffloadOptimizer) for gobrrr's gpt2 (124M) and Llama shapes
   (llama3-1b, llama3-3b), bf16-mixed, gpt2 and llama3-1b also with gradient accumulation;
   gpt2 and llama3-1b without offload for reference. Per configuration: the median step
   (CUDA events around whole optimizer steps, after warm-up, peaks reset), split where
   optimizer.step() is entered; max_memory_allocated / reserved; the host seconds inside
   optimizer.step() and inside each parameter's CPU step; the pinned and ordinary host
   bytes the offloaded optimizer holds (its tensors, and the CUDA host allocator's own count
   where torch has it); the process's peak resident memory; what was offloaded.
Every item catches its own errors (recorded, the run goes on); OUT.json is rewritten after
each. The prediction is computed from this file on any CPU (tests/test_offload.py and
`python benchmarks/calibration/bench_offload.py --compare OUT.json`).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
# src/, the repository root (zoo/), benchmarks/ (child_rows, suite/, plan/) and this folder
sys.path[:0] = [
    str(HERE.parents[2] / "src"),
    str(HERE.parents[2]),
    str(HERE.parents[1]),
    str(HERE.parent),
]

from child_rows import env_row, run_row  # noqa: E402

from zoo.offload import CONFIGS, PRECISION, predicted  # noqa: E402

VERSION = 1

DEVICE = "cuda"


# -- children ----------------------------------------------------------------------------------
def run_section() -> dict:
    """The section as `offload_section` measures it, each part catching its own errors."""
    import torch

    from gobrrr.calibrate.sections import offload as co

    dev, section, errors = torch.device("cuda"), {"threads": torch.get_num_threads()}, {}
    t0 = time.perf_counter()
    parts = {
        "link": lambda: co.link_bandwidths(dev),
        "issue": lambda: co.issue_costs(dev),
        **{f"adamw:{k}": (lambda k=k: co.cpu_adamw_times(dtypes=(k,))) for k in co.ADAM_DTYPES},
    }
    for name, fn in parts.items():
        try:
            section.update(fn())
        except Exception as e:  # recorded, never fatal
            errors[name] = {
                "type": type(e).__name__,
                "message": str(e)[:1000],
                "traceback": traceback.format_exc().splitlines()[-8:],
            }
    return {"offload": section, "errors": errors, "seconds": time.perf_counter() - t0}


def run_one(name: str, warmup: int, steps: int) -> dict:
    import torch

    from gobrrr.estimate import workload_factory
    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs

    source, seq, g, knobs = CONFIGS[name]
    row: dict = {}
    try:
        torch.manual_seed(0)
        with torch.device(DEVICE):
            wl = workload_factory(source, g, seq)()
        step = apply(wl, Knobs.from_dict(knobs), precision=PRECISION)
        marks = _mark_optimizer_step(step.optimizer)
        cpu = _time_cpu_steps(step.optimizer)
        batch = wl.batch
        for _ in range(warmup):
            step(batch)
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        marks.clear()
        cpu.clear()
        times = []
        for _ in range(steps):
            times.append(_timed(lambda: step(batch), marks))
            if cpu:  # the CPU steps' host seconds inside this optimizer step
                times[-1]["cpu_steps_s"] = sum(t for _, t in cpu)
                row["cpu_steps"] = [[n, t] for n, t in cpu]  # (elements, s), the last step's
                cpu.clear()
        row.update(
            {k: statistics.median(t[k] for t in times) for k in times[0]},
            steps=times,
            peak_allocated=torch.cuda.max_memory_allocated(),
            peak_reserved=torch.cuda.max_memory_reserved(),
            optimizer=type(step.optimizer).__name__,
            host=host_bytes(step.optimizer),
        )
    except Exception as e:  # recorded: one configuration must not sink the run
        oom = isinstance(e, torch.cuda.OutOfMemoryError) or "out of memory" in str(e)
        row["error"] = {
            "type": type(e).__name__,
            "message": str(e)[:1000],
            "oom": oom,
            "traceback": traceback.format_exc().splitlines()[-8:],
        }
    row["rss_peak_bytes"] = _status_bytes("VmHWM")
    return row


def _timed(fn, marks: list) -> dict[str, float]:
    """One optimizer step timed with CUDA events on the compute stream: step_s (whole),
    to_optimizer_s (until optimizer.step() is entered: the forward and backward as the GPU
    ran them), optimizer_s (from there to the end); optimizer_host_s, the host seconds inside
    optimizer.step() (the offloaded step returns once its last copy back has landed)."""
    import torch

    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    fn()
    b.record()
    b.synchronize()
    entered, host_s = marks.pop()
    marks.clear()
    return {
        "step_s": a.elapsed_time(b) * 1e-3,
        "to_optimizer_s": a.elapsed_time(entered) * 1e-3,
        "optimizer_s": entered.elapsed_time(b) * 1e-3,
        "optimizer_host_s": host_s,
    }


def _time_cpu_steps(opt) -> list:
    """Wrap each offloaded parameter's CPU optimizer step to record (elements, seconds)."""
    times: list = []

    def timed(f, n: int):
        def step():
            t0 = time.perf_counter()
            out = f()
            times.append((n, time.perf_counter() - t0))
            return out

        return step

    for p, o in getattr(opt, "optim_dict", {}).items():
        o.step = timed(o.step, p.numel())
    return times


def _mark_optimizer_step(opt) -> list:
    """Wrap opt.step to record (a CUDA event on entry, its host seconds) per call."""
    import torch

    marks: list = []
    inner = opt.step

    def step(*a, **k):
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        t0 = time.perf_counter()
        out = inner(*a, **k)
        marks.append((e, time.perf_counter() - t0))
        return out

    opt.step = step
    return marks


def host_bytes(opt) -> dict:
    """What an offloaded optimizer keeps on the host: pinned parameter and gradient copies,
    the states of its per-parameter CPU optimizers, and the parameters left on the GPU."""
    import torch

    if not hasattr(opt, "param_d2h_map"):
        return {}
    pinned = sum(
        h.untyped_storage().nbytes() + h.grad.untyped_storage().nbytes()
        for h in opt.param_d2h_map.values()
    )
    states = sum(
        v.untyped_storage().nbytes()
        for o in opt.optim_dict.values()
        for s in o.state.values()
        for v in s.values()
        if isinstance(v, torch.Tensor)
    )
    out = {
        "pinned_tensor_bytes": pinned,
        "state_bytes": states,
        "offloaded_params": len(opt.param_d2h_map),
        "offloaded_elements": sum(h.numel() for h in opt.param_d2h_map.values()),
        "offloaded_numels": sorted(h.numel() for h in opt.param_d2h_map.values()),
        "gpu_params": sum(len(g["params"]) for g in opt.d_param_groups),
        "gpu_elements": sum(p.numel() for g in opt.d_param_groups for p in g["params"]),
    }
    stats = getattr(torch.cuda, "host_memory_stats", None)
    if stats is not None:
        try:
            s = stats()
            out["host_allocator"] = dict(s)
        except Exception as e:  # older torch: no host allocator stats
            out["host_allocator"] = {"error": str(e)[:200]}
    return out


def _status_bytes(key: str) -> int | None:
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith(key + ":"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


# -- the parent --------------------------------------------------------------------------------
def child(args, flag: list[str]) -> dict:
    return run_row(
        [
            sys.executable,
            str(HERE),
            *flag,
            "--warmup",
            str(args.warmup),
            "--steps",
            str(args.steps),
        ],
        args.timeout,
    )


def environment() -> dict:
    return env_row(str(HERE))


def _env() -> dict:
    import os

    import torch

    from gobrrr.kernels.bench import env_info

    info = env_info()
    info.update(cpu_count=os.cpu_count(), torch_threads=torch.get_num_threads())
    try:
        import torchao

        info["torchao"] = torchao.__version__
    except ImportError as e:
        info["torchao"] = f"missing: {e}"
    return info


def measure(args) -> dict:
    out = {
        "version": VERSION,
        "benchmark": "offload",
        "precision": PRECISION,
        "environment": environment(),
        "settings": {"warmup": args.warmup, "steps": args.steps},
        "configs": {
            name: {"source": c[0], "seq": c[1], "global_batch": c[2], "knobs": c[3]}
            for name, c in CONFIGS.items()
        },
        "measured": {},
    }
    path = Path(args.out)
    path.parent.mkdir(parents=True, exist_ok=True)

    def save() -> None:
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(out, indent=1))
        tmp.replace(path)

    t0 = time.perf_counter()
    out["section"] = child(args, ["--section"])
    print("section:", {k: v for k, v in out["section"].items() if k != "offload"}, flush=True)
    save()
    for name in args.configs.split(","):
        if time.perf_counter() - t0 > args.budget:
            out["measured"][name] = {
                "error": {
                    "type": "skipped",
                    "oom": False,
                    "message": f"past --budget {args.budget} s",
                }
            }
            continue
        out["measured"][name] = row = child(args, ["--one", name])
        print(
            name,
            "->",
            {k: row.get(k) for k in ("step_s", "optimizer_s", "peak_allocated", "error")},
            flush=True,
        )
        save()
    return out


def merge(path: str, into: str) -> None:
    """Set the calibration file `into`'s offload section to the one measured in results
    `path`, recording the run's environment in its meta."""
    import dataclasses

    from gobrrr.hardware import Calibration

    results = json.loads(Path(path).read_text())
    section = (results.get("section") or {}).get("offload")
    if not section or (results["section"].get("errors") or {}):
        raise SystemExit(f"{path}: no complete offload section to merge")
    cal = Calibration.load(into)
    meta = {**cal.meta, "offload": {**results["environment"], "from": Path(path).name}}
    dataclasses.replace(cal, offload=section, meta=meta).save(into)
    print(f"merged the offload section of {path} into {into}")


def compare(path: str) -> None:
    """Print and store (beside `path`, "_predicted") each configuration's prediction."""
    results = json.loads(Path(path).read_text())
    rows = predicted(results)
    for name, r in rows.items():
        print(f"{name:20s}", {k: round(v, 4) for k, v in r["errors"].items()})
    dest = Path(path).with_name(Path(path).stem + "_predicted.json")
    dest.write_text(
        json.dumps({"version": VERSION, "from": Path(path).name, "rows": rows}, indent=1)
    )
    print("wrote", dest)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", help="results JSON to write")
    ap.add_argument("--configs", default=",".join(CONFIGS))
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--timeout", type=int, default=120, help="seconds per configuration")
    ap.add_argument(
        "--budget",
        type=int,
        default=200,
        help="seconds after which configurations left are skipped",
    )
    ap.add_argument("--one", choices=sorted(CONFIGS))
    ap.add_argument("--section", action="store_true")
    ap.add_argument("--env", action="store_true")
    ap.add_argument(
        "--compare",
        metavar="RESULTS.json",
        help="predict each measured configuration (on this CPU) beside the measurement",
    )
    ap.add_argument(
        "--merge",
        nargs=2,
        metavar=("RESULTS.json", "CALIBRATION.json"),
        help="set the calibration's offload section to the one measured",
    )
    args = ap.parse_args(argv)
    if args.merge:
        merge(*args.merge)
    elif args.compare:
        compare(args.compare)
    elif args.env:
        print("ENV " + json.dumps(_env()))
    elif args.section:
        try:
            row = run_section()
        except Exception as e:  # recorded, never fatal
            row = {
                "error": {
                    "type": type(e).__name__,
                    "message": str(e)[:1000],
                    "traceback": traceback.format_exc().splitlines()[-8:],
                }
            }
        print("ROW " + json.dumps(row))
    elif args.one:
        print("ROW " + json.dumps(run_one(args.one, args.warmup, args.steps)))
    elif args.out:
        measure(args)
    else:
        ap.error("give --out OUT.json")


if __name__ == "__main__":
    main()
