"""`gobrrr.estimate`: predict a step's memory and time on a GPU, without one: capture the
step on fake tensors, then `evaluate` the graph."""

from __future__ import annotations

import inspect
import time
from collections.abc import Callable
from typing import Any

from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import Estimate, evaluate
from gobrrr.hardware import Calibration, GpuSpec, Target
from gobrrr.models.registry import get_workload, load_workload, model_names
from gobrrr.workload import Workload

__all__ = ["Estimate", "estimate", "workload_factory"]


def workload_factory(
    source: str | Callable[..., Workload] | Workload,
    batch: int | None = None,
    seq: int | None = None,
) -> Callable[[], Workload]:
    """A zero-argument function building the workload: a built-in model name, a
    "file.py:function" spec, a function taking optional batch_size/seq_len, or a Workload."""
    if isinstance(source, Workload):
        return lambda: source
    if isinstance(source, str):
        if source in model_names():
            return lambda: get_workload(source, batch_size=batch, seq_len=seq)
        if ":" in source or source.endswith(".py"):
            return lambda: load_workload(source, batch_size=batch, seq_len=seq)
        raise GobrrrError(
            f"unknown model {source!r}: choose one of {', '.join(model_names())}, "
            "or give path/to/file.py:function"
        )
    if callable(source):
        kwargs = _accepted(source, batch_size=batch, seq_len=seq)
        return lambda: source(**kwargs)
    raise GobrrrError(f"cannot make a workload from {type(source).__name__}")


def _accepted(fn: Callable, **kw: Any) -> dict[str, Any]:
    try:
        params = inspect.signature(fn).parameters
    except (TypeError, ValueError):
        return {}
    return {k: v for k, v in kw.items() if v is not None and k in params}


def estimate(
    source: str | Callable[..., Workload] | Workload,
    gpu: str | GpuSpec = "h100",
    *,
    batch: int | None = None,
    seq: int | None = None,
    precision: str = "bf16-mixed",
    checkpoint: str = "none",
    calibration: Calibration | None | bool = True,
    compile: bool = False,
) -> Estimate:
    """Predict peak memory and step time of one training step on `gpu`.

    compile: the model runs under torch.compile (the optimizer stays eager): the step is
    traced as AOTAutograd partitions it, with Inductor's fusion (`gobrrr.capture.compiled`,
    `gobrrr.passes.compile`); ops between matmuls fuse into one kernel each and misaligned
    matmuls are padded.

    calibration: True = use a saved calibration for this GPU if one exists; False/None = the
    datasheet with default efficiencies; or a Calibration to use.
    """
    for what, v in (("batch", batch), ("seq", seq)):
        if v is not None and v <= 0:
            raise GobrrrError(f"--{what} must be a positive number, got {v}")
    target = Target.resolve(gpu, calibration)
    t0 = time.perf_counter()
    graph = capture(
        workload_factory(source, batch, seq),
        precision=precision,
        checkpoint=checkpoint,
        sdpa=target_for(target.gpu.full_name),
        compile=compile,
    )
    return evaluate(graph, target, capture_s=time.perf_counter() - t0)
