"""`gobrrr.estimate`: predict a step's memory and time on a GPU, without one: capture the
step on fake tensors, then `evaluate` the graph."""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any

from gobrrr.capture import CHECKPOINTS, capture
from gobrrr.capture.compiled import mode as compile_mode
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError, check_choice, check_count, check_flag
from gobrrr.evaluate import Estimate, evaluate
from gobrrr.graph.ir import StepGraph
from gobrrr.hardware import Calibration, GpuSpec, Target
from gobrrr.memory.replay import step_memory
from gobrrr.models.registry import get_workload, load_workload, model_names
from gobrrr.passes.ddp import ddp
from gobrrr.passes.fsdp import fsdp
from gobrrr.passes.loop import LOOPS, held, other
from gobrrr.passes.loop import loop as loop_pass
from gobrrr.precision import PRECISIONS
from gobrrr.workload import Workload

__all__ = [
    "LOOPS",
    "PARALLEL",
    "SHARDED",
    "Estimate",
    "check_target_args",
    "estimate",
    "shard",
    "workload_factory",
]

#: the loop `estimate` assumes where it is not told: the plain loop's, which holds the model's
#: output through backward (never under for it; a loop that drops the output peaks lower)
DEFAULT_LOOP = "keeps-output"

#: the data-parallel recipes `estimate(parallel=...)` knows: DDP; FSDP2 sharded over every
#: rank; HSDP, FSDP2 sharded within each node and replicated across nodes
PARALLEL = ("ddp", "fsdp", "hsdp")
#: the recipes built on FSDP2's fully_shard (traced in bf16, with units and resharding)
SHARDED = ("fsdp", "hsdp")


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
            not_a_directory(source)
            return lambda: load_workload(source, batch_size=batch, seq_len=seq)
        raise GobrrrError(
            f"unknown model {source!r}: choose one of {', '.join(model_names())}, "
            "or give path/to/file.py:function"
        )
    if callable(source):
        kwargs = _accepted(source, batch_size=batch, seq_len=seq)
        return lambda: source(**kwargs)
    raise GobrrrError(f"cannot make a workload from {type(source).__name__}")


def not_a_directory(spec: str) -> None:
    """A folder where the workload's file belongs is named as one (not "not found")."""
    path = Path(spec.rpartition(":")[0] if ":" in spec else spec).expanduser()
    if path.is_dir():
        py = sorted(p.name for p in path.glob("*.py"))[:3]
        example = f" such as {path / py[0]}:workload" if py else ""
        raise GobrrrError(
            f"workload {spec}: {path} is a directory",
            hint=f"give a Python file and its function, path/to/file.py:function{example}",
        )


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
    compile: bool | str = False,
    gpus: int = 1,
    nodes: int = 1,
    parallel: str = "ddp",
    reshard_after_forward: bool = True,
    units: Sequence[str] | None = None,
    loop: str | None = None,
) -> Estimate:
    """Predict peak memory and step time of one training step on `gpu`.

    loop: the training loop whose memory is predicted (`gobrrr.passes.loop`):
    "keeps-output" (the default: `out = model(...); loss.backward(); opt.step()`, the model's
    output alive until the next step rebinds it), "drops-output" (gobrrr's own step,
    Lightning, HF Trainer in fp32: the output freed before backward), "hf-trainer" (HF
    Trainer: dropped too, after Accelerate's mixed precision copied its fp16/bf16 tensors to
    fp32, the originals still alive; the model traced with `config.use_cache` False, as the
    Trainer sets it) or "zero-grad-first" (timm's and torchvision's
    train_one_epoch: the output kept, and zero_grad() called just before backward, so the
    last step's gradients live through the forward). Leave it None for a
    Workload(forward_backward=...), whose own loop is traced. The Estimate's `other_loop`
    is the memory under the other loop; the time is the same under both, but for
    "hf-trainer"'s copies. It is read off the same trace: under "hf-trainer" that is the
    model with its KV cache off, so the other loop's figure holds no cache either.

    compile: the model runs under torch.compile (the optimizer stays eager): the step is
    traced as AOTAutograd partitions it, with Inductor's fusion (`gobrrr.capture.compiled`,
    `gobrrr.passes.compile`); ops between matmuls fuse into one kernel each and misaligned
    matmuls are padded. True or "model": torch.compile(model); "blocks": each repeated
    block's forward compiled on its own, the rest eager (regional compilation), which
    composes with checkpoint="full" (each block checkpointed around its compiled forward).

    calibration: True = use a saved calibration for this GPU if one exists; False/None = the
    datasheet with default efficiencies; or a Calibration to use.

    gpus, nodes, parallel: the step data-parallel over `gpus` GPUs in all on `nodes` hosts,
    by `parallel` ("ddp", "fsdp" or "hsdp", see `shard`); `batch` is each GPU's. One GPU: as
    traced. reshard_after_forward, units: FSDP2's (fsdp and hsdp only; units default to the
    repeated blocks).
    """
    check_target_args(source, gpu, calibration, batch=batch, seq=seq, gpus=gpus, nodes=nodes)
    check_choice("precision", precision, PRECISIONS)
    check_choice("checkpoint", checkpoint, CHECKPOINTS)
    compile = compile_mode(compile)
    check_flag("reshard_after_forward", reshard_after_forward)
    check_choice("parallel", parallel, PARALLEL)
    if units is not None and (isinstance(units, str) or not all(isinstance(u, str) for u in units)):
        raise GobrrrError(
            f"units={units!r} is not a list of module names",
            hint="give names as model.named_modules() spells them, e.g. units=['layers.0']",
        )
    if loop is not None:
        check_choice("loop", loop, LOOPS)
    check_parallel(gpus, nodes, parallel)
    check_fsdp_knobs(parallel, reshard_after_forward, units)
    if gpus > 1 and parallel in SHARDED and precision != "bf16-mixed":
        raise GobrrrError(
            f"--parallel {parallel} models FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, "
            f"reduce_dtype=fp32), not --precision {precision}: use --precision bf16-mixed"
        )
    if gpus > 1 and parallel in SHARDED and compile != "none":
        raise GobrrrError(
            f"--parallel {parallel} with --compile is not modelled: the compiled step's backward "
            "is not traced unit by unit, so FSDP2's per-unit reduce-scatters cannot be placed; "
            "predict it without --compile"
        )
    target = Target.resolve(gpu, calibration)
    t0 = time.perf_counter()
    with _configured_for(loop, workload_factory(source, batch, seq)) as factory:
        graph = capture(
            factory,
            precision=traced_precision(precision, gpus, parallel),
            checkpoint=checkpoint,
            sdpa=target_for(target.gpu.full_name),
            compile=compile,
        )
    traced = graph
    graph = _looped(traced, loop)
    sharded = (
        (lambda g: shard(g, parallel, gpus, nodes, reshard_after_forward, units))
        if gpus > 1
        else (lambda g: g)
    )
    est = evaluate(sharded(graph), target, capture_s=time.perf_counter() - t0)
    alternative = other(graph.meta.loop_mode)
    if alternative is None:
        return est
    if not held(traced):  # the model returns nothing a loop could keep longer
        return dataclasses.replace(est, other_loop=est.memory)
    memory = step_memory(
        sharded(loop_pass(traced, alternative)), target.gpu, target.cal, target.memory_cal
    )
    return dataclasses.replace(est, other_loop=memory)


@contextlib.contextmanager
def _configured_for(
    loop: str | None, factory: Callable[[], Workload]
) -> Iterator[Callable[[], Workload]]:
    """The workload's factory as loop `loop` configures the model before its first step.

    HF's `Trainer` sets `model.config.use_cache = TrainingArguments.use_cache` (False unless
    asked for) when it is made (transformers 5.17, trainer.py, "Finalize"), so a decoder under
    the Trainer returns no KV cache: none of its keys and values is an output (under
    torch.compile, Inductor then writes no contiguous copy of them). For "hf-trainer" the
    model is traced so configured; what was set is put back after the trace (a Workload the
    caller built is theirs)."""
    if loop != "hf-trainer":
        yield factory
        return
    touched: list[tuple[Any, Any]] = []

    def build() -> Workload:
        w = factory()
        config = getattr(w.model, "config", None)
        # a config without the flag has no cache to switch off (and may not take attributes)
        if config is not None and hasattr(config, "use_cache"):
            touched.append((config, config.use_cache))
            config.use_cache = False
        return w

    try:
        yield build
    finally:
        for config, value in reversed(touched):
            config.use_cache = value


def _looped(graph: StepGraph, kind: str | None) -> StepGraph:
    """The traced graph under loop `kind` (None: DEFAULT_LOOP, or the workload's own
    forward_backward where it gives one)."""
    if kind is None:
        if graph.meta.loop_mode == "forward-backward":
            return graph
        kind = DEFAULT_LOOP
    return loop_pass(graph, kind)


def check_target_args(source, gpu, calibration, **counts: int | None) -> None:
    """The arguments `estimate` and `plan` share, checked where they enter (a string where a
    number belongs fails here in one line, not deep inside the trace): one GobrrrError naming
    the argument and the fix."""
    if not (isinstance(source, str | Workload) or callable(source)):
        raise GobrrrError(
            f"source={source!r} is not a workload",
            hint="give a built-in model name, 'file.py:function', a function returning a "
            "gobrrr.Workload, or a Workload",
        )
    if not isinstance(gpu, str | GpuSpec | Target):
        raise GobrrrError(
            f"gpu={gpu!r} is not a GPU",
            hint="give a GPU's name such as 'h100' (`gobrrr gpus` lists them) or a "
            ".toml/.json spec file; for how many GPUs, use gpus=N",
        )
    if not (calibration is None or isinstance(calibration, bool | Calibration)):
        raise GobrrrError(
            f"calibration={calibration!r} is not a calibration",
            hint="give True (the saved one), False (datasheet) or a gobrrr Calibration",
        )
    for name, value in counts.items():
        check_count(name, value, optional=name in ("batch", "seq", "global_batch"))


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
    if parallel == "hsdp" and nodes < 2:
        raise GobrrrError(
            "--parallel hsdp shards within a node and replicates across nodes: it needs "
            f"--nodes 2 or more (got --nodes {nodes}); on one node use --parallel fsdp"
        )


def check_fsdp_knobs(
    parallel: str, reshard_after_forward: bool, units: Sequence[str] | None
) -> None:
    """FSDP2's knobs given to a recipe without FSDP2: one GobrrrError naming the fix."""
    if parallel in SHARDED:
        return
    given = [
        f
        for f, on in (("--units", units is not None), ("--no-reshard", not reshard_after_forward))
        if on
    ]
    if given:
        raise GobrrrError(
            f"{' and '.join(given)}: FSDP2's units and resharding, for --parallel fsdp or "
            f"hsdp, not {parallel}"
        )


def shard(
    graph: StepGraph,
    parallel: str,
    gpus: int,
    nodes: int = 1,
    reshard_after_forward: bool = True,
    units: Sequence[str] | None = None,
) -> StepGraph:
    """One rank's step of `graph` data-parallel over `gpus` GPUs on `nodes` hosts: DDP
    (`passes.ddp`), FSDP2 sharded over all of them or, "hsdp", sharded within each node and
    replicated across the nodes (`passes.fsdp`), with FSDP2's `reshard_after_forward` and
    `units` (default: the repeated blocks; none: a GobrrrError naming --units)."""
    check_parallel(gpus, nodes, parallel)
    check_fsdp_knobs(parallel, reshard_after_forward, units)
    if parallel == "ddp":
        return ddp(graph, gpus, nodes)
    if units is None and not graph.meta.blocks:
        raise GobrrrError(
            f"--parallel {parallel}: {graph.meta.name or 'the model'} has no repeated blocks "
            "to shard as FSDP2 units (an nn.ModuleList or nn.Sequential of two or more modules "
            "of one class): name them with --units NAME,NAME, or use --parallel ddp"
        )
    return fsdp(graph, gpus, nodes, reshard_after_forward, units, hsdp=parallel == "hsdp")


def traced_precision(precision: str, gpus: int, parallel: str) -> str:
    """The precision the one-rank step is traced in. Under FSDP2, "bf16-mixed" means what
    torchtitan runs: `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, fp32 sharded
    parameters and no autocast, so each unit computes in bf16 on its gathered bf16 parameters:
    the "bf16" trace, whose parameters, gradients and states `passes.fsdp` re-types as FSDP2
    holds them."""
    if gpus > 1 and parallel in SHARDED and precision == "bf16-mixed":
        return "bf16"
    return precision
