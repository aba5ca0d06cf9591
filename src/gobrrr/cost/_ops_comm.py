"""c10d's collectives as a data-parallel pass puts them in a step (`passes.ddp`, `passes.fsdp`):
each moves its WHOLE buffer (the all-reduce's tensor, the all-gather's output, the
reduce-scatter's input: `cost.collectives`' convention), no FLOPs, kind "comm". Their time is
not a roofline: `cost.comm.comm_time` reads it off the calibration's collective curves on the
comm stream.

c10d.allreduce_.default(tensors): an all-reduce of its (one) input, in place;
c10d._allgather_base_.default(output, input): an all-gather into `output`;
c10d._reduce_scatter_base_.default(output, input): a reduce-scatter of `input`.

fsdp.hooks.default(): FSDP2's Python around one unit's forward or backward (args: phase,
parameter tensors, reshard_after_forward): no kernel, host time only, read off the
calibration's `dp_host` (`cost.dp_host`) by `evaluate`."""

from __future__ import annotations

from gobrrr.cost._ops_common import CostFn, OpCost
from gobrrr.graph.ir import OpNode

KIND = "comm"
HOOK_KIND = "hook"
HOOKS = "fsdp.hooks.default"

#: op name -> the collective (`cost.collectives.COLLECTIVES`) and the argument holding the
#: whole buffer: "in" (first input) or "out" (first output)
COLLECTIVE_OF = {
    "c10d.allreduce_.default": ("all_reduce", "in"),
    "c10d._allgather_base_.default": ("all_gather", "out"),
    "c10d._reduce_scatter_base_.default": ("reduce_scatter", "in"),
}


def whole_bytes(node: OpNode) -> float:
    """Bytes of the collective's whole buffer."""
    _, where = COLLECTIVE_OF[node.op]
    ts = node.inputs if where == "in" else node.outputs
    ts = ts or node.inputs or node.outputs
    return float(ts[0].nbytes) if ts else 0.0


def collective(node: OpNode, tf32: bool) -> OpCost:
    return OpCost(0.0, whole_bytes(node), "vector", KIND, 1)


def hooks(node: OpNode, tf32: bool) -> OpCost:
    return OpCost(0.0, 0.0, "vector", HOOK_KIND, 0)


COSTS: dict[str, CostFn] = {**dict.fromkeys(COLLECTIVE_OF, collective), HOOKS: hooks}
