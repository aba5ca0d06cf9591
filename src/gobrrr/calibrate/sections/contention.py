"""Calibration of what an NCCL collective and the compute kernels beside it cost each other.

    torchrun --nproc-per-node 4 -m gobrrr.calibrate.sections.contention --out contention.json

An NCCL kernel holds SMs (a thread block per channel) from its launch to its end, while it
moves data and while it waits for the other ranks; the compute kernels that run beside it get
the rest of the chip, and it gets what they leave. A data-parallel step overlaps most of its
collectives with compute (DDP's bucket all-reduces with the backward, FSDP2's prefetched
all-gathers with the forward), so both slow down.

For each collective as data-parallel training issues it (all-reduce in fp32: DDP's buckets;
all-gather in bf16: FSDP2's parameters; reduce-scatter in fp32: FSDP2's gradients) of 32 and
128 MiB, and each compute kernel of a grid (bf16 matmuls from under one wave of SMs to many,
an elementwise kernel of 64 MiB and 1 GiB, a softmax, a causal attention forward):

- the compute slowdown: a chain of the kernel queued on the default stream while a loop of
  the collective, queued first on a second stream, keeps an NCCL kernel resident throughout;
  seconds per kernel, against the chain alone;
- the collective's slowdown: the collective's loop while a chain of the kernel, queued first,
  keeps the compute stream busy throughout; seconds per call, against the loop alone.

Each figure is the median over rounds, the slowest rank's. Beside torch it imports only the
collectives section (its torchrun set-up and slowest-rank reduction).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys

import torch
import torch.distributed as dist
import torch.nn.functional as F

from gobrrr.calibrate.sections.collectives import (
    _buffers,
    _call,
    _slowest,
    _timed,
    join_torchrun,
)
from gobrrr.calibrate.sections.collectives import environment as collectives_environment

MIB = 2**20
#: (collective, dtype) as DDP and FSDP2 issue them
COLLECTIVES = (
    ("all_reduce", torch.float32),
    ("all_gather", torch.bfloat16),
    ("reduce_scatter", torch.float32),
)
SIZES = (32 * MIB, 128 * MIB)
#: bf16 matmuls (m, n, k): 128x128 output tiles over 132 SMs from half a wave to ~30 waves
MATMULS = (
    (2048, 1024, 2048),
    (2048, 2048, 2048),
    (8192, 2048, 2048),
    (8192, 2048, 8192),
    (8192, 8192, 2048),
    (8192, 8192, 8192),
)
#: elementwise kernels (bytes of the bf16 tensor scaled in place)
ELEMENTWISE = (64 * MIB, 1024 * MIB)


def _dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "fp32", torch.bfloat16: "bf16"}[dtype]


def kernels() -> list[dict]:
    """The compute grid: {name, class, flops, bytes, fn} (fn queues one kernel)."""
    out = []
    for m, n, k in MATMULS:
        a = torch.randn(m, k, device="cuda", dtype=torch.bfloat16)
        b = torch.randn(k, n, device="cuda", dtype=torch.bfloat16)
        c = torch.empty(m, n, device="cuda", dtype=torch.bfloat16)
        out.append(
            {
                "name": f"matmul {m}x{n}x{k}",
                "class": "matmul",
                "flops": 2 * m * n * k,
                "bytes": 2 * (m * k + k * n + m * n),
                "fn": lambda a=a, b=b, c=c: torch.mm(a, b, out=c),
            }
        )
    for nbytes in ELEMENTWISE:
        x = torch.randn(nbytes // 2, device="cuda", dtype=torch.bfloat16)
        out.append(
            {
                "name": f"scale {nbytes // MIB} MiB",
                "class": "memory",
                "flops": 0,
                "bytes": 2 * nbytes,
                "fn": lambda x=x: x.mul_(1.0),
            }
        )
    s = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    out.append(
        {
            "name": "softmax 8192x8192",
            "class": "memory",
            "flops": 0,
            "bytes": 2 * s.numel() * 2,
            "fn": lambda s=s: torch.softmax(s, -1),
        }
    )
    q, kk, v = (torch.randn(1, 16, 8192, 64, device="cuda", dtype=torch.bfloat16) for _ in range(3))
    out.append(
        {
            "name": "attention 1x16x8192x64 causal",
            "class": "attention",
            "flops": 2 * 2 * 16 * 8192 * 8192 * 64 // 2,
            "bytes": 4 * q.numel() * 2,
            "fn": lambda: F.scaled_dot_product_attention(q, kk, v, is_causal=True),
        }
    )
    return out


def _collective(op: str, dtype: torch.dtype, nbytes: int):
    """One call of `op` over a whole buffer of `nbytes`, as the collectives section makes it."""
    inp, out = _buffers(op, nbytes, dtype, dist.get_world_size(), torch.device("cuda"))
    return lambda: _call(op, inp, out)


def _loop(fn, count: int, stream) -> tuple:
    """Queue `fn` `count` times on `stream` between two events."""
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with torch.cuda.stream(stream):
        a.record(stream)
        for _ in range(count):
            fn()
        b.record(stream)
    return a, b


def _per_call(fn, count: int, stream, rounds: int) -> float:
    """Median seconds per call of `fn` queued `count` times on `stream` (collectives' timer)."""
    return statistics.median(_timed(fn, count, rounds, stream))


def _beside(first, n_first, second, n_second, s_first, s_second, rounds: int) -> float:
    """Seconds per call of `second` (n_second calls on s_second) queued while `first` (n_first
    calls on s_first, queued before it) runs."""
    out = []
    for _ in range(rounds):
        dist.barrier()
        torch.cuda.synchronize()
        _loop(first, n_first, s_first)
        a, b = _loop(second, n_second, s_second)
        torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / 1e3 / n_second)
    return statistics.median(out)


def measure_all(rounds: int = 5, span_s: float = 0.02) -> dict:
    """Every (collective, size, kernel) point on every rank of the NCCL process group."""
    main, side = torch.cuda.current_stream(), torch.cuda.Stream()
    grid = kernels()
    for k in grid:  # warm-up (cuBLAS heuristics, cuDNN plans) and the kernel alone
        _per_call(k["fn"], 3, main, 1)
        k["alone_s"] = _slowest(_per_call(k["fn"], 20, main, rounds))
    points = []
    for op, dtype in COLLECTIVES:
        for nbytes in SIZES:
            coll = _collective(op, dtype, nbytes)
            _per_call(coll, 3, side, 1)
            c_alone = _slowest(_per_call(coll, 10, side, rounds))
            for k in grid:
                n_k = max(8, int(span_s / k["alone_s"]))
                n_c = max(8, int(span_s / c_alone))
                # the collective's loop covers the chain: 3x the chain's length alone
                compute = _beside(coll, 3 * n_c, k["fn"], n_k, side, main, rounds)
                # the chain covers the collective's loop: 20x the loop's length alone (a
                # collective beside saturating matmuls has run 10-15x slower)
                n_c = max(2, n_c // 4)
                collective = _beside(k["fn"], 5 * n_k, coll, n_c, main, side, rounds)
                points.append(
                    {
                        "op": op,
                        "dtype": _dtype_name(dtype),
                        "bytes": nbytes,
                        "ranks": dist.get_world_size(),
                        "kernel": k["name"],
                        "class": k["class"],
                        "kernel_flops": k["flops"],
                        "kernel_bytes": k["bytes"],
                        "kernel_alone_s": k["alone_s"],
                        "kernel_beside_s": _slowest(compute),
                        "collective_alone_s": c_alone,
                        "collective_beside_s": _slowest(collective),
                    }
                )
    return {"version": 1, "kind": "contention", "meta": environment(), "points": points}


def environment() -> dict:
    """The collectives section's environment, and the SMs the kernels share."""
    return {
        **collectives_environment(),
        "sms": torch.cuda.get_device_properties(0).multi_processor_count,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="JSON file rank 0 writes")
    ap.add_argument("--rounds", type=int, default=5)
    args = ap.parse_args(argv)
    if not join_torchrun("contention", "contention.json"):
        return 2
    result = measure_all(args.rounds)
    if dist.get_rank() == 0:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
        for p in result["points"]:
            print(
                f"{p['op']:>14} {p['bytes'] // MIB:4d} MiB | {p['kernel']:30s} "
                f"{p['kernel_alone_s'] * 1e6:8.1f} -> {p['kernel_beside_s'] * 1e6:8.1f} us | "
                f"collective {p['collective_alone_s'] * 1e6:8.1f} -> "
                f"{p['collective_beside_s'] * 1e6:8.1f} us"
            )
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
