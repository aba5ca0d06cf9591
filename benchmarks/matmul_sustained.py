"""bf16 matmul throughput measured as the calibration measures it, and sustained, on a GPU:
whether a training step's back-to-back matmuls run at the rate of the calibration's short
bursts.

    PYTHONPATH=src python benchmarks/matmul_sustained.py OUT.json

For each shape (a Llama-8B layer's at 32768 tokens, forward and weight gradient, and square
ones), on random normal inputs:
- "burst": gobrrr.calibrate.timing.time_op, as the calibration's matmul grid runs it (each run
  behind a ~1 ms spin kernel, median of 5);
- "sustained": the same matmul back to back for `--heat` seconds, then 30 more each timed
  with CUDA events (median), with the SM clock (MHz) and the board's power (W) read through
  NVML (torch.cuda.clock_rate, torch.cuda.power_draw) right after.
The clock and power are also read idle, before anything runs.
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
#: (m, k, n): C[m, n] = A[m, k] @ B[k, n]
SHAPES = ((32768, 4096, 14336), (32768, 14336, 4096), (14336, 32768, 4096),
          (32768, 4096, 4096), (8192, 8192, 8192), (4096, 4096, 4096))


def nvml(torch) -> dict:
    out = {}
    for key, fn in (("sm_clock_mhz", "clock_rate"), ("power_mw", "power_draw"),
                    ("temperature_c", "temperature")):
        try:
            out[key] = getattr(torch.cuda, fn)()
        except Exception as e:  # NVML missing: say so, keep measuring
            out[key] = f"unavailable: {type(e).__name__}"
    return out


def main(argv=None) -> int:
    import torch
    from bench_estimate_suite import environment

    from gobrrr.calibrate.timing import time_op

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--heat", type=float, default=2.0)
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    doc = {"version": VERSION, "environment": environment(), "idle": nvml(torch),
           "heat_s": args.heat, "rows": []}
    for m, k, n in SHAPES:
        a = torch.randn(m, k, device=dev, dtype=torch.bfloat16)
        b = torch.randn(k, n, device=dev, dtype=torch.bfloat16)
        c = torch.empty(m, n, device=dev, dtype=torch.bfloat16)
        fn = lambda a=a, b=b, c=c: torch.mm(a, b, out=c)  # noqa: E731
        flop = 2.0 * m * k * n
        torch.cuda.synchronize()
        time.sleep(1.0)  # let the board settle between shapes, as between calibration points
        burst = time_op(fn, dev, 5)
        t0 = time.perf_counter()
        while time.perf_counter() - t0 < args.heat:
            for _ in range(10):
                fn()
            torch.cuda.synchronize()
        ev = [(torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
              for _ in range(30)]
        for s, e in ev:
            s.record()
            fn()
            e.record()
        hot = nvml(torch)
        torch.cuda.synchronize()
        sustained = statistics.median(s.elapsed_time(e) for s, e in ev) * 1e-3
        row = {"m": m, "k": k, "n": n, "burst_s": burst, "sustained_s": sustained,
               "burst_tflops": flop / burst / 1e12, "sustained_tflops": flop / sustained / 1e12,
               "after_heat": hot}
        doc["rows"].append(row)
        print(f"{m}x{k}x{n}: burst {row['burst_tflops']:.0f} TF/s, sustained "
              f"{row['sustained_tflops']:.0f} TF/s, {hot}", flush=True)
        del a, b, c
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
