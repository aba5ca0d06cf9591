"""Ground truth for gobrrr's replay of CUDA's caching allocator (`gobrrr.memory.allocator`).

    python benchmarks/memory/allocator_truth.py tests/fixtures/allocator_truth_h100.json \
        [--steps gpt2:1:256:bf16-mixed gpt2-medium:4:1024:bf16-mixed ...]

In one process, runs deterministic sequences of `torch.empty` allocations and frees of mixed
sizes (small-pool requests, 1-10 MiB requests that share 20 MiB segments, large requests,
patterns that fragment, seeded random mixes, a training-step-like pattern, and the out-of-memory
path under a per-process memory limit). Each sequence starts from `torch.cuda.empty_cache()` and
reset statistics. Recorded per sequence: the sequence itself (events `["a", id, bytes]` and
`["f", id]`), `max_memory_allocated`, `max_memory_reserved`, the allocator's counters (segments,
retries, out-of-memory errors, cudaMalloc/cudaFree calls), the allocated/reserved/segment count
after every event, and the segments of `torch.cuda.memory_snapshot()` at the end (before the
survivors are freed). Also recorded: the device memory the process holds outside the allocator
(CUDA context, then with cuBLAS and cuDNN loaded), what a step's budget must leave aside.
`tests/test_allocator.py` replays every sequence through gobrrr's model and asserts the same
peaks. Runs in a few seconds; needs no gobrrr import. With `--steps`, it also records the
allocator's own trace (every alloc, free and segment) of built-in workloads from the model's
build through four training steps (gobrrr from src/ is imported for those).
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root: zoo/
from zoo.allocator_sequences import SEQUENCES, MiB  # noqa: E402

VERSION = 1


# ----------------------------------------------------------------------------- measurement
def _stats() -> dict:
    m = torch.cuda.memory_stats()
    return {
        k: m.get(k, 0)
        for k in (
            "allocated_bytes.all.current",
            "reserved_bytes.all.current",
            "segment.all.current",
        )
    }


def _segments() -> list[dict]:
    segs = sorted(torch.cuda.memory_snapshot(), key=lambda seg: seg["address"])
    base = segs[0]["address"] if segs else 0
    return [
        {
            "offset": seg["address"] - base,
            "total_size": seg["total_size"],
            "segment_type": seg["segment_type"],
            "blocks": [[blk["size"], blk["state"]] for blk in seg["blocks"]],
        }
        for seg in segs
    ]


def _fresh() -> int:
    gc.collect()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    torch.cuda.reset_accumulated_memory_stats()
    return torch.cuda.memory_reserved()


def run_sequence(events: list[list], limit: int | None) -> dict:
    """Replays `events` with torch.empty on the current device; returns what the allocator
    recorded. `limit`: a per-process memory limit in bytes (set as a fraction of the total)."""
    total = torch.cuda.mem_get_info()[1]
    fraction = None
    if limit is not None:
        fraction = limit / total
        torch.cuda.set_per_process_memory_fraction(fraction)
    start_reserved = _fresh()
    live: dict[int, torch.Tensor] = {}
    trace, ooms = [], []
    for i, ev in enumerate(events):
        if ev[0] == "a":
            try:
                live[ev[1]] = torch.empty(ev[2], dtype=torch.uint8, device="cuda")
            except torch.cuda.OutOfMemoryError:
                ooms.append(i)
        else:
            live.pop(ev[1], None)
        st = _stats()
        trace.append(
            [
                st["allocated_bytes.all.current"],
                st["reserved_bytes.all.current"],
                st["segment.all.current"],
            ]
        )
    m = torch.cuda.memory_stats()
    out = {
        "start_reserved": start_reserved,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "segments_peak": m.get("segment.all.peak"),
        "segments_end": len(torch.cuda.memory_snapshot()),
        "counters": {
            k: m.get(k)
            for k in (
                "segment.small_pool.peak",
                "segment.large_pool.peak",
                "inactive_split_bytes.all.peak",
                "num_alloc_retries",
                "num_ooms",
                "num_device_alloc",
                "num_device_free",
            )
        },
        "oom_events": ooms,
        "trace": trace,  # [allocated, reserved, segments] after each event
        "snapshot_end": _segments(),
    }
    if limit is not None:
        out.update(limit_bytes=limit, fraction=fraction, device_total=total)
        torch.cuda.set_per_process_memory_fraction(1.0)
    live.clear()
    _fresh()
    return out


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
        driver = subprocess.run(query, capture_output=True, text=True, timeout=20).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = None
    free, total = torch.cuda.mem_get_info()
    return {
        "device": props.name,
        "memory_bytes": props.total_memory,
        "mem_get_info_total": total,
        "mem_get_info_free": free,
        "driver": driver,
        "cuda": torch.version.cuda,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "allocator_backend": torch.cuda.get_allocator_backend(),
        "alloc_conf": {
            k: os.environ.get(k) for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")
        },
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }


def outside_allocator(label: str) -> dict:
    """Device memory this process holds outside the caching allocator (the CUDA context, the
    libraries' kernels and handles): total - free - reserved, from cudaMemGetInfo."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {
        "when": label,
        "total": total,
        "free": free,
        "reserved": reserved,
        "outside_allocator": total - free - reserved,
    }


def library_context() -> list[dict]:
    """Outside-allocator memory after cuBLAS (a bf16 matmul) and cuDNN (a convolution) ran."""
    out = []
    a = torch.randn(1024, 1024, device="cuda", dtype=torch.bfloat16)
    (a @ a).sum().item()
    out.append(outside_allocator("after a cuBLAS matmul"))
    x = torch.randn(8, 64, 56, 56, device="cuda", dtype=torch.bfloat16)
    w = torch.randn(64, 64, 3, 3, device="cuda", dtype=torch.bfloat16)
    torch.nn.functional.conv2d(x, w, padding=1).sum().item()
    out.append(outside_allocator("after a cuDNN convolution"))
    return out


# ----------------------------------------------------------------------------- real steps
TRACE_CODES = {"alloc": "a", "free_completed": "f", "segment_alloc": "s", "segment_free": "S"}


def record_step(case: str, steps: int = 4) -> dict:
    """The allocator's own trace of a built-in workload, from building the model through
    `steps` training steps (3 warm-ups and the measured one, as bench_estimate_suite.py
    runs them): events [code, address, bytes] with code a (alloc, requested bytes),
    f (free), s (segment alloc), S (segment free); reserved and allocated after each step.
    `case`: "model:batch:seq:precision[:checkpoint]" (seq "-" for models without one)."""
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))
    from gobrrr.models.registry import get_workload
    from gobrrr.profile.runner import matmul_precision, prepare, run_step

    model, batch, seq, precision, *rest = case.split(":")
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear:
        clear()  # the workspaces are allocated again in step 1, as in a fresh process
    _fresh()
    torch.cuda.memory._record_memory_history(
        enabled="all", context=None, stacks="python", max_entries=4_000_000
    )
    with torch.device("cuda"):
        wl = get_workload(
            model, batch_size=int(batch), seq_len=None if seq in ("", "-", "0") else int(seq)
        )
    wl, opt, scaler = prepare(wl, "cuda", precision, rest[0] if rest else "none")
    after = []
    with matmul_precision(precision):
        for _ in range(steps):
            run_step(wl, opt, precision, scaler, "cuda")
            torch.cuda.synchronize()
            after.append([torch.cuda.memory_allocated(), torch.cuda.memory_reserved()])
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [
        [TRACE_CODES[e["action"]], e["addr"], e["size"]]
        for e in snap["device_traces"][torch.cuda.current_device()]
        if e["action"] in TRACE_CODES
    ]
    out = {
        "case": case,
        "steps": steps,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "after_step": after,
        "trace": trace,
    }
    del wl, opt, scaler
    _fresh()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--only", nargs="*", help="run only these sequences")
    ap.add_argument(
        "--steps",
        nargs="*",
        default=[],
        metavar="MODEL:BATCH:SEQ:PRECISION",
        help="also record the allocator's trace of these built-in workloads' "
        "first steps (needs gobrrr on the path), e.g. gpt2:1:256:bf16-mixed",
    )
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("allocator_truth.py needs a CUDA GPU (torch.cuda.is_available() is False)")
    torch.empty(1, device="cuda")  # create the context before any sequence
    env = environment()
    context = [outside_allocator("after CUDA context creation")]
    t0, results = time.time(), {}
    for name, (build, limit) in SEQUENCES.items():
        if args.only and name not in args.only:
            continue
        events = build().events
        res = run_sequence(events, limit)
        results[name] = {"events": events, "limit_bytes": limit, **res}
        print(
            f"{name:20s} events {len(events):4d}  "
            f"allocated {res['max_memory_allocated'] / MiB:9.2f} MiB  "
            f"reserved {res['max_memory_reserved'] / MiB:9.2f} MiB  "
            f"segments {res['segments_peak']:3d}  ooms {len(res['oom_events'])}",
            flush=True,
        )
    context += library_context()  # cuBLAS keeps its workspace allocated afterwards
    steps = []
    for case in args.steps:
        steps.append(record_step(case))
        print(
            f"{case:28s} {len(steps[-1]['trace']):6d} events  reserved "
            f"{steps[-1]['max_memory_reserved'] / MiB:9.2f} MiB",
            flush=True,
        )
    out = {
        "version": VERSION,
        "env": env,
        "seconds": round(time.time() - t0, 2),
        "context": context,
        "sequences": results,
        "steps": steps,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({out['seconds']} s)")


if __name__ == "__main__":
    main()
