"""Host seconds per call of ATen op classes, on a GPU: what a view, a batch-norm backward and
an autograd node cost the host beside a plain elementwise launch.

    PYTHONPATH=src python benchmarks/host_op_classes.py OUT.json [cpu]

The step's host model charges each traced ATen op the calibration's mean per-op cost of its
phase (`op_overhead`, measured on tiny transformers' whole steps), plus measured extras for
cuDNN convolutions and the batch-norm forward (`op_host`). This measures what that mean stands
for, op class by op class:
- "grad:<op>": the op with autograd recording (inputs that require grad, grad mode on), as a
  forward runs it;
- "nograd:<op>": the op with grad mode off, as ops inside a backward node run;
- "node:<kind>": the backward of a chain of 256 nodes of one kind (add, a view: t, one of
  each: add then t, batch norm), per node, with the engine's own work in it.
Ops: an elementwise add (the baseline), views (view, t, slice, expand, squeeze, as_strided,
detach, permute), batch norm forward and backward (bf16 and fp32 input, fp32 affine), the
threshold and SiLU backwards. Tiny tensors, so the host is what a loop of calls waits on;
timed as gobrrr.calibrate.sections.host.per_call does (400 back-to-back calls after 20, least
of 5 rounds).
"""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# src/, the repository root (zoo/), benchmarks/ (child_rows, suite/, plan/) and this folder
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parents[1]),
                str(HERE.parent)]

VERSION = 1
CHAIN = 256


def op_cases(torch, dev, grad: bool):
    aten = torch.ops.aten
    a = torch.randn(8, 8, device=dev, requires_grad=grad)
    yield "add", lambda: aten.add(a, a)
    yield "view", lambda: aten.view(a, [64])
    yield "t", lambda: aten.t(a)
    yield "slice", lambda: aten.slice(a, 1, 0, 4)
    yield "expand", lambda: aten.expand(a[:1], [8, 8])
    yield "squeeze", lambda: aten.squeeze(a[None], 0)
    yield "as_strided", lambda: aten.as_strided(a, [4, 4], [8, 1])
    yield "detach", lambda: aten.detach(a)
    yield "permute", lambda: aten.permute(a, [1, 0])
    for dtype, key in ((torch.bfloat16, "bf16"), (torch.float32, "fp32")):
        x = torch.randn(2, 8, 8, 8, device=dev, dtype=dtype, requires_grad=grad)
        w = torch.ones(8, device=dev, requires_grad=grad)
        b = torch.zeros(8, device=dev, requires_grad=grad)
        rm, rv = torch.zeros(8, device=dev), torch.ones(8, device=dev)
        yield f"batch_norm:{key}", lambda x=x, w=w, b=b, rm=rm, rv=rv: \
            torch.nn.functional.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
        if grad:
            continue
        _, mean, invstd = aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
        gy = torch.randn_like(x)
        yield f"native_batch_norm_backward:{key}", \
            lambda gy=gy, x=x, w=w, rm=rm, rv=rv, mean=mean, invstd=invstd: \
            aten.native_batch_norm_backward(gy, x, w, rm, rv, mean, invstd, True, 1e-5,
                                            [True, True, True])
        yield f"threshold_backward:{key}", lambda gy=gy, x=x: aten.threshold_backward(gy, x, 0)
        yield f"silu_backward:{key}", lambda gy=gy, x=x: aten.silu_backward(gy, x)


def chain(torch, dev, kind: str):
    """A leaf and a chain of CHAIN autograd nodes of `kind` on it; returns (leaf, output)."""
    a = torch.randn(8, 8, device=dev, requires_grad=True)
    y = a
    if kind == "batch_norm":
        y = torch.randn(2, 8, 8, 8, device=dev, requires_grad=True)
        a = y
        w = torch.ones(8, device=dev, requires_grad=True)
        rm, rv = torch.zeros(8, device=dev), torch.ones(8, device=dev)
        for _ in range(CHAIN):
            y = torch.nn.functional.batch_norm(y, rm, rv, w, None, True, 0.1, 1e-5)
        return a, y
    for _ in range(CHAIN):
        if kind in ("add", "add+t"):
            y = y + 1
        if kind in ("t", "add+t"):
            y = y.t()
    return a, y


def node_cost(torch, dev, kind: str, rounds: int = 5, reps: int = 20) -> float:
    """Host seconds per node of the backward of a chain of `kind`: the least over rounds of
    the mean over reps of backward()'s wall time (the graph rebuilt, outside the timing)."""
    from gobrrr.calibrate.sections.step import _sync

    best = float("inf")
    for _ in range(rounds):
        total = 0.0
        for _ in range(reps):
            leaf, y = chain(torch, dev, kind)
            g = torch.ones_like(y)
            _sync(dev)
            t0 = time.perf_counter()
            y.backward(g)
            total += time.perf_counter() - t0
            _sync(dev)
        best = min(best, total / reps)
    return best / CHAIN


def main(argv=None) -> int:
    import torch
    from suite.bench_estimate_suite import environment

    from gobrrr.calibrate.sections.host import per_call

    args = argv or sys.argv[1:]
    out_path = args[0]
    dev = torch.device(args[1] if len(args) > 1 else "cuda")  # "cpu": a dry run
    per = {}
    for grad in (True, False):
        with torch.set_grad_enabled(grad):
            for name, fn in op_cases(torch, dev, grad):
                key = f"{'grad' if grad else 'nograd'}:{name}"
                per[key] = per_call(fn, dev, 400, rounds=5, warmup=20)
                print(f"{key}: {per[key] * 1e6:.2f} us", flush=True)
    for kind in ("add", "t", "add+t", "batch_norm"):
        node_cost(torch, dev, kind, rounds=1, reps=3)  # warm-up
        per[f"node:{kind}"] = node_cost(torch, dev, kind)
        print(f"node:{kind}: {per[f'node:{kind}'] * 1e6:.2f} us", flush=True)
    env = environment() if dev.type == "cuda" else {"device": "cpu"}
    doc = {"version": VERSION, "environment": env, "chain": CHAIN,
           "per_call_s": per}
    Path(out_path).write_text(json.dumps(doc, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
