"""`profile()`: one workload measured for real, joined, classified and diagnosed."""

from __future__ import annotations

import datetime
import platform
from dataclasses import dataclass
from pathlib import Path

import torch

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Calibration, GpuSpec, Target
from gobrrr.precision import check_precision, peak_mode
from gobrrr.profile.analyze import analyze
from gobrrr.profile.diagnose import diagnose
from gobrrr.profile.flops import StepFlops, step_flops, traced_flops, untraced
from gobrrr.profile.join import join_trace
from gobrrr.profile.result import ProfileResult
from gobrrr.profile.runner import (
    CPU_LABEL,
    Measured,
    check_device,
    load_graph_arg,
    measure,
    median,
    oom_error,
    target_for,
    unnamed_gpu,
)
from gobrrr.workload import Workload


def profile(
    workload: Workload,
    device: str = "cuda",
    precision: str = "bf16-mixed",
    steps: int = 10,
    warmup: int = 3,
    checkpoint: str = "none",
    compile: bool = False,
    trace_path: str | Path | None = None,
    graph: StepGraph | str | Path | None = None,
    gpu: str | GpuSpec | Target | None = None,
    calibration: Calibration | None = None,
) -> ProfileResult:
    """Measure `workload`'s training step on `device` ("cuda", "cuda:N" or "cpu").

    Runs `warmup` steps, times `steps` steps (median/min/max seconds), then profiles one
    step under torch.profiler (CPU + CUDA, shapes recorded) and joins every kernel to its ATen
    op, module and phase, and to `graph`'s nodes when a StepGraph (or its JSON path) is given.
    `trace_path` gets that step as a Chrome/Perfetto trace (written atomically).
    `gpu` names the spec to judge against (default: the one CUDA reports), resolved with
    `calibration` (default: the stored one for that GPU) by `Target.resolve` before the run.

    MFU and HFU follow `gobrrr estimate`'s definitions: the FLOPs are counted on the traced
    step graph (`graph` when given, else the workload traced with gobrrr.capture first: on
    the CPU under fake tensors, seconds, the model untouched), model FLOPs those of its
    forward and backward without recomputation, HFU's every op it runs; both per second of
    the median step over one peak, the precision's dense matmul peak of the GPU (none on the
    CPU: MFU and HFU are None there, the FLOPs still counted). Throughput is tokens/s for a
    sequence workload, samples/s otherwise.

    The workload is moved to the device (its model in place). Raises GobrrrError for: no GPU
    when one was asked for, CUDA out of memory, a workload that raises.
    """
    check_device(device)
    check_precision(precision)
    if steps < 1 or warmup < 0:
        raise GobrrrError(f"steps={steps}, warmup={warmup}: need steps >= 1 and warmup >= 0")
    graph = load_graph_arg(graph)
    gpu_name = torch.cuda.get_device_name(device) if device.startswith("cuda") else None
    target = target_for(gpu_name, gpu, calibration) if gpu_name else None
    flops = (
        step_flops(graph)
        if graph is not None
        else traced_flops(workload, precision, checkpoint, gpu_name)
    )
    try:
        m = measure(workload, device, precision, steps, warmup, checkpoint, compile, trace_path)
    except torch.cuda.OutOfMemoryError:
        raise oom_error(device, workload, precision) from None
    except (GobrrrError, KeyboardInterrupt):
        raise
    except Exception as e:  # the user's model, loss or optimizer failed
        msg = str(e).strip().splitlines()[0] if str(e).strip() else ""
        raise GobrrrError(
            f"workload {workload.name!r} raised {type(e).__name__}: {msg} "
            "(run it once without gobrrr to debug; GOBRRR_DEBUG=1 shows the "
            "traceback)"
        ) from e
    return summarize(
        m,
        RunInfo(workload.name, device, precision, checkpoint, compile, steps, warmup),
        flops,
        graph=graph,
        gpu=target,
        calibration=calibration,
    )


@dataclass(frozen=True)
class RunInfo:
    """What was run: the labels a ProfileResult carries."""

    workload: str
    device: str
    precision: str
    checkpoint: str
    compiled: bool
    steps: int
    warmup: int


def summarize(
    m: Measured,
    info: RunInfo,
    flops: StepFlops | None = None,
    graph: StepGraph | None = None,
    gpu: str | GpuSpec | Target | None = None,
    calibration: Calibration | None = None,
) -> ProfileResult:
    """Analyze raw measurements (also those of a stored trace) into a ProfileResult.
    `flops`: the step's FLOPs and throughput unit (default: counted on `graph`). `gpu` and
    `calibration` as in `profile` (a Target is taken as it is)."""
    on_gpu = info.device.startswith("cuda")
    target = target_for(m.device_name, gpu, calibration) if on_gpu else None
    spec, cal = (target.gpu, target.cal) if target is not None else (None, None)
    label = CPU_LABEL if not on_gpu else "" if spec is not None else unnamed_gpu(m.device_name)
    joined = join_trace(m.trace, has_device=on_gpu)
    an = analyze(joined, spec, info.precision, graph, cal)
    step_s = median(m.step_times)
    if flops is None:
        flops = step_flops(graph) if graph is not None else untraced(None, "none: no graph")
    peak = spec.peak(peak_mode(info.precision)) if spec is not None else 0.0
    # Idle time of a timed step: its median time less the kernel time of the profiled step
    # (kernel durations are what the profiler measures well; its host overhead would inflate
    # the gaps inside the profiled step itself).
    idle = max(0.0, step_s - an.busy_s) if on_gpu else 0.0
    idle_share = idle / step_s if on_gpu and step_s > 0 else 0.0
    return ProfileResult(
        workload=info.workload,
        device=info.device,
        device_name=m.device_name,
        gpu=spec.name if spec else "",
        label=label,
        precision=info.precision,
        checkpoint=info.checkpoint,
        compiled=info.compiled,
        steps=info.steps,
        warmup=info.warmup,
        unit=flops.unit,
        units_per_step=flops.units,
        step_s=step_s,
        step_min_s=min(m.step_times),
        step_max_s=max(m.step_times),
        step_times=tuple(m.step_times),
        per_s=flops.units / step_s if step_s else 0.0,
        model_flops=flops.model,
        executed_flops=flops.executed,
        flops_source=flops.source,
        peak_flops=peak,
        peak=f"dense {peak_mode(info.precision)} matmul peak of {spec.name}" if spec else "",
        **utilization(flops, step_s, peak),
        peak_allocated=m.peak_allocated,
        peak_reserved=m.peak_reserved,
        profiled_step_s=an.span_s,
        busy_s=an.busy_s,
        idle_s=idle,
        idle_share=idle_share,
        kernels=an.kernels,
        kernels_attributed=an.kernels_attributed,
        graph_matched=an.graph_matched,
        ops=an.ops,
        phases=an.phases,
        modules=an.modules,
        kinds=an.kinds,
        diagnosis=diagnose(an.ops, spec, step_s, idle_share, m.peak_allocated, cal, info.precision),
        meta=environment(on_gpu, cal is not None),
    )


def utilization(flops: StepFlops, step_s: float, peak: float) -> dict[str, float | None]:
    """MFU, HFU and PaLM's MFU (fractions of `peak` FLOP/s over `step_s` seconds); None where
    there is no peak, no time or no FLOPs counted."""

    def rate(n: float | None) -> float | None:
        return n / step_s / peak if n and peak and step_s > 0 else None

    return {
        "mfu": rate(flops.model),
        "hfu": rate(flops.executed),
        "model_flops_6n_attention": flops.palm,
        "mfu_6n_attention": rate(flops.palm),
    }


def environment(on_gpu: bool, calibrated: bool) -> dict:
    """Versions and date recorded with every result."""
    env = {
        "torch": torch.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "calibrated": calibrated,
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        pass
    if on_gpu:
        env["cuda"] = torch.version.cuda
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        env["gpu_memory"] = props.total_memory
        env["sms"] = props.multi_processor_count
    return env
