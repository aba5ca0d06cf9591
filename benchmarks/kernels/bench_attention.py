"""Attention benchmark: gobrrr's Triton flash attention vs PyTorch SDPA backends on one GPU.

FlashAttention protocol (BENCHMARKS.md item 5): 16k tokens (B*S = 16384), hidden 2048 (H=32 at
D=64, H=16 at D=128), S in 512..16384, causal and not, bf16. FLOPs: forward 4*B*S^2*H*D (halved
for causal), backward 2.5x forward, forward+backward 3.5x. Times: triton.testing.do_bench median
(L2 flushed between reps), all backends in one process. Before timing: odd-shape correctness
checks against an fp32 reference (run in worker processes, which also warm Triton's compile cache
in parallel), then each benchmark shape is checked against SDPA's flash backend.

    PYTHONPATH=src python benchmarks/kernels/bench_attention.py OUT.json [--quick] [--experiments]
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import multiprocessing as mp
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor

import torch
import torch.nn.functional as F
import triton

from gobrrr.kernels import _attention_bwd as kb
from gobrrr.kernels import _attention_fwd as kf
from gobrrr.kernels.attention import attention

TOKENS, HIDDEN = 16384, 2048
SEQS = (512, 1024, 2048, 4096, 8192, 16384)
DTYPE = torch.bfloat16
REL_TOL = {torch.bfloat16: 1e-2, torch.float16: 2e-3}  # ||got - ref|| / ||ref||
T0 = time.time()


def log(msg: str) -> None:
    print(f"[{time.time() - T0:6.1f}s] {msg}", flush=True)


def environment() -> dict:
    props = torch.cuda.get_device_properties(0)
    try:
        driver = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=20,
        ).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "unknown"
    return dict(
        gpu=props.name,
        memory_gib=round(props.total_memory / 2**30, 1),
        sms=props.multi_processor_count,
        driver=driver,
        cuda=torch.version.cuda,
        torch=torch.__version__,
        triton=triton.__version__,
        python=sys.version.split()[0],
        date=datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    )


# ----------------------------------------------------------------------------- worker jobs
def _rand(shape, dtype, seed):
    g = torch.Generator(device="cuda").manual_seed(seed)
    return torch.randn(shape, device="cuda", dtype=torch.float32, generator=g).to(dtype)


def compile_job(kind: str, d: int, causal: bool, c: tuple) -> str:
    """Compile (by running once on small inputs) one kernel at one config; warms the cache."""
    config = kf.cfg(*c)
    b, h, s = 1, 2, 256  # same divisibility specialisation as the benchmark shapes
    q, k, v, do = (_rand((b, h, s, d), DTYPE, i) for i in range(4))
    lse = torch.zeros((b, h, s), device="cuda")
    if kind == "fwd":
        kf.attention_forward(q, k, v, causal, d**-0.5, config)
    elif kind == "dkdv":
        kb.bwd_dkdv(do, q, k, v, lse, lse, causal, d**-0.5, config=config)
    elif kind == "dkdv_atomic":
        kb.bwd_dkdv(
            do,
            q,
            k,
            v,
            lse,
            lse,
            causal,
            d**-0.5,
            config=config,
            dq_acc=torch.zeros(q.shape, device="cuda"),
        )
    elif kind == "dq":
        kb.bwd_dq(do, q, k, v, q, lse, causal, d**-0.5, config=config)
    else:
        kb.bwd_preprocess(q, do)
    torch.cuda.synchronize()
    return f"{kind} d{d} c{int(causal)} {c}"


def _reference(q, k, v, causal, scale):
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, 1), v.repeat_interleave(group, 1)
    s = (q @ k.transpose(-1, -2)) * scale
    if causal:
        s = s.masked_fill(
            ~torch.ones(s.shape[-2:], dtype=torch.bool, device=s.device).tril(), float("-inf")
        )
    return torch.softmax(s, -1) @ v


def check_job(case: dict, pick: int) -> dict:
    """One odd-shape case against the fp32 reference, autotuning pinned to config #pick."""
    for name in ("fwd_configs", "dkdv_configs", "dq_configs"):
        mod = kf if name == "fwd_configs" else kb
        full = getattr(mod, name)
        setattr(mod, name, lambda bd, f=full: [f(bd)[pick % len(f(bd))]])
    dtype = getattr(torch, case["dtype"])
    b, h, hkv, s_q, s_k, d = (case[x] for x in ("B", "H", "Hkv", "S_q", "S_k", "D"))
    q = _rand((b, s_q, h, d), dtype, 1).transpose(1, 2)  # non-contiguous, as from a projection
    k = _rand((b, s_k, hkv, d), dtype, 2).transpose(1, 2)
    v = _rand((b, hkv, s_k, d), dtype, 3)
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    do = _rand(q.shape, dtype, 4)
    out = attention(q, k, v, causal=case["causal"])
    grads = torch.autograd.grad(out, (q, k, v), do)
    if case.get("atomic"):
        o2, lse = torch.ops.gobrrr.attention_fwd(q, k, v, case["causal"], d**-0.5)
        grads = kb.attention_backward(do, q, k, v, o2, lse, case["causal"], d**-0.5, "atomic")
    r = [t.detach().float().requires_grad_() for t in (q, k, v)]
    ref = _reference(*r, case["causal"], d**-0.5)
    ref_grads = torch.autograd.grad(ref, r, do.float())
    errs, max_abs = {}, {}
    for n, g, w in zip(("out", "dq", "dk", "dv"), (out, *grads), (ref, *ref_grads), strict=True):
        # relative to ||ref||, or to sqrt(numel) (an RMS error) where the true value is ~0,
        # as dq and dk are at S_k = 1
        denom = max(w.norm().item(), 1e-3 * w.numel() ** 0.5) if w.numel() else 1.0
        errs[n] = (g.float() - w).norm().item() / denom
        max_abs[n] = (g.float() - w).abs().max().item()
    ok = all(e < REL_TOL[dtype] for e in errs.values())
    return dict(case, rel_err=errs, max_abs_err=max_abs, ok=ok, config_index=pick)


CHECKS = [
    dict(B=2, H=4, Hkv=2, S_q=1000, S_k=1000, D=128, causal=True, dtype="bfloat16"),
    dict(B=1, H=4, Hkv=1, S_q=777, S_k=777, D=40, causal=False, dtype="bfloat16"),
    dict(B=2, H=8, Hkv=8, S_q=513, S_k=1025, D=96, causal=False, dtype="float16"),
    dict(B=1, H=4, Hkv=4, S_q=2048, S_k=2048, D=64, causal=True, dtype="float16"),
    dict(B=3, H=6, Hkv=2, S_q=1, S_k=1, D=64, causal=True, dtype="bfloat16"),
    dict(B=1, H=2, Hkv=2, S_q=4097, S_k=4097, D=128, causal=True, dtype="bfloat16"),
    dict(B=2, H=4, Hkv=4, S_q=300, S_k=300, D=128, causal=False, dtype="float16"),
    dict(B=1, H=8, Hkv=2, S_q=1536, S_k=1536, D=64, causal=False, dtype="bfloat16"),
    dict(B=1, H=4, Hkv=2, S_q=640, S_k=640, D=128, causal=True, dtype="bfloat16", atomic=True),
    dict(B=1, H=4, Hkv=4, S_q=1000, S_k=1000, D=64, causal=False, dtype="bfloat16", atomic=True),
]


def compile_jobs(heads: tuple[int, ...], experiments: bool) -> list[tuple]:
    jobs = [("pre", d, False, (64, 64, 4, 1)) for d in heads]
    for d in heads:
        for causal in (False, True):
            lists = [
                ("fwd", kf.fwd_configs(d)),
                ("dkdv", kb.dkdv_configs(d)),
                ("dq", kb.dq_configs(d)),
            ]
            if experiments:
                lists.append(("dkdv_atomic", kb.dkdv_atomic_configs(d)))
            for kind, configs in lists:
                jobs += [
                    (
                        kind,
                        d,
                        causal,
                        (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages),
                    )
                    for c in configs
                ]
    return jobs


def warm_and_check(heads, experiments: bool, workers: int) -> list[dict]:
    """Compile every benchmark kernel config and run the odd-shape checks, in parallel."""
    ctx = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        checks = [pool.submit(check_job, c, i) for i, c in enumerate(CHECKS)]
        compiled = [pool.submit(compile_job, *j) for j in compile_jobs(heads, experiments)]
        for f in compiled:
            try:
                f.result()
            except Exception as e:  # a config that fails to compile is reported, not fatal
                log(f"compile failed: {e!r}"[:300])
        results = []
        for f in checks:
            try:
                results.append(f.result())
            except Exception as e:
                results.append(dict(ok=False, error=repr(e)[:500]))
    return results


# ----------------------------------------------------------------------------- timing
def bench(fn) -> dict:
    med, lo, hi = triton.testing.do_bench(fn, warmup=25, rep=100, quantiles=[0.5, 0.2, 0.8])
    return dict(ms=med, p20=lo, p80=hi)


def sdpa(backend, causal):
    from torch.nn.attention import SDPBackend, sdpa_kernel

    be = getattr(SDPBackend, backend)

    def f(q, k, v):
        with sdpa_kernel(be):
            return F.scaled_dot_product_attention(q, k, v, is_causal=causal)

    return f


def time_impl(f, q, k, v, do, flops_fwd) -> dict:
    out = f(q, k, v)
    r = dict(
        fwd=bench(lambda: f(q, k, v)),
        bwd=bench(lambda: torch.autograd.grad(out, (q, k, v), do, retain_graph=True)),
        fwd_bwd=bench(lambda: torch.autograd.grad(f(q, k, v), (q, k, v), do)),
    )
    for phase, mult in (("fwd", 1.0), ("bwd", 2.5), ("fwd_bwd", 3.5)):
        r[phase]["tflops"] = mult * flops_fwd / (r[phase]["ms"] * 1e-3) / 1e12
    return r


def best_configs(d: int, causal: bool, s: int) -> dict:
    """The configs the autotuner chose for this shape, by kernel."""
    key = (d, causal, kf.seq_bucket(s), DTYPE)
    return {tag: str(c) for (tag, k), c in kf.BEST.items() if k == key}


def run_shape(d: int, causal: bool, s: int) -> dict:
    b, h = TOKENS // s, HIDDEN // d
    q, k, v = (_rand((b, h, s, d), DTYPE, i).requires_grad_() for i in range(3))
    do = _rand((b, h, s, d), DTYPE, 3)
    flops = 4.0 * b * s * s * h * d * (0.5 if causal else 1.0)
    res = dict(D=d, causal=causal, S=s, B=b, H=h, dtype=str(DTYPE), flops_fwd=flops)
    ours = lambda q, k, v: attention(q, k, v, causal=causal)  # noqa: E731
    o = ours(q, k, v)
    g = torch.autograd.grad(o, (q, k, v), do)
    ref_o = sdpa("FLASH_ATTENTION", causal)(q, k, v)
    ref_g = torch.autograd.grad(ref_o, (q, k, v), do)
    res["max_abs_err_vs_sdpa_flash"] = {
        n: (a.float() - b_.float()).abs().max().item()
        for n, a, b_ in zip(("out", "dq", "dk", "dv"), (o, *g), (ref_o, *ref_g), strict=True)
    }
    impls = dict(
        ours=ours,
        sdpa_flash=sdpa("FLASH_ATTENTION", causal),
        sdpa_cudnn=sdpa("CUDNN_ATTENTION", causal),
        sdpa_efficient=sdpa("EFFICIENT_ATTENTION", causal),
    )
    for name, f in impls.items():
        try:
            res[name] = time_impl(f, q, k, v, do, flops)
        except Exception as e:  # e.g. a backend that does not support the shape
            res[name] = dict(error=repr(e)[:300])
    res["configs"] = best_configs(d, causal, s)
    res["phases_ms"] = phases(q, k, v, do, causal)
    return res


def phases(q, k, v, do, causal) -> dict:
    """Ours, kernel by kernel (autotuned configs): forward, dQ (+ delta), dK/dV."""
    scale = q.shape[-1] ** -0.5
    q, k, v = q.detach(), k.detach(), v.detach()
    out, lse = kf.attention_forward(q, k, v, causal, scale)
    _, delta = kb.bwd_dq(do, q, k, v, out, lse, causal, scale)
    return dict(
        fwd=bench(lambda: kf.attention_forward(q, k, v, causal, scale))["ms"],
        dq_delta=bench(lambda: kb.bwd_dq(do, q, k, v, out, lse, causal, scale))["ms"],
        dkdv=bench(lambda: kb.bwd_dkdv(do, q, k, v, lse, delta, causal, scale))["ms"],
    )


def experiment_shape(d: int, causal: bool, s: int) -> dict:
    """Every config of every kernel, alone, and the atomic-dQ backward, at one shape."""
    b, h = TOKENS // s, HIDDEN // d
    q, k, v, do = (_rand((b, h, s, d), DTYPE, i) for i in range(4))
    scale = d**-0.5
    o, lse = kf.attention_forward(q, k, v, causal, scale)
    _, delta = kb.bwd_dq(do, q, k, v, o, lse, causal, scale)
    row = dict(D=d, causal=causal, S=s)
    runs = dict(
        fwd=(kf.fwd_configs(d), lambda c: kf.attention_forward(q, k, v, causal, scale, c)),
        dkdv=(
            kb.dkdv_configs(d),
            lambda c: kb.bwd_dkdv(do, q, k, v, lse, delta, causal, scale, config=c),
        ),
        dq=(kb.dq_configs(d), lambda c: kb.bwd_dq(do, q, k, v, o, lse, causal, scale, config=c)),
        dkdv_atomic=(
            kb.dkdv_atomic_configs(d),
            lambda c: kb.bwd_dkdv(
                do,
                q,
                k,
                v,
                lse,
                delta,
                causal,
                scale,
                config=c,
                dq_acc=torch.zeros(q.shape, device="cuda"),
            ),
        ),
    )
    for kind, (configs, fn) in runs.items():
        row[kind] = {}
        for c in configs:
            key = f"{c.kwargs['BLOCK_M']}x{c.kwargs['BLOCK_N']} w{c.num_warps} s{c.num_stages}"
            try:
                row[kind][key] = bench(lambda c=c, fn=fn: fn(c))["ms"]
            except Exception as e:
                row[kind][key] = repr(e)[:200]
    for mode in ("separate", "atomic"):
        row[f"backward_{mode}_ms"] = bench(
            lambda m=mode: kb.attention_backward(do, q, k, v, o, lse, causal, scale, dq_mode=m)
        )["ms"]
    return row


class _NoDispatch(torch.autograd.Function):
    """Our kernels under autograd without the custom-op dispatch (host-time diagnosis only)."""

    @staticmethod
    def forward(ctx, q, k, v):
        out, lse = kf.attention_forward(q, k, v, True, q.shape[-1] ** -0.5)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, do):
        q, k, v, out, lse = ctx.saved_tensors
        return kb.attention_backward(do, q, k, v, out, lse, True, q.shape[-1] ** -0.5)


def _host_us(fn, n: int) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(n):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / n * 1e6


def host_diagnostics(n: int = 300) -> dict:
    """Wall time per call at a tiny causal shape (1x1x128x64), where the GPU waits on the host:
    the host (Python, dispatch, launch) time of each layer of our path, in microseconds."""
    import cProfile
    import gc
    import io
    import pstats

    q, k, v = (_rand((1, 1, 128, 64), DTYPE, i).requires_grad_() for i in range(3))
    do = _rand((1, 1, 128, 64), DTYPE, 3)
    qd, kd, vd = q.detach(), k.detach(), v.detach()
    flash = sdpa("FLASH_ATTENTION", True)
    out, lse = kf.attention_forward(qd, kd, vd, True, 0.125)
    runs = dict(
        public_fwd_bwd=lambda: torch.autograd.grad(attention(q, k, v, causal=True), (q, k, v), do),
        no_op_dispatch_fwd_bwd=lambda: torch.autograd.grad(
            _NoDispatch.apply(q, k, v), (q, k, v), do
        ),
        launchers_fwd_bwd=lambda: kb.attention_backward(
            do, qd, kd, vd, *kf.attention_forward(qd, kd, vd, True, 0.125), True, 0.125
        ),
        launcher_fwd=lambda: kf.attention_forward(qd, kd, vd, True, 0.125),
        launcher_dq=lambda: kb.bwd_dq(do, qd, kd, vd, out, lse, True, 0.125),
        sdpa_flash_fwd_bwd=lambda: torch.autograd.grad(flash(q, k, v), (q, k, v), do),
    )
    res = {name: _host_us(fn, n) for name, fn in runs.items()}
    attn_mod = sys.modules["gobrrr.kernels.attention"]  # the module; the package exports the fn
    direct = attn_mod._direct
    attn_mod._direct = lambda t: False  # every call through the ops, as under a tracer
    try:
        res["public_fwd_bwd_via_ops"] = _host_us(runs["public_fwd_bwd"], n)
    finally:
        attn_mod._direct = direct
    gc.disable()
    res["public_fwd_bwd_gc_off"] = _host_us(runs["public_fwd_bwd"], n)
    gc.enable()
    prof = cProfile.Profile()
    prof.enable()
    for _ in range(200):
        runs["public_fwd_bwd"]()
    prof.disable()
    torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
    res["profile_public_fwd_bwd_200_calls"] = text.getvalue()[-6000:]
    return res


def _tflops(r: dict, name: str, phase: str = "fwd_bwd") -> float:
    return r.get(name, {}).get(phase, {}).get("tflops", math.nan)


def table(rows) -> str:
    head = (
        f"{'D':>4} {'causal':>6} {'S':>6} | {'ours fwd':>8} {'bwd':>6} {'f+b':>6} | "
        f"{'flash f+b':>9} {'cudnn f+b':>9} {'eff f+b':>8} | {'/flash':>6} {'/cudnn':>6}"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        o, fl, cu = (_tflops(r, n) for n in ("ours", "sdpa_flash", "sdpa_cudnn"))
        lines.append(
            f"{r['D']:>4} {str(r['causal']):>6} {r['S']:>6} | {_tflops(r, 'ours', 'fwd'):8.0f} "
            f"{_tflops(r, 'ours', 'bwd'):6.0f} {o:6.0f} | {fl:9.0f} {cu:9.0f} "
            f"{_tflops(r, 'sdpa_efficient'):8.0f} | {o / fl:6.2f} {o / cu:6.2f}"
        )
    return "\n".join(lines)


def _md_main(r: dict) -> list[str]:
    env = r["env"]
    lines = [
        f"{env['gpu']}, driver {env['driver']}, CUDA {env['cuda']}, torch {env['torch']}, "
        f"triton {env['triton']}, {env['date'][:10]}; bf16, B*S = {TOKENS}, hidden "
        f"{HIDDEN}; TFLOP/s in the FlashAttention convention; do_bench medians.",
        "",
        "| D | causal | S | ours fwd | ours bwd | ours f+b | SDPA flash f+b | cuDNN f+b "
        "| efficient f+b | ours/flash | ours/cuDNN |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    ratios = {64: [], 128: []}
    for x in r["shapes"]:
        o, fl, cu = (_tflops(x, n) for n in ("ours", "sdpa_flash", "sdpa_cudnn"))
        ratios[x["D"]].append((o / fl, o / cu))
        lines.append(
            f"| {x['D']} | {'yes' if x['causal'] else 'no'} | {x['S']} "
            f"| {_tflops(x, 'ours', 'fwd'):.0f} | {_tflops(x, 'ours', 'bwd'):.0f} | {o:.0f} "
            f"| {fl:.0f} | {cu:.0f} | {_tflops(x, 'sdpa_efficient'):.0f} | {o / fl:.2f} "
            f"| {o / cu:.2f} |"
        )
    lines.append("")
    for d, rs in ratios.items():
        fl, cu = [a for a, _ in rs], [b for _, b in rs]
        lines.append(
            f"- D={d}: ours/flash fwd+bwd {min(fl):.2f}-{max(fl):.2f}x, ours/cuDNN "
            f"{min(cu):.2f}-{max(cu):.2f}x over the 12 shapes."
        )
    return lines


def _md_phases(r: dict) -> list[str]:
    """Kernel times; 'matmul' TFLOP/s counts the matmuls each kernel really does (forward 2,
    dK/dV 4, dQ 3 of size S*S*D per head), unlike the 2.5x backward convention."""
    lines = [
        "| D | causal | S | fwd ms | dQ+delta ms | dK/dV ms | fwd matmul TFLOP/s "
        "| dQ matmul TFLOP/s | dK/dV matmul TFLOP/s | fwd / dQ / dK/dV config |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for x in r["shapes"]:
        ph, f = x["phases_ms"], x["flops_fwd"]
        cfgs = " / ".join(
            x["configs"]
            .get(t, "?")
            .split(", num_ctas")[0]
            .replace("BLOCK_M: ", "")
            .replace(", BLOCK_N: ", "x")
            .replace(", num_warps: ", " w")
            + " s"
            + x["configs"].get(t, "num_stages: ?").split("num_stages: ")[1][0]
            for t in ("fwd", "dq", "dkdv")
        )
        lines.append(
            f"| {x['D']} | {'yes' if x['causal'] else 'no'} | {x['S']} | {ph['fwd']:.3f} "
            f"| {ph['dq_delta']:.3f} | {ph['dkdv']:.3f} | {f / ph['fwd'] / 1e9:.0f} "
            f"| {1.5 * f / ph['dq_delta'] / 1e9:.0f} | {2 * f / ph['dkdv'] / 1e9:.0f} | {cfgs} |"
        )
    return lines


def _md_experiments(r: dict) -> list[str]:
    lines = [
        "| D | causal | S | kernel | config (BLOCK_M x BLOCK_N, warps, stages): ms |",
        "|---|---|---|---|---|",
    ]
    for e in r.get("experiments", []):
        for kind in ("fwd", "dq", "dkdv", "dkdv_atomic"):
            cells = ", ".join(f"{k}: {v:.3f}" for k, v in e[kind].items())
            lines.append(
                f"| {e['D']} | {'yes' if e['causal'] else 'no'} | {e['S']} | {kind} | {cells} |"
            )
        lines.append(
            f"| {e['D']} | {'yes' if e['causal'] else 'no'} | {e['S']} | whole backward "
            f"| dQ kernel: {e['backward_separate_ms']:.3f}; fp32 atomics: "
            f"{e['backward_atomic_ms']:.3f} |"
        )
    return lines


def _md_host(r: dict) -> list[str]:
    lines = ["| path (causal 1x1x128x64, fwd+bwd unless named) | host us per call |", "|---|---|"]
    for k, v in r.get("host_us", {}).items():
        if isinstance(v, float):
            lines.append(f"| {k} | {v:.0f} |")
    return lines


def markdown(path: str) -> str:
    """Markdown tables from a results file, for benchmarks/README.md."""
    r = json.load(open(path))
    checks = r["gpu_checks"]
    worst = max(max(c["rel_err"].values()) for c in checks if "rel_err" in c)
    out = [
        "#### Forward + backward vs SDPA",
        *_md_main(r),
        "",
        "#### Our kernels, one by one (autotuned configs)",
        *_md_phases(r),
        "",
        "#### Every candidate config at four shapes; dQ by atomics",
        *_md_experiments(r),
        "",
        "#### Host time per call",
        *_md_host(r),
        "",
        f"GPU correctness checks (odd shapes, GQA, non-contiguous, fp16/bf16, vs fp32): "
        f"{sum(bool(c.get('ok')) for c in checks)}/{len(checks)} within tolerance; largest "
        f"relative error {worst:.4f}.",
    ]
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="path of the JSON file to write")
    ap.add_argument("--quick", action="store_true", help="D=128, S in {2048, 8192} only")
    ap.add_argument("--experiments", action="store_true", help="per-config and atomic-dQ timings")
    ap.add_argument("--workers", type=int, default=14)
    ap.add_argument(
        "--host",
        action="store_true",
        help="only the host time per call (configs pinned: no autotuning)",
    )
    ap.add_argument(
        "--markdown",
        action="store_true",
        help="print markdown tables from the results file OUT and exit",
    )
    args = ap.parse_args()
    if args.markdown:
        print(markdown(args.out))
        return
    heads = (64, 128)
    seqs = (2048, 8192) if args.quick else SEQS
    result = dict(
        version=1,
        env=environment(),
        protocol=dict(
            tokens=TOKENS,
            hidden=HIDDEN,
            dtype=str(DTYPE),
            timer="triton.testing.do_bench median",
            flops="fwd 4*B*S^2*H*D (x0.5 causal), bwd 2.5x, fwd+bwd 3.5x",
        ),
    )
    log(f"environment: {result['env']}")

    def save():
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)

    if args.host:
        for name in ("fwd_configs", "dkdv_configs", "dq_configs"):
            mod = kf if name == "fwd_configs" else kb
            full = getattr(mod, name)
            setattr(mod, name, lambda bd, f=full: f(bd)[:1])
        result["host_us"] = host_diagnostics()
        result["total_s"] = time.time() - T0
        save()
        print(
            json.dumps(
                {k: round(v, 1) for k, v in result["host_us"].items() if isinstance(v, float)},
                indent=1,
            )
        )
        print(result["host_us"]["profile_public_fwd_bwd_200_calls"][:3000], flush=True)
        return
    result["gpu_checks"] = warm_and_check(heads, args.experiments, args.workers)
    result["warm_s"] = time.time() - T0
    for c in result["gpu_checks"]:
        log(f"check {'ok ' if c.get('ok') else 'FAIL'} {json.dumps(c)}")
    save()
    result["shapes"] = []
    for d in heads:
        for causal in (False, True):
            for s in seqs:
                try:
                    result["shapes"].append(run_shape(d, causal, s))
                except Exception as e:
                    result["shapes"].append(dict(D=d, causal=causal, S=s, error=repr(e)[:500]))
                log(f"shape D={d} causal={causal} S={s}: {json.dumps(result['shapes'][-1])}")
                save()
    result["host_us"] = host_diagnostics()
    log(
        "host time per call (us): "
        + json.dumps({k: round(v, 1) for k, v in result["host_us"].items() if isinstance(v, float)})
    )
    print(result["host_us"]["profile_public_fwd_bwd_200_calls"][:3000], flush=True)
    if args.experiments:
        result["experiments"] = []
        for shape in ((128, False, 8192), (128, True, 8192), (64, False, 2048), (128, True, 1024)):
            try:
                result["experiments"].append(experiment_shape(*shape))
            except Exception as e:
                result["experiments"].append(dict(shape=shape, error=repr(e)[:500]))
            log(f"experiment {shape}: {json.dumps(result['experiments'][-1])}")
            save()
    result["total_s"] = time.time() - T0
    save()
    print(table([r for r in result["shapes"] if "error" not in r]), flush=True)


if __name__ == "__main__":
    main()
