"""What a measured step's FLOPs and throughput are counted in: the traced step graph, by the
same definitions `gobrrr estimate` uses (cost.roofline `model_flops`, estimate
`throughput_unit`), so a profile's MFU and HFU mean what an estimate's mean."""

from __future__ import annotations

from dataclasses import dataclass

from gobrrr.capture import capture
from gobrrr.capture.sdpa import target_for
from gobrrr.cost.flops import op_cost
from gobrrr.cost.roofline import model_flops, model_flops_6n
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import throughput_unit
from gobrrr.graph.ir import StepGraph
from gobrrr.workload import Workload

MFU_DEFINITION = (
    "MFU: model FLOPs (the traced forward and backward, without recomputation) "
    "per second over the peak"
)
HFU_DEFINITION = (
    "HFU: every FLOP the traced step runs (recompute, optimizer) per second over the same peak"
)


@dataclass(frozen=True)
class StepFlops:
    """FLOPs of one step and the unit its throughput is counted in.

    `model`: the traced forward and backward without recomputation (MFU's numerator);
    `executed`: every op of the traced step, recompute and optimizer included (HFU's), so
    model <= executed. `palm`: 6·N·T + attention (PaLM's convention), for sequence workloads
    only, else None. `unit`: "tokens" or "samples"; `units`: how many per step. `source` says
    where the counts come from ("traced step graph", or why there are none).
    """

    model: float
    executed: float
    palm: float | None
    unit: str
    units: int
    source: str


def step_flops(graph: StepGraph) -> StepFlops:
    """The counts of a traced step (no GPU, no time: FLOPs of the graph's ops)."""
    tf32 = graph.meta.tf32_mode
    costs = [op_cost(n, tf32) for n in graph.nodes]
    palm = float(model_flops_6n(graph)) if graph.meta.seq_len else None
    return StepFlops(
        model=float(model_flops(graph, costs)),
        executed=float(sum(c.flops for c in costs)),
        palm=palm,
        unit=throughput_unit(graph),
        units=int(graph.meta.tokens or 0),
        source="traced step graph",
    )


def traced_flops(
    workload: Workload, precision: str, checkpoint: str, gpu_name: str | None = None
) -> StepFlops:
    """Trace `workload`'s step with gobrrr.capture (on the CPU, under fake tensors: seconds,
    no memory; the user's model is left untouched) and count its FLOPs. `gpu_name` (CUDA's
    device name) picks the attention backends the trace takes, as on that GPU. A step the
    trace cannot follow gets no FLOPs (StepFlops.source says why), not a failed profile."""
    sdpa = target_for(gpu_name) if gpu_name else None
    try:
        graph = capture(workload, precision=precision, checkpoint=checkpoint, sdpa=sdpa)
    except GobrrrError as e:
        return untraced(workload, f"none: the step could not be traced ({e})")
    return step_flops(graph)


def untraced(workload: Workload | None, why: str) -> StepFlops:
    """No FLOPs counted; throughput still in the workload's unit where it is known."""
    if workload is None:
        return StepFlops(0.0, 0.0, None, "samples", 0, why)
    unit = "tokens" if workload.seq_len else "samples"
    return StepFlops(0.0, 0.0, None, unit, workload.token_count(), why)
