"""Calibration of NCCL's collectives: time over message size, ranks and dtype, as
`torch.distributed` runs them, and what a collective and a matmul cost each other when they
overlap.

    torchrun --nproc-per-node 4 -m gobrrr.calibrate.sections.collectives --out coll.json
    torchrun --nproc-per-node 4 -m gobrrr calibrate --collectives     # the same, merged into
                                                                      # this GPU's calibration

Every rank runs the same loop; rank 0 writes the JSON. For each collective (all-reduce,
all-gather into one tensor, reduce-scatter from one tensor), dtype and size (bytes of the
*whole* buffer: the all-reduce's tensor, the all-gather's output, the reduce-scatter's input),
the collective is queued `iters` times between barriers and timed with CUDA events on the
communication stream: the median per call over `rounds` rounds, and the slowest rank's
figure (a collective ends when its slowest rank does). Each round is queued behind a sleep
on the GPU long enough for the host to queue all of it, so the events time NCCL's kernels
back to back: queued straight from the host, a call under a few MiB would time
ProcessGroupNCCL's host work instead (about 45 us a call, against 15-40 us of kernel;
docs/investigations/2026-11-28-small-collectives-time-the-host.md). The host's issue time is
kept beside it (`host_issue_s`). Bus bandwidth is NCCL's convention
(nccl-tests' PERFORMANCE.md): bytes × 2(n-1)/n / time for all-reduce, bytes × (n-1)/n / time
for all-gather and reduce-scatter; it is the figure a cost model can hold roughly constant
across rank counts, and small messages show NCCL's fixed latency under it.

Overlap: a bf16 matmul loop on the default stream and a collective loop on a second stream,
each timed alone and then together, so the slowdown each causes the other is measured, not
assumed (NCCL's kernels take SMs and memory bandwidth from the compute they overlap).

Only torch is imported, so the module runs on any machine with CUDA and NCCL, whatever
version of gobrrr is installed there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import functools
import json
import os
import platform
import statistics
import sys
import time

import torch
import torch.distributed as dist

OPS = ("all_reduce", "all_gather", "reduce_scatter")
#: message sizes (bytes of the whole buffer): 4 KiB to 1 GiB, four per octave pair
SIZES = [2**k for k in range(12, 31)] + [3 * 2**k for k in range(12, 29)]
#: the coarse grid of a quick check: 1 MiB to 1 GiB by 4x
QUICK_SIZES = [2**k for k in range(20, 31, 2)]
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
#: the environment that changes what NCCL does, recorded with the figures
ENV = ("NCCL_NVLS_ENABLE", "NCCL_ALGO", "NCCL_PROTO", "TORCH_NCCL_AVOID_RECORD_STREAMS")


def bus_factor(op: str, n: int) -> float:
    """Bus bytes per buffer byte (nccl-tests): 2(n-1)/n for all-reduce, (n-1)/n otherwise."""
    return 2 * (n - 1) / n if op == "all_reduce" else (n - 1) / n


def _buffers(op: str, nbytes: int, dtype: torch.dtype, n: int, dev) -> tuple:
    """(input, output) of one call of `op` over a whole buffer of `nbytes`."""
    numel = max(nbytes // torch.tensor([], dtype=dtype).element_size() // n * n, n)
    if op == "all_reduce":
        t = torch.randn(numel, dtype=dtype, device=dev)
        return t, t
    if op == "all_gather":
        return (
            torch.randn(numel // n, dtype=dtype, device=dev),
            torch.empty(numel, dtype=dtype, device=dev),
        )
    return (
        torch.randn(numel, dtype=dtype, device=dev),
        torch.empty(numel // n, dtype=dtype, device=dev),
    )


def _call(op: str, inp, out, group=None):
    if op == "all_reduce":
        return dist.all_reduce(inp, group=group)
    if op == "all_gather":
        return dist.all_gather_into_tensor(out, inp, group=group)
    return dist.reduce_scatter_tensor(out, inp, group=group)


def _timed(fn, iters: int, rounds: int, stream, ahead_s: float) -> tuple[list, list]:
    """(device seconds per call, host seconds per call) of `fn` queued `iters` times on
    `stream`, once per round, the ranks lined up by a barrier before each round. The stream
    first sleeps `ahead_s` on the GPU, so the host has queued every call before the first
    runs and the events time the device alone; queued without it, a small collective's
    figure is the host's issue rate (ProcessGroupNCCL's ~40-50 us a call), not NCCL's
    kernel."""
    device, host = [], []
    cycles = int(ahead_s * _sleep_cycles_per_s())
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            torch.cuda._sleep(cycles)
            start.record(stream)
            t = time.perf_counter()
            for _ in range(iters):
                fn()
            host.append((time.perf_counter() - t) / iters)
            end.record(stream)
        end.synchronize()
        device.append(start.elapsed_time(end) / 1e3 / iters)
    return device, host


@functools.cache
def _sleep_cycles_per_s() -> float:
    """GPU clock cycles a second of `torch.cuda._sleep` on this device, timed once."""
    torch.cuda._sleep(1000)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(20_000_000)
    b.record()
    b.synchronize()
    return 20_000_000 / (a.elapsed_time(b) / 1e3)


def ahead_for(host_s_per_call: float, iters: int) -> float:
    """Seconds the stream sleeps before a round: three times the host's time to queue the
    round (timed once, after the warm-up; at twice, one round in 15 of most points outlasted
    its sleep on a 4xH200 host), and 1 ms at least, at most 0.2 s."""
    return min(max(3.0 * host_s_per_call * iters, 1e-3), 0.2)


def _slowest(x: float) -> float:
    """The largest of every rank's `x`."""
    t = torch.tensor([x], dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def measure_op(op: str, dtype: str, nbytes: int, rounds: int, stream, max_iters: int = 100) -> dict:
    """One (op, dtype, size) point: seconds per call and bus bandwidth, slowest rank. Each
    round queues up to `max_iters` calls (fewer for large messages: 512 MiB in all)."""
    n = dist.get_world_size()
    inp, out = _buffers(op, nbytes, DTYPES[dtype], n, torch.device("cuda"))
    whole = (out if op == "all_gather" else inp).numel() * inp.element_size()
    iters = max(min(4, max_iters), min(max_iters, int(2**29 // max(whole, 1))))
    with torch.cuda.stream(stream):
        for _ in range(iters):
            _call(op, inp, out)  # warm-up: NCCL's communicator, channels and buffers set up
        stream.synchronize()
        t = time.perf_counter()
        for _ in range(iters):
            _call(op, inp, out)  # the host's time to queue a round
        issue = (time.perf_counter() - t) / iters
    stream.synchronize()
    # one sleep on every rank: a rank that slept less would time the others' sleep too
    ahead = ahead_for(_slowest(issue), iters)
    times, host = _timed(lambda: _call(op, inp, out), iters, rounds, stream, ahead)
    t = _slowest(statistics.median(times))
    return {
        "op": op,
        "dtype": dtype,
        "bytes": whole,
        "ranks": n,
        "iters": iters,
        "seconds": t,
        "min_s": _slowest(min(times)),
        "max_s": _slowest(max(times)),
        "bus_bytes_per_s": whole * bus_factor(op, n) / t if t > 0 else None,
        # the host's issue time a call (slowest rank), and the rounds whose queuing outlasted
        # the sleep ahead of them (their device figure may hold host time: 0 expected)
        "host_issue_s": _slowest(statistics.median(host)),
        "ahead_s": ahead,
        "host_bound_rounds": int(_slowest(float(sum(h * iters > ahead for h in host)))),
    }


def measure_overlap(op: str, nbytes: int, rounds: int, stream) -> dict:
    """A bf16 8192x8192x8192 matmul loop on the default stream against a loop of `op` on
    `stream`: each alone, then both queued together (seconds for the whole loop, slowest
    rank)."""
    n = dist.get_world_size()
    a = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    b = torch.randn(8192, 8192, dtype=torch.bfloat16, device="cuda")
    inp, out = _buffers(op, nbytes, torch.bfloat16, n, torch.device("cuda"))
    mm_iters, coll_iters = 20, 10
    main = torch.cuda.current_stream()

    def mm_loop():
        with torch.cuda.stream(main):
            for _ in range(mm_iters):
                a @ b

    def coll_loop():
        with torch.cuda.stream(stream):
            for _ in range(coll_iters):
                _call(op, inp, out)

    def both() -> tuple[float, float]:
        dist.barrier()
        torch.cuda.synchronize()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(4)]
        ev[0].record(main)
        ev[2].record(stream)
        mm_loop()
        coll_loop()
        ev[1].record(main)
        ev[3].record(stream)
        torch.cuda.synchronize()
        return ev[0].elapsed_time(ev[1]) / 1e3, ev[2].elapsed_time(ev[3]) / 1e3

    def alone(loop, s) -> float:
        dist.barrier()
        torch.cuda.synchronize()
        e0, e1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        e0.record(s)
        loop()
        e1.record(s)
        torch.cuda.synchronize()
        return e0.elapsed_time(e1) / 1e3

    mm_loop(), coll_loop()
    torch.cuda.synchronize()
    mm_alone = statistics.median(alone(mm_loop, main) for _ in range(rounds))
    coll_alone = statistics.median(alone(coll_loop, stream) for _ in range(rounds))
    pairs = [both() for _ in range(rounds)]
    mm_both = statistics.median(p[0] for p in pairs)
    coll_both = statistics.median(p[1] for p in pairs)
    whole = (out if op == "all_gather" else inp).numel() * inp.element_size()
    return {
        "op": op,
        "bytes": whole,
        "ranks": n,
        "matmul": "bf16 8192^3",
        "matmul_iters": mm_iters,
        "collective_iters": coll_iters,
        "matmul_alone_s": _slowest(mm_alone),
        "collective_alone_s": _slowest(coll_alone),
        "matmul_overlapped_s": _slowest(mm_both),
        "collective_overlapped_s": _slowest(coll_both),
    }


def environment() -> dict:
    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "world_size": dist.get_world_size(),
        "host": platform.node(),
        "gpus": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
        "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "env": {k: os.environ.get(k) for k in ENV},
    }


#: below this many bytes a call takes tens of microseconds and one sweep's figure moves by
#: up to a third between sweeps (benchmarks/results/collectives_spread_h200_x4.json: below
#: 8 MiB only ~80% of single sweeps lie within 10% of their five-sweep median, from 8 MiB up
#: 97%): such points are measured in `sweeps` interleaved sweeps and their median kept
SWEEP_BELOW = 2**24


def _sweep_order(sizes: list[int], sweep: int) -> list[int]:
    """Ascending on even sweeps, descending on odd ones: a drift over the run (clocks, the
    host) lands on the two ends alike."""
    s = sorted(sizes)
    return s if sweep % 2 == 0 else s[::-1]


def measure_all(
    sizes=SIZES,
    dtypes=("bf16", "fp32"),
    rounds: int = 15,
    overlap: bool = True,
    max_iters: int = 100,
    waiting=None,
    sweeps: int = 5,
) -> dict:
    """Every point of the grid on every rank of the initialised NCCL process group (the
    current CUDA device this rank's): the result rank 0 writes, {"version", "kind", "meta",
    "points", "overlap"}. Points under `SWEEP_BELOW` bytes are measured in `sweeps` sweeps
    over the grid, the larger ones in the first only; a point's `seconds` is the median of
    its sweeps' figures (each the slowest rank's median over `rounds`), `sweeps_s` all of
    them. `waiting(what)`: a context manager around each point (the caller's watchdog),
    none by default."""
    waiting = waiting or (lambda what: contextlib.nullcontext())
    stream = torch.cuda.Stream()
    cases = [
        (op, dtype)
        for dtype in dtypes
        for op in OPS
        # FSDP2 gathers parameters in param_dtype: bf16 is the case
        if not (dtype == "fp32" and op == "all_gather")
    ]
    found: dict[tuple, list[dict]] = {}
    for sweep in range(max(1, sweeps)):
        for op, dtype in cases:
            for size in _sweep_order(sizes, sweep):
                if sweep and size >= SWEEP_BELOW:
                    continue
                with waiting(f"{op} of {size} bytes ({dtype})"):
                    p = measure_op(op, dtype, size, rounds, stream, max_iters)
                found.setdefault((op, dtype, size), []).append(p)
    points = [
        _median_point(found[(op, dtype, size)]) for op, dtype in cases for size in sorted(sizes)
    ]
    over = []
    for op in OPS if overlap else ():
        for size in (2**24, 2**27):
            with waiting(f"the overlap test ({op} of {size} bytes)"):
                over.append(measure_overlap(op, size, rounds, stream))
    return {
        "version": 1,
        "kind": "collectives",
        "meta": {**environment(), "rounds": rounds, "sweeps": sweeps, "sweep_below": SWEEP_BELOW},
        "points": points,
        "overlap": over,
    }


def _median_point(sweeps: list[dict]) -> dict:
    """One point from its sweeps: the median sweep's seconds (the lower middle of an even
    count), the spread over every round of every sweep, and each sweep's figure."""
    times = [p["seconds"] for p in sweeps]
    t = statistics.median_low(times)
    p = dict(sweeps[times.index(t)])
    p["min_s"] = min(q["min_s"] for q in sweeps)
    p["max_s"] = max(q["max_s"] for q in sweeps)
    if len(sweeps) > 1:
        p["sweeps_s"] = times
    return p


def summary_lines(result: dict) -> list[str]:
    """A few points (bf16 at 1, 64, 256 MiB and 1 GiB) and the overlap test, one per line."""
    lines = [
        f"{p['op']:>14} {p['bytes'] / 2**20:8.0f} MiB {p['seconds'] * 1e6:9.1f} us "
        f"{(p['bus_bytes_per_s'] or 0) / 1e9:6.1f} GB/s"
        for p in result["points"]
        if p["dtype"] == "bf16" and p["bytes"] in (2**20, 2**26, 2**28, 2**30)
    ]
    return lines + [
        f"overlap {o['op']:>14} {o['bytes'] / 2**20:5.0f} MiB: matmul "
        f"{o['matmul_alone_s'] * 1e3:.2f} -> {o['matmul_overlapped_s'] * 1e3:.2f} ms, "
        f"collective {o['collective_alone_s'] * 1e3:.2f} -> "
        f"{o['collective_overlapped_s'] * 1e3:.2f} ms"
        for o in result["overlap"]
    ]


def join_torchrun(section: str, out: str) -> bool:
    """This rank in the job's NCCL process group, on its local GPU; False (and one line on
    stderr saying how to run it) outside torchrun."""
    if "RANK" not in os.environ:
        print(
            "error: run under torchrun, e.g. torchrun --nproc-per-node 4 -m "
            f"gobrrr.calibrate.sections.{section} --out {out}",
            file=sys.stderr,
        )
        return False
    local = int(os.environ.get("LOCAL_RANK", 0))
    torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(seconds=120)
    )
    return True


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--rounds", type=int, default=15)
    ap.add_argument("--max-bytes", type=int, default=2**30)
    ap.add_argument("--dtypes", default="bf16,fp32")
    ap.add_argument(
        "--sweeps",
        type=int,
        default=5,
        help=f"sweeps over the messages under {SWEEP_BELOW // 2**20} MiB (their median kept)",
    )
    args = ap.parse_args(argv)
    if not join_torchrun("collectives", "coll.json"):
        return 2
    sizes = [s for s in SIZES if s <= args.max_bytes]
    result = measure_all(sizes, args.dtypes.split(","), args.rounds, sweeps=args.sweeps)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        print("\n".join(summary_lines(result)))
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
