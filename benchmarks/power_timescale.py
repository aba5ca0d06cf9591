"""Whether the power limit's hold on bf16 matmuls follows the step's duty or the duty over a
shorter window: the same duties run with short and long stretches of each kernel.

    PYTHONPATH=src python benchmarks/power_timescale.py OUT.json

For duties of one half (i matmuls then i copies) and four fifths (4i matmuls then i copies),
with i from 1 to 64 (stretches of ~0.17 ms to ~11 ms of one kind of kernel), each pattern
run through `gobrrr.calibrate.sections.power.steady`, as `power_duty` runs its patterns (1 s
idle, 1.5 s of the pattern, then repeats timed group by group with CUDA events): the matmuls'
share of their burst rate. If the board's power controller averages over less than a stretch,
long stretches of matmuls throttle as at a duty of one.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[1] / "src"), str(HERE.parent)]

VERSION = 1
STRETCHES = (1, 4, 16, 64)


def main(argv=None) -> int:
    import torch
    from bench_estimate_suite import environment

    from gobrrr.calibrate.sections.power import kernels, settle, steady
    from gobrrr.calibrate.timing import time_op

    out_path = (argv or sys.argv[1:])[0]
    dev = torch.device("cuda")
    matmul, copy = kernels(dev)
    settle(dev, 1.0)
    burst = time_op(matmul, dev, 5)
    rows = []
    for ratio in (1, 4):
        for i in STRETCHES:
            n_mm, n_cp = ratio * i, i
            mm_t, cp_t = steady(matmul, copy, n_mm, n_cp, dev, 1.5, max(4, 64 // i), 1.0)
            duty = n_mm * mm_t / (n_mm * mm_t + n_cp * cp_t)
            row = {"matmuls": n_mm, "copies": n_cp, "duty": duty,
                   "matmul_stretch_s": n_mm * mm_t, "copy_stretch_s": n_cp * cp_t,
                   "fraction": burst / mm_t}
            rows.append(row)
            print(f"{n_mm:4d} mm / {n_cp:3d} copies: duty {duty:.2f}, stretch "
                  f"{n_mm * mm_t * 1e3:6.2f} ms, fraction {burst / mm_t:.3f}", flush=True)
    doc = {"version": VERSION, "environment": environment(), "burst_s": burst, "rows": rows}
    Path(out_path).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
