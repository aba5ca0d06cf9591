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
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Calibration, GpuSpec, Target
from gobrrr.models.registry import get_workload, load_workload, model_names
from gobrrr.passes.ddp import ddp
from gobrrr.passes.fsdp import fsdp
from gobrrr.workload import Workload

__all__ = ["PARALLEL", "Estimate", "estimate", "shard", "workload_factory"]

#: the data-parallel recipes `estimate(parallel=...)` knows
PARALLEL = ("ddp", "fsdp")


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
    gpus: int = 1,
    nodes: int = 1,
    parallel: str = "ddp",
) -> Estimate:
    """Predict peak memory and step time of one training step on `gpu`.

    compile: the model runs under torch.compile (the optimizer stays eager): the step is
    traced as AOTAutograd partitions it, with Inductor's fusion (`gobrrr.capture.compiled`,
    `gobrrr.passes.compile`); ops between matmuls fuse into one kernel each and misaligned
    matmuls are padded.

    calibration: True = use a saved calibration for this GPU if one exists; False/None = the
    datasheet with default efficiencies; or a Calibration to use.

    gpus, nodes, parallel: the step data-parallel over `gpus` GPUs in all on `nodes` hosts,
    by `parallel` ("ddp" or "fsdp", see `shard`); `batch` is each GPU's. One GPU: as traced.
    """
    for what, v in (("batch", batch), ("seq", seq)):
        if v is not None and v <= 0:
            raise GobrrrError(f"--{what} must be a positive number, got {v}")
    check_parallel(gpus, nodes, parallel)
    if gpus > 1 and parallel == "fsdp" and precision != "bf16-mixed":
        raise GobrrrError(
            f"--parallel fsdp models FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, "
            f"reduce_dtype=fp32), not --precision {precision}: use --precision bf16-mixed"
        )
    target = Target.resolve(gpu, calibration)
    t0 = time.perf_counter()
    graph = capture(
        workload_factory(source, batch, seq),
        precision=traced_precision(precision, gpus, parallel),
        checkpoint=checkpoint,
        sdpa=target_for(target.gpu.full_name),
        compile=compile,
    )
    if gpus > 1:
        graph = shard(graph, parallel, gpus, nodes)
    return evaluate(graph, target, capture_s=time.perf_counter() - t0)


def check_parallel(gpus: int, nodes: int, parallel: str) -> None:
    """One GobrrrError naming the value and the fix where the data-parallel arguments
    cannot describe a job."""
    if parallel not in PARALLEL:
        raise GobrrrError(f"unknown --parallel {parallel!r}: choose one of {', '.join(PARALLEL)}")
    if gpus < 1:
        raise GobrrrError(f"--gpus must be at least 1, got {gpus}")
    if nodes < 1 or gpus % nodes:
        raise GobrrrError(
            f"--nodes {nodes} must divide --gpus {gpus} (the same GPUs on every node)"
        )


def shard(graph: StepGraph, parallel: str, gpus: int, nodes: int = 1) -> StepGraph:
    """One rank's step of `graph` data-parallel over `gpus` GPUs on `nodes` hosts: DDP
    (`passes.ddp`) or FSDP2 (`passes.fsdp`)."""
    check_parallel(gpus, nodes, parallel)
    if parallel == "ddp":
        return ddp(graph, gpus, nodes)
    return fsdp(graph, gpus, nodes)


def traced_precision(precision: str, gpus: int, parallel: str) -> str:
    """The precision the one-rank step is traced in. Under FSDP2, "bf16-mixed" means what
    torchtitan runs: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fp32 sharded
    parameters and no autocast, so each unit computes in bf16 on its gathered bf16 parameters:
    the "bf16" trace, whose parameters, gradients and states `passes.fsdp` re-types as FSDP2
    holds them."""
    if gpus > 1 and parallel == "fsdp" and precision == "bf16-mixed":
        return "bf16"
    return precision
