"""A data-parallel training step measured on every rank of a torchrun job (`gobrrr profile
--parallel`), as `benchmarks/multigpu/steps.py` measures its cases.

On each rank: the workload moved to the rank's device, wrapped for DDP or FSDP2
(`training.distributed.data_parallel`; FSDP2 casts with its MixedPrecisionPolicy, so the step
runs without autocast), the optimizer built after wrapping; `warmup` steps, then the cache
emptied and the peak statistics reset (the unsharded build is not in the reserved peak), then
`steps` steps each timed after a barrier (the ranks start together), then one step under
torch.profiler: its NCCL kernels against every other kernel (`profile.comm`), each split where
the last rank arrives (the ranks swap their NCCL kernels' starts, a few hundred numbers; each
rank sets them against its own kernels): waiting for other ranks, then transfer. Rank 0
gathers every rank's figures; the job's step is the slowest rank's median, its memory the
largest rank's peaks, and the communication the min / median / max over ranks (a rank that
reaches a collective first waits inside the NCCL kernel for the others, so its exposed time
differs a lot between ranks; the transfer's much less).
"""

from __future__ import annotations

import statistics
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist

from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.errors import GobrrrError
from gobrrr.estimate import shard, traced_precision
from gobrrr.evaluate import evaluate
from gobrrr.hardware import Target
from gobrrr.passes.fsdp import fsdp
from gobrrr.profile.comm import rank_communication
from gobrrr.profile.ranks import Watchdog
from gobrrr.profile.runner import _cpu_name, matmul_precision, prepare
from gobrrr.profile.timing import sync, time_steps
from gobrrr.training.distributed import Group, data_parallel, unit_names
from gobrrr.training.step import TrainStep
from gobrrr.workload import Workload

RESULT_VERSION = 1
NO_NCCL_ON_CPU = "no NCCL kernels (CPU): gloo's communication is not measured"


@dataclass(frozen=True)
class ParallelRun:
    """What each rank runs. `batch` is per rank (None: the workload's own); `reshard`:
    FSDP2's reshard_after_forward."""

    parallel: str
    precision: str = "bf16-mixed"
    steps: int = 10
    warmup: int = 3
    checkpoint: str = "none"
    reshard: bool = True
    batch: int | None = None
    seq: int | None = None

    @property
    def step_precision(self) -> str:
        """The precision the step's autocast follows: FSDP2's policy does the casting, so
        its step runs without autocast ("fp32": no autocast, matmuls as the policy casts)."""
        return "fp32" if self.parallel == "fsdp" else self.precision


def check_run(run: ParallelRun) -> None:
    """One GobrrrError where the options cannot describe the job."""
    if run.parallel == "fsdp" and run.precision != "bf16-mixed":
        raise GobrrrError(
            f"--parallel fsdp runs FSDP2 with MixedPrecisionPolicy(param_dtype=bf16, "
            f"reduce_dtype=fp32), not --precision {run.precision}",
            hint="use --precision bf16-mixed",
        )
    if run.steps < 1 or run.warmup < 0:
        raise GobrrrError(f"--steps {run.steps}, --warmup {run.warmup}: need >= 1 and >= 0")


def prepare_rank(workload: Workload, group: Group, run: ParallelRun) -> tuple[Workload, object]:
    """(the workload on this rank's device, its fp16 loss scaler or None): no collective,
    so a failure here can be agreed on before any rank waits in one."""
    wl, _, scaler = prepare(workload, str(group.device), run.precision, run.checkpoint)
    if run.parallel == "fsdp":
        unit_names(wl.model)  # a model with no unit fails here, on every rank alike
    return wl, scaler


def wrap_step(wl: Workload, scaler, group: Group, run: ParallelRun) -> Callable[[], object]:
    """The prepared workload wrapped for `run.parallel` (DDP's set-up broadcasts the
    parameters: collective), its optimizer built on the wrapped parameters: a zero-argument
    training step."""
    wl.model = data_parallel(wl.model, run.parallel, group, reshard_after_forward=run.reshard)
    opt = wl.make_optimizer()  # after wrapping: FSDP2's parameters are the sharded DTensors
    return TrainStep(
        wl, opt, run.step_precision, device_type=group.device.type, scaler=scaler, keep_loss=False
    )


def measure_rank(step: Callable[[], object], group: Group, run: ParallelRun, dog: Watchdog) -> dict:
    """This rank's figures: step times (s), peaks (bytes; None on the CPU), communication."""
    device, cuda = str(group.device), group.device.type == "cuda"
    with matmul_precision(run.step_precision):
        for i in range(max(run.warmup, 1)):
            with dog.waiting(f"warm-up step {i + 1}"):
                step()
                sync(device)
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats()
        # the ranks start each timed step together; NCCL's barrier on this rank's GPU
        ids = [group.device.index] if cuda else None
        times = []
        for i in range(run.steps):
            with dog.waiting(f"timed step {i + 1}"):
                times += time_steps(step, 1, device, before=lambda: dist.barrier(device_ids=ids))
        peaks = (
            (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
            if cuda
            else (None, None)
        )
        with dog.waiting("the profiled step"):
            comm = profiled_communication(step, exchange) if cuda else None
    return {
        "rank": group.rank,
        "device": torch.cuda.get_device_name() if cuda else _cpu_name(),
        "step_s": times,
        "median_s": statistics.median(times),
        "peak_allocated": peaks[0],
        "peak_reserved": peaks[1],
        "comm": comm,
    }


def profiled_communication(step: Callable[[], object], swap: Callable[[dict], list]) -> dict:
    """One step under torch.profiler (GPU kernels only), summarised by `profile.comm`, its
    NCCL kernels split into waiting and transfer against every rank's (`swap`: this rank's
    starts -> every rank's; a collective, every rank calls it once)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [
        (ev.name, ev.time_range.start / 1e6, ev.time_range.end / 1e6)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    ]
    # the events count from this rank's trace start; the ranks' clocks are the host's
    clock_ns = prof.profiler.kineto_results.trace_start_ns()
    return rank_communication(kernels, swap, clock_ns)


def exchange(payload: object) -> list:
    """Every rank's `payload`, in rank order, on every rank (an all-gather)."""
    out: list = [None] * dist.get_world_size()
    dist.all_gather_object(out, payload)
    return out


def gather(rank: dict, group: Group, dog: Watchdog) -> list[dict] | None:
    """Every rank's figures on rank 0 (in rank order); None on the others."""
    out: list | None = [None] * group.world if group.is_first else None
    with dog.waiting("gathering the results on rank 0"):
        dist.gather_object(rank, out, dst=0)
    return out


def summarize(ranks: list[dict], run: ParallelRun, workload: str) -> dict:
    """The job's figures from every rank's: the JSON `gobrrr profile --parallel` prints."""
    slow = max(ranks, key=lambda r: r["median_s"])
    cuda = ranks[0]["peak_allocated"] is not None
    measured: dict = {
        "step_s": slow["median_s"],
        "slowest_rank": slow["rank"],
        "peak_allocated": max(r["peak_allocated"] for r in ranks) if cuda else None,
        "peak_reserved": max(r["peak_reserved"] for r in ranks) if cuda else None,
    }
    if cuda:
        for key in ("comm_busy_s", "comm_exposed_s"):
            measured[key] = spread([r["comm"][key] for r in ranks])
        measured.update(split_spread(ranks))
        if by := collective_spread(ranks):
            measured["collectives"] = by
    else:
        measured["comm"] = NO_NCCL_ON_CPU
    return {
        "version": RESULT_VERSION,
        "workload": workload,
        "parallel": run.parallel,
        "reshard_after_forward": run.reshard if run.parallel == "fsdp" else None,
        "world": len(ranks),
        "device": ranks[0]["device"],
        "precision": run.precision,
        "checkpoint": run.checkpoint,
        "batch_per_rank": run.batch,
        "seq": run.seq,
        "steps": run.steps,
        "warmup": run.warmup,
        "measured": measured,
        "ranks": ranks,
    }


def spread(xs: list[float]) -> dict[str, float]:
    """{"min", "median", "max"} of a figure over the ranks."""
    return {"min": min(xs), "median": statistics.median(xs), "max": max(xs)}


def split_spread(ranks: list[dict]) -> dict:
    """The job's waiting for other ranks and exposed transfer (`comm_wait_s`,
    `comm_transfer_exposed_s`: min / median / max over ranks, None where the ranks' NCCL
    kernels could not be matched) and `comm_split`, what the matching said."""
    comms = [r["comm"] for r in ranks]
    split = all(c.get("comm_transfer_exposed_s") is not None for c in comms)
    # every rank matched the same starts, so every rank's note is the same
    out: dict = {"comm_split": comms[0].get("comm_split", "not split")}
    for key in ("comm_wait_s", "comm_transfer_exposed_s"):
        out[key] = spread([c[key] for c in comms]) if split else None
    return out


def collective_spread(ranks: list[dict]) -> dict:
    """Per collective (all_gather, reduce_scatter, all_reduce, ...), its exposed transfer's
    min / median / max over the ranks (`transfer_exposed_s`), where every rank's NCCL kernels
    were split; {} where not."""
    comms = [r["comm"] for r in ranks]
    ops = sorted({op for c in comms for op in c.get("collectives", {})})
    out = {}
    for op in ops:
        xs = [c.get("collectives", {}).get(op, {}).get("transfer_exposed_s") for c in comms]
        if all(x is not None for x in xs):
            out[op] = {"transfer_exposed_s": spread(xs)}
    return out


def predict(make: Callable[[], Workload], target: Target, run: ParallelRun, world: int) -> dict:
    """The prediction of one rank's step (`gobrrr.estimate` with gpus=world, parallel=...;
    FSDP2 without resharding after forward through `passes.fsdp`, which `shard` does not
    expose), in the measured figures' keys."""
    graph = capture(
        make,
        precision=traced_precision(run.precision, world, run.parallel),
        checkpoint=run.checkpoint,
        sdpa=target_for(target.gpu.full_name),
    )
    if world > 1 and run.parallel == "fsdp" and not run.reshard:
        graph = fsdp(graph, world, 1, reshard_after_forward=False)
    elif world > 1:
        graph = shard(graph, run.parallel, world)
    est = evaluate(graph, target)
    return {
        "gpu": target.gpu.name,
        "calibrated": target.cal is not None,
        "peak_allocated": est.memory.peak,
        "peak_reserved": est.memory.reserved,
        "step_s": est.time.step_s,
        "comm_busy_s": est.time.comm_s,
        "comm_exposed_s": est.time.exposed_comm_s,
        "comm_by_collective": est.time.comm_by_collective,
    }


def errors(measured: dict, predicted: dict) -> dict:
    """predicted / measured - 1 for memory and step; exposed communication as predicted -
    measured seconds (a few ms, where a ratio says little) against the median rank's exposed
    transfer (the prediction's ranks run in lockstep: it predicts the transfer, not the
    waiting for other ranks), or, where the ranks' NCCL kernels were not matched, against the
    ranks' min exposed (the rank that waits least); `comm_exposed_against` says which. A
    figure not measured (the CPU's memory, NCCL) has no error."""
    out: dict = {}
    for k in ("peak_allocated", "peak_reserved", "step_s"):
        m = measured.get(k)
        out[k] = predicted[k] / m - 1 if m else None
    transfer, exposed = measured.get("comm_transfer_exposed_s"), measured.get("comm_exposed_s")
    if transfer:
        out["comm_exposed_s"] = predicted["comm_exposed_s"] - transfer["median"]
        out["comm_exposed_against"] = "comm_transfer_exposed_s median"
    elif exposed:
        out["comm_exposed_s"] = predicted["comm_exposed_s"] - exposed["min"]
        out["comm_exposed_against"] = "comm_exposed_s min"
    else:
        out["comm_exposed_s"] = None
    return out
