"""GPU checks of the measuring half (gobrrr.profile), through its public API.

1. calibration: `calibrate()` on this GPU, saved (the shipped H100 calibration comes from here);
2. cos_cos (examples/cos_cos.py): eager ops memory-bound, fusion finding, eager vs compiled;
3. GPT-2 124M, seq 256, bf16-mixed eager, batch 1/2/4/8: the scaling test says overhead-bound;
4. GPT-2 124M in fp32: the diagnosis says its matmuls are off the tensor cores;
5. GPT-2 124M bf16-mixed with its step graph: join fraction and predicted vs measured;
6. fixtures: small real traces (+ step graphs) for the CPU tests, in one .tar.gz.

    PYTHONPATH=src python benchmarks/suite/bench_profile_checks.py --out benchmarks/results

Every check is recorded in one JSON (with versions and GPU); a failing check records its
error and the others still run. A short table is printed last.
"""

from __future__ import annotations

import argparse
import gc
import gzip
import json
import shutil
import tarfile
import time
import traceback
from dataclasses import asdict
from pathlib import Path

import torch

from gobrrr.calibrate.api import calibrate
from gobrrr.models.registry import get_workload, load_workload
from gobrrr.profile import profile, scaling
from gobrrr.profile.api import environment

TINY = dict(n_layer=2, n_embd=128, n_head=4, vocab_size=1024, block_size=128)


def _free() -> None:
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def _ops(r, pred) -> list[dict]:
    keep = (
        "op",
        "phase",
        "module",
        "kernels",
        "device_s",
        "gap_s",
        "flops",
        "bytes",
        "flops_per_s",
        "bytes_per_s",
        "roofline",
        "regime",
        "math",
        "compiled",
    )
    return [{k: getattr(o, k) for k in keep} for o in r.ops if pred(o)]


def _summary(r) -> dict:
    return dict(
        step_s=r.step_s,
        step_min_s=r.step_min_s,
        step_max_s=r.step_max_s,
        tokens_per_s=r.tokens_per_s,
        mfu=r.mfu,
        hfu=r.hfu,
        idle_share=r.idle_share,
        peak_allocated=r.peak_allocated,
        kernels=r.kernels,
        kernels_attributed=r.kernels_attributed,
        graph_matched=r.graph_matched,
        phases=[asdict(g) for g in r.phases],
        kinds=[asdict(g) for g in r.kinds],
        diagnosis=[asdict(f) for f in r.diagnosis],
    )


def check_calibration(args) -> dict:
    cal = calibrate(args.device, save=Path(args.out) / "calibration.json")
    return asdict(cal)


def check_cos_cos(args) -> dict:
    spec = "examples/cos_cos.py:workload"
    eager = profile(load_workload(spec), args.device, "fp32", steps=10, warmup=3)
    _free()
    comp = profile(load_workload(spec), args.device, "fp32", steps=10, warmup=3, compile=True)
    _free()
    cos = [o for o in eager.ops if o.family == "cos"]
    fused = [o for o in comp.ops if o.phase == "forward" and o.op.startswith("compiled::")]
    eager_cos_s = sum(o.device_s for o in cos)
    fused_s = sum(o.device_s for o in fused)
    fusion = [asdict(f) for f in eager.diagnosis if f.kind == "fusion"]
    return dict(
        eager=_summary(eager),
        compiled=_summary(comp),
        eager_cos_ops=_ops(eager, lambda o: o.family == "cos"),
        compiled_forward_ops=_ops(comp, lambda o: o.phase == "forward"),
        eager_cos_s=eager_cos_s,
        compiled_forward_s=fused_s,
        fusion_measured=eager_cos_s / fused_s if fused_s else None,
        step_ratio=eager.step_s / comp.step_s,
        fusion_finding=fusion,
        cos_regimes=[o.regime for o in cos],
    )


def check_gpt2_scaling(args) -> dict:
    make = lambda b: get_workload("gpt2", batch_size=b, seq_len=256)
    # twice: the first pass also warms the process (cuDNN/cuBLAS plans, clocks); both kept
    passes = [
        scaling(make, 1, args.device, "bf16-mixed", steps=20, warmup=5, factors=(1, 2, 4, 8))
        for _ in range(2)
    ]
    s = passes[-1]
    _free()
    r = profile(make(1), args.device, "bf16-mixed", steps=10, warmup=3)
    _free()
    over = [asdict(f) for f in r.diagnosis if f.kind == "overhead"]
    regimes: dict[str, int] = {}
    for o in r.ops:
        regimes[o.regime] = regimes.get(o.regime, 0) + 1
    return dict(
        scaling=s.to_dict(),
        first_pass=passes[0].to_dict(),
        batch1=_summary(r),
        overhead_finding=over,
        op_regimes=regimes,
    )


def check_gpt2_fp32(args) -> dict:
    r = profile(
        get_workload("gpt2", batch_size=4, seq_len=1024), args.device, "fp32", steps=5, warmup=2
    )
    _free()
    mm = [o for o in r.ops if o.kind == "matmul"]
    t = sum(o.device_s for o in mm)
    fl = sum(o.flops for o in mm)
    return dict(
        summary=_summary(r),
        matmul_s=t,
        matmul_flops_per_s=fl / t if t else None,
        matmul_math=sorted({o.math for o in mm}),
        tensor_core_finding=[asdict(f) for f in r.diagnosis if f.kind == "tensor_cores"],
    )


def check_gpt2_compare(args) -> dict:
    from gobrrr.capture import capture
    from gobrrr.evaluate import evaluate
    from gobrrr.hardware import get_gpu
    from gobrrr.profile import compare

    make = lambda: get_workload("gpt2", batch_size=8, seq_len=1024)
    graph = capture(make, precision="bf16-mixed")
    r = profile(make(), args.device, "bf16-mixed", steps=10, warmup=3, graph=graph)
    _free()
    gpu = get_gpu(r.gpu or "h100")
    c = compare(evaluate(graph, gpu).time, r)
    top = sorted(r.ops, key=lambda o: -o.device_s)[:20]
    return dict(
        summary=_summary(r),
        compare=c.to_dict(),
        top_ops=_ops(r, lambda o: o in top),
        modules=[asdict(g) for g in r.modules],
    )


def check_variants(args) -> dict:
    """The other precisions and checkpointing on the tiny GPT: they run, phases are right."""
    out = {}
    for precision, ckpt in (
        ("fp16-mixed", "none"),
        ("bf16", "none"),
        ("tf32", "none"),
        ("bf16-mixed", "full"),
    ):
        r = profile(
            get_workload("gpt2", batch_size=4, seq_len=128, **TINY),
            args.device,
            precision,
            steps=3,
            warmup=2,
            checkpoint=ckpt,
        )
        _free()
        phases = {}
        for o in r.ops:
            phases[o.phase] = phases.get(o.phase, 0) + 1
        out[f"{precision}/{ckpt}"] = dict(
            step_s=r.step_s,
            phases=phases,
            attributed=r.kernels_attributed,
            kernels=r.kernels,
            matmul_math=sorted({o.math for o in r.ops if o.kind == "matmul"}),
        )
    return out


def record_fixtures(args) -> dict:
    """Small real traces for the CPU tests, with the step graph where one can be captured."""
    from gobrrr.capture import capture

    fx = Path(args.out) / "fixtures"
    fx.mkdir(parents=True, exist_ok=True)
    made = {}
    for name, precision in (("tiny_gpt_bf16", "bf16-mixed"), ("tiny_gpt_fp32", "fp32")):
        make = lambda: get_workload("gpt2", batch_size=4, seq_len=128, **TINY)
        graph = capture(make, precision=precision)
        r = profile(
            make(),
            args.device,
            precision,
            steps=5,
            warmup=2,
            graph=graph,
            trace_path=fx / f"{name}.json",
        )
        _free()
        (fx / f"{name}.graph.json").write_text(graph.to_json())
        (fx / f"{name}.result.json").write_text(r.to_json())
        made[name] = dict(
            kernels=r.kernels,
            attributed=r.kernels_attributed,
            graph_matched=r.graph_matched,
            step_s=r.step_s,
        )
    for name, comp in (("cos_cos_eager", False), ("cos_cos_compiled", True)):
        wl = load_workload("examples/cos_cos.py:workload")
        wl.batch = torch.rand(2**22)
        r = profile(
            wl, args.device, "fp32", steps=3, warmup=2, compile=comp, trace_path=fx / f"{name}.json"
        )
        (fx / f"{name}.result.json").write_text(r.to_json())
        made[name] = dict(kernels=r.kernels, attributed=r.kernels_attributed, step_s=r.step_s)
        _free()
    for p in fx.glob("*.json"):
        with open(p, "rb") as src, gzip.open(str(p) + ".gz", "wb", compresslevel=9) as dst:
            shutil.copyfileobj(src, dst)
        p.unlink()
    with tarfile.open(Path(args.out) / "fixtures.tar.gz", "w:gz") as tar:
        tar.add(fx, arcname="traces")
    shutil.rmtree(fx)
    return made


CHECKS = {
    "calibration": check_calibration,
    "fixtures": record_fixtures,
    "cos_cos": check_cos_cos,
    "gpt2_scaling": check_gpt2_scaling,
    "gpt2_fp32": check_gpt2_fp32,
    "gpt2_compare": check_gpt2_compare,
    "variants": check_variants,
}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="benchmarks/results")
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--only", nargs="*", default=list(CHECKS))
    ap.add_argument("--name", default="profile_checks_h100.json", help="result file name")
    args = ap.parse_args()
    Path(args.out).mkdir(parents=True, exist_ok=True)
    on_gpu = args.device.startswith("cuda")
    res: dict = {
        "env": environment(on_gpu, False),
        "device_name": torch.cuda.get_device_name() if on_gpu else "cpu",
        "checks": {},
    }
    if on_gpu:
        res["env"]["driver"] = _driver()
    for name in args.only:
        t0 = time.perf_counter()
        try:
            res["checks"][name] = CHECKS[name](args)
        except Exception as e:  # record and go on: one failing check must not hide the rest
            res["checks"][name] = {
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc(),
            }
            print(traceback.format_exc())
        res["checks"][name]["seconds"] = round(time.perf_counter() - t0, 1)
        print(f"[{name}] done in {res['checks'][name]['seconds']} s", flush=True)
        _free()
    path = Path(args.out) / args.name
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(res, indent=1, default=str))
    tmp.replace(path)
    print_table(res)


def _driver() -> str:
    import subprocess

    try:
        return subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return ""


def print_table(res: dict) -> None:
    c = res["checks"]
    rows = []
    if "calibration" in c and "error" not in c["calibration"]:
        cal = c["calibration"]
        mm = ", ".join(f"{k} {v / 1e12:.0f}" for k, v in cal["matmul_flops"].items())
        rows.append(("calibration TFLOP/s", mm))
        rows.append(
            (
                "calibration GB/s copy/pw/red",
                f"{cal['copy_bandwidth'] / 1e9:.0f} / {cal['pointwise_bandwidth'] / 1e9:.0f}"
                f" / {cal['reduction_bandwidth'] / 1e9:.0f}",
            )
        )
        rows.append(
            (
                "launch host / kernel us",
                f"{cal['launch_overhead'] * 1e6:.2f} / {cal['kernel_latency'] * 1e6:.2f}",
            )
        )
    if "cos_cos" in c and "error" not in c["cos_cos"]:
        cc = c["cos_cos"]
        rows.append(("cos_cos regimes", ", ".join(cc["cos_regimes"])))
        rows.append(
            (
                "cos_cos eager cos / fused fwd",
                f"{cc['eager_cos_s'] * 1e3:.3f} ms / "
                f"{cc['compiled_forward_s'] * 1e3:.3f} ms = {cc['fusion_measured']:.2f}x",
            )
        )
        rows.append(("cos_cos step eager / compiled", f"{cc['step_ratio']:.2f}x"))
    if "gpt2_scaling" in c and "error" not in c["gpt2_scaling"]:
        s = c["gpt2_scaling"]["scaling"]
        rows.append(("gpt2 S=256 scaling", s["summary"]))
    if "gpt2_fp32" in c and "error" not in c["gpt2_fp32"]:
        g = c["gpt2_fp32"]
        rows.append(
            (
                "gpt2 fp32 matmul TFLOP/s",
                f"{(g['matmul_flops_per_s'] or 0) / 1e12:.1f}"
                f" ({len(g['tensor_core_finding'])} tensor-core finding)",
            )
        )
    if "gpt2_compare" in c and "error" not in c["gpt2_compare"]:
        g = c["gpt2_compare"]
        st = g["compare"]["step"]
        rows.append(
            (
                "gpt2 B8 S1024 step pred/meas",
                f"{st['predicted_s'] * 1e3:.1f} / {st['measured_s'] * 1e3:.1f} ms, "
                f"joined {g['summary']['graph_matched']}",
            )
        )
    if "variants" in c and "error" not in c["variants"]:
        for k, v in c["variants"].items():
            if k != "seconds":
                rows.append(
                    (
                        f"tiny gpt {k}",
                        f"{v['step_s'] * 1e3:.2f} ms {v['phases']} {v['matmul_math']}",
                    )
                )
    for name, v in c.items():
        if "error" in v:
            rows.append((f"{name} FAILED", v["error"][:90]))
    print("\n== profile checks ==")
    for k, v in rows:
        print(f"{k:34s} {v}")


if __name__ == "__main__":
    main()
