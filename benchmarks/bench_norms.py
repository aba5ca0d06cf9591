"""RMSNorm / LayerNorm fwd, bwd and fwd+bwd bandwidth vs eager and torch.compile (bf16).

GB/s of the minimal bytes: fwd reads x, w (, b) and writes y; bwd reads x, dy, w, rstd (, mean)
and writes dx, dw (, db). Shapes 16384x4096 and 4096x16384. GPU time from CUDA-graph replays
(inputs are 2.5x the L2, so no flush); host-inclusive times (launch_*) are recorded beside.
Inputs come from a private generator; every timing failure is recorded, not raised.

    PYTHONPATH=src python benchmarks/bench_norms.py OUT.json [--sweep]
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F

from gobrrr.kernels import layer_norm, norms, rms_norm
from gobrrr.kernels.bench import generator, rel_err, table, time_graph_ms, time_ms, write_json

DEVICE = "cuda"  # the benchmarks need a GPU; a CPU dry run may override this

SHAPES = [(16384, 4096), (4096, 16384)]
DTYPE = torch.bfloat16
EPS = 1e-6


def rms_ref(x, w, b=None):
    xf = x.float()
    return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + EPS) * w.float()).to(x.dtype)


def rms_eager(x, w, b=None):
    return F.rms_norm(x, (x.shape[-1],), w, EPS)


def ln_eager(x, w, b=None):
    return F.layer_norm(x, (x.shape[-1],), w, b, EPS)


IMPLS = {
    "rms_norm": {"gobrrr": lambda x, w, b=None: rms_norm(x, w, EPS), "eager": rms_eager,
                 "compile_fn": rms_ref},
    "layer_norm": {"gobrrr": lambda x, w, b=None: layer_norm(x, w, b, EPS), "eager": ln_eager,
                   "compile_fn": ln_eager},
}


def minimal_bytes(norm, m, n, s=2):
    """Bytes the op must move: (fwd, bwd). s = bytes per element of x, w, b."""
    stats = 4 * m * (1 if norm == "rms_norm" else 2)  # rstd (+ mean), fp32
    params = n * s * (1 if norm == "rms_norm" else 2)  # w (+ b)
    fwd = 2 * m * n * s + params  # x, w, (b) -> y
    bwd = 3 * m * n * s + n * s + stats + params  # x, dy, w, stats -> dx, dw, (db)
    return fwd, bwd


def make(m, n):
    g = generator(0, DEVICE)
    x = torch.randn(m, n, device=DEVICE, dtype=DTYPE, generator=g).requires_grad_()
    w = (1 + 0.1 * torch.randn(n, device=DEVICE, generator=g)).to(DTYPE).requires_grad_()
    b = (0.1 * torch.randn(n, device=DEVICE, generator=g)).to(DTYPE).requires_grad_()
    dy = torch.randn(m, n, device=DEVICE, dtype=DTYPE, generator=g)
    return x, w, b, dy


def measure(fn, norm, x, w, b, dy, launch=True):
    """Times in ms. GPU time from CUDA-graph replays (fwd, and fwd+bwd in one graph; bwd is the
    difference); with launch=True also host-inclusive times without a graph (L2 flushed)."""
    params = [x, w] if norm == "rms_norm" else [x, w, b]

    def fwd():
        return fn(x, w, b)

    def fwdbwd():
        return torch.autograd.grad(fn(x, w, b), params, dy)

    out = {"fwd": time_graph_ms(fwd), "fwdbwd": time_graph_ms(fwdbwd)}
    if launch:
        out.update(fwd_launch=time_ms(fwd), fwdbwd_launch=time_ms(fwdbwd))
    return out


def check(norm, x, w, b, dy):
    params = [x, w] if norm == "rms_norm" else [x, w, b]
    ref_fn = rms_eager if norm == "rms_norm" else ln_eager
    outs = []
    for fn in (IMPLS[norm]["gobrrr"], ref_fn):
        y = fn(x.float(), w.float(), b.float()) if fn is ref_fn else fn(x, w, b)
        outs.append([y, *torch.autograd.grad(y, params, dy.float() if fn is ref_fn else dy)])
    return {k: rel_err(a, e) for k, a, e in zip(["y", "dx", "dw", "db"], *outs, strict=False)}


def row(norm, impl, shape, t):
    fb, bb = minimal_bytes(norm, *shape)
    r = {"norm": norm, "impl": impl, "shape": f"{shape[0]}x{shape[1]}", "timings": t}
    if "median_ms" in t["fwd"] and "median_ms" in t["fwdbwd"]:
        f, fwb = t["fwd"]["median_ms"], max(t["fwdbwd"]["median_ms"], t["fwd"]["median_ms"] + 1e-6)
        r.update(fwd_ms=f, bwd_ms=fwb - f, fwdbwd_ms=fwb, fwd_GBps=fb / f / 1e6,
                 bwd_GBps=bb / (fwb - f) / 1e6, fwdbwd_GBps=(fb + bb) / fwb / 1e6)
    if "median_ms" in t.get("fwd_launch", {}) and "median_ms" in t.get("fwdbwd_launch", {}):
        f, fwb = t["fwd_launch"]["median_ms"], t["fwdbwd_launch"]["median_ms"]
        r.update(launch_fwd_GBps=fb / f / 1e6, launch_fwdbwd_GBps=(fb + bb) / fwb / 1e6)
    return r


def sweep_rows(norm, shape, x, w, b, dy):
    """Our backward under several launch configurations (rows per program, warps, programs
    per SM, pipeline stages of the row loop), GPU time from CUDA graphs."""
    saved, out = dict(norms.TUNING), []
    n = shape[1]
    if n >= 16384:
        configs = [(1, wp, p, st) for wp in (8, 16, 32) for p in (1, 2, 4) for st in (1, 2)]
    else:
        configs = [(r, wp, p, st) for r in (1, 2) for wp in (4, 8) for p in (2, 4, 8)
                   for st in (1, 3)] + [(2, 8, 1, 1), (2, 8, 1, 3)]
    for rows, warps, per_sm, stages in configs:
        norms.TUNING.update(bwd_elems=rows * n, bwd_warps=warps, bwd_per_sm=per_sm,
                            bwd_stages=stages)
        cfg = {"rows_per_prog": rows, "warps": warps, "per_sm": per_sm, "stages": stages}
        try:
            r = row(norm, "gobrrr", shape, measure(IMPLS[norm]["gobrrr"], norm, x, w, b, dy,
                                                   launch=False))
            out.append({**cfg, **{k: v for k, v in r.items() if k != "timings"}})
        except Exception as e:  # noqa: BLE001 - one bad config must not end the sweep
            out.append({"norm": norm, **cfg, "error": repr(e)[:200]})
    norms.TUNING.clear()
    norms.TUNING.update(saved)
    return out


def run(out_path: str | Path, sweep: bool = False) -> Path:
    rows, checks, sweeps = [], {}, []
    for shape in SHAPES:
        x, w, b, dy = make(*shape)
        for norm, impls in IMPLS.items():
            checks[f"{norm} {shape[0]}x{shape[1]}"] = check(norm, x, w, b, dy)
            for impl in ("gobrrr", "eager", "torch.compile"):
                try:
                    fn = impls[impl] if impl != "torch.compile" else torch.compile(
                        impls["compile_fn"], dynamic=False)
                    rows.append(row(norm, impl, shape, measure(fn, norm, x, w, b, dy)))
                except Exception as e:  # noqa: BLE001 - keep the other rows
                    rows.append({"norm": norm, "impl": impl, "error": repr(e)[:300]})
            if sweep and norm == "rms_norm":
                sweeps += sweep_rows(norm, shape, x, w, b, dy)
        del x, w, b, dy
        torch.cuda.empty_cache()
    path = write_json(out_path, {
        "benchmark": "norms fwd/bwd bandwidth (minimal bytes)",
        "dtype": str(DTYPE), "shapes": SHAPES, "eps": EPS, "tuning": dict(norms.TUNING),
        "check_vs_fp32_rel_err": checks, "target_fwdbwd_GBps": 2850, "rows": rows,
        "sweep": sweeps,
    })
    if sweeps:
        best = sorted((r for r in sweeps if "bwd_GBps" in r), key=lambda r: -r["bwd_GBps"])
        print(table(best[:10], ["shape", "rows_per_prog", "warps", "per_sm", "stages",
                                "bwd_GBps", "fwdbwd_GBps"]))
    print("correctness vs fp32 eager (rel. Frobenius error):", checks)
    print(table(rows, ["norm", "impl", "shape", "fwd_ms", "bwd_ms", "fwd_GBps", "bwd_GBps",
                       "fwdbwd_GBps", "launch_fwd_GBps", "launch_fwdbwd_GBps"]))
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    p.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    args = p.parse_args(argv)
    run(args.out, sweep=args.sweep)


if __name__ == "__main__":
    main()
