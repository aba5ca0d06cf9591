"""Measure real training steps: warm up, time steps, profile one more under torch.profiler.

`profile(workload, device, precision)` moves the workload to the device, runs
`run_step` (forward + loss under the precision's autocast, backward, optimizer.step,
zero_grad) `warmup` times, times `steps` steps with CUDA events (perf_counter on the CPU),
then records one step under torch.profiler and joins its kernels to ops, modules and phases.
"""

from __future__ import annotations

import contextlib
import os
import statistics
import tempfile
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.profiler import record_function

from gobrrr.capture import CHECKPOINTS
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Calibration, GiB, GpuSpec, Target, match_device_name
from gobrrr.precision import Precision
from gobrrr.profile.join import MODULE_PREFIX, PHASE_PREFIX, STEP_LABEL
from gobrrr.profile.timing import sync
from gobrrr.profile.timing import time_steps as time_steps  # benchmarks import it here
from gobrrr.training.checkpointing import apply_checkpointing
from gobrrr.training.step import TrainStep, make_scaler
from gobrrr.training.step import (
    autocast_for as autocast_for,  # re-exported: benchmarks import it here
)
from gobrrr.workload import Workload, iter_tensors, map_tensors

CPU_LABEL = "cpu: measured on the CPU, not a GPU"


# -- one real step --------------------------------------------------------------------------


@contextlib.contextmanager
def matmul_precision(precision: str) -> Iterator[None]:
    """ "tf32": TF32 on for matmuls and convolutions; otherwise matmuls in true fp32 and
    cuDNN's setting left as it is (PyTorch's default: TF32 convolutions, which the trace
    records and the cost model follows); restored after."""
    old = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    tf32 = Precision.parse(precision).tf32
    torch.backends.cuda.matmul.allow_tf32 = tf32
    if tf32:
        torch.backends.cudnn.allow_tf32 = True
    try:
        yield
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = old


def run_step(
    workload: Workload,
    optimizer: torch.optim.Optimizer,
    precision: str,
    scaler: Any = None,
    device_type: str = "cuda",
) -> torch.Tensor:
    """One training step (gobrrr.training.step.TrainStep, the step capture traces): forward + loss
    (autocast for the mixed precisions), backward (through the GradScaler for fp16),
    optimizer.step, zero_grad(set_to_none=True). Each part sits in a `gobrrr::<phase>`
    profiler range. Returns the loss (detached)."""
    return TrainStep(
        workload, optimizer, precision, device_type=device_type, scaler=scaler, phase=_phase_range
    )()


def _phase_range(name: str) -> record_function:
    return record_function(PHASE_PREFIX + name)


def prepare(
    workload: Workload, device: str, precision: str, checkpoint: str = "none", compile: bool = False
) -> tuple[Workload, torch.optim.Optimizer, Any]:
    """Move the workload to the device in the precision; returns (workload, optimizer, scaler).

    The workload's own tensors are moved (its model in place); "bf16" casts the model and the
    floating inputs to bfloat16. `checkpoint` "none", or "full" (each repeated block)."""
    p = Precision.parse(precision)
    model = workload.model.to(device)
    if p.casts_weights:
        model = model.to(p.param_dtype)
    dtype = p.param_dtype if p.casts_weights else None
    batch = map_tensors(
        workload.batch,
        lambda t: t.to(
            device, dtype=dtype if dtype is not None and t.is_floating_point() else None
        ),
    )
    if checkpoint not in CHECKPOINTS:
        raise GobrrrError(f"checkpoint={checkpoint!r}: use one of {', '.join(CHECKPOINTS)}")
    if checkpoint != "none":
        if not apply_checkpointing(model):
            raise GobrrrError(
                f"checkpoint={checkpoint!r}: the model has no repeated blocks to "
                "checkpoint; use checkpoint='none'"
            )
    workload.model, workload.batch = model, batch
    opt = workload.make_optimizer()
    if compile:
        workload.model = torch.compile(model)
    return workload, opt, make_scaler(precision, device.split(":")[0])


# -- module labels --------------------------------------------------------------------------


@contextlib.contextmanager
def module_ranges(model: nn.Module) -> Iterator[None]:
    """Push a `gobrrr.module::<fqn>` profiler range for the duration of every module's
    forward (pre-hook enters it, post-hook leaves it); removed on exit."""
    handles = []
    for name, mod in model.named_modules():
        label = MODULE_PREFIX + name
        stack: list[Any] = []

        def pre(m, args, _label=label, _stack=stack):
            rf = record_function(_label)
            rf.__enter__()
            _stack.append(rf)

        def post(m, args, out, _stack=stack):
            if _stack:
                _stack.pop().__exit__(None, None, None)

        handles.append(mod.register_forward_pre_hook(pre))
        handles.append(mod.register_forward_hook(post, always_call=True))
    try:
        yield
    finally:
        for h in handles:
            h.remove()


# -- timing ---------------------------------------------------------------------------------


@dataclass(frozen=True)
class Measured:
    """Raw measurements of one workload, before analysis."""

    step_times: tuple[float, ...]
    trace: dict
    peak_allocated: int
    peak_reserved: int
    device_name: str


def measure(
    workload: Workload,
    device: str,
    precision: str,
    steps: int,
    warmup: int,
    checkpoint: str,
    compile: bool,
    trace_path: str | Path | None,
) -> Measured:
    """Warm up, time `steps` steps, profile one more; see `profile` for the faults raised."""
    wl, step, dev_type = _stepper(workload, device, precision, checkpoint, compile)
    with matmul_precision(precision):
        _warm_up(step, warmup, device)
        if dev_type == "cuda":
            torch.cuda.reset_peak_memory_stats()
        times = time_steps(step, steps, device)
        peak_a, peak_r = _peaks(dev_type)
        trace = _profile_one(wl, step, dev_type, trace_path, hooks=not compile)
    name = torch.cuda.get_device_name() if dev_type == "cuda" else _cpu_name()
    return Measured(tuple(times), trace, peak_a, peak_r, name)


def _peaks(dev_type: str) -> tuple[int, int]:
    if dev_type != "cuda":
        return 0, 0
    return torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()


def _cpu_name() -> str:
    import platform

    return platform.processor() or platform.machine() or "cpu"


def _profile_one(wl: Workload, step, dev_type: str, trace_path, hooks: bool) -> dict:
    """One warm-up step and one recorded step under torch.profiler; the trace as a dict.
    The trace is exported (atomically to `trace_path` when given) as the cycle ends."""
    from torch.profiler import ProfilerActivity, profile, schedule

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev_type == "cuda" else [])
    hook_ctx = module_ranges(wl.model) if hooks else contextlib.nullcontext()
    out: dict = {}
    warnings.filterwarnings("ignore", message=".*Profiler clears events.*")
    with (
        hook_ctx,
        profile(
            activities=acts,
            record_shapes=True,
            schedule=schedule(wait=0, warmup=1, active=1),
            on_trace_ready=lambda p: out.update(_export(p, trace_path)),
        ) as prof,
    ):
        for _ in range(2):
            with record_function(STEP_LABEL):
                step()
            sync(dev_type)
            prof.step()
    if not out:
        raise GobrrrError("torch.profiler returned no trace for the profiled step")
    return out


def _export(prof, trace_path) -> dict:
    """Export the Chrome trace (atomically to `trace_path` when given) and load it."""
    import json

    fd, tmp = tempfile.mkstemp(suffix=".json", dir=_tmp_dir(trace_path))
    os.close(fd)
    try:
        prof.export_chrome_trace(tmp)
        with open(tmp) as f:
            trace = json.load(f)
        if trace_path is not None:
            os.replace(tmp, trace_path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return trace


def _tmp_dir(trace_path) -> str | None:
    return str(Path(trace_path).resolve().parent) if trace_path is not None else None


# -- faults ---------------------------------------------------------------------------------


def check_device(device: str) -> None:
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise GobrrrError(
            f"device {device!r} was asked for but no CUDA GPU is visible: run on a "
            "machine with a GPU, or pass --device cpu"
        )
    if not device.startswith(("cuda", "cpu")):
        raise GobrrrError(f"device {device!r}: use 'cuda' (or 'cuda:N') or 'cpu'")


def oom_error(device: str, workload: Workload, precision: str) -> GobrrrError:
    """Free what the failed step held and say how much it needed."""
    needed = torch.cuda.max_memory_reserved()
    total = torch.cuda.get_device_properties(device).total_memory
    workload.model.to("cpu")
    with contextlib.suppress(Exception):
        workload.batch = map_tensors(workload.batch, lambda t: t.to("cpu"))
    torch.cuda.empty_cache()
    return GobrrrError(
        f"{workload.name} does not fit: needed >= {needed / GiB:.1f} GiB of "
        f"{total / GiB:.1f} GiB on {torch.cuda.get_device_name()} at {precision}: use a smaller "
        "--batch, --checkpoint blocks, or a lower precision"
    )


def target_for(
    device_name: str, gpu: str | GpuSpec | Target | None, calibration: Calibration | None = None
) -> Target | None:
    """The GPU measured on, with its calibration (`Target.resolve`): the one given, else the
    one CUDA names; None when CUDA names a GPU gobrrr has no spec for and none was given (the
    profile then reports no roofline regimes and no MFU, and says why)."""
    cal = calibration if calibration is not None else True
    if gpu is not None and gpu != "":
        return Target.resolve(gpu, cal)
    try:
        return Target.resolve(device_name, cal)
    except GobrrrError:
        if match_device_name(device_name) is not None:
            raise  # the GPU is known: its calibration is what failed
        return None


def unnamed_gpu(device_name: str) -> str:
    """The label of a profile on a GPU gobrrr cannot name."""
    return (
        f"CUDA reports {device_name!r}, which no built-in spec names: pass --gpu (a "
        "built-in name or a .toml/.json spec file) for regimes and MFU"
    )


def batch_on(workload: Workload) -> str:
    ts = list(iter_tensors(workload.batch))
    return str(ts[0].device) if ts else "cpu"


def median(xs) -> float:
    return statistics.median(xs) if xs else 0.0


def load_graph_arg(graph: StepGraph | str | Path | None) -> StepGraph | None:
    if graph is None or isinstance(graph, StepGraph):
        return graph
    return StepGraph.load(graph)


def time_workload(
    workload: Workload,
    device: str,
    precision: str,
    steps: int,
    warmup: int,
    checkpoint: str = "none",
    compile: bool = False,
) -> tuple[float, ...]:
    """Seconds per step of `steps` timed steps after `warmup` (no profiler): the step times
    that `profile` reports, for scaling tests."""
    _, step, _ = _stepper(workload, device, precision, checkpoint, compile)
    with matmul_precision(precision):
        _warm_up(step, warmup, device)
        return tuple(time_steps(step, steps, device))


def _stepper(workload: Workload, device: str, precision: str, checkpoint: str, compile: bool):
    """(the prepared workload, a zero-argument training step, the device type)."""
    wl, opt, scaler = prepare(workload, device, precision, checkpoint, compile)
    dev_type = device.split(":")[0]
    return wl, (lambda: run_step(wl, opt, precision, scaler, dev_type)), dev_type


def _warm_up(step, warmup: int, device: str) -> None:
    for _ in range(max(warmup, 1)):
        step()
    sync(device)
