"""Does a fused attention kernel's time follow the sequence length, or the sequence length
rounded up to its tiles? Times F.scaled_dot_product_attention (default backend, forward and
backward apart, as `calibrate_step.attention_variants` does) at sequence lengths that are
and are not multiples of 64 and 128, at a fixed batch x heads, per mask variant and head dim.

    PYTHONPATH=src python benchmarks/attention_tiles.py OUT.json
"""

from __future__ import annotations

import argparse
import sys

import torch
import torch.nn.functional as F

from gobrrr.calibrate.timing import time_op
from gobrrr.kernels.bench import env_info, write_json

SEQS = (128, 192, 197, 256, 320, 384, 448, 512, 577, 640, 1024, 1500, 1536, 2048)


def point(dev, s: int, d: int, mask: str, p: float, bh: int = 192) -> dict:
    b, h = bh // (1024 // d), 1024 // d
    q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=torch.bfloat16, requires_grad=True)
               for _ in range(3))
    g = torch.randn_like(q)
    kw = {"is_causal": mask == "causal", "dropout_p": p}

    def fwd():
        return [F.scaled_dot_product_attention(q, k, v, **kw) for _ in range(4)]

    def both():
        for o in fwd():
            torch.autograd.grad(o, (q, k, v), g)

    t_fwd, t_both = time_op(fwd, dev, 10) / 4, time_op(both, dev, 10) / 4
    return {"s": s, "d": d, "mask": mask, "dropout": p, "batch": b, "heads": h,
            "forward_s": t_fwd, "backward_s": t_both - t_fwd}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    args = ap.parse_args(argv)
    dev = torch.device("cuda")
    rows = []
    for d in (64, 128):
        for mask, p in (("full", 0.0), ("causal", 0.0), ("full", 0.1)):
            for s in SEQS:
                try:
                    rows.append(point(dev, s, d, mask, p))
                except Exception as e:  # recorded, the rest still runs
                    rows.append({"s": s, "d": d, "mask": mask, "dropout": p, "error": str(e)})
                print(rows[-1], flush=True)
    write_json(args.out, {"benchmark": "attention time over sequence lengths (tiles)",
                          "env": env_info(), "rows": rows})


if __name__ == "__main__":
    sys.exit(main())
