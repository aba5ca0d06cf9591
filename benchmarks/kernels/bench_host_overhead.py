"""Host time per forward+backward call of each gobrrr kernel, two ways, beside PyTorch's op.

At tiny shapes the GPU finishes each kernel long before the host issues the next, so the wall
time of N calls without a sync, divided by N, is the host's cost per call. Two paths of gobrrr's
functions, in the same process:
- `ops`: through the gobrrr:: custom ops (the op dispatcher);
- `direct`: the kernels launched without the op dispatcher (`gobrrr.kernels._util.direct`).

    PYTHONPATH=src python benchmarks/bench_host_overhead.py OUT.json
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gobrrr.kernels import (
    _util,
    attention,
    gelu,
    layer_norm,
    linear_cross_entropy,
    rms_norm,
    swiglu,
)
from gobrrr.kernels.bench import generator, out_only_main, table, write_json

PATHS = {"ops": False, "direct": True}


def cases():
    """name -> (gobrrr fn, torch fn, leaves), tiny shapes (8 rows of 256; attention 1x2x64x64)."""
    g = generator(0, "cuda")

    def r(*shape, dtype=torch.bfloat16):
        return torch.randn(*shape, device="cuda", dtype=dtype, generator=g).requires_grad_()

    x, u, w, b = r(8, 256), r(8, 256), r(256), r(256)
    q, k, v = r(1, 2, 64, 64), r(1, 2, 64, 64), r(1, 2, 64, 64)
    hid, wte = r(64, 256), r(1000, 256)
    tgt = torch.randint(0, 1000, (64,), device="cuda", generator=g)
    return {
        "rms_norm": (lambda: rms_norm(x, w), lambda: F.rms_norm(x, (256,), w), [x, w]),
        "layer_norm": (lambda: layer_norm(x, w, b), lambda: F.layer_norm(x, (256,), w, b),
                       [x, w, b]),
        "gelu": (lambda: gelu(x, "tanh"), lambda: F.gelu(x, approximate="tanh"), [x]),
        "swiglu": (lambda: swiglu(x, u), lambda: F.silu(x) * u, [x, u]),
        "attention": (lambda: attention(q, k, v, causal=True),
                      lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True), [q, k, v]),
        "linear_cross_entropy": (lambda: linear_cross_entropy(hid, wte, tgt),
                                 lambda: F.cross_entropy((hid @ wte.t()).float(), tgt),
                                 [hid, wte]),
    }


def host_us(fn, leaves, calls=200, rounds=5) -> dict:
    """Median (and spread) over rounds of the host time per fwd+bwd call, in microseconds."""
    def once():
        y = fn()
        torch.autograd.backward(y, torch.ones_like(y))
        for t in leaves:
            t.grad = None

    for _ in range(20):
        once()
    torch.cuda.synchronize()
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(calls):
            once()
        per.append((time.perf_counter() - t0) / calls * 1e6)
        torch.cuda.synchronize()
    return {"median_us": statistics.median(per), "min_us": min(per), "max_us": max(per)}


def run(out_path: str | Path) -> Path:
    rows = []
    for name, (ours, theirs, leaves) in cases().items():
        row = {"op": name, "torch_us": host_us(theirs, leaves)["median_us"]}
        for path, on in PATHS.items():
            _util.DIRECT = on
            try:
                row[f"{path}_us"] = host_us(ours, leaves)["median_us"]
            except Exception as e:  # noqa: BLE001 - record and go on
                row[f"{path}_error"] = repr(e)[:200]
            finally:
                _util.DIRECT = True
        rows.append(row)
    path = write_json(out_path, {
        "benchmark": "host time per fwd+bwd call (tiny shapes, no sync)",
        "paths": {k: {"direct": on} for k, on in PATHS.items()},
        "rows": rows,
    })
    print(table(rows, ["op", "torch_us", "ops_us", "direct_us"]))
    return path


def main(argv=None):
    out_only_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
