"""SwiGLU / GELU fwd and bwd bandwidth vs eager, torch.compile and a device-to-device copy.

GB/s of the minimal bytes: swiglu fwd reads gate, up, writes y (3 tensors); bwd reads dy, gate,
up, writes dgate, dup (5); gelu fwd 2 tensors, bwd 3. Shape 8192x14336 bf16 (a Llama-3-8B MLP
at 8k tokens). Target: >= 90% of the copy's bandwidth measured in the same run. GPU times from
CUDA-graph replays (inputs far larger than L2); host-inclusive times (launch_*) beside.

    PYTHONPATH=src python benchmarks/kernels/bench_pointwise.py OUT.json [--sweep]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from gobrrr.kernels import gelu, pointwise, swiglu
from gobrrr.kernels.bench import generator, rel_err, table, time_graph_ms, time_ms, write_json

DEVICE = "cuda"  # the benchmarks need a GPU; a CPU dry run may override this

SHAPE = (8192, 14336)
DTYPE = torch.bfloat16


def swiglu_eager(g, u):
    return F.silu(g) * u


OPS = {  # name: (ours, eager, number of inputs, tensors moved fwd, bwd)
    "swiglu": (swiglu, swiglu_eager, 2, 3, 5),
    "gelu": (lambda x: gelu(x), lambda x: F.gelu(x), 1, 2, 3),
    "gelu_tanh": (lambda x: gelu(x, "tanh"), lambda x: F.gelu(x, approximate="tanh"), 1, 2, 3),
}


def copy_GBps() -> dict:
    src = torch.randn(
        512 * 1024 * 1024 // 2, device=DEVICE, dtype=DTYPE, generator=generator(1, DEVICE)
    )  # 512 MiB
    dst = torch.empty_like(src)
    nbytes = 2 * src.numel() * src.element_size()
    t, g = time_ms(lambda: dst.copy_(src)), time_graph_ms(lambda: dst.copy_(src))
    out = {"bytes": nbytes, "launch": t, "graph": g, "GBps": nbytes / t["median_ms"] / 1e6}
    if "median_ms" in g:
        out["GBps"] = max(out["GBps"], nbytes / g["median_ms"] / 1e6)  # the higher ceiling
    return out


def inputs(n_in):
    g = generator(0, DEVICE)
    xs = [
        torch.randn(SHAPE, device=DEVICE, dtype=DTYPE, generator=g).requires_grad_()
        for _ in range(n_in)
    ]
    return xs, torch.randn(SHAPE, device=DEVICE, dtype=DTYPE, generator=g)


def measure(fn, xs, dy, n_fwd, n_bwd):
    """GB/s from CUDA-graph GPU times (fwd; fwd+bwd, bwd = difference), falling back to
    host-inclusive do_bench times (L2 flushed) where capture fails; both recorded."""
    nbytes = xs[0].numel() * xs[0].element_size()

    def fwd():
        return fn(*xs)

    def fwdbwd():
        return torch.autograd.grad(fn(*xs), xs, dy)

    t = {
        "fwd": time_graph_ms(fwd),
        "fwdbwd": time_graph_ms(fwdbwd),
        "fwd_launch": time_ms(fwd),
        "fwdbwd_launch": time_ms(fwdbwd),
    }
    out = {"timings": t}
    for kind, f_key, fb_key in (("", "fwd", "fwdbwd"), ("launch_", "fwd_launch", "fwdbwd_launch")):
        if "median_ms" in t[f_key] and "median_ms" in t[fb_key]:
            f = t[f_key]["median_ms"]
            b = max(t[fb_key]["median_ms"] - f, 1e-6)
            out.update(
                {
                    f"{kind}fwd_ms": f,
                    f"{kind}bwd_ms": b,
                    f"{kind}fwd_GBps": n_fwd * nbytes / f / 1e6,
                    f"{kind}bwd_GBps": n_bwd * nbytes / b / 1e6,
                }
            )
    if "fwd_GBps" not in out and "launch_fwd_GBps" in out:  # no graph: fall back
        out.update(fwd_GBps=out["launch_fwd_GBps"], bwd_GBps=out["launch_bwd_GBps"])
    return out


def check(ours, eager, xs, dy):
    y = ours(*xs)
    got = [y, *torch.autograd.grad(y, xs, dy)]
    xf = [x.detach().float().requires_grad_() for x in xs]
    yr = eager(*xf)
    want = [yr, *torch.autograd.grad(yr, xf, dy.float())]
    return [rel_err(a, e) for a, e in zip(got, want, strict=True)]


def sweep_swiglu(xs, dy):
    saved, out = dict(pointwise.TUNING), []
    for block in (1024, 2048, 4096, 8192):
        for warps in (4, 8, 16):
            pointwise.TUNING.update(block=block, warps=warps)
            r = measure(swiglu, xs, dy, 3, 5)
            out.append(
                {"block": block, "warps": warps, **{k: v for k, v in r.items() if k != "timings"}}
            )
    pointwise.TUNING.update(saved)
    return out


def run(out_path: str | Path, sweep: bool = False) -> Path:
    copy = copy_GBps()
    rows, checks, sweeps = [], {}, []
    for name, (ours, eager, n_in, n_fwd, n_bwd) in OPS.items():
        xs, dy = inputs(n_in)
        checks[name] = check(ours, eager, xs, dy)
        impls = {"gobrrr": ours, "eager": eager, "torch.compile": None}
        for impl, fn in impls.items():
            try:
                fn = fn or torch.compile(eager, dynamic=False)
                r = {"op": name, "impl": impl, **measure(fn, xs, dy, n_fwd, n_bwd)}
                if "fwd_GBps" in r:
                    r["fwd_vs_copy"] = r["fwd_GBps"] / copy["GBps"]
                    r["bwd_vs_copy"] = r["bwd_GBps"] / copy["GBps"]
                rows.append(r)
            except Exception as e:  # noqa: BLE001 - keep the other rows
                rows.append({"op": name, "impl": impl, "error": repr(e)[:300]})
        if sweep and name == "swiglu":
            sweeps = sweep_swiglu(xs, dy)
        del xs, dy
        torch.cuda.empty_cache()
    path = write_json(
        out_path,
        {
            "benchmark": "pointwise fwd/bwd bandwidth (minimal bytes)",
            "shape": SHAPE,
            "dtype": str(DTYPE),
            "tuning": dict(pointwise.TUNING),
            "copy": copy,
            "check_vs_fp32_rel_err": checks,
            "target_vs_copy": 0.9,
            "rows": rows,
            "sweep": sweeps,
        },
    )
    if sweeps:
        print(table(sweeps, ["block", "warps", "fwd_GBps", "bwd_GBps"]))
    print(f"device copy: {copy['GBps']:.0f} GB/s; correctness (rel. err y, grads):", checks)
    print(
        table(
            rows,
            [
                "op",
                "impl",
                "fwd_ms",
                "bwd_ms",
                "fwd_GBps",
                "bwd_GBps",
                "fwd_vs_copy",
                "bwd_vs_copy",
                "launch_fwd_GBps",
                "launch_bwd_GBps",
            ],
        )
    )
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    p.add_argument("--sweep", action="store_true", help="also sweep block size and warps")
    args = p.parse_args(argv)
    run(args.out, sweep=args.sweep)


if __name__ == "__main__":
    main()
