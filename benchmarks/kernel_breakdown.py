"""Where a real step's GPU time goes, kernel by kernel (a diagnostic for the cost model).

    python benchmarks/kernel_breakdown.py OUT.json

For a few built-in workloads: one profiled steady-state step, the top kernels by total GPU
time, the sum of kernel time against the step's wall time (the rest is idle: host overhead),
and the number of ATen ops the host dispatched. Plus matmuls with the GPT-2 vocabulary
(50257, not a multiple of 8) against the padded 50304, to see what misalignment costs.
"""

from __future__ import annotations

import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.profile.runner import matmul_precision, prepare, run_step  # noqa: E402

CASES = [("gpt2", 16, 1024, "bf16-mixed"), ("gpt2", 16, 1024, "fp32"), ("gpt2", 1, 256,
         "bf16-mixed"), ("convnet", 64, None, "bf16-mixed"), ("llama3-1b", 1, 2048, "bf16-mixed")]


def breakdown(name, batch, seq, precision) -> dict:
    with torch.device("cuda"):
        wl = get_workload(name, batch_size=batch, seq_len=seq)
    wl, opt, scaler = prepare(wl, "cuda", precision)
    with matmul_precision(precision):
        for _ in range(3):
            run_step(wl, opt, precision, scaler)
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        run_step(wl, opt, precision, scaler)
        b.record()
        b.synchronize()
        wall = a.elapsed_time(b) * 1e-3
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            run_step(wl, opt, precision, scaler)
            torch.cuda.synchronize()
    kernels: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    aten_ops = 0
    for e in prof.events():
        if e.device_type == torch.autograd.DeviceType.CUDA:
            k = kernels[e.name[:90]]
            k[0] += e.device_time_total * 1e-6 if hasattr(e, "device_time_total") else 0
            k[1] += 1
        elif e.name.startswith("aten::"):
            aten_ops += 1
    total = sum(v[0] for v in kernels.values())
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:25]
    return {"case": [name, batch, seq, precision], "step_s": wall, "kernel_s": total,
            "kernels": sum(v[1] for v in kernels.values()), "aten_events": aten_ops,
            "top": [{"kernel": k, "s": v[0], "n": v[1]} for k, v in top]}


def alignment() -> list[dict]:
    from triton.testing import do_bench

    out = []
    for v in (50257, 50304):
        for dt in (torch.bfloat16, torch.float32):
            x = torch.randn(16384, 768, device="cuda", dtype=dt)
            w = torch.randn(v, 768, device="cuda", dtype=dt)
            g = torch.randn(16384, v, device="cuda", dtype=dt)
            flops = 2 * 16384 * 768 * v
            for what, fn in (("x@w.T", lambda x=x, w=w: x @ w.t()),
                             ("g@w", lambda g=g, w=w: g @ w),
                             ("g.T@x", lambda g=g, x=x: g.t() @ x)):
                ms = do_bench(fn, return_mode="median")
                out.append({"vocab": v, "dtype": str(dt), "op": what, "ms": ms,
                            "tflops": flops / ms / 1e9})
    return out


def main() -> None:
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": []}
    for case in CASES:
        r = breakdown(*case)
        out["cases"].append(r)
        print(f"{case}: step {r['step_s'] * 1e3:.2f} ms, kernels {r['kernel_s'] * 1e3:.2f} ms "
              f"({r['kernels']} launches), aten events {r['aten_events']}")
        for t in r["top"][:12]:
            print(f"   {t['s'] * 1e3:8.3f} ms  x{t['n']:<5} {t['kernel']}")
        torch.cuda.empty_cache()
    out["alignment"] = alignment()
    for a in out["alignment"]:
        print(f"vocab {a['vocab']} {a['dtype']:15s} {a['op']:6s} {a['ms']:.3f} ms "
              f"{a['tflops']:.0f} TFLOP/s")
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
