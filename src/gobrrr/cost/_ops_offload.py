"""CPU offload's ops (gobrrr.training.offload): what each moves or computes, no GPU kernel.

gobrrr.offload_grad_d2h(param): a gradient's copy to pinned host memory, the parameter's
    bytes (gradients have the parameter's shape and dtype), kind "d2h";
gobrrr.offload_param_h2d(param): the updated parameter's copy back, its bytes, kind "h2d";
gobrrr.offload_cpu_step(param): the base optimizer's step on the CPU, kind "cpu_step": no GPU
    bytes and no GPU FLOPs (MFU and HFU count the GPU's work only).
Their times come from the calibration's "offload" section (cost/offload.py)."""

from __future__ import annotations

from gobrrr.cost._ops_common import CostFn, OpCost, read_bytes
from gobrrr.graph.ir import OpNode

KINDS = ("d2h", "h2d", "cpu_step")


def _param_bytes(node: OpNode) -> float:
    return float(read_bytes(node.inputs[0])) if node.inputs else 0.0


def grad_d2h(node: OpNode, tf32: bool) -> OpCost:
    return OpCost(0.0, _param_bytes(node), "vector", "d2h", 1)


def param_h2d(node: OpNode, tf32: bool) -> OpCost:
    return OpCost(0.0, _param_bytes(node), "vector", "h2d", 1)


def cpu_step(node: OpNode, tf32: bool) -> OpCost:
    return OpCost(0.0, 0.0, "vector", "cpu_step", 0)


COSTS: dict[str, CostFn] = {
    "gobrrr.offload_grad_d2h": grad_d2h,
    "gobrrr.offload_param_h2d": param_h2d,
    "gobrrr.offload_cpu_step": cpu_step,
}
