"""Two RMSNorm and two LayerNorm steps (forward and backward, bf16) for Nsight Compute to profile
kernel by kernel (the first step of each compiles; both are profiled):

    PYTHONPATH=src ncu --clock-control none --kernel-name regex:"_norm_|_sum_parts" \
        --metrics gpu__time_duration.sum,dram__throughput.avg.pct_of_peak_sustained_elapsed,... \
        --csv python benchmarks/norm_bwd_profile.py [--shape 4096 16384] > OUT.csv

`results/norm_bwd_ncu_h100.csv` is such a profile (of the code of runs 9-10, benchmarks/README.md).
"""

from __future__ import annotations

import argparse

import torch

from gobrrr.kernels import layer_norm, rms_norm


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--shape", nargs=2, type=int, default=[4096, 16384])
    args = p.parse_args(argv)
    m, n = args.shape
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    w = torch.ones(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    b = torch.zeros(n, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    dy = torch.randn(m, n, device="cuda", dtype=torch.bfloat16, generator=g)
    for norm, fn in (("rms", lambda: rms_norm(x, w)), ("ln", lambda: layer_norm(x, w, b))):
        for _ in range(2):
            fn().backward(dy)
        torch.cuda.synchronize()
        print(norm, "done", flush=True)


if __name__ == "__main__":
    main()
