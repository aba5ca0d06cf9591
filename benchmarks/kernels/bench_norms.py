"""RMSNorm / LayerNorm fwd, bwd and fwd+bwd bandwidth vs eager and torch.compile (bf16).

GB/s of the minimal bytes: fwd reads x, w (, b) and writes y; bwd reads x, dy, w, rstd (, mean)
and writes dx, dw (, db). Shapes 16384x4096 and 4096x16384. GPU time from CUDA-graph replays
(inputs are 2.5x the L2, so no flush); host-inclusive times (launch_*) are recorded beside.
Inputs come from a private generator; every timing failure is recorded, not raised.

    PYTHONPATH=src python benchmarks/kernels/bench_norms.py OUT.json [--sweep] \
        [--impls gobrrr eager]
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
    "rms_norm": {
        "gobrrr": lambda x, w, b=None: rms_norm(x, w, EPS),
        "eager": rms_eager,
        "compile_fn": rms_ref,
    },
    "layer_norm": {
        "gobrrr": lambda x, w, b=None: layer_norm(x, w, b, EPS),
        "eager": ln_eager,
        "compile_fn": ln_eager,
    },
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
        r.update(
            fwd_ms=f,
            bwd_ms=fwb - f,
            fwdbwd_ms=fwb,
            fwd_GBps=fb / f / 1e6,
            bwd_GBps=bb / (fwb - f) / 1e6,
            fwdbwd_GBps=(fb + bb) / fwb / 1e6,
        )
    if "median_ms" in t.get("fwd_launch", {}) and "median_ms" in t.get("fwdbwd_launch", {}):
        f, fwb = t["fwd_launch"]["median_ms"], t["fwdbwd_launch"]["median_ms"]
        r.update(launch_fwd_GBps=fb / f / 1e6, launch_fwdbwd_GBps=(fb + bb) / fwb / 1e6)
    return r


def sweep_configs(n: int) -> list[dict]:
    """norms.TUNING overrides to try at row width n: backward rows per program, warps, programs
    per SM, pipeline stages, columns per program of the dw (db) sums; for wide rows the tile held
    in 16 bits (bwd_keep16) at other warps and stages, and the fp32 paths it replaces (one read,
    or two: bwd_reload); a few forward block shapes."""
    if n >= 16384:
        bwd = [
            {"bwd_keep16": 0, "bwd_reload": 0},
            {"bwd_keep16": 0, "bwd_reload": 1},
            {"bwd_keep16": 0, "bwd_reload": 1, "bwd_warps": 16},
            {"bwd_keep16_warps_rms": 16, "bwd_keep16_warps_ln": 8},
            {"bwd_keep16_warps_rms": 32, "bwd_keep16_warps_ln": 32},
            {"bwd_stages": 1},
            {"sum_block_n": 64},
        ]
        fwd = []
    else:
        bwd = [
            {"bwd_elems": r * n, "bwd_warps": w, "bwd_stages": st}
            for r in (1, 2)
            for w in (4, 8)
            for st in (1, 3)
        ]
        bwd += [
            {"bwd_elems": n, "bwd_warps": 4, "bwd_per_sm": 2, "bwd_stages": 3},
            {"sum_block_n": 64},
            {"sum_block_n": 128},
        ]
        fwd = [{"fwd_elems": e, "fwd_warps": w} for e in (4096, 8192) for w in (4, 16)]
    return bwd + fwd


def _repeatable(norm, x, w, b, dy, times=3) -> bool:
    """Whether the gradients of `times` backward passes are bitwise equal (they must be: every
    sum is taken in a fixed order)."""
    params = [x, w] if norm == "rms_norm" else [x, w, b]
    runs = [torch.autograd.grad(IMPLS[norm]["gobrrr"](x, w, b), params, dy) for _ in range(times)]
    return all(torch.equal(a, c) for r in runs[1:] for a, c in zip(runs[0], r, strict=True))


def sweep_rows(norm, shape, x, w, b, dy):
    """Our kernels under several launch configurations (sweep_configs), GPU time from CUDA
    graphs; each row names the TUNING entries it changed."""
    saved, out = dict(norms.TUNING), []
    for cfg in sweep_configs(shape[1]):
        norms.TUNING.clear()
        norms.TUNING.update(saved, **cfg)
        try:
            errs = check(norm, x, w, b, dy)  # every configuration is checked, not only timed
            same = _repeatable(norm, x, w, b, dy)
            r = row(
                norm,
                "gobrrr",
                shape,
                measure(IMPLS[norm]["gobrrr"], norm, x, w, b, dy, launch=False),
            )
            t = norms.TUNING  # the effective values too, under the names older reports read
            out.append(
                {
                    "tuning": cfg,
                    "rows_per_prog": max(1, t["bwd_elems"] // shape[1]),
                    "warps": t["bwd_warps"],
                    "per_sm": t["bwd_per_sm"],
                    "stages": t["bwd_stages"],
                    "check_vs_fp32_rel_err": errs,
                    "bitwise_repeatable": same,
                    **{k: v for k, v in r.items() if k != "timings"},
                }
            )
        except Exception as e:  # noqa: BLE001 - one bad config must not end the sweep
            out.append({"norm": norm, "tuning": cfg, "error": repr(e)[:200]})
        print(
            norm,
            shape,
            cfg,
            {k: out[-1].get(k) for k in ("bwd_GBps", "fwdbwd_GBps", "bitwise_repeatable", "error")},
            flush=True,
        )
    norms.TUNING.clear()
    norms.TUNING.update(saved)
    return out


def run(
    out_path: str | Path,
    sweep: bool = False,
    impls: tuple[str, ...] = ("gobrrr", "eager", "torch.compile"),
    sweep_shapes: tuple[str, ...] = (),
) -> Path:
    rows, checks, sweeps = [], {}, []
    for shape in SHAPES:
        x, w, b, dy = make(*shape)
        for norm, fns in IMPLS.items():
            checks[f"{norm} {shape[0]}x{shape[1]}"] = check(norm, x, w, b, dy)
            for impl in impls:
                try:
                    fn = (
                        fns[impl]
                        if impl != "torch.compile"
                        else torch.compile(fns["compile_fn"], dynamic=False)
                    )
                    rows.append(row(norm, impl, shape, measure(fn, norm, x, w, b, dy)))
                except Exception as e:  # noqa: BLE001 - keep the other rows
                    rows.append({"norm": norm, "impl": impl, "error": repr(e)[:300]})
            if sweep and (not sweep_shapes or f"{shape[0]}x{shape[1]}" in sweep_shapes):
                sweeps += sweep_rows(norm, shape, x, w, b, dy)
        del x, w, b, dy
        torch.cuda.empty_cache()
    path = write_json(
        out_path,
        {
            "benchmark": "norms fwd/bwd bandwidth (minimal bytes)",
            "dtype": str(DTYPE),
            "shapes": SHAPES,
            "eps": EPS,
            "tuning": dict(norms.TUNING),
            "check_vs_fp32_rel_err": checks,
            "target_fwdbwd_GBps": 2850,
            "rows": rows,
            "sweep": sweeps,
        },
    )
    if sweeps:
        best = sorted((r for r in sweeps if "bwd_GBps" in r), key=lambda r: -r["bwd_GBps"])
        for r in best:
            r["tuning"] = " ".join(f"{k}={v}" for k, v in r["tuning"].items())
        print(table(best, ["norm", "shape", "tuning", "fwd_GBps", "bwd_GBps", "fwdbwd_GBps"]))
    print("correctness vs fp32 eager (rel. Frobenius error):", checks)
    print(
        table(
            rows,
            [
                "norm",
                "impl",
                "shape",
                "fwd_ms",
                "bwd_ms",
                "fwd_GBps",
                "bwd_GBps",
                "fwdbwd_GBps",
                "launch_fwd_GBps",
                "launch_fwdbwd_GBps",
            ],
        )
    )
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    p.add_argument("--sweep", action="store_true", help="also sweep launch configurations")
    p.add_argument(
        "--impls",
        nargs="+",
        default=["gobrrr", "eager", "torch.compile"],
        choices=["gobrrr", "eager", "torch.compile"],
        help="implementations to time",
    )
    p.add_argument(
        "--sweep-shapes", nargs="*", default=[], help="sweep only these shapes, e.g. 4096x16384"
    )
    args = p.parse_args(argv)
    run(args.out, sweep=args.sweep, impls=tuple(args.impls), sweep_shapes=tuple(args.sweep_shapes))


if __name__ == "__main__":
    main()
