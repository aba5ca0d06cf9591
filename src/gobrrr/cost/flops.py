"""Per-op FLOPs and minimal HBM bytes for the nodes of a step graph.

`op_cost(node)` says what one ATen (or gobrrr) op costs on a GPU in eager mode: FLOPs, the
bytes it must move at least (each input read once, each output written once), which peak
applies (a tensor-core dtype or "vector"), what kind of op it is and how many kernels it
launches. Conventions are documented next to each family:
  matmuls and convolutions: _ops_matmul (match torch.utils.flop_counter exactly),
  attention: _ops_attention (FlashAttention convention, causal halved),
  pointwise, reductions, copies and views: _ops_pointwise,
  norms, softmax, embedding, losses, scatter: _ops_norm,
  optimizer (foreach and fused): _ops_optim,  gobrrr's kernels: _ops_gobrrr,
  CPU offload's copies and CPU steps: _ops_offload,  c10d's collectives: _ops_comm,
  bitsandbytes' dequantization, 4-bit matmul and optimizers: _ops_bnb.
An op nobody knows gets a conservative pointwise-like default and its name lands in
UNKNOWN_OPS, so reports can list what was guessed.
"""

from __future__ import annotations

from gobrrr.cost import (
    _ops_attention,
    _ops_bnb,
    _ops_comm,
    _ops_gobrrr,
    _ops_matmul,
    _ops_norm,
    _ops_offload,
    _ops_optim,
    _ops_pointwise,
    _ops_rnn,
)
from gobrrr.cost._ops_common import CostFn, OpCost, Tf32, first_out, io_bytes, tf32_of, vector
from gobrrr.graph.ir import OpNode, StepGraph

__all__ = ["OpCost", "UNKNOWN_OPS", "graph_costs", "op_cost", "register_cost"]

UNKNOWN_OPS: set[str] = set()  # ops costed by the default (unknown, or their formula failed)

_REGISTRY: dict[str, CostFn] = {}
for _module in (
    _ops_pointwise,
    _ops_norm,
    _ops_matmul,
    _ops_attention,
    _ops_optim,
    _ops_gobrrr,
    _ops_offload,
    _ops_comm,
    _ops_rnn,
    _ops_bnb,
):
    _REGISTRY.update(_module.COSTS)


def register_cost(op: str, fn: CostFn) -> None:
    """Cost `op` with `fn(node, tf32) -> OpCost`. `op` is an overload ("aten.mm.default") or a
    whole op ("aten.mm", "gobrrr.rms_norm_fwd"); an overload's entry wins over its op's."""
    if not callable(fn):
        raise ValueError(f"register_cost({op!r}, ...): fn must be callable, got {fn!r}")
    if op.count(".") not in (1, 2):
        raise ValueError(f"register_cost: op {op!r} must look like 'aten.mm' or 'aten.mm.default'")
    _REGISTRY[op] = fn


def _lookup(node: OpNode) -> CostFn | None:
    op = node.op
    packet = ".".join(op.split(".")[:2])
    fn = _REGISTRY.get(op) or _REGISTRY.get(packet)
    if fn is None and node.name.startswith("_foreach_"):
        fn = _ops_optim.foreach
    if fn is None and op.startswith(("profiler.", "prim.")):  # markers and metadata: no kernel
        fn = _ops_pointwise.view
    return fn


def default_cost(node: OpNode) -> OpCost:
    """Conservative guess for an unknown op: inputs + outputs bytes, 1 FLOP per output
    element, one launch."""
    out = first_out(node)
    n = sum(t.numel for t in node.outputs) if node.outputs else (out.numel if out else 0)
    return vector(n, io_bytes(node), "other")


DEFAULT_TF32 = Tf32()


def op_cost(node: OpNode, tf32: Tf32 | bool = DEFAULT_TF32) -> OpCost:
    """FLOPs, minimal bytes, peak, kind and kernel launches of one op. `tf32`: fp32 matmuls
    and convolutions run on TF32 tensor cores. Never raises on an op it does not know."""
    fn = _lookup(node)
    if fn is not None:
        try:
            return fn(node, tf32)
        except (IndexError, KeyError, TypeError, ValueError, AttributeError, ZeroDivisionError):
            pass  # an unexpected argument layout: fall back rather than stop the report
    UNKNOWN_OPS.add(node.op)
    return default_cost(node)


def graph_costs(graph: StepGraph) -> list[OpCost]:
    """op_cost of every node, in order, under the TF32 settings the graph was traced with."""
    tf32 = tf32_of(graph.meta)
    return [op_cost(node, tf32) for node in graph.nodes]
