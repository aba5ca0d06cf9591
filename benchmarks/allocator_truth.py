"""Ground truth for gobrrr's replay of CUDA's caching allocator (`gobrrr.memory.allocator`).

    python benchmarks/allocator_truth.py benchmarks/results/allocator_truth_h100.json \
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
import random
import subprocess
import sys
import time
from pathlib import Path

import torch

VERSION = 1
KiB, MiB = 1024, 1024 * 1024


# ----------------------------------------------------------------------------- sequences
class Seq:
    """Builds an event list; `a` allocates (returns the id), `f` frees by id."""

    def __init__(self) -> None:
        self.events: list[list] = []
        self.next_id = 0

    def a(self, nbytes: int) -> int:
        tid, self.next_id = self.next_id, self.next_id + 1
        self.events.append(["a", tid, int(nbytes)])
        return tid

    def f(self, tid: int) -> None:
        self.events.append(["f", tid])


def small_pack() -> Seq:
    """3 x 600 KiB share one 2 MiB segment; a 4th needs a second one."""
    s = Seq()
    ids = [s.a(600 * KiB) for _ in range(3)]
    s.f(ids[1])
    s.a(600 * KiB)  # reuses the freed 600 KiB block
    s.a(600 * KiB)  # a new 2 MiB segment
    return s


def small_odd_sizes() -> Seq:
    """Sizes around the 512 B rounding and the 1 MiB small/large boundary, freed and reused."""
    s = Seq()
    sizes = [1, 511, 512, 513, 1000, 4096, 65537, 300 * KiB, MiB - 1, MiB, MiB + 1, MiB + 512,
             3 * KiB, 700 * KiB, 1500 * KiB]
    ids = [s.a(n) for n in sizes]
    for tid in ids[::2]:
        s.f(tid)
    for n in (256, 900 * KiB, 200 * KiB, MiB, 2 * MiB, 512 * KiB + 3):
        s.a(n)
    for tid in ids[1::2]:
        s.f(tid)
    s.a(1900 * KiB)
    return s


def mid_pack() -> Seq:
    """1-10 MiB requests: a 5 MiB request takes a 20 MiB segment; five 4 MiB blocks fill one."""
    s = Seq()
    first = s.a(5 * MiB)
    s.f(first)
    ids = [s.a(4 * MiB) for _ in range(6)]  # 5 fit (the 5th takes the last 4 MiB unsplit)
    s.f(ids[2])
    s.a(3 * MiB)  # 3 MiB into the 4 MiB hole: remainder 1 MiB is not split off (needs > 1 MiB)
    s.a(2 * MiB + 1)
    s.a(9 * MiB + 512 * KiB)
    return s


def split_rules() -> Seq:
    """Large-pool split only when the remainder exceeds 1 MiB; big segments rounded to 2 MiB."""
    s = Seq()
    s.a(19 * MiB + 512 * KiB)  # >= 10 MiB: a 20 MiB segment, remainder 0.5 MiB kept in the block
    x = s.a(9 * MiB + 512 * KiB)  # 20 MiB segment, split: 10.5 MiB free remainder
    s.a(9 * MiB + 600 * KiB)  # into the 10.5 MiB remainder, 0.9 MiB left unsplit
    s.f(x)
    s.a(8 * MiB)  # into the freed 9.5 MiB block, 1.5 MiB remainder split off
    s.a(11 * MiB)  # a 12 MiB segment, 1 MiB remainder unsplit
    s.a(10 * MiB)  # exactly 10 MiB: its own 10 MiB segment
    s.a(10 * MiB + 1)  # 12 MiB segment
    s.a(33 * MiB + 1)  # 34 MiB segment
    return s


def large_reuse() -> Seq:
    """A freed large segment serves smaller requests (best fit), then the cache is outgrown."""
    s = Seq()
    a = s.a(64 * MiB)
    s.f(a)
    b = s.a(32 * MiB)  # splits the cached 64 MiB segment
    c = s.a(40 * MiB)  # the 32 MiB remainder is too small: new 40 MiB segment
    d = s.a(30 * MiB)  # best fit: the 32 MiB remainder, not the bigger blocks
    s.f(b)
    s.f(d)  # coalesces with b's block back into the whole 64 MiB
    s.a(48 * MiB)
    s.f(c)
    s.a(100 * MiB)
    s.a(12 * MiB)
    return s


def fragment_holes() -> Seq:
    """3 MiB blocks freed alternately leave holes that 5 MiB requests cannot use."""
    s = Seq()
    ids = [s.a(3 * MiB) for _ in range(20)]
    for tid in ids[::2]:
        s.f(tid)
    big = [s.a(5 * MiB) for _ in range(6)]
    for n in (2 * MiB, 3 * MiB, 2 * MiB + 512 * KiB, 1 * MiB + 1):
        s.a(n)
    for tid in ids[1::2]:
        s.f(tid)
    for tid in big[:3]:
        s.f(tid)
    s.a(18 * MiB)
    s.a(25 * MiB)
    return s


def interleaved_pools() -> Seq:
    """Small and large requests interleaved, many small segments emptied and refilled."""
    s = Seq()
    live = []
    for i in range(60):
        live.append(s.a((i % 7 + 1) * 150 * KiB))
        if i % 5 == 0:
            live.append(s.a((i % 4 + 1) * 3 * MiB + 777))
        if i % 3 == 2:
            s.f(live.pop(len(live) // 2))
    for tid in live[::3]:
        s.f(tid)
    for i in range(20):
        s.a((i % 5 + 1) * 200 * KiB + 1)
    return s


def training_like(seed: int) -> Seq:
    """A step's shape: persistent params, forward activations, backward frees them in reverse
    while gradients appear, then an optimizer's temporaries; two steps."""
    rng = random.Random(seed)
    s = Seq()
    params = [rng.choice([4 * KiB, 96 * KiB, 2 * MiB + 4 * KiB, 9 * MiB, 36 * MiB]) for _ in
              range(24)]
    for n in params:
        s.a(n)
    grads = None
    for _step in range(2):
        acts = []
        for _layer in range(12):
            for n in (rng.randint(1, 64) * 128 * KiB, 6 * MiB, rng.randint(1, 20) * MiB + 256):
                acts.append(s.a(n))
            tmp = s.a(rng.randint(8, 40) * MiB)
            s.f(tmp)
        new_grads = []
        for tid in reversed(acts):
            scratch = s.a(rng.randint(1, 16) * MiB)
            s.f(scratch)
            s.f(tid)
            if len(new_grads) < len(params) and rng.random() < 0.7:
                new_grads.append(s.a(params[len(new_grads)]))
        if grads is not None:
            for tid in grads:
                s.f(tid)
        grads = new_grads
        for n in params[:8]:
            t = s.a(n)
            s.f(t)
    return s


def random_mix(seed: int, events: int = 400) -> Seq:
    """Seeded random allocations (log-uniform 256 B - 48 MiB) and frees of random live ones."""
    rng = random.Random(seed)
    s = Seq()
    live: list[int] = []
    for _ in range(events):
        if live and rng.random() < 0.45:
            s.f(live.pop(rng.randrange(len(live))))
        else:
            live.append(s.a(int(2 ** rng.uniform(8, 25.6))))
    return s


def oom_retry() -> Seq:
    """Under a 256 MiB limit: cached segments released and the request retried, a split segment
    that cannot be released, then a request that fails (recorded as out of memory)."""
    s = Seq()
    a, b = s.a(100 * MiB), s.a(100 * MiB)
    s.f(a)
    s.f(b)  # 200 MiB cached in two segments
    c = s.a(150 * MiB)  # 200 + 150 > 256: free both cached segments, retry
    s.a(4 * MiB)  # a 20 MiB segment, split (kept alive: it cannot be released)
    s.a(600 * KiB)  # a 2 MiB small segment, split
    s.a(90 * MiB)  # 150 + 20 + 2 + 90 > 256 and nothing releasable: out of memory
    s.f(c)
    s.a(200 * MiB)  # 22 + 150 cached: releasing the unsplit 150 MiB makes room
    s.a(30 * MiB)  # 222 + 30 <= 256
    s.a(8 * MiB)  # fits in the 16 MiB left of the 20 MiB segment
    return s


SEQUENCES = {
    "small_pack": (small_pack, None),
    "small_odd_sizes": (small_odd_sizes, None),
    "mid_pack": (mid_pack, None),
    "split_rules": (split_rules, None),
    "large_reuse": (large_reuse, None),
    "fragment_holes": (fragment_holes, None),
    "interleaved_pools": (interleaved_pools, None),
    "training_like_s0": (lambda: training_like(0), None),
    "training_like_s1": (lambda: training_like(1), None),
    "random_s0": (lambda: random_mix(0), None),
    "random_s1": (lambda: random_mix(1), None),
    "random_s2": (lambda: random_mix(2, 800), None),
    "oom_retry": (oom_retry, 256 * MiB),  # (builder, memory limit in bytes or None)
}


# ----------------------------------------------------------------------------- measurement
def _stats() -> dict:
    m = torch.cuda.memory_stats()
    return {k: m.get(k, 0) for k in (
        "allocated_bytes.all.current", "reserved_bytes.all.current", "segment.all.current")}


def _segments() -> list[dict]:
    segs = sorted(torch.cuda.memory_snapshot(), key=lambda seg: seg["address"])
    base = segs[0]["address"] if segs else 0
    return [{"offset": seg["address"] - base, "total_size": seg["total_size"],
             "segment_type": seg["segment_type"],
             "blocks": [[blk["size"], blk["state"]] for blk in seg["blocks"]]} for seg in segs]


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
        trace.append([st["allocated_bytes.all.current"], st["reserved_bytes.all.current"],
                      st["segment.all.current"]])
    m = torch.cuda.memory_stats()
    out = {
        "start_reserved": start_reserved,
        "max_memory_allocated": torch.cuda.max_memory_allocated(),
        "max_memory_reserved": torch.cuda.max_memory_reserved(),
        "segments_peak": m.get("segment.all.peak"),
        "segments_end": len(torch.cuda.memory_snapshot()),
        "counters": {k: m.get(k) for k in (
            "segment.small_pool.peak", "segment.large_pool.peak", "inactive_split_bytes.all.peak",
            "num_alloc_retries", "num_ooms", "num_device_alloc", "num_device_free")},
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
    return {"device": props.name, "memory_bytes": props.total_memory, "mem_get_info_total": total,
            "mem_get_info_free": free, "driver": driver, "cuda": torch.version.cuda,
            "torch": torch.__version__, "python": platform.python_version(),
            "allocator_backend": torch.cuda.get_allocator_backend(),
            "alloc_conf": {k: os.environ.get(k) for k in
                           ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF")},
            "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds")}


def outside_allocator(label: str) -> dict:
    """Device memory this process holds outside the caching allocator (the CUDA context, the
    libraries' kernels and handles): total - free - reserved, from cudaMemGetInfo."""
    torch.cuda.synchronize()
    free, total = torch.cuda.mem_get_info()
    reserved = torch.cuda.memory_reserved()
    return {"when": label, "total": total, "free": free, "reserved": reserved,
            "outside_allocator": total - free - reserved}


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
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
    from gobrrr.models.registry import get_workload
    from gobrrr.profile.runner import matmul_precision, prepare, run_step

    model, batch, seq, precision, *rest = case.split(":")
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear:
        clear()  # the workspaces are allocated again in step 1, as in a fresh process
    _fresh()
    torch.cuda.memory._record_memory_history(enabled="all", context=None, stacks="python",
                                             max_entries=4_000_000)
    with torch.device("cuda"):
        wl = get_workload(model, batch_size=int(batch),
                          seq_len=None if seq in ("", "-", "0") else int(seq))
    wl, opt, scaler = prepare(wl, "cuda", precision, rest[0] if rest else "none")
    after = []
    with matmul_precision(precision):
        for _ in range(steps):
            run_step(wl, opt, precision, scaler, "cuda")
            torch.cuda.synchronize()
            after.append([torch.cuda.memory_allocated(), torch.cuda.memory_reserved()])
    snap = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    trace = [[TRACE_CODES[e["action"]], e["addr"], e["size"]]
             for e in snap["device_traces"][torch.cuda.current_device()]
             if e["action"] in TRACE_CODES]
    out = {"case": case, "steps": steps, "max_memory_allocated": torch.cuda.max_memory_allocated(),
           "max_memory_reserved": torch.cuda.max_memory_reserved(), "after_step": after,
           "trace": trace}
    del wl, opt, scaler
    _fresh()
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", type=Path, help="JSON file to write")
    ap.add_argument("--only", nargs="*", help="run only these sequences")
    ap.add_argument("--steps", nargs="*", default=[], metavar="MODEL:BATCH:SEQ:PRECISION",
                    help="also record the allocator's trace of these built-in workloads' "
                         "first steps (needs gobrrr on the path), e.g. gpt2:1:256:bf16-mixed")
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
        print(f"{name:20s} events {len(events):4d}  "
              f"allocated {res['max_memory_allocated'] / MiB:9.2f} MiB  "
              f"reserved {res['max_memory_reserved'] / MiB:9.2f} MiB  "
              f"segments {res['segments_peak']:3d}  ooms {len(res['oom_events'])}", flush=True)
    context += library_context()  # cuBLAS keeps its workspace allocated afterwards
    steps = []
    for case in args.steps:
        steps.append(record_step(case))
        print(f"{case:28s} {len(steps[-1]['trace']):6d} events  reserved "
              f"{steps[-1]['max_memory_reserved'] / MiB:9.2f} MiB", flush=True)
    out = {"version": VERSION, "env": env, "seconds": round(time.time() - t0, 2),
           "context": context, "sequences": results, "steps": steps}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, separators=(",", ":")) + "\n")
    print(f"wrote {args.out} ({out['seconds']} s)")


if __name__ == "__main__":
    main()
