"""Do memory-bound kernels run slower inside a training step than alone? The same kernels
(a bf16 add, a bf16 -> fp32 cast, AdamW's `_foreach_lerp_` over a 1B model's fp32 lists)
timed by the profiler's kernel durations in four settings:

- alone: as the calibration times them, the GPU idle (a spin kernel) and L2 flushed before;
- burst: 20 back to back on the same buffers;
- rotate: back to back, each on buffers of its own (up to 20 sets, half the free memory);
- after_matmul: each right after a 8192^3 bf16 matmul (the GPU at full power).

Also the kernel each case runs, as the evidence for the calibration's kernel paths
(`calibrate_paths`): one short profile of every path case.

    PYTHONPATH=src python benchmarks/calibration/instep_bandwidth.py OUT.json [--paths-only]

`--paths-only`: only the kernel each path case runs (no settings), a few seconds.
"""

from __future__ import annotations

import statistics
import sys

import torch

from gobrrr.calibrate.timing import flush_buffer
from gobrrr.kernels.bench import cuda_kernels, gpu_out_arg, write_json

N = 2**26  # elements (128 MiB bf16)
REPS = 20


def durations(fn, match: str, reps: int = 1) -> list[float]:
    return [s for name, s in cuda_kernels(fn, reps) if match in name]


def settings(name: str, make, match: str, footprint: int) -> dict:
    """`make()` -> (fn, bytes held): timed in the four settings."""
    dev = torch.device("cuda")
    fn, _ = make()
    fn()
    flush = flush_buffer(dev)

    def alone():
        for _ in range(REPS):
            flush.zero_()
            torch.cuda._sleep(2_000_000)
            fn()

    row = {"case": name}
    row["alone"] = statistics.median(durations(alone, match))
    row["burst"] = statistics.median(durations(lambda: [fn() for _ in range(REPS)], match))
    copies = max(2, min(REPS, footprint))
    fns = [make()[0] for _ in range(copies)]
    row["rotate_buffers"] = copies
    row["rotate"] = statistics.median(durations(lambda fns=fns: [f() for f in fns], match))
    del fns
    a = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)

    def after():
        for _ in range(REPS):
            a @ a
            fn()

    row["after_matmul"] = statistics.median(durations(after, match))
    row["kernel"] = next(n for n, _ in cuda_kernels(fn) if match in n)
    for k in ("burst", "rotate", "after_matmul"):
        row[f"{k}_over_alone"] = row[k] / row["alone"]
    return row


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    paths_only = "--paths-only" in argv
    argv = [a for a in argv if a != "--paths-only"]
    out = gpu_out_arg(__doc__, "instep_bandwidth", argv)
    if out is None:
        return 2
    dev = torch.device("cuda")
    free = torch.cuda.mem_get_info()[0]

    def add():
        a, b = (torch.randn(N, device=dev, dtype=torch.bfloat16) for _ in range(2))
        return (lambda: a + b), 6 * N

    def upcast():
        a = torch.randn(N, device=dev, dtype=torch.bfloat16)
        return (lambda: a.float()), 6 * N

    def lerp():
        d, layers = 2048, 16
        shapes = ([(d, d)] * 4 + [(4 * d, d)] * 3 + [(d,)] * 2) * layers
        m, p = ([torch.randn(s, device=dev) for s in shapes] for _ in range(2))
        return (lambda: torch._foreach_lerp_(m, p, 0.1)), 12 * sum(t.numel() for t in m)

    rows = []
    cases = (
        ("add bf16", add, "add"),
        ("cast bf16->fp32", upcast, "direct_copy"),
        ("foreach_lerp_ fp32", lerp, "multi_tensor_apply"),
    )
    for name, make, match in () if paths_only else cases:
        held = make()[1]
        rows.append(settings(name, make, match, int(0.5 * free // held)))
        print(rows[-1], flush=True)

    from gobrrr.calibrate.sections.paths import _foreach_cases, _path_cases

    paths = []
    for n in (2**20, 2**26):
        for key, op, fn in _path_cases(dev, n):
            fn()
            ks = cuda_kernels(fn)
            paths.append({"path": key, "op": op, "elements": n, "kernels": [[k, s] for k, s in ks]})
    for key, op, fn in _foreach_cases(dev):  # the first case is enough
        ks = cuda_kernels(fn)
        paths.append({"path": key, "op": op, "kernels": sorted({k for k, _ in ks})})
        break
    write_json(out, {"benchmark": "in-step bandwidth", "settings": rows, "paths": paths})
    print(out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
