"""What to change, in plain words, ranked by the step time it would save.

Each finding carries its evidence (the measured ops behind it) and an estimate of the saving:

- **fusion**: runs of consecutive memory-bound pointwise / norm / softmax / copy ops. A fused
  kernel reads the run's inputs and writes its output once, about the bytes of its largest
  op, so the saving is (sum of the run's bytes - largest op's bytes) / bandwidth.
- **fp32 matmuls off the tensor cores**: the time above what the same FLOPs take at the
  bf16 tensor-core rate (calibrated, else 80 % of the dense peak).
- **overhead-bound step**: the GPU idles between kernels; saving = the idle time.
- **unfused attention**: bmm -> softmax -> bmm (or the math SDPA backend); saving = the time
  of the score-matrix ops that a fused kernel never writes to memory.
- **logits + cross-entropy spike**: the (tokens x vocab) logits, their fp32 log-softmax and
  its gradient are held at once; reported with the memory a fused linear + cross-entropy
  would free (its time saving is small, so it ranks low).
"""

from __future__ import annotations

from collections.abc import Sequence

from gobrrr.hardware import Calibration, GiB, GpuSpec
from gobrrr.profile.result import Finding, MeasuredOp

FUSABLE = ("pointwise", "norm", "softmax", "copy", "reduction")
IDLE_SHARE = 0.25  # a step whose GPU idles this much of the time is overhead-bound
SPIKE_FRACTION = 0.05  # report the logits spike when it is >= 5 % of the peak memory


def diagnose(
    ops: Sequence[MeasuredOp],
    gpu: GpuSpec | None,
    step_s: float,
    idle_share: float,
    peak_allocated: int = 0,
    calibration: Calibration | None = None,
    precision: str = "bf16-mixed",
) -> tuple[Finding, ...]:
    """All findings for one measured step, largest saving first. Needs a GPU spec (a CPU run
    gets no findings: its times say nothing about a GPU)."""
    if gpu is None:
        return ()
    found = [
        fusion(ops, gpu, calibration),
        off_tensor_cores(ops, gpu, calibration),
        overhead_bound(ops, step_s, idle_share),
        unfused_attention(ops),
        logits_spike(ops, peak_allocated, precision),
    ]
    return tuple(sorted((f for f in found if f is not None), key=lambda f: -f.saving_s))


def _ms(s: float) -> str:
    return f"{s * 1e3:.3g} ms"


def chains(ops: Sequence[MeasuredOp]) -> list[list[MeasuredOp]]:
    """Maximal runs (length >= 2) of consecutive memory-bound fusable ops in one phase."""
    out: list[list[MeasuredOp]] = []
    run: list[MeasuredOp] = []
    for o in sorted(ops, key=lambda o: o.index):
        ok = o.kind in FUSABLE and o.regime == "memory" and o.bytes > 0
        if ok and run and run[-1].phase == o.phase:
            run.append(o)
            continue
        if len(run) >= 2:
            out.append(run)
        run = [o] if ok else []
    if len(run) >= 2:
        out.append(run)
    return out


def chain_saving(run: Sequence[MeasuredOp], bandwidth: float) -> float:
    """Seconds saved by fusing a run: (sum of bytes - largest op's bytes) / bandwidth, capped
    at the run's measured time less the fused kernel's floor."""
    total = sum(o.bytes for o in run)
    fused = max(o.bytes for o in run)
    measured = sum(o.device_s for o in run)
    return max(0.0, min((total - fused) / bandwidth, measured - fused / bandwidth))


def fusion(ops, gpu: GpuSpec, calibration: Calibration | None) -> Finding | None:
    bw = gpu.bandwidth * gpu.bandwidth_efficiency
    if calibration is not None:
        bw = calibration.pointwise_bandwidth
    runs = chains(ops)
    if not runs:
        return None
    saved = [(chain_saving(r, bw), r) for r in runs]
    saved.sort(key=lambda x: -x[0])
    total = sum(s for s, _ in saved)
    measured = sum(o.device_s for r in runs for o in r)
    top = "; ".join(
        f"{r[0].module or '(top)'} [{r[0].phase}]: {' -> '.join(o.family for o in r[:6])}"
        f"{' ...' if len(r) > 6 else ''} {_ms(sum(o.device_s for o in r))}"
        for _, r in saved[:3]
    )
    speedup = measured / max(measured - total, 1e-12)
    return Finding(
        kind="fusion",
        saving_s=total,
        title=f"{len(runs)} chain(s) of memory-bound ops could be fused "
        f"(≈{speedup:.2g}x faster on those ops)",
        evidence=f"{sum(len(r) for r in runs)} ops take {_ms(measured)} moving "
        f"{sum(o.bytes for r in runs for o in r) / 1e9:.3g} GB; largest: {top}",
        remedy="torch.compile the model (fuses pointwise chains into one kernel), or use "
        "fused kernels (fused LayerNorm/RMSNorm, fused bias+activation)",
    )


def off_tensor_cores(ops, gpu: GpuSpec, calibration: Calibration | None) -> Finding | None:
    slow = [o for o in ops if o.kind in ("matmul", "attention", "conv") and o.math == "fp32"]
    if not slow:
        return None
    rate = (calibration.matmul_flops.get("bf16") if calibration else None) or (
        gpu.peak("bf16") * gpu.matmul_efficiency
    )
    t = sum(o.device_s for o in slow)
    fl = sum(o.flops for o in slow)
    saving = max(0.0, t - fl / rate)
    return Finding(
        kind="tensor_cores",
        saving_s=saving,
        title=f"{len(slow)} matmul(s) run in fp32, off the tensor cores",
        evidence=f"they take {_ms(t)} at {fl / t / 1e12 if t else 0:.3g} TFLOP/s; the same "
        f"{fl / 1e12:.3g} TFLOP at the bf16 tensor-core rate ({rate / 1e12:.0f} "
        f"TFLOP/s) take {_ms(fl / rate)}",
        remedy="train with --precision bf16-mixed (torch.autocast), or at least enable TF32 "
        "(torch.backends.cuda.matmul.allow_tf32 = True)",
    )


def overhead_bound(ops, step_s: float, idle_share: float) -> Finding | None:
    over = [o for o in ops if o.regime == "overhead"]
    if idle_share < IDLE_SHARE:
        return None
    tiny = sorted(o.device_s for o in ops)
    med = tiny[len(tiny) // 2] if tiny else 0.0
    return Finding(
        kind="overhead",
        saving_s=idle_share * step_s,
        title="the step is overhead-bound: the GPU waits for the host",
        evidence=f"GPU idle {idle_share:.0%} of the step; {len(over)} of {len(ops)} "
        f"ops overhead-bound; median op {med * 1e6:.3g} us of device time",
        remedy="a larger batch (more work per launch), torch.compile (fewer, larger "
        "kernels), CUDA graphs (torch.compile mode='reduce-overhead')",
    )


def unfused_attention(ops) -> Finding | None:
    seq = sorted((o for o in ops if o.phase == "forward"), key=lambda o: o.index)
    math_sdpa = [o for o in ops if "attention_math" in o.op]
    found: list[list[MeasuredOp]] = []
    for i, o in enumerate(seq):
        if o.kind != "softmax" or o.family.startswith("log"):
            continue
        before = [p for p in seq[max(0, i - 4) : i] if p.module == o.module]
        after = [p for p in seq[i + 1 : i + 4] if p.module == o.module]
        if any(p.kind == "matmul" for p in before) and any(p.kind == "matmul" for p in after):
            j = max(k for k, p in enumerate(before) if p.kind == "matmul")
            found.append(before[j + 1 :] + [o])
    if not found and not math_sdpa:
        return None
    saving = sum(p.device_s for grp in found for p in grp)
    where = sorted({grp[-1].module for grp in found})[:3]
    return Finding(
        kind="attention",
        saving_s=saving,
        title="attention runs unfused (the score matrix goes through memory)",
        evidence=f"{len(found)} bmm -> softmax -> bmm pattern(s) in {', '.join(where) or '-'}"
        f"{f'; {len(math_sdpa)} math-backend SDPA call(s)' if math_sdpa else ''}; "
        f"score-matrix ops take {_ms(saving)} in forward alone",
        remedy="use torch.nn.functional.scaled_dot_product_attention with a fused backend "
        "(flash / cuDNN / memory-efficient): no S x S matrix in memory",
    )


def logits_spike(ops, peak_allocated: int, precision: str) -> Finding | None:
    ls = [o for o in ops if o.family == "log_softmax" and o.phase == "forward"]
    if not ls:
        return None
    o = max(ls, key=lambda o: o.bytes)
    itemsize = 2 if precision in ("bf16", "fp16") else 4  # autocast runs log-softmax in fp32
    numel = o.bytes / (2 * itemsize)  # it reads the logits and writes as many
    if numel <= 0:
        return None
    held = numel * 4 * 2  # fp32 log-softmax (saved) + fp32 gradient of the logits
    if precision.endswith("mixed"):
        held += numel * 2  # the bf16/fp16 logits themselves
    if peak_allocated and held < SPIKE_FRACTION * peak_allocated:
        return None
    loss_ops = [p for p in ops if p.kind in ("softmax", "loss")]
    share = f" ({held / peak_allocated:.0%} of the peak)" if peak_allocated else ""
    return Finding(
        kind="logits",
        saving_s=0.0,
        memory_bytes=held,
        title="the logits and cross-entropy make a memory spike",
        evidence=f"{numel / 1e6:.3g} M logits in {o.module or '(top)'}: log-softmax and its "
        f"gradient hold ≈{held / GiB:.3g} GiB at once{share}; the loss ops take "
        f"{_ms(sum(p.device_s for p in loss_ops))}",
        remedy="a fused linear + cross-entropy (chunked over tokens, e.g. Liger's) never "
        "materialises the full logits",
    )
