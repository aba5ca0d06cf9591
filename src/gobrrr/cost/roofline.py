"""Roofline time of one op on a target GPU (`time_op`), and what changes it: a compiled
step's fused kernels (`compiled_times`), an optimizer's measured host time
(`optimizer_host`). The step those times add up to is `gobrrr.schedule`'s.

Per kernel: device time = max(flops / achieved FLOP/s, bytes / achieved bandwidth) + a fixed
kernel latency. Per op: host time = the eager dispatch + launch cost.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from gobrrr.cost import conv, pad_mm
from gobrrr.cost._ops_attention import padded as attention_padded
from gobrrr.cost._ops_attention import variant as attention_variant
from gobrrr.cost._ops_offload import KINDS as OFFLOAD_KINDS
from gobrrr.cost._ops_rnn import step_dims as rnn_step_dims
from gobrrr.cost.curves import interp
from gobrrr.cost.flops import OpCost, op_cost
from gobrrr.cost.fusion import extern, fuse, regions
from gobrrr.cost.measured_ops import op_seconds, rnn_issue
from gobrrr.cost.offload import offload_times
from gobrrr.cost.rates import BATCH_NORMS, Rates
from gobrrr.cost.shapes import (
    alignment,
    gemm_dims,
    layout_bytes,
    misaligned,
    misaligned_nt,
    wave_efficiency,
)
from gobrrr.graph.ir import OpNode, StepGraph

MATMUL_MATH = ("bf16", "fp16", "fp8", "tf32", "fp32")


@dataclass(frozen=True)
class OpTime:
    """One op's predicted cost. Times in seconds; intensity in FLOP/byte."""

    index: int
    op: str
    module: str
    phase: str
    kind: str
    math: str
    flops: float
    bytes: float
    intensity: float
    compute_s: float
    memory_s: float
    device_s: float
    host_s: float
    regime: str  # "compute" | "memory" | "overhead" | "none" (views: no kernel)
    side_s: float = 0.0  # on the side stream of the host link (CPU offload's copies)
    # > 0: the op's kernels run as the host issues them (cuDNN's RNN, a kernel per step), the
    # last of them this long: it ends no sooner than its issue's end plus this
    streamed_s: float = 0.0

    @classmethod
    def of(
        cls,
        node: OpNode,
        cost: OpCost,
        *,
        host_s: float,
        regime: str,
        flops: float | None = None,
        bytes: float | None = None,  # noqa: A002 (the field's name)
        intensity: float | None = None,
        compute_s: float = 0.0,
        memory_s: float = 0.0,
        device_s: float = 0.0,
        side_s: float = 0.0,
        streamed_s: float = 0.0,
    ) -> OpTime:
        """The OpTime of `node`: its identity (index, op, module, phase) from the node, kind
        and math from its cost, FLOPs and bytes from the cost unless given, the intensity
        FLOPs / bytes unless given (infinite with no bytes)."""
        flops = cost.flops if flops is None else flops
        nbytes = cost.bytes if bytes is None else bytes
        return cls(
            node.index,
            node.op,
            node.module,
            node.phase,
            cost.kind,
            cost.math,
            flops,
            nbytes,
            intensity if intensity is not None else flops / nbytes if nbytes else math.inf,
            compute_s,
            memory_s,
            device_s,
            host_s,
            regime,
            side_s,
            streamed_s,
        )


# the `op_host` names: the CPU trace and CUDA pick different overloads of one op
_HOST_ALIASES = {
    **{n: "convolution" for n in conv.FORWARD},
    **{n: "native_batch_norm" for n, d in BATCH_NORMS.items() if d == "forward"},
}


def _measured(
    node: OpNode, cost: OpCost, device: float, host: float, streamed_s: float = 0.0
) -> OpTime:
    """The OpTime of an op whose device seconds a calibration grid measured (8-bit Adam, cuDNN
    RNNs, the pixel-wise ops): no roofline, overhead-bound where the host takes longer."""
    return OpTime.of(
        node,
        cost,
        intensity=cost.flops / max(cost.bytes, 1.0),
        memory_s=device,
        device_s=device,
        host_s=host,
        regime="overhead" if host >= device else "memory",
        streamed_s=streamed_s,
    )


def _host_op(name: str) -> str:
    """The `op_host` name of a traced op."""
    return _HOST_ALIASES.get(name, name)


def time_op(
    node: OpNode, cost: OpCost, rates: Rates, padded: bool = False, *, host_phase: str | None = None
) -> OpTime:
    """Roofline time of one op. `padded`: misaligned matmul dimensions were padded to
    alignment first (Inductor's pad_mm does this under torch.compile). `host_phase`: the
    host-cost key in place of the op's phase ("checkpointed": a forward op under
    checkpointing)."""
    if cost.kind in OFFLOAD_KINDS:  # the host's CPU and the host link, not the compute stream
        host, side = offload_times(node, cost, rates.cal)
        return OpTime.of(
            node, cost, flops=0.0, intensity=0.0, host_s=host, regime="none", side_s=side
        )
    host = rates.host(
        host_phase or node.phase, cost.launches, _host_op(node.name), cost.math, node.saved
    )
    if (measured8 := rates.adam8bit(node, cost.bytes)) is not None:
        device, host = measured8
        return _measured(node, cost, device, host)
    if cost.launches == 0:
        return OpTime.of(
            node, cost, flops=0.0, bytes=0.0, intensity=0.0, host_s=host, regime="none"
        )
    if (seconds := op_seconds(rates.cal, node)) is not None:  # a measured grid's time
        host, tail = rnn_issue(rates.cal, node) or (host, 0.0)  # cuDNN RNN: per-step launches
        return _measured(node, cost, seconds, host, streamed_s=tail)
    conv_rate = None
    dw_bw = rates.depthwise(node, cost.bytes) if cost.kind == "conv" else None
    if dw_bw is not None:  # CUDA-core kernels bound by memory and latency: its bandwidth
        rate = math.inf
    elif cost.kind == "attention":
        backward = "backward" in node.name or node.name.endswith("_bwd")
        seq, pad = attention_padded(node)  # the kernel works on whole tiles of positions
        rate = (
            rates.attention(
                cost.math, seq, "backward" if backward else "forward", attention_variant(node)
            )
            / pad
        )
    elif cost.kind == "conv" and (conv_rate := rates.conv(node, cost)) is not None:
        rate = conv_rate
    elif cost.math in MATMUL_MATH:
        dims = rnn_step_dims(node) if cost.kind == "rnn" else gemm_dims(node)
        rate = rates.matmul(cost.math, cost.flops, dims)
        if rates.cal is None:
            rate *= wave_efficiency(node, rates.gpu.sms)
        if cost.math != "fp32" and not padded and misaligned(node):
            rate *= rates.misaligned_fraction(cost.math, misaligned_nt(node), alignment(node))
        elif cost.kind == "loss" and cost.math != "fp32":
            rate *= fused_loss_fraction(node, cost, rates)
    else:
        rate = rates.gpu.peak("fp32")  # CUDA cores
    compute = cost.flops / rate if rate > 0 else 0.0
    memory = rates.embedding_backward(node)
    memory = (
        memory
        if memory is not None
        else cost.bytes
        / (
            dw_bw
            or rates.batch_norm(node)
            or rates.layer_norm(node)
            or rates.outer_sum(node)
            or rates.softmax(node)
            or rates.path(node, cost.kind, cost.bytes)
            or rates.sized(cost.kind, node.name, cost.bytes)
            or rates.bandwidth(cost.kind, node.name)
        )
    )
    latency = rates.latency * cost.launches
    device = max(compute, memory) + latency
    measured = conv_rate is not None or dw_bw is not None  # transposes included
    convert = 0.0 if measured else layout_bytes(node, cost)
    if convert:  # separate transpose kernels before and after the convolution
        device += convert / rates.bandwidth("copy") + 2 * rates.latency
    if cost.kind == "conv":  # the bias's add or gradient sum, copies of operands: own kernels
        device += rates.conv_bias(node) + rates.conv_copies(node)
    if host >= device:
        regime = "overhead"
    else:
        regime = "compute" if compute >= memory else "memory"
    return OpTime.of(
        node,
        cost,
        compute_s=compute,
        memory_s=memory,
        device_s=device,
        host_s=host,
        regime=regime,
    )


def fused_loss_fraction(node: OpNode, cost: OpCost, rates: Rates) -> float:
    """The fused linear + cross-entropy's achieved share of the aligned matmul rate. Its
    cuBLAS matmuls work on (chunk, V) logits chunks: with a vocabulary whose width in bytes is
    not a multiple of 16 (GPT-2's 50257) they take the misaligned paths, the forward's
    `h @ W.T` the transposed-weight one (`nt`), the gradients' the others. Their FLOPs are
    weighed by those paths' calibrated fractions (see Rates.misaligned_fraction)."""
    weight = node.inputs[1] if len(node.inputs) > 1 else None
    if weight is None or not weight.shape:
        return 1.0
    vocab, itemsize = weight.shape[0], 2 if cost.math in ("bf16", "fp16") else 4
    align = math.gcd(vocab * itemsize, 16)
    if align >= 16:
        return 1.0
    d = weight.shape[-1]
    n = node.inputs[0].numel // max(d, 1)
    fwd = 2.0 * n * d * vocab
    grads = max(cost.flops - fwd, 0.0)  # the gradient matmuls (and the few vector ops)
    f_nt = rates.misaligned_fraction(cost.math, True, align)
    f = rates.misaligned_fraction(cost.math, False, align)
    return cost.flops / (fwd / f_nt + grads / f)


def _per_tensor(points: list[list[float]], tensors: int) -> float:
    """Host seconds per parameter tensor of an optimizer step over `tensors` of them, from
    [[tensors, seconds], ...]: seconds per tensor interpolated in the count, held at the
    ends."""
    return interp([p[0] for p in points], [p[1] / p[0] for p in points], tensors)


def optimizer_host(graph: StepGraph, ops: tuple[OpTime, ...], rates: Rates) -> tuple[OpTime, ...]:
    """The optimizer step's host seconds as measured for its optimizer, by its number of
    parameter tensors and how many are large (the calibration's `optimizer_host`: per tensor
    at that count, the small and the large ones each at their own size's curve), in place of
    its ops' per-op costs, shared among them as those were. Unchanged where the graph does not
    name its optimizer or the calibration did not measure it."""
    info = graph.meta.optimizer
    curves = (rates.cal.optimizer_host if rates.cal else {}).get(info.key if info else "")
    idx = [o.index for o in ops if o.phase == "optimizer"]
    tensors, large = (info.tensors, info.large) if info else (0, 0)
    if not curves or not idx or tensors <= 0:
        return ops
    by_size = sorted((int(k), v) for k, v in curves.items())
    small_pts, large_pts = by_size[0][1], by_size[-1][1]
    total = (tensors - large) * _per_tensor(small_pts, tensors) + large * _per_tensor(
        large_pts, tensors
    )
    weights = graph.weights()
    before = sum(ops[i].host_s * weights[i] for i in idx)
    if before <= 0:
        return ops
    out = list(ops)
    for i in idx:
        out[i] = replace(ops[i], host_s=ops[i].host_s * total / before)
    return tuple(out)


def compiled_times(
    graph: StepGraph, costs: list[OpCost], ops: tuple[OpTime, ...], rates: Rates
) -> tuple[OpTime, ...]:
    """Replace each fused group by one kernel; compiled code launches kernels from a
    generated wrapper, so no per-op eager dispatch cost remains. A misaligned 16-bit matmul
    runs at the aligned rate on padded copies of its operands (pad_mm), whose copy kernels
    (each reads its operand and writes the padded copy: `cost.pad_mm`) it pays for."""
    out = list(ops)
    region = regions(graph)
    pads = pad_mm.by_op(graph, costs)
    for o in ops:
        if region[o.index] >= 0 and extern(graph.nodes[o.index], costs[o.index]):
            t = time_op(graph.nodes[o.index], costs[o.index], rates, padded=True)
            if copies := pads.get(o.index):
                moved = sum(src.nbytes + nbytes for src, nbytes in copies)
                copy_s = moved / rates.bandwidth("copy") + rates.latency * len(copies)
                t = replace(t, bytes=t.bytes + moved, device_s=t.device_s + copy_s)
            launches = max(costs[o.index].launches, 1) + len(copies or ())
            out[o.index] = replace(t, host_s=rates.launch * launches)
    for g in fuse(graph, costs):
        first = graph.nodes[g.nodes[0]]
        t = time_op(first, g.cost, rates)
        out[first.index] = replace(
            t, op=f"fused[{len(g.nodes)} ops]", kind="fused", host_s=rates.launch * g.cost.launches
        )
        for i in g.nodes[1:]:
            out[i] = replace(
                ops[i],
                flops=0.0,
                bytes=0.0,
                compute_s=0.0,
                memory_s=0.0,
                device_s=0.0,
                host_s=0.0,
                regime="none",
            )
    return tuple(out)


MODEL_PHASES = ("forward", "backward")


def model_flops(graph: StepGraph, costs: list[OpCost] | None = None) -> float:
    """Model FLOPs of one step: the FLOPs of the traced forward and backward, without
    recomputation (a checkpointed step's recomputed forward and the optimizer are left out).
    The same definition for every model: a CNN's convolutions, a ViT's patches, only the
    experts an MoE routes to, as they ran. `costs`: the nodes' costs, if already computed."""
    costs = costs if costs is not None else [op_cost(n) for n in graph.nodes]
    return sum(
        c.flops * w
        for n, c, w in zip(graph.nodes, costs, graph.weights(), strict=True)
        if n.phase in MODEL_PHASES
    )


def model_flops_6n(graph: StepGraph) -> float:
    """Model FLOPs by the 6·N + attention convention (PaLM, Chowdhery et al. 2022, App. B):
    6 · N · tokens for the parameters that take part in matmuls (embedding lookups excluded,
    a tied output head included) plus 3 × the forward score and value matmuls over the full
    S×S (12·L·d·S per token, not halved for causal). Meaningful for dense transformers only:
    it counts images as tokens and every expert of an MoE."""
    n = graph.meta.trainable_params - graph.meta.embedding_params
    attn = 0.0
    for node, w in zip(graph.nodes, graph.weights(), strict=True):
        if node.phase == "forward" and _is_attention_forward(node):
            q, k = node.inputs[0], node.inputs[1]
            b, h, s_q, d = _bhsd(q)
            s_k = k.shape[-2]
            attn += 4.0 * b * h * s_q * s_k * d * w
    return 6.0 * n * graph.meta.tokens + 3.0 * attn


def _is_attention_forward(node: OpNode) -> bool:
    name = node.name
    return ("scaled_dot_product" in name and "backward" not in name) or name == "attention_fwd"


def _bhsd(t) -> tuple[int, int, int, int]:
    shape = t.shape
    if len(shape) == 4:
        return shape[0], shape[1], shape[2], shape[3]
    if len(shape) == 3:
        return 1, shape[0], shape[1], shape[2]
    return 1, 1, shape[-2], shape[-1]
