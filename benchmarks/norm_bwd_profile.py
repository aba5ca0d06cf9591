"""One norm backward per configuration, for Nsight Compute: `ncu --kernel-name regex:bwd ...
python benchmarks/norm_bwd_profile.py` profiles each backward kernel launched here.

    PYTHONPATH=src python benchmarks/norm_bwd_profile.py [--shape 4096 16384]
"""

from __future__ import annotations

import argparse

import torch

from gobrrr.kernels import layer_norm, norms, rms_norm

CONFIGS = {"one_program_a_row": {"split_cols": 0}, "split": {}}


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
    saved = dict(norms.TUNING)
    for name, cfg in CONFIGS.items():
        norms.TUNING.update(saved, **cfg)
        for norm, fn in (("rms", lambda: rms_norm(x, w)), ("ln", lambda: layer_norm(x, w, b))):
            for _ in range(2):  # the first compiles
                fn().backward(dy)
            torch.cuda.synchronize()
            print(name, norm, "done", flush=True)
    norms.TUNING.update(saved)


if __name__ == "__main__":
    main()
