"""What cuDNN convolutions allocate inside the call, beyond their outputs.

The traced graph sees a convolution's inputs and outputs, not the buffers cuDNN allocates and
frees within the op (through PyTorch's caching allocator, so they count in
`max_memory_allocated`):

- In 16-bit, cuDNN's tensor-core kernels want channels-last (NHWC) tensors. For channels-first
  (NCHW, PyTorch's default) tensors PyTorch makes NHWC copies around the kernel: forward, of
  the input and the weight (input channels padded up to a multiple of 8, e.g. an RGB stem's
  3 to 8) and of the output; backward, of grad_output, the input and the weight (a 1x1
  weight is channels-last already). Measured on an H100 in
  `tests/fixtures/cnn_diagnostics_h100.json`: forward exactly, backward within 25%.
- The kernel's own workspace, which depends on the algorithm cuDNN's heuristics pick and
  jumps between neighbouring shapes (in fp32 forward: none for most, 5-25x the tensors for a
  few). It is not derivable from the shapes; a calibration measures it over a grid of
  convolutions and keeps the typical (median) fraction of the op's input + output bytes, per
  math mode and direction (`conv_workspace`).

The allocator traces of the zoo's steps (`tests/fixtures/zoo_diagnose_h100.json`) show
both vary by shape: the NHWC copies happen inside cuDNN's workspace for some convolutions
(ViT's 16x16 patches, Whisper's 1-D convolutions: the workspace is exactly the copies) and not
at all for others (MobileNetV3's), fp32 1x1 convolutions ask nothing and 3x3s about twice their
input. A calibration that measured, per layout and shape class, everything a convolution
allocates inside the call ("inside:layout:class:direction", `class_inside`) is used in place
of both where it has the class.

Depthwise convolutions (groups = input channels) take another path in PyTorch
(ConvParams::use_cudnn_depthwise): channels-first ones in fp32 or bf16 run PyTorch's own
depthwise kernels, which allocate nothing inside the call (EfficientNet-B0's 16 in tf32 and
MobileNetV3's 15 in bf16, forward and backward: zoo_diagnose_h100.json); channels-last ones go
to cuDNN, whose 16-bit weight gradient sums fp32 partials in a buffer of
`DEPTHWISE_WGRAD_PARTIALS` per weight element, whatever the batch and image (ConvNeXt-T's 18
7x7 depthwise backwards, 56x56 to 7x7: zoo_diagnose_h100_run2.json). The grid's "grouped"
class (3x3, 16 groups) measures neither.

A stride-1 channels-first 1x1 convolution's backward over many pixels asks cuDNN for a weight
gradient that sums fp32 partials, a buffer of `WGRAD_PARTIALS_1X1[math]` per weight element
whatever the batch and image (MobileNetV3's bf16 1x1s from 14x14 to 112x112, ResNet-50's tf32
ones from 14x14 to 56x56: each within 400 bytes in zoo_diagnose_h100.json); over few pixels it
copies the tensors instead. The grid's class fraction scales with the tensors, so it is taken
where it is smaller (few pixels) and the partials elsewhere.

The grids measured dense operands. An operand that is not contiguous in the layout the
convolution runs in is copied to a dense one inside the op, before the kernels: PyTorch's
`input.contiguous(memory_format)` (and grad_output's in backward; `operand_copies`). A channel
slice (ShuffleNet-v2's `x.chunk(2, dim=1)`) is contiguous in no layout; a dense channels-first
tensor is not channels-last. ShuffleNet-v2's allocator trace on an H100
(benchmarks/results/zoo_diagnose_far_h100.json) shows each such copy at the slice's dense size,
forward and backward; its profile a copy kernel in each of those convolutions.
"""

from __future__ import annotations

from gobrrr.cost._ops_common import targ, tf32_of
from gobrrr.cost.flops import op_cost
from gobrrr.cost.shapes import (
    CONV_FALLBACK,
    channels_last_strides,
    contiguous_in,
    conv_class,
    conv_layout,
)
from gobrrr.graph.ir import OpNode, StepGraph, TensorInfo
from gobrrr.hardware import Calibration

FORWARD = ("convolution", "_convolution", "cudnn_convolution", "convolution_overrideable")
BACKWARD = ("convolution_backward",)
HALF = ("bfloat16", "float16")
# fp32 partial sums per weight element that cuDNN's 16-bit channels-last depthwise weight
# gradient allocates inside the call (the allocator traces of zoo_diagnose_h100_run2.json, the
# same at each of ConvNeXt-T's four stages; tests/test_alloc_sequence.py holds it to them)
DEPTHWISE_WGRAD_PARTIALS = 512
# fp32 partial sums per weight element of a stride-1 channels-first 1x1 convolution's weight
# gradient, by math mode (the same traces; tests/test_alloc_sequence.py holds them to them)
WGRAD_PARTIALS_1X1 = {"bf16": 128, "tf32": 64}


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
    """Bytes of the NHWC copies around a 16-bit convolution on channels-first tensors; none
    where cuDNN runs channels-last (PyTorch copies a channels-first operand to channels-last
    before the call then: `operand_copies`)."""
    if conv_layout(node) == "channels_last":
        return 0
    if node.name in FORWARD:
        x, w = targ(node, 0, "input"), targ(node, 1, "weight")
        out = node.outputs[0] if node.outputs else None
        if x is None or x.dtype not in HALF or not channels_first(x):
            return 0
        return (
            _nhwc_bytes(x, pad_channels=True) + _nhwc_bytes(w, pad_channels=True) + _nhwc_bytes(out)
        )
    if node.name in BACKWARD:
        go, x, w = (targ(node, i, n) for i, n in enumerate(("grad_output", "input", "weight")))
        if go is None or go.dtype not in HALF or not channels_first(go):
            return 0
        return (
            _nhwc_bytes(go) + _nhwc_bytes(x, pad_channels=True) + _nhwc_bytes(w, pad_channels=True)
        )
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


def depthwise(node: OpNode) -> bool:
    """PyTorch's ConvParams::is_depthwise: a 2-D or 3-D convolution, not transposed, whose
    groups equal its input channels (over 1), each group making whole output channels."""
    backward = node.name in BACKWARD
    x = targ(node, 1 if backward else 0, "input")
    w = targ(node, 2 if backward else 1, "weight")
    groups = node.arg(9 if backward else 8, "groups", 1) or 1
    if (
        x is None
        or w is None
        or len(x.shape) not in (4, 5)
        or node.arg(7 if backward else 6, "transposed", False)
    ):
        return False
    return groups > 1 and x.shape[1] == groups and w.shape[0] % groups == 0


def native_depthwise(node: OpNode) -> bool:
    """A depthwise convolution PyTorch runs on its own kernels, not cuDNN's
    (ConvParams::use_cudnn_depthwise): channels-first in fp32 or bf16."""
    x = targ(node, 1 if node.name in BACKWARD else 0, "input")
    return (
        depthwise(node)
        and conv_layout(node) == "channels_first"
        and x is not None
        and x.dtype != "float16"
    )


def copy_layout(node: OpNode) -> str:
    """The layout PyTorch makes a convolution's operands contiguous in before its kernels:
    its own depthwise kernels' and every 1-D or 3-D convolution's "channels_first", else the
    one cuDNN runs in (`conv_layout`)."""
    x = targ(node, 1 if node.name in BACKWARD else 0, "input")
    if native_depthwise(node) or x is None or len(x.shape) != 4:
        return "channels_first"
    return conv_layout(node)


def operand_copies(node: OpNode) -> tuple[tuple[str, TensorInfo], ...]:
    """The dense copies PyTorch makes of a convolution's operands that are not contiguous in
    the layout it runs in (`copy_layout`), as (operand, tensor copied), one per copy made.

    Forward (Convolution.cpp's _convolution): a 1-D input is made contiguous before it is
    viewed as 2-D; cuDNN's gets `input.contiguous(layout)` and, in cudnn_convolution_forward,
    the weight too; PyTorch's depthwise kernels expect both contiguous. Backward
    (convolution_backward): the input where the weight's gradient is asked for (a 1-D one
    always), the weight for the input's gradient, and grad_output (`_grad_output_copies`).
    A channel slice (ShuffleNet's `x.chunk(2, dim=1)`) is contiguous in no layout; a dense
    channels-first input beside a channels-last weight is not in the layout cuDNN picks. A
    dense 3-D convolution's operands are left alone (cuDNN may run them channels-last)."""
    backward = node.name in BACKWARD
    if node.name not in FORWARD and not backward:
        return ()
    x = targ(node, 1 if backward else 0, "input")
    w = targ(node, 2 if backward else 1, "weight")
    if x is None or w is None or x.numel == 0:
        return ()
    layout = copy_layout(node)
    if not backward:
        return tuple((name, t) for name, t in (("input", x), ("weight", w)) if _copied(t, layout))
    mask = list(node.arg(10, "output_mask", (True, True, False)) or ())
    grad_input, grad_weight = (bool(m) for m in (*mask, False, False)[:2])
    go = targ(node, 0, "grad_output")
    out = []
    if (grad_weight or len(x.shape) == 3) and _copied(x, layout):
        out.append(("input", x))
    if native_depthwise(node):  # expect_contiguous once, for both gradients
        out += [("grad_output", go)] if _copied(go, layout) else []
    elif go is not None:
        x_format = layout if grad_weight or len(x.shape) == 3 else _suggested(x)
        out += [("grad_output", go)] * _grad_output_copies(
            go, w, x_format, grad_input + grad_weight
        )
    if grad_input and _copied(w, layout):
        out.append(("weight", w))
    return tuple(out)


def _copied(t: TensorInfo | None, layout: str) -> bool:
    if t is None or (len(t.shape) == 5 and t.is_dense()):
        return False
    return not contiguous_in(t, layout)


def _suggested(t: TensorInfo) -> str:
    """c10's suggest_memory_format: channels-last for a 4-D tensor with its strides' order."""
    return "channels_last" if channels_last_strides(t) else "channels_first"


def _grad_output_copies(go: TensorInfo, w: TensorInfo, x_format: str, asked: int) -> int:
    """Copies cuDNN's backward (cudnn/ConvShared.cpp) makes of grad_output: `.to()` the
    format the (copied) input suggests, a copy where grad_output suggests another; then each
    gradient asked for (`asked`) makes it contiguous in the layout cuDNN runs in
    (cudnn_conv_suggest_memory_format of it and the weight), a copy each where it is not (a
    slice: the second is made once the first is freed)."""
    if len(go.shape) == 5 and go.is_dense():
        return 0
    if len(go.shape) == 4 and _suggested(go) != x_format:
        cl = x_format == "channels_last" or channels_last_strides(w)
        return 1 + asked * (x_format != ("channels_last" if cl else "channels_first"))
    cl = len(go.shape) == 4 and (channels_last_strides(go) or channels_last_strides(w))
    return asked * (not contiguous_in(go, "channels_last" if cl else "channels_first"))


def copy_blocks(node: OpNode) -> tuple[int, ...]:
    """Bytes of the blocks `operand_copies` allocates, one per operand: grad_output's second
    copy (cuDNN's weight gradient after its input gradient) is made once the first is freed,
    in the block the first left."""
    seen = {name: t.numel * t.itemsize for name, t in operand_copies(node)}
    return tuple(seen.values())


def copy_path(t: TensorInfo, layout: str) -> str:
    """The TensorIterator path (`shapes.elementwise_path`) of copying t into a dense tensor
    in `layout`: "strided" where t runs along the copy's fastest dim (channels for
    channels-last, the last dim otherwise) with gaps between its runs (a channel slice of a
    channels-last tensor), "transposed" where it is strided along it (any channels-first
    tensor copied to channels-last)."""
    order = (1, 3, 2, 0) if layout == "channels_last" and len(t.shape) == 4 else None
    order = order or tuple(reversed(range(len(t.shape))))
    dims = [d for d in order if t.shape[d] > 1]
    if not dims:
        return "strided"
    return "strided" if t.stride[dims[0]] == 1 else "transposed"


def bias_kernel(node: OpNode) -> tuple[str, TensorInfo] | None:
    """The kernel a CUDA convolution runs for its bias apart from the convolution itself:
    ("add", output) forward where cuDNN runs it (ATen's _convolution adds the bias in place
    after cudnn_convolution; PyTorch's own depthwise kernels take the bias themselves), and
    ("sum", grad_output) backward where the bias gradient is asked for (convolution_backward
    sums grad_output over all but the channel dim for every CUDA backend); None otherwise.
    Neither is in the calibration's grids, which time convolutions without a bias."""
    if node.name in FORWARD:
        if targ(node, 2, "bias") is None or not node.outputs or native_depthwise(node):
            return None
        return "add", node.outputs[0]
    if node.name in BACKWARD:
        mask = list(node.arg(10, "output_mask", (False, False, False)) or ())
        go = targ(node, 0, "grad_output")
        if len(mask) > 2 and mask[2] and go is not None and len(go.shape) > 2:
            return "sum", go
    return None


def depthwise_inside(node: OpNode) -> int | None:
    """Bytes a depthwise convolution allocates inside the call where the allocator traces show
    it (module docstring): 0 for PyTorch's own kernels (channels-first, fp32 or bf16), the fp32
    partials of cuDNN's 16-bit channels-last weight gradient; None elsewhere (fp16
    channels-first may go to cuDNN; the calibration's class then)."""
    if node.name not in FORWARD and node.name not in BACKWARD or not depthwise(node):
        return None
    backward = node.name in BACKWARD
    x = targ(node, 1 if backward else 0, "input")
    w = targ(node, 2 if backward else 1, "weight")
    if native_depthwise(node):
        return 0
    if conv_layout(node) == "channels_first":
        return None
    if x.dtype not in HALF:
        return None
    return DEPTHWISE_WGRAD_PARTIALS * w.numel * 4 if backward else None


def pointwise_wgrad_partials(node: OpNode, math_mode: str) -> int | None:
    """Bytes of the fp32 partials a stride-1 channels-first 1x1 convolution's backward sums
    its weight gradient in (module docstring); None for other convolutions and math modes."""
    partials = WGRAD_PARTIALS_1X1.get(math_mode)
    w = targ(node, 2, "weight")
    stride = node.arg(4, "stride", (1,)) or (1,)
    if (
        node.name not in BACKWARD
        or partials is None
        or w is None
        or len(w.shape) != 4
        or w.shape[2:] != (1, 1)
        or any(s != 1 for s in stride)
        or depthwise(node)
        or conv_layout(node) != "channels_first"
    ):
        return None
    return partials * w.numel * 4


def scratch(graph: StepGraph, cal: Calibration | None) -> dict[int, int | tuple[int, ...]]:
    """{op index: bytes allocated and freed inside the op} for the graph's convolutions: the
    calibrated (or modelled) inside bytes, measured on dense operands, and before them the
    blocks of the copies of operands that are not (`copy_blocks`), where there are any."""
    tf32 = tf32_of(graph.meta)
    out = {}
    for node in graph.nodes:
        if node.name not in FORWARD and node.name not in BACKWARD:
            continue
        math_mode = op_cost(node, tf32).math
        inside = depthwise_inside(node)
        if inside is None:
            inside = class_inside(node, cal, math_mode)
            partials = pointwise_wgrad_partials(node, math_mode)
            if inside is not None and partials is not None:
                inside = min(inside, partials)
        extra = (
            inside if inside is not None else layout_scratch(node) + workspace(node, cal, math_mode)
        )
        copies = copy_blocks(node)
        if copies:
            out[node.index] = (*copies, extra) if extra else copies
        elif extra:
            out[node.index] = extra
    return out
