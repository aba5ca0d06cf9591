"""The CPU's AdamW rate alone and inside an offloaded step's loop, on a GPU machine.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/offload_contention.py OUT.json

torchao's CPUOffloadOptimizer steps each parameter on the CPU (`AdamW(fused=True)` over its
pinned fp32 copy and gradient) and then queues that parameter's copy back to the GPU on a side
stream, so the copy of one parameter runs (the GPU's DMA reading pinned host memory) while the
CPU steps the next: both stream through the host's memory. The calibration
(`profile.calibrate_offload.cpu_adamw_times`) times the steps alone over a 512 MiB working set.
Measured here, per parameter size, seconds per element over a working set of `--gib` GiB of
parameters: (1) the steps alone, as the calibration does; (2) each step followed by its
parameter's host-to-device copy, queued non-blocking on a side stream, as the offloaded step
does; (3) the steps alone again over the calibration's 512 MiB working set. The medians of
three passes after one.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

VERSION = 1
SIZES = (2**22, 2**24, 2**26)


def _params(n: int, count: int, torch):
    out = []
    for _ in range(count):
        p = torch.rand(n, pin_memory=True)
        p.grad = torch.rand(n, pin_memory=True)
        out.append((p, torch.optim.AdamW([p], lr=3e-4, weight_decay=0.01, fused=True)))
    return out


def _pass(items, copy: bool, gpu, stream, torch) -> float:
    t0 = time.perf_counter()
    for k, (p, opt) in enumerate(items):
        opt.step()
        if copy:
            with torch.cuda.stream(stream):
                gpu[k].copy_(p, non_blocking=True)
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def measure(n: int, working_bytes: int, copy: bool, torch) -> float:
    """Seconds per element of one pass over parameters of n elements (16 bytes of parameter,
    gradient and moments each), as many as fill `working_bytes`."""
    count = max(1, working_bytes // (16 * n))
    items = _params(n, count, torch)
    gpu = [torch.empty(n, device="cuda") for _ in range(count)] if copy else []
    stream = torch.cuda.Stream()
    times = [_pass(items, copy, gpu, stream, torch) for _ in range(4)][1:]
    del items, gpu
    return statistics.median(times) / (n * count)


def main(argv=None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--gib", type=float, default=8.0)
    args = ap.parse_args(argv)
    from bench_estimate_suite import environment

    big = int(args.gib * 2**30)
    rows = []
    for n in SIZES:
        row = {"elements": n, "alone_s_per_elem": measure(n, big, False, torch),
               "with_copies_s_per_elem": measure(n, big, True, torch),
               "alone_512mib_s_per_elem": measure(n, 2**29, False, torch)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    doc = {"version": VERSION, "environment": environment(), "working_set_gib": args.gib,
           "threads": torch.get_num_threads(), "rows": rows}
    Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
