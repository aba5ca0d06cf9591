"""Roofline time of every op on a target GPU, and the step time they add up to.

Per kernel: device time = max(flops / achieved FLOP/s, bytes / achieved bandwidth) + a fixed
kernel latency. Per op: host time = the eager dispatch + launch cost. The step is simulated
as two queues, the host issuing ops in order and the device running them as soon as they are
issued and the previous kernel is done; when the host is slower than the device, the device
idles and the step is overhead-bound.
"""

from __future__ import annotations

import math
from collections import defaultdict
from dataclasses import dataclass, field, replace

from gobrrr.cost import conv
from gobrrr.cost._ops_attention import padded as attention_padded
from gobrrr.cost._ops_attention import variant as attention_variant
from gobrrr.cost._ops_common import tf32_of
from gobrrr.cost._ops_offload import KINDS as OFFLOAD_KINDS
from gobrrr.cost._ops_optim import quantized
from gobrrr.cost.curves import curve, grid, grid_value, interp, measured
from gobrrr.cost.flops import OpCost, op_cost
from gobrrr.cost.offload import offload_times
from gobrrr.cost.shapes import (
    CHECKPOINT_PHASES,
    alignment,
    channels_last_strides,
    checkpointed_modules,
    conv_class,
    conv_directions,
    conv_layout,
    conv_points,
    depthwise,
    depthwise_class,
    gemm_dims,
    host_key,
    layout_bytes,
    misaligned,
    misaligned_nt,
    outer_sum_columns,
    selective_modules,
    wave_efficiency,
)
from gobrrr.graph import OpNode, StepGraph
from gobrrr.hardware import Calibration, GpuSpec
from gobrrr.precision import peak_mode

MATMUL_MATH = ("bf16", "fp16", "fp8", "tf32", "fp32")
# Fraction of the dense matmul rate fused attention kernels reach without a calibration
# (FlashAttention-2 on an H100: ~35-55% of peak for fwd+bwd).
ATTENTION_EFFICIENCY = 0.45
# Achieved fraction of the aligned tensor-core rate with a misaligned leading dimension, when
# no calibration measured it (cuBLAS falls back to 1-element-aligned kernels).
MISALIGNED_FRACTION = 0.2
VIEW_HOST_FRACTION = 0.3  # a metadata-only op costs this share of a launch in host time


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


@dataclass(frozen=True)
class Prediction:
    """The step on one GPU. Times in seconds, FLOP/s as fractions of the dense peak."""

    gpu: str
    calibrated: bool
    ops: tuple[OpTime, ...] = field(repr=False)
    step_s: float
    device_s: float
    host_s: float
    idle_s: float
    flops: float
    model_flops: float
    tokens: int
    peak_flops: float
    phase_s: dict[str, float]
    regime_s: dict[str, float]

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.step_s if self.step_s > 0 else 0.0

    @property
    def mfu(self) -> float:
        """Model FLOPs per second over `peak_flops`, the precision's dense matmul peak. Model
        FLOPs: those of the traced forward and backward, without recomputation (see
        `model_flops`), so MFU <= HFU."""
        return self.model_flops / self.step_s / self.peak_flops if self.step_s > 0 else 0.0

    @property
    def hfu(self) -> float:
        """Every FLOP the step runs (recompute and optimizer included) per second over the
        same peak."""
        return self.flops / self.step_s / self.peak_flops if self.step_s > 0 else 0.0

    def regime_share(self) -> dict[str, float]:
        """Share of the step's time by regime; idle device time counts as overhead."""
        total = self.step_s or 1.0
        out = {k: v / total for k, v in self.regime_s.items()}
        out["overhead"] = out.get("overhead", 0.0) + self.idle_s / total
        return out

    def by_module(self, depth: int = 2) -> dict[str, float]:
        out: dict[str, float] = defaultdict(float)
        for o in self.ops:
            out[".".join((o.module or "<top>").split(".")[:depth])] += o.device_s
        return dict(sorted(out.items(), key=lambda kv: -kv[1]))

    def backward_forward_ratio(self) -> float:
        fwd = sum(o.flops for o in self.ops if o.phase == "forward")
        bwd = sum(o.flops for o in self.ops if o.phase in ("backward", "recompute"))
        return bwd / fwd if fwd else 0.0


class Rates:
    """Achieved FLOP/s and bytes/s on one GPU, from a calibration or the spec."""

    def __init__(self, gpu: GpuSpec, cal: Calibration | None) -> None:
        self.gpu, self.cal = gpu, cal
        eff_bw = gpu.bandwidth * gpu.bandwidth_efficiency
        self.copy_bw = cal.copy_bandwidth if cal else eff_bw
        self.pointwise_bw = cal.pointwise_bandwidth if cal else eff_bw
        self.reduction_bw = cal.reduction_bandwidth if cal else eff_bw
        self.launch = cal.launch_overhead if cal else gpu.launch_overhead
        self.latency = cal.kernel_latency if cal else gpu.kernel_latency

    def matmul(self, math_mode: str, flops: float, dims: tuple[float, float] | None = None
               ) -> float:
        """Achieved FLOP/s of a matmul-class kernel doing `flops` in `math_mode`; `dims` =
        (output elements, depth k) when known, looked up in the calibration's grid."""
        if self.cal and dims and self.cal.matmul_grid.get(math_mode):
            return grid(self.cal.matmul_grid[math_mode], *dims)
        if self.cal and dims and math_mode == "fp16" and self.cal.matmul_grid.get("bf16"):
            # the same tensor cores: bf16's shape dependence, at fp16's measured rate
            scale = self.cal.matmul_flops.get("fp16", 1.0) / self.cal.matmul_flops.get("bf16", 1.0)
            return grid(self.cal.matmul_grid["bf16"], *dims) * scale
        if self.cal and math_mode in self.cal.matmul_flops:
            rate = self.cal.matmul_flops[math_mode]
            return rate * curve(self.cal.matmul_curve.get(math_mode), flops)
        return self.gpu.peak(math_mode) * self.gpu.matmul_efficiency

    def conv(self, node: OpNode, cost: OpCost) -> float | None:
        """Measured FLOP/s of a cuDNN convolution at its implicit-GEMM dims, for its layout,
        shape class and direction (a backward asking for both gradients at the rate measured
        so, else each gradient at its own rate, summed as times), transposes included where
        the layout needs them; None without a convolution grid. A grid without layouts
        (calibrations before them, measured on channels-first tensors over all shapes, both
        gradients together) is read as it always was."""
        dims = gemm_dims(node)
        by_mode = self.cal.conv_grid if self.cal and dims else {}
        mode = cost.math
        if mode == "fp16" and "fp16" not in by_mode and "bf16" in by_mode:
            mode = "bf16"  # the same tensor cores and kernels
        table = by_mode.get(mode)
        if not table:
            return None
        layout, cls = conv_layout(node), conv_class(node)
        parts = conv_directions(node, cost.flops)
        if len(parts) == 2 and (both := conv_points(table, layout, cls, "backward")):
            return grid(both, *dims)  # both gradients, measured in one call as they run
        seconds = 0.0
        for direction, flops in parts.items():
            points = conv_points(table, layout, cls, direction)
            if points is None:
                break
            seconds += flops / grid(points, *dims)
        else:
            if seconds > 0:
                return sum(parts.values()) / seconds
        old = table.get("backward" if node.name.endswith("backward") else "forward")
        return grid(old, *dims) if old else None

    def depthwise(self, node: OpNode, nbytes: float) -> float | None:
        """Measured bytes/s of a depthwise convolution this size, for its layout and kernel
        class where measured, or None (not depthwise, or no measurement)."""
        if not self.cal or not depthwise(node):
            return None
        direction = "backward" if node.name.endswith("backward") else "forward"
        layout, cls = conv_layout(node), depthwise_class(node)
        return measured(self.cal.depthwise_bandwidth, direction, node.inputs[0].dtype, nbytes,
                         (f"{layout}:{cls}", f"{layout}:{cls.split('-')[0]}", f"{layout}:3x3"))

    def batch_norm(self, node: OpNode) -> float | None:
        """Measured bytes/s of a training-mode batch norm at its channel count, rows (N·H·W),
        dtype and layout (the calibration's grid; else its curve over channels), or None."""
        direction = BATCH_NORMS.get(node.name)
        if not direction or not self.cal or not node.inputs:
            return None
        x = node.inputs[0] if direction == "forward" else (node.inputs[1:2] or node.inputs)[0]
        if len(x.shape) < 2:
            return None
        layout = ("channels_last",) if channels_last_strides(x) else ()
        key = f"{direction}:{'bf16' if x.dtype in ('bfloat16', 'float16') else 'fp32'}"
        points = self.cal.batch_norm_grid.get(":".join((key, *layout)))
        if points:
            return grid_value(points, x.shape[1], x.numel / x.shape[1])
        return measured(self.cal.batch_norm_bandwidth, direction, x.dtype, x.shape[1], layout)

    def sized(self, kind: str, name: str, nbytes: float) -> float | None:
        """Measured bytes/s of a copy or pointwise kernel moving `nbytes` (the calibration's
        curve over size), unless the op has a bandwidth of its own; else None."""
        if not self.cal or kind not in ("copy", "pointwise") or name in self.cal.op_bandwidth:
            return None
        points = self.cal.size_bandwidth.get(kind)
        if not points or nbytes <= 0:
            return None
        return interp([math.log(p[0]) for p in points], [p[1] for p in points],
                       math.log(nbytes))

    def layer_norm(self, node: OpNode) -> float | None:
        """Measured bytes/s of native_layer_norm or its backward at its width, rows and input
        dtype (the calibration's grid), or None."""
        if node.name not in ("native_layer_norm", "native_layer_norm_backward") or \
                not self.cal or not node.inputs:
            return None
        x = node.inputs[1 if node.name.endswith("backward") else 0]
        key = "bf16" if x.dtype in ("bfloat16", "float16") else "fp32"
        points = self.cal.layer_norm_grid.get(f"{node.name}:{key}")
        if not points or not x.shape:
            return None
        return grid_value(points, x.shape[-1], x.numel / x.shape[-1])

    def embedding_backward(self, node: OpNode) -> float | None:
        """Seconds of embedding_dense_backward(grad (.., D), indices, V, ...) from the
        calibration's fit (the (V, D) gradient written, the T tokens' D values summed into
        their rows, a fixed part), or None."""
        fit = self.cal.embedding_backward if self.cal else None
        if node.name != "embedding_dense_backward" or not fit or not node.inputs:
            return None
        g = node.inputs[0]
        d, s = g.shape[-1] if g.shape else 1, g.itemsize
        v = int(node.arg(2, "num_weights", 0))
        return (v * d * s / fit["fill_Bps"] + g.numel / fit["token_values_per_s"] +
                fit["fixed_s"])

    def outer_sum(self, node: OpNode) -> float | None:
        """Measured bytes/s of a sum over leading dimensions at its output size and dtype (the
        calibration's curve), or None."""
        cols = outer_sum_columns(node)
        if cols is None or not self.cal:
            return None
        return measured(self.cal.outer_sum_bandwidth, "sum", node.inputs[0].dtype, cols)

    def misaligned_fraction(self, math_mode: str, nt: bool = False, align: int | None = None
                            ) -> float:
        """Achieved fraction of the aligned rate when a leading dimension is not 16-byte
        aligned (tensor-core modes only; CUDA-core fp32 kernels do not care). `nt`: the odd
        dimension is the output's and the second operand a transposed weight (a linear
        layer's forward), measured apart where calibrated."""
        by_align = self.cal.matmul_misaligned if self.cal else {}
        key = f"{'nt:' if nt else ''}{math_mode}@{align}"
        if align and key in by_align:  # measured at this alignment (2, 4 or 8 bytes)
            return by_align[key]
        if self.cal and nt and f"nt:{math_mode}" in self.cal.matmul_misaligned:
            return self.cal.matmul_misaligned[f"nt:{math_mode}"]
        if self.cal and math_mode in self.cal.matmul_misaligned:
            return self.cal.matmul_misaligned[math_mode]
        return MISALIGNED_FRACTION

    def attention(self, math_mode: str, seq: int | None = None,
                  direction: str | None = None, variant: str | None = None) -> float:
        """Achieved FLOP/s of a fused attention kernel (FlashAttention's FLOP count), in this
        direction ("forward" / "backward") where the calibration measured it apart, for this
        kernel variant (`_ops_attention.variant`: mask, dropout, head dim) where it measured
        that variant (at another head dim when not at this one)."""
        key = "fp32" if math_mode in ("fp32", "tf32") else "bf16"
        curves = self.cal.attention_curve if self.cal else {}
        pts = None
        if seq and direction and variant:
            pts = _variant_curve(curves, f"{direction}:{key}", variant)
        if pts is None and seq and direction and curves.get(f"{direction}:{key}"):
            pts = curves[f"{direction}:{key}"]
        if pts is None and seq and curves.get(key):
            pts = curves[key]
        if pts:
            return interp([math.log(p[0]) for p in pts], [p[1] for p in pts], math.log(seq))
        if self.cal and self.cal.attention_flops and key in self.cal.attention_flops:
            return self.cal.attention_flops[key]
        return self.gpu.peak(math_mode) * ATTENTION_EFFICIENCY

    def host(self, phase: str, launches: int, op: str = "", math_mode: str = "") -> float:
        """Host seconds to issue one op: the measured per-op cost of an eager training step in
        this phase (calibrated), plus a launch for each kernel past the first, plus what this
        op costs the host beyond an ordinary one where that was measured (cuDNN's
        convolutions and batch norm: `op_host`, keyed "name:dtype"). gobrrr's own kernel ops
        cost what was measured for them (`kernel_host`) instead."""
        if self.cal and op in self.cal.kernel_host:
            return self.cal.kernel_host[op]
        per_op = self.cal.op_overhead if self.cal else {}
        key = phase
        if key.endswith("_selective") and key not in per_op:  # not measured: as full
            key = key.removesuffix("_selective")
        if key in CHECKPOINT_PHASES and key not in per_op:
            key = "forward"
        if key in per_op:
            extra = self.cal.op_host.get(f"{op}:{_host_dtype(math_mode)}", 0.0)
            return per_op[key] + self.launch * max(launches - 1, 0) + extra
        if launches == 0:
            return self.launch * VIEW_HOST_FRACTION
        return self.launch * launches

    def adam8bit(self, node: OpNode, nbytes: float) -> tuple[float, float] | None:
        """(device s, host s) of one torchao 8-bit Adam update moving `nbytes`, from the
        calibration's `optim8` section: the device time over bytes interpolated log-log (past
        the grid, at its last point's bytes/s; under it, its first point's time); the host's
        per update as measured with parameters of distinct shapes (a model's: each call's
        guards are checked against the other shapes' compiled entries first), else of one
        shape; None without the section (the op is then costed as any other: its bytes at
        the pointwise bandwidth, the eager per-op host cost)."""
        sec = self.cal.optim8 if self.cal else None
        if not sec or node.name != "adam8bit_update" or not node.inputs:
            return None
        small = not quantized(node.inputs[0].numel)
        pts = sec.get("device_small" if small else "device") or sec.get("device")
        if not pts:
            return None
        if nbytes >= pts[-1][0]:
            device = nbytes * pts[-1][1] / pts[-1][0]
        elif nbytes <= pts[0][0]:
            device = pts[0][1]
        else:
            device = math.exp(interp([math.log(p[0]) for p in pts],
                                     [math.log(p[1]) for p in pts], math.log(nbytes)))
        return device, sec.get("host_distinct") or sec["host"]

    def bandwidth(self, kind: str, name: str = "") -> float:
        """Achieved bytes/s for an op of this kind: the op's own measured bandwidth where the
        calibration has it, else the kind's."""
        if self.cal and name in self.cal.op_bandwidth:
            return self.cal.op_bandwidth[name]
        if kind in ("reduction", "norm", "softmax", "loss"):
            return self.reduction_bw
        if kind in ("copy",):
            return self.copy_bw
        return self.pointwise_bw


BATCH_NORMS = {
    "native_batch_norm": "forward", "_native_batch_norm_legit": "forward",
    "_native_batch_norm_legit_functional": "forward", "cudnn_batch_norm": "forward",
    "_batch_norm_with_update": "forward", "native_batch_norm_backward": "backward",
    "cudnn_batch_norm_backward": "backward", "batch_norm_backward": "backward",
}

# the `op_host` names: the CPU trace and CUDA pick different overloads of one op
_HOST_ALIASES = {**{n: "convolution" for n in conv.FORWARD},
                 **{n: "native_batch_norm" for n, d in BATCH_NORMS.items() if d == "forward"}}


def _host_op(name: str) -> str:
    """The `op_host` name of a traced op."""
    return _HOST_ALIASES.get(name, name)


def _host_dtype(math_mode: str) -> str:
    """The dtype key of `op_host`: 16-bit math as measured in bf16, everything else fp32."""
    return "bf16" if math_mode in ("bf16", "fp16") else "fp32"


def time_op(node: OpNode, cost: OpCost, rates: Rates, padded: bool = False, *,
            host_phase: str | None = None) -> OpTime:
    """Roofline time of one op. `padded`: misaligned matmul dimensions were padded to
    alignment first (Inductor's pad_mm does this under torch.compile). `host_phase`: the
    host-cost key in place of the op's phase ("checkpointed": a forward op under
    checkpointing)."""
    if cost.kind in OFFLOAD_KINDS:  # the host's CPU and the host link, not the compute stream
        host, side = offload_times(node, cost, rates.cal)
        return OpTime(node.index, node.op, node.module, node.phase, cost.kind, cost.math,
                      0.0, cost.bytes, 0.0, 0.0, 0.0, 0.0, host, "none", side)
    host = rates.host(host_phase or node.phase, cost.launches, _host_op(node.name), cost.math)
    if (measured8 := rates.adam8bit(node, cost.bytes)) is not None:
        device, host = measured8
        return OpTime(node.index, node.op, node.module, node.phase, cost.kind, cost.math,
                      cost.flops, cost.bytes, cost.flops / max(cost.bytes, 1.0), 0.0, device,
                      device, host, "overhead" if host >= device else "memory")
    if cost.launches == 0:
        return OpTime(node.index, node.op, node.module, node.phase, cost.kind, cost.math,
                      0.0, 0.0, 0.0, 0.0, 0.0, 0.0, host, "none")
    conv_rate = None
    dw_bw = rates.depthwise(node, cost.bytes) if cost.kind == "conv" else None
    if dw_bw is not None:  # CUDA-core kernels bound by memory and latency: its bandwidth
        rate = math.inf
    elif cost.kind == "attention":
        backward = "backward" in node.name or node.name.endswith("_bwd")
        seq, pad = attention_padded(node)  # the kernel works on whole tiles of positions
        rate = rates.attention(cost.math, seq, "backward" if backward else "forward",
                               attention_variant(node)) / pad
    elif cost.kind == "conv" and (conv_rate := rates.conv(node, cost)) is not None:
        rate = conv_rate
    elif cost.math in MATMUL_MATH:
        rate = rates.matmul(cost.math, cost.flops, gemm_dims(node))
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
    memory = memory if memory is not None else cost.bytes / (
        dw_bw or rates.batch_norm(node) or rates.layer_norm(node) or rates.outer_sum(node) or
                           rates.sized(cost.kind, node.name, cost.bytes) or
                           rates.bandwidth(cost.kind, node.name))
    latency = rates.latency * cost.launches
    device = max(compute, memory) + latency
    measured = conv_rate is not None or dw_bw is not None  # transposes included
    convert = 0.0 if measured else layout_bytes(node, cost)
    if convert:  # separate transpose kernels before and after the convolution
        device += convert / rates.bandwidth("copy") + 2 * rates.latency
    if host >= device:
        regime = "overhead"
    else:
        regime = "compute" if compute >= memory else "memory"
    intensity = cost.flops / cost.bytes if cost.bytes else math.inf
    return OpTime(node.index, node.op, node.module, node.phase, cost.kind, cost.math,
                  cost.flops, cost.bytes, intensity, compute, memory, device, host, regime)


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


def _variant_curve(curves: dict, prefix: str, variant: str) -> list | None:
    """The calibrated curve of `variant` ("<mask>:d<D>") under `prefix` ("<direction>:<dtype>"),
    else the same mask's curve at the nearest measured head dim, else None."""
    if f"{prefix}:{variant}" in curves:
        return curves[f"{prefix}:{variant}"]
    mask, d = variant.rsplit(":d", 1)
    dims = [int(k.rsplit(":d", 1)[1]) for k in curves
            if k.startswith(f"{prefix}:{mask}:d")]
    if not dims:
        return None
    return curves[f"{prefix}:{mask}:d{min(dims, key=lambda x: abs(x - int(d)))}"]


def predict(graph: StepGraph, gpu: GpuSpec, calibration: Calibration | None = None,
            compiled: bool = False) -> Prediction:
    """Predict the step's time on `gpu`. `compiled`: the model runs under torch.compile
    (forward and backward fused by Inductor; the optimizer stays eager)."""
    tf32 = tf32_of(graph.meta)
    rates = Rates(gpu, calibration)
    costs = [op_cost(n, tf32) for n in graph.nodes]
    under, selective = checkpointed_modules(graph), selective_modules(graph)
    ops = tuple(time_op(n, c, rates, host_phase=host_key(n, under, selective))
                for n, c in zip(graph.nodes, costs, strict=True))
    if compiled:
        ops = _compiled(graph, costs, ops, rates)
    host_t, device_t = _schedule(ops, set(graph.meta.get("syncs") or ()), graph.repeat,
                                 _offloaded(graph, ops))
    step = max(host_t, device_t)
    weights = graph.weights()
    device_busy = sum(o.device_s * w for o, w in zip(ops, weights, strict=True))
    phase_s: dict[str, float] = defaultdict(float)
    regime_s: dict[str, float] = defaultdict(float)
    for o, w in zip(ops, weights, strict=True):
        phase_s[o.phase] += o.device_s * w
        if o.device_s > 0:
            regime_s[o.regime] += o.device_s * w
    return Prediction(
        gpu=gpu.name, calibrated=calibration is not None, ops=ops, step_s=step,
        device_s=device_busy, host_s=host_t, idle_s=max(step - device_busy, 0.0),
        flops=sum(o.flops * w for o, w in zip(ops, weights, strict=True)),
        model_flops=model_flops(graph, costs),
        tokens=int(graph.meta.get("tokens") or 0),
        peak_flops=gpu.peak(peak_mode(graph.meta.get("precision", "bf16-mixed"))),
        phase_s=dict(phase_s), regime_s=dict(regime_s),
    )


def _schedule(ops: tuple[OpTime, ...], syncs: set[int],
              repeat: tuple[int, int, int] | None,
              param_of: dict[int, int] | None = None) -> tuple[float, float]:
    """When the host has issued the last op and when the device has run it (s). Two queues:
    the host issues each op in turn; the device runs it once issued and free. A repeated
    segment (`StepGraph.repeat`) runs twice, and its second run, the steady state, stands
    for the runs after it.

    CPU offload (gobrrr.offload) adds a third, the side stream of the host link (`link_t`),
    whose copies run one after another: a gradient's copy to the host (d2h) once the compute
    stream has run what was issued before it; the CPU step (on the host) once that
    parameter's gradient has landed (`param_of`: op index -> its parameter's storage); the
    parameter's copy back (h2d) once the host has queued it. The optimizer's step returns
    when the last copy has landed: the host waits for the link at the end."""
    host_t = device_t = link_t = 0.0
    param_of = param_of or {}
    landed: dict[int, float] = {}  # parameter -> when its gradient's latest copy landed

    def run(part) -> None:
        nonlocal host_t, device_t, link_t
        for o in part:
            if o.kind == "cpu_step":  # the host waits for the gradient, then steps
                host_t = max(host_t, landed.get(param_of.get(o.index), 0.0))
            host_t += o.host_s
            if o.device_s > 0:
                device_t = max(device_t, host_t) + o.device_s
            if o.kind == "d2h":  # behind the compute stream's work issued so far
                link_t = max(link_t, device_t, host_t) + o.side_s
                landed[param_of.get(o.index)] = link_t
            elif o.kind == "h2d":
                link_t = max(link_t, host_t) + o.side_s
            if o.index in syncs:  # the host reads a GPU value (e.g. GradScaler's found_inf)
                host_t = max(host_t, device_t)

    if repeat is None:
        run(ops)
        return max(host_t, link_t), device_t
    start, end, times = repeat
    run(ops[:end])
    if times > 1:
        before = (host_t, device_t, link_t)
        run(ops[start:end])
        host_t += (times - 2) * (host_t - before[0])
        device_t += (times - 2) * (device_t - before[1])
        shift = (times - 2) * (link_t - before[2])
        link_t += shift
        landed.update((p, t + shift) for p, t in landed.items())
    run(ops[end:])
    return max(host_t, link_t), device_t


def _offloaded(graph: StepGraph, ops: tuple[OpTime, ...]) -> dict[int, int]:
    """{op index: its parameter's storage} for CPU offload's ops (their first input)."""
    return {o.index: graph.nodes[o.index].inputs[0].storage for o in ops
            if o.kind in OFFLOAD_KINDS and graph.nodes[o.index].inputs}


def _compiled(graph: StepGraph, costs: list[OpCost], ops: tuple[OpTime, ...],
              rates: Rates) -> tuple[OpTime, ...]:
    """Replace each fused group by one kernel; compiled code launches kernels from a
    generated wrapper, so no per-op eager dispatch cost remains."""
    from gobrrr.cost.fusion import extern, fuse, regions

    out = list(ops)
    region = regions(graph)
    for o in ops:
        if region[o.index] >= 0 and extern(graph.nodes[o.index], costs[o.index]):
            t = time_op(graph.nodes[o.index], costs[o.index], rates, padded=True)
            out[o.index] = replace(t, host_s=rates.launch * max(costs[o.index].launches, 1))
    for g in fuse(graph, costs):
        first = graph.nodes[g.nodes[0]]
        t = time_op(first, g.cost, rates)
        out[first.index] = replace(t, op=f"fused[{len(g.nodes)} ops]", kind="fused",
                                   host_s=rates.launch * g.cost.launches)
        for i in g.nodes[1:]:
            out[i] = replace(ops[i], flops=0.0, bytes=0.0, compute_s=0.0, memory_s=0.0,
                             device_s=0.0, host_s=0.0, regime="none")
    return tuple(out)


MODEL_PHASES = ("forward", "backward")


def model_flops(graph: StepGraph, costs: list[OpCost] | None = None) -> float:
    """Model FLOPs of one step: the FLOPs of the traced forward and backward, without
    recomputation (a checkpointed step's recomputed forward and the optimizer are left out).
    The same definition for every model: a CNN's convolutions, a ViT's patches, only the
    experts an MoE routes to, as they ran. `costs`: the nodes' costs, if already computed."""
    costs = costs if costs is not None else [op_cost(n) for n in graph.nodes]
    return sum(c.flops * w for n, c, w in zip(graph.nodes, costs, graph.weights(), strict=True)
               if n.phase in MODEL_PHASES)


def model_flops_6n(graph: StepGraph) -> float:
    """Model FLOPs by the 6·N + attention convention (PaLM, Chowdhery et al. 2022, App. B):
    6 · N · tokens for the parameters that take part in matmuls (embedding lookups excluded,
    a tied output head included) plus 3 × the forward score and value matmuls over the full
    S×S (12·L·d·S per token, not halved for causal). Meaningful for dense transformers only:
    it counts images as tokens and every expert of an MoE."""
    n = graph.meta.get("trainable_params", 0) - graph.meta.get("embedding_params", 0)
    attn = 0.0
    for node, w in zip(graph.nodes, graph.weights(), strict=True):
        if node.phase == "forward" and _is_attention_forward(node):
            q, k = node.inputs[0], node.inputs[1]
            b, h, s_q, d = _bhsd(q)
            s_k = k.shape[-2]
            attn += 4.0 * b * h * s_q * s_k * d * w
    return 6.0 * n * graph.meta.get("tokens", 0) + 3.0 * attn


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
