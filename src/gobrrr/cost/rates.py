"""Achieved rates of one GPU: FLOP/s and bytes/s by kernel class and shape, read from a
calibration (the microbenchmarks of `gobrrr.calibrate.api*`) or, without one, from the
GPU's datasheet at default efficiencies. `roofline.time_op` turns them into an op's time."""

from __future__ import annotations

import math

from gobrrr.cost._ops_common import targ
from gobrrr.cost._ops_optim import block_rows, quantized
from gobrrr.cost.conv import bias_kernel, copy_layout, copy_path, operand_copies
from gobrrr.cost.curves import curve, curve_points, grid, grid_value, interp, measured
from gobrrr.cost.flops import OpCost
from gobrrr.cost.shapes import (
    CHECKPOINT_PHASES,
    channels_last_strides,
    conv_class,
    conv_directions,
    conv_layout,
    conv_points,
    depthwise,
    depthwise_class,
    elementwise_path,
    gemm_dims,
    outer_sum_columns,
)
from gobrrr.graph.ir import OpNode
from gobrrr.hardware import Calibration, GpuSpec

# Fraction of the dense matmul rate fused attention kernels reach without a calibration
# (FlashAttention-2 on an H100: ~35-55% of peak for fwd+bwd).
ATTENTION_EFFICIENCY = 0.45
# Achieved fraction of the aligned tensor-core rate with a misaligned leading dimension, when
# no calibration measured it (cuBLAS falls back to 1-element-aligned kernels).
MISALIGNED_FRACTION = 0.2
VIEW_HOST_FRACTION = 0.3  # a metadata-only op costs this share of a launch in host time
SOFTMAXES = ("_log_softmax", "_softmax", "_log_softmax_backward_data", "_softmax_backward_data")


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

    def matmul(
        self, math_mode: str, flops: float, dims: tuple[float, float] | None = None
    ) -> float:
        """Achieved FLOP/s of a matmul-class kernel doing `flops` in `math_mode`; `dims` =
        (output elements, depth k) when known, looked up in the calibration's grid."""
        if self.cal and dims and self.cal.matmul_grid.get(math_mode):
            return grid(self.cal.matmul_grid[math_mode], *dims)
        if self.cal and dims and math_mode == "fp16" and self.cal.matmul_grid.get("bf16"):
            # the same tensor cores: bf16's shape dependence, at fp16's measured rate
            scale = self.cal.matmul_flops.get("fp16", 1.0) / self.cal.matmul_flops.get("bf16", 1.0)
            return grid(self.cal.matmul_grid["bf16"], *dims) * scale
        if self.cal and dims and math_mode == "fp8" and self.cal.matmul_grid.get("bf16"):
            # no fp8 grid measured: the datasheet fp8 peak at the bf16 grid's efficiency there
            scale = self.gpu.peak("fp8") / self.gpu.peak("bf16")
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
        variants = (f"{layout}:{cls}", f"{layout}:{cls.split('-')[0]}", f"{layout}:3x3")
        table, x = self.cal.depthwise_bandwidth, node.inputs[0]
        points = curve_points(table, direction, x.dtype, variants)
        if points and len(points[0]) == 3:  # over channels and size
            w = targ(node, 2 if direction == "backward" else 1, "weight")
            return grid_value(points, w.shape[0] if w is not None else 1, nbytes)
        return measured(table, direction, x.dtype, nbytes, variants)

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
        return interp([math.log(p[0]) for p in points], [p[1] for p in points], math.log(nbytes))

    def path(self, node: OpNode, kind: str, nbytes: float) -> float | None:
        """Measured bytes/s of a TensorIterator copy or pointwise kernel on the path it
        takes (`shapes.elementwise_path`) at its output's dtype, over the bytes it moves;
        None on the vectorized paths (the `size_bandwidth` curves) or without a measurement.
        A torch `_foreach_*` list op: its own curve over the lists' bytes."""
        table = self.cal.path_bandwidth if self.cal else None
        if not table or nbytes <= 0:
            return None
        if kind == "optimizer" and node.name.startswith("_foreach_"):
            return self._path_rate("foreach", nbytes)
        path = elementwise_path(node, kind)
        if path is None or path in ("vector", "cast_down"):
            return None
        # a calibration from before "generic_cast" was timed: its broadcast's rate
        fallback = ("bcast",) if path == "generic_cast" else ()
        return self._path_rate(kind, nbytes, (path, *fallback), node.outputs[0].itemsize)

    def _path_rate(
        self, kind: str, nbytes: float, paths: tuple[str, ...] = (), itemsize: int = 2
    ) -> float | None:
        """The path_bandwidth curve at `nbytes`: "<kind>:<path>:<bf16|fp32>" for the first
        of `paths` measured, at the output's width, else the other width ("foreach": `kind`
        alone); None without a measurement."""
        table = self.cal.path_bandwidth if self.cal else {}
        bits = "bf16" if itemsize == 2 else "fp32"
        other = "fp32" if bits == "bf16" else "bf16"
        keys = [f"{kind}:{p}:{b}" for p in paths for b in (bits, other)] if paths else [kind]
        points = next((table[k] for k in keys if table.get(k)), None)
        if not points or nbytes <= 0:
            return None
        return interp([math.log(p[0]) for p in points], [p[1] for p in points], math.log(nbytes))

    def softmax(self, node: OpNode) -> float | None:
        """Measured bytes/s of (log-)softmax or its backward at its row width and rows, per
        input dtype (the calibration's grid), or None."""
        grid_ = self.cal.softmax_grid if self.cal else None
        if not grid_ or node.name not in SOFTMAXES or not node.inputs:
            return None
        x = node.inputs[0]
        key = "bf16" if x.dtype in ("bfloat16", "float16") else "fp32"
        points = grid_.get(f"{node.name}:{key}")
        if not points or not x.shape:
            return None
        dim = int(node.arg(1 if node.name in SOFTMAXES[:2] else 2, "dim", -1)) % len(x.shape)
        width = x.shape[dim]
        return grid_value(points, width, x.numel / max(width, 1))

    def layer_norm(self, node: OpNode) -> float | None:
        """Measured bytes/s of native_layer_norm or its backward at its width, rows and input
        dtype (the calibration's grid), or None."""
        if (
            node.name not in ("native_layer_norm", "native_layer_norm_backward")
            or not self.cal
            or not node.inputs
        ):
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
        return v * d * s / fit["fill_Bps"] + g.numel / fit["token_values_per_s"] + fit["fixed_s"]

    def outer_sum(self, node: OpNode) -> float | None:
        """Measured bytes/s of a sum over leading dimensions at its output size, rows summed
        and dtype (the calibration's grid; a curve over the output size alone in calibrations
        that measured one row count), or None."""
        cols = outer_sum_columns(node)
        if cols is None or not self.cal:
            return None
        x = node.inputs[0]
        return self._outer_sum(x.dtype, cols, x.numel / max(cols, 1))

    def _outer_sum(self, dtype: str, cols: int, rows: float) -> float | None:
        points = curve_points(self.cal.outer_sum_bandwidth, "sum", dtype)
        if points and len(points[0]) == 3:
            return grid_value(points, cols, rows)
        return measured(self.cal.outer_sum_bandwidth, "sum", dtype, cols)

    def conv_bias(self, node: OpNode) -> float:
        """Device seconds of the kernel a convolution runs for its bias (`conv.bias_kernel`):
        the in-place broadcast add over the output at the generic kernel's measured rate, or
        the bias gradient's sum over grad_output (an outer sum in channels-last, where the
        channels are the fastest dim; else an ordinary reduction); 0 without one."""
        part = bias_kernel(node)
        if part is None:
            return 0.0
        what, t = part
        channels, rate = t.shape[1], None
        if what == "add":
            nbytes = 2 * t.nbytes + channels * t.itemsize
            rate = self._path_rate("pointwise", nbytes, ("bcast",), t.itemsize) or self.bandwidth(
                "pointwise"
            )
        else:
            nbytes = t.nbytes + channels * t.itemsize
            if self.cal and channels_last_strides(t):
                rate = self._outer_sum(t.dtype, channels, t.numel / max(channels, 1))
            rate = rate or self.bandwidth("reduction")
        return nbytes / rate + self.latency

    def conv_copies(self, node: OpNode) -> float:
        """Device seconds of the copies PyTorch makes of a convolution's operands that are not
        contiguous in the layout it runs in (`conv.operand_copies`): each a TensorIterator
        copy reading and writing the operand once, at the measured rate of its path
        (`conv.copy_path`), else the copy bandwidth, plus a kernel's latency; 0 with none.
        The calibration's convolution grids, measured on dense operands, hold none of them."""
        seconds, layout = 0.0, copy_layout(node)
        for _, t in operand_copies(node):
            nbytes = 2 * t.numel * t.itemsize
            rate = self._path_rate("copy", nbytes, (copy_path(t, layout),), t.itemsize)
            seconds += nbytes / (rate or self.copy_bw) + self.latency
        return seconds

    def misaligned_fraction(
        self, math_mode: str, nt: bool = False, align: int | None = None
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

    def attention(
        self,
        math_mode: str,
        seq: int | None = None,
        direction: str | None = None,
        variant: str | None = None,
    ) -> float:
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

    def host(
        self,
        phase: str,
        launches: int,
        op: str = "",
        math_mode: str = "",
        saved: int | None = None,
    ) -> float:
        """Host seconds to issue one op: the measured per-op cost of an eager training step in
        this phase (calibrated), plus a launch for each kernel past the first, plus what this
        op costs the host beyond an ordinary one where that was measured (cuDNN's
        convolutions and batch norm: `op_host`, keyed "name:dtype"). gobrrr's own kernel ops
        cost what was measured for them (`kernel_host`) instead. A forward op inside a
        checkpointed block that saves `saved` tensors for backward: see `_checkpointed`."""
        if self.cal and op in self.cal.kernel_host:
            return self.cal.kernel_host[op]
        per_op = self.cal.op_overhead if self.cal else {}
        base = _checkpointed(per_op, phase, saved)
        key = phase
        if key.endswith("_selective") and key not in per_op:  # not measured: as full
            key = key.removesuffix("_selective")
        if key in CHECKPOINT_PHASES and key not in per_op:
            key = "forward"
        if base is None and key in per_op:
            base = per_op[key]
        if base is not None:
            extra = self.cal.op_host.get(f"{op}:{_host_dtype(math_mode)}", 0.0)
            return base + self.launch * max(launches - 1, 0) + extra
        if launches == 0:
            return self.launch * VIEW_HOST_FRACTION
        return self.launch * launches

    def adam8bit(self, node: OpNode, nbytes: float) -> tuple[float, float] | None:
        """(device s, host s) of one torchao 8-bit Adam update moving `nbytes`, from the
        calibration's `optim8` section, by the parameter's layout (rows of one quantisation
        block, or wider: `device_rows`): the device time over bytes interpolated log-log (past
        the grid, at its last point's bytes/s; under it, its first point's time); the host's
        per update as measured with parameters of distinct shapes (a model's: each call's
        guards are checked against the other shapes' compiled entries first), else of one
        shape; None without the section (the op is then costed as any other: its bytes at
        the pointwise bandwidth, the eager per-op host cost)."""
        sec = self.cal.optim8 if self.cal else None
        if not sec or node.name != "adam8bit_update" or not node.inputs:
            return None
        p = node.inputs[0]
        small = not quantized(p.numel)
        curve = "device_small" if small else "device" if block_rows(p.shape) else "device_rows"
        pts = sec.get(curve) or sec.get("device")
        if not pts:
            return None
        if nbytes >= pts[-1][0]:
            device = nbytes * pts[-1][1] / pts[-1][0]
        elif nbytes <= pts[0][0]:
            device = pts[0][1]
        else:
            device = math.exp(
                interp(
                    [math.log(p[0]) for p in pts], [math.log(p[1]) for p in pts], math.log(nbytes)
                )
            )
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
    "native_batch_norm": "forward",
    "_native_batch_norm_legit": "forward",
    "_native_batch_norm_legit_functional": "forward",
    "cudnn_batch_norm": "forward",
    "_batch_norm_with_update": "forward",
    "native_batch_norm_backward": "backward",
    "cudnn_batch_norm_backward": "backward",
    "batch_norm_backward": "backward",
}


def _variant_curve(curves: dict, prefix: str, variant: str) -> list | None:
    """The calibrated curve of `variant` ("<mask>:d<D>") under `prefix` ("<direction>:<dtype>"),
    else the same mask's curve at the nearest measured head dim, else None."""
    if f"{prefix}:{variant}" in curves:
        return curves[f"{prefix}:{variant}"]
    mask, d = variant.rsplit(":d", 1)
    dims = [int(k.rsplit(":d", 1)[1]) for k in curves if k.startswith(f"{prefix}:{mask}:d")]
    if not dims:
        return None
    return curves[f"{prefix}:{mask}:d{min(dims, key=lambda x: abs(x - int(d)))}"]


def _checkpointed(per_op: dict[str, float], key: str, saved: int | None) -> float | None:
    """Host seconds of a forward op inside a checkpointed block (`key` "checkpointed" or
    "checkpointed_selective") that saves `saved` tensors for backward: the forward rate plus
    the checkpoint's surcharge in two parts, "<key>_fit_per_op" (s) and "<key>_fit_per_saved"
    (s a tensor: its saved-tensor hook runs once for each), fitted on the calibration's tiny
    steps (`calibrate.sections.host.fit_surcharge`). None where that is not known: no count on
    the op, or a calibration that measured the surcharge per op only (then charged per op); a
    selective block without its policy's figures reads the full policy's."""
    if saved is None or not key.startswith("checkpointed") or "forward" not in per_op:
        return None
    for k in (key, key.removesuffix("_selective")):
        a, b = per_op.get(k + "_fit_per_op"), per_op.get(k + "_fit_per_saved")
        if a is not None and b is not None:
            return per_op["forward"] + a + saved * b
        if k in per_op:
            return None
    return None


def _host_dtype(math_mode: str) -> str:
    """The dtype key of `op_host`: 16-bit math as measured in bf16, everything else fp32."""
    return "bf16" if math_mode in ("bf16", "fp16") else "fp32"
