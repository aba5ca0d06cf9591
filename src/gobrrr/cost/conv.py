"""What cuDNN convolutions allocate inside the call, beyond their outputs.

The traced graph sees a convolution's inputs and outputs, not the buffers cuDNN allocates and
frees within the op (through PyTorch's caching allocator, so they count in
`max_memory_allocated`):

- In 16-bit, cuDNN's tensor-core kernels want channels-last (NHWC) tensors. For channels-first
  (NCHW, PyTorch's default) tensors PyTorch makes NHWC copies around the kernel: forward, of
  the input and the weight (input channels padded up to a multiple of 8, e.g. an RGB stem's
  3 to 8) and of the output; backward, of grad_output, the input and the weight (a 1x1
  weight is channels-last already). Measured on an H100 in
  `benchmarks/results/cnn_diagnostics_h100.json`: forward exactly, backward within 25%.
- The kernel's own workspace, which depends on the algorithm cuDNN's heuristics pick and
  jumps between neighbouring shapes (in fp32 forward: none for most, 5-25x the tensors for a
  few). It is not derivable from the shapes; a calibration measures it over a grid of
  convolutions and keeps the typical (median) fraction of the op's input + output bytes, per
  math mode and direction (`conv_workspace`).

The allocator traces of the zoo's steps (`benchmarks/results/zoo_diagnose_h100.json`) show
both vary by shape: the NHWC copies happen inside cuDNN's workspace for some convolutions
(ViT's 16x16 patches, Whisper's 1-D convolutions: the workspace is exactly the copies) and not
at all for others (MobileNetV3's), fp32 1x1 convolutions ask nothing and 3x3s about twice their
input. A calibration that measured, per layout and shape class, everything a convolution
allocates inside the call ("inside:layout:class:direction", `class_inside`) is used in place
of both where it has the class.
"""

from __future__ import annotations

from gobrrr.cost._ops_common import targ, tf32_of
from gobrrr.cost.shapes import CONV_FALLBACK, conv_class, conv_layout
from gobrrr.graph import OpNode, StepGraph
from gobrrr.hardware import Calibration

FORWARD = ("convolution", "_convolution", "cudnn_convolution", "convolution_overrideable")
BACKWARD = ("convolution_backward",)
HALF = ("bfloat16", "float16")


def _nhwc_bytes(t, pad_channels: bool = False) -> int:
    """Bytes of a channels-last copy of 4-D tensor t (channels padded to a multiple of 8);
    0 when t is channels-last already (a contiguous 1x1 weight is)."""
    if not channels_first(t):
        return 0
    n, c, h, w = t.shape
    if pad_channels:
        c = -(-c // 8) * 8
    return n * c * h * w * t.itemsize


def channels_first(t) -> bool:
    """True for a 4-D tensor in the channels-first layout (channel stride not 1)."""
    return t is not None and len(t.shape) == 4 and t.shape[1] > 1 and t.stride[1] != 1


def layout_scratch(node: OpNode) -> int:
    """Bytes of the NHWC copies around a 16-bit convolution on channels-first tensors."""
    if node.name in FORWARD:
        x, w = targ(node, 0, "input"), targ(node, 1, "weight")
        out = node.outputs[0] if node.outputs else None
        if x is None or x.dtype not in HALF or not channels_first(x):
            return 0
        return _nhwc_bytes(x, pad_channels=True) + _nhwc_bytes(w, pad_channels=True) + \
            _nhwc_bytes(out)
    if node.name in BACKWARD:
        go, x, w = (targ(node, i, n) for i, n in enumerate(("grad_output", "input", "weight")))
        if go is None or go.dtype not in HALF or not channels_first(go):
            return 0
        return _nhwc_bytes(go) + _nhwc_bytes(x, pad_channels=True) + \
            _nhwc_bytes(w, pad_channels=True)
    return 0


def io_bytes(node: OpNode) -> int:
    return sum(t.nbytes for t in (*node.inputs, *node.outputs))


def workspace(node: OpNode, cal: Calibration | None, math_mode: str) -> int:
    """cuDNN's own workspace for this convolution: the calibration's typical fraction of the
    op's input + output bytes, for its layout where measured apart (0 without a
    calibration)."""
    if cal is None:
        return 0
    mode = "bf16" if math_mode == "fp16" and "fp16" not in cal.conv_workspace else math_mode
    direction = "backward" if node.name in BACKWARD else "forward"
    fractions = cal.conv_workspace.get(mode, {})
    layout = conv_layout(node)
    if layout != "channels_first" and f"{layout}:{direction}" in fractions:
        direction = f"{layout}:{direction}"
    return int(fractions.get(direction, 0.0) * io_bytes(node))


def class_inside(node: OpNode, cal: Calibration | None, math_mode: str) -> int | None:
    """Bytes this convolution allocates inside the call (NHWC copies and workspace alike) from
    the calibration's fraction for its layout, shape class (or the nearest measured class) and
    direction; None where the calibration has no such fraction (older calibrations: then
    `layout_scratch` + `workspace`)."""
    if cal is None:
        return None
    mode = "bf16" if math_mode == "fp16" and "fp16" not in cal.conv_workspace else math_mode
    fractions = cal.conv_workspace.get(mode, {})
    cls = conv_class(node)
    direction = "backward" if node.name in BACKWARD else "forward"
    for c in (cls, *CONV_FALLBACK.get(cls, ())) if cls else ():
        frac = fractions.get(f"inside:{conv_layout(node)}:{c}:{direction}")
        if frac is not None:
            return int(frac * io_bytes(node))
    return None


def scratch(graph: StepGraph, cal: Calibration | None) -> dict[int, int]:
    """{op index: bytes allocated and freed inside the op} for the graph's convolutions."""
    from gobrrr.cost.flops import op_cost

    tf32 = tf32_of(graph.meta)
    out = {}
    for node in graph.nodes:
        if node.name not in FORWARD and node.name not in BACKWARD:
            continue
        math_mode = op_cost(node, tf32).math
        inside = class_inside(node, cal, math_mode)
        extra = inside if inside is not None else \
            layout_scratch(node) + workspace(node, cal, math_mode)
        if extra:
            out[node.index] = extra
    return out
