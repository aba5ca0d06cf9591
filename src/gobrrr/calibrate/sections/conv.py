"""Calibration of cuDNN convolutions: achieved FLOP/s by math mode, memory layout, shape class
and direction, over the shapes real CNNs run, and the workspace cuDNN allocates inside a call.

Why by layout: in 16-bit, cuDNN's tensor-core kernels run on channels-last (NHWC) tensors, and
PyTorch copies channels-first (NCHW) ones to NHWC and back around the kernel; a model converted
with `.to(memory_format=torch.channels_last)` runs none of those copies. Why by shape class: a
1x1 convolution is a plain GEMM, a strided or 7x7 one gathers its im2col tiles differently, a
grouped one runs small per-group GEMMs; the same (output elements, depth) runs at different
rates in each. Why by direction: a convolution_backward computes grad_input and grad_weight
with different kernels (the first layer of a network asks for grad_weight only).

Each class is a rectangular grid of (output elements, depth) in the implicit-GEMM terms of
`gobrrr.cost.shapes.gemm_dims`, the channel count setting the depth (C_in/groups · k · k) and
the batch making up the output size. Powers of two keep every grid point exactly on its row.
The spatial size shrinks as channels grow, as through a CNN's stages.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterator
from dataclasses import dataclass

import torch

from gobrrr.calibrate.sections.step import _allocated_inside, _record
from gobrrr.calibrate.timing import time_op
from gobrrr.cost import conv
from gobrrr.cost.flops import op_cost
from gobrrr.cost.shapes import gemm_dims

LAYOUTS = ("channels_first", "channels_last")
MODES = (("bf16", torch.bfloat16), ("tf32", torch.float32), ("fp32", torch.float32))
OUTPUTS = (2**19, 2**21, 2**23, 2**25, 2**27)  # output elements N·Ho·Wo·C_out of each grid row
# (grad_input, grad_weight, grad_bias) requested of convolution_backward, per direction
BACKWARD_MASKS = {"backward_input": [True, False, False], "backward_weight": [False, True, False]}
REPS = 10  # timed runs per point (the median is kept)
# conv_workspace keys "inside:<layout>:<class>:<direction>": all the bytes a convolution of that
# class allocates inside the call (cuDNN's workspace, with any NHWC copies it makes in it), as a
# fraction of the op's input + output bytes, the median over the class's grid points
INSIDE = "inside:"
# the largest output row measured per class where below OUTPUTS' (a 128-wide grouped 1-D
# kernel runs at a few TFLOP/s: the top rows would take minutes)
ROW_CAP = {"grouped-1d": 2**23}
DEPTHWISE_BATCHES = (1, 4, 16, 64)
# (channels, output plane) as CNNs pair them: wide planes early, many channels late
DEPTHWISE_SHAPES = (
    (32, 112),
    (64, 56),
    (96, 56),
    (128, 56),
    (192, 28),
    (256, 28),
    (384, 14),
    (512, 14),
    (768, 7),
    (1152, 7),
)
DEPTHWISE_CLASSES = {
    "3x3": (3, 1),
    "5x5": (5, 1),
    "7x7": (7, 1),
    "3x3-s2": (3, 2),
    "5x5-s2": (5, 2),
}


@dataclass(frozen=True)
class ConvShape:
    """One convolution of the grid, without its batch. Planes in pixels (height = width)."""

    cls: str
    c_in: int
    c_out: int
    kernel: int
    stride: int
    groups: int
    plane: int  # output height = width (the length, 1-D)
    dims: int = 2  # spatial dims: 2 (images), 1 (sequences: speech models' Conv1d)
    pad: int | None = None  # each side; None: kernel // 2 (the output keeps the input's plane)
    kernel_w: int | None = None  # a 2-D kernel's width where it is not `kernel` (1x7, 3x1)

    @property
    def kernels(self) -> tuple[int, ...]:
        """The kernel's size along each spatial dim (height, width)."""
        if self.kernel_w is None:
            return (self.kernel,) * self.dims
        return (self.kernel, self.kernel_w)

    def batch(self, outputs: int) -> int:
        """The largest power-of-two batch N with N · plane^dims · C_out <= outputs (0 when
        one sample is more): shapes whose per-sample outputs differ by powers of two land on
        the same grid rows."""
        n = outputs // (self.c_out * self.plane**self.dims)
        return 1 << (n.bit_length() - 1) if n else 0


def _plane(budget: int, channels: int) -> int:
    """Output plane for this channel count: budget // channels, within 8..64 pixels."""
    return min(max(budget // channels, 8), 64)


def conv_shapes() -> Iterator[ConvShape]:
    """The grid's convolutions, by class: "1x1" (C_out = C_in, depth = C_in 64..2048),
    "1x1-reduce" and "1x1-expand" (C_out = C_in / 4 and 4 · C_in: a bottleneck's 1x1s),
    "3x3" (stride 1, 32..512 channels), "1xk" and "kx1" (stride 1, a 1x7 / 7x1 over 64..256
    channels and a 1x3 / 3x1 over 256 and 512: Inception's factorized kernels, whose backward
    asks other workspaces than a 3x3's: its 3x1s at 8x8 took 5.5x the 3x3 class's fraction in
    zoo_diagnose_far_h100.json), "3x3-s2" (stride 2: the downsampling 3x3 of a stage),
    "stem" (3 input channels: a 3x3 and a 7x7, both stride 2), "grouped" (3x3, 16 groups of
    4..64 channels each), "grouped-1d" (1-D, kernel 128, 16 groups of 16..64 channels over
    512 positions: the convolutional position embedding of wav2vec2, HuBERT, WavLM and
    data2vec-audio, which cuDNN runs at a few TFLOP/s), "patchify" (stride = kernel, no
    padding: 2x2 downsampling of 96-384 channels) and "stem-patchify" (3-channel images cut
    into 4x4 and 16x16 patches)."""
    for c in (64, 128, 256, 512, 1024, 2048):
        yield ConvShape("1x1", c, c, 1, 1, 1, _plane(8192, c))
    for c in (256, 512, 1024, 2048):  # a bottleneck's way in (or an inverted one's way out)
        yield ConvShape("1x1-reduce", c, c // 4, 1, 1, 1, _plane(8192, c))
    for c in (64, 128, 256, 512):  # a bottleneck's way out (or an inverted one's way in)
        yield ConvShape("1x1-expand", c, 4 * c, 1, 1, 1, _plane(8192, 4 * c))
    for c in (32, 64, 128, 256, 512):
        yield ConvShape("3x3", c, c, 3, 1, 1, _plane(4096, c))
    for k, channels in ((7, (64, 128, 256)), (3, (256, 512))):
        for c in channels:
            yield ConvShape("1xk", c, c, 1, 1, 1, _plane(4096, c), kernel_w=k)
            yield ConvShape("kx1", c, c, k, 1, 1, _plane(4096, c), kernel_w=1)
    for c in (64, 128, 256, 512):
        yield ConvShape("3x3-s2", c, c, 3, 2, 1, _plane(2048, c))
    # at ImageNet's 224 x 224 (112 x 112 out), the size stems run at: measured at 128 x 128,
    # the channels_last 7x7 ran at 19 TFLOP/s, 1.6 ms for ResNet-50's b128 forward, where that
    # step's whole stem conv module (forward, backward, a copy) measured 0.96 ms
    yield ConvShape("stem", 3, 32, 3, 2, 1, 112)
    yield ConvShape("stem", 3, 64, 7, 2, 1, 112)
    for width in (4, 8, 16, 32, 64):
        yield ConvShape("grouped", 16 * width, 16 * width, 3, 1, 16, _plane(4096, 16 * width))
    for c in (256, 512, 768, 1024):
        yield ConvShape("grouped-1d", c, c, 128, 1, 16, 512, dims=1)
    # non-overlapping patches: an image cut into 4x4 and 16x16 ones (ConvNeXt's and Swin's
    # stems, ViT's patch embedding), a stage's 2x2 downsampling (ConvNeXt)
    for c_in, c_out, k, plane in (
        (3, 96, 4, 56),
        (3, 384, 16, 14),
        (3, 768, 16, 14),
        (96, 192, 2, 28),
        (192, 384, 2, 14),
        (384, 768, 2, 7),
    ):
        yield ConvShape(
            "stem-patchify" if c_in < 8 else "patchify", c_in, c_out, k, k, 1, plane, pad=0
        )


def _tensors(s: ConvShape, n: int, dtype: torch.dtype, layout: str, dev: torch.device):
    """(input, weight, grad_output, convolution args after the bias) of shape s at batch n."""
    g = torch.Generator(device=dev).manual_seed(s.c_in * 7919 + sum(s.kernels) * 31 + n)
    if s.pad is None:
        pads = [k // 2 for k in s.kernels]
        # an even kernel with `pad` each side gives one output more than inputs (models drop
        # it): one input fewer keeps the output at `plane`
        sizes = [s.plane * s.stride - (1 - k % 2) for k in s.kernels]
    else:
        pads = [s.pad] * s.dims
        sizes = [(s.plane - 1) * s.stride + k - 2 * s.pad for k in s.kernels]
    x = torch.randn(n, s.c_in, *sizes, device=dev, dtype=dtype, generator=g)
    w = (
        torch.randn(s.c_out, s.c_in // s.groups, *s.kernels, device=dev, dtype=dtype, generator=g)
        * 0.05
    )
    if layout == "channels_last":
        x = x.contiguous(memory_format=torch.channels_last)
        w = w.contiguous(memory_format=torch.channels_last)
    args = ([s.stride] * s.dims, pads, [1] * s.dims, False, [0] * s.dims, s.groups)
    y = torch.ops.aten.convolution(x, w, None, *args)
    assert y.shape[-1] == s.plane, (s, y.shape)
    return x, w, torch.randn_like(y), args  # randn_like keeps y's memory format


def _calls(x, w, gy, args) -> dict[str, tuple[str, object]]:
    """direction -> (ATen op name, fn) of one grid point: "forward", "backward_input",
    "backward_weight" (the first layer asks for grad_weight only) and "backward" (both
    gradients, as a layer inside a network asks: in 16-bit channels-first, PyTorch copies
    grad_output to NHWC once for both, so the parts' sum would count that copy twice)."""
    aten = torch.ops.aten
    calls = {"forward": ("convolution", lambda: aten.convolution(x, w, None, *args))}
    masks = {**BACKWARD_MASKS, "backward": [True, True, False]}
    for direction, mask in masks.items():
        calls[direction] = (
            "convolution_backward",
            lambda mask=mask: aten.convolution_backward(gy, x, w, None, *args, mask),
        )
    return calls


def _point(
    s: ConvShape, n: int, mode: str, dtype: torch.dtype, layout: str, dev: torch.device
) -> tuple[dict[str, list[float]], dict[str, float]]:
    """({direction: [outputs, depth, FLOP/s]}, {"forward" | "backward": workspace fraction})
    of shape s at batch n."""
    rates, spaces = {}, {}
    x, w, gy, args = _tensors(s, n, dtype, layout, dev)
    for direction, (name, fn) in _calls(x, w, gy, args).items():
        node = _record(fn, name)
        if direction in ("forward", "backward"):
            total = _allocated_inside(fn, dev) if dev.type == "cuda" else 0
            spaces[direction] = max(total - conv.layout_scratch(node), 0) / conv.io_bytes(node)
            spaces[f"{INSIDE}{direction}"] = total / conv.io_bytes(node)
        mn, k = gemm_dims(node)
        flops = op_cost(node, mode == "tf32").flops
        rates[direction] = [mn, k, flops / time_op(fn, dev, REPS)]
    return rates, spaces


def conv_grid(
    dev: torch.device,
    outputs: tuple[int, ...] = OUTPUTS,
    shapes: tuple[ConvShape, ...] | None = None,
) -> tuple[dict, dict]:
    """(rates, workspaces) of cuDNN convolutions over `conv_shapes()` at `outputs`:
    rates {mode: {"layout:class:direction": [[output elements, depth, FLOP/s], ...]}},
    layout "channels_first" | "channels_last", direction "forward" | "backward_input" |
    "backward_weight" | "backward" (both gradients in one call); workspaces {mode:
    {"forward" | "backward": fraction (channels-first), "channels_last:forward" |
    "channels_last:backward": fraction}}: the bytes cuDNN
    allocated and freed inside the call beyond the 16-bit layout copies
    `gobrrr.cost.conv.layout_scratch` models, over the op's input + output bytes, the median
    over the grid; and "inside:layout:class:direction": everything allocated inside the call
    over the input + output bytes, the median over each shape class (the allocator traces of
    the zoo's steps show the NHWC copies inside cuDNN's workspace for some shapes and none for
    others, and fp32 1x1 convolutions asking nothing where 3x3s ask about twice their input).
    The workspace depends on the algorithm cuDNN's heuristics pick, which jumps between
    neighbouring shapes, so only the typical fractions are kept."""
    rates: dict[str, dict[str, list[list[float]]]] = {}
    spaces: dict[str, dict[str, float]] = {}
    shapes = shapes or tuple(conv_shapes())
    old = torch.backends.cudnn.allow_tf32
    try:
        for mode, dtype in MODES:
            torch.backends.cudnn.allow_tf32 = mode == "tf32"
            rates[mode], ws = {}, {}
            for layout in LAYOUTS:
                for s in shapes:
                    if s.dims != 2 and layout == "channels_last":
                        continue  # PyTorch runs 1-D convolutions channels-first only
                    rows = class_rows(s.cls, shapes, outputs)
                    for out in _rows(s, shapes, outputs):
                        r, w = _point(s, s.batch(out), mode, dtype, layout, dev)
                        for direction, row in r.items():
                            rates[mode].setdefault(f"{layout}:{s.cls}:{direction}", []).append(
                                [snap(row[0], rows), *row[1:]]
                            )
                        prefix = "" if layout == "channels_first" else f"{layout}:"
                        for direction, frac in w.items():
                            if direction.startswith(INSIDE):  # by layout and class
                                key = f"{direction}".replace(INSIDE, f"{INSIDE}{layout}:{s.cls}:")
                                ws.setdefault(key, []).append(frac)
                            else:
                                ws.setdefault(prefix + direction, []).append(frac)
                        _free(dev)
            spaces[mode] = {k: statistics.median(v) for k, v in ws.items()}
    finally:
        torch.backends.cudnn.allow_tf32 = old
    return rates, spaces


def class_rows(
    cls: str, shapes: tuple[ConvShape, ...] | None = None, outputs: tuple[int, ...] = OUTPUTS
) -> list[float]:
    """The output elements of a class's grid rows: its first shape's at each row."""
    shapes = shapes or tuple(conv_shapes())
    ref = next(s for s in shapes if s.cls == cls)
    return [
        float(ref.batch(o) * ref.plane**ref.dims * ref.c_out) for o in _rows(ref, shapes, outputs)
    ]


def snap(mn: float, rows: list[float]) -> float:
    """A point's output elements put on its class's grid row: the smallest row at or over
    them. A shape whose per-sample outputs are no power of two times the class's first
    shape's (768 channels beside 256) lands between rows, at 1/2 to 1 of its row's; the grid
    is read by rows (`cost.curves.grid_value`), so a point off its row would form a row of
    its own."""
    return min((r for r in rows if r >= mn), default=mn)


def _rows(s: ConvShape, shapes: tuple[ConvShape, ...], outputs: tuple[int, ...]) -> list[int]:
    """The outputs at which every shape of s's class fits a batch: complete grid rows (up to
    the class's ROW_CAP)."""
    return [
        o
        for o in outputs
        if all(t.batch(o) for t in shapes if t.cls == s.cls) and o <= ROW_CAP.get(s.cls, o)
    ]


def _free(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.empty_cache()


def depthwise_bandwidths(
    dev: torch.device,
    shapes: tuple[tuple[int, int], ...] = DEPTHWISE_SHAPES,
    batches: tuple[int, ...] = DEPTHWISE_BATCHES,
) -> dict[str, list[list[float]]]:
    """Achieved bytes/s of depthwise (groups = channels) convolutions, forward and backward
    (both gradients), per dtype, layout and kernel class, over their channels and size:
    {"forward:bf16:channels_last:3x3" | "backward:fp32:channels_first:5x5-s2" | ...:
    [[channels, bytes, B/s], ...]}, bytes as the cost model counts them, at each (channels,
    output plane) of `shapes` over `batches`. With one input channel per output channel a
    depthwise convolution is no GEMM (cuDNN runs it on CUDA cores, bound by memory and
    latency), so the dense grid says nothing about it; how cuDNN's kernels split the
    channels sets their speed (ConvNeXt's 96 channels at 56x56 ran 35% slower per byte than
    128), so one channel count cannot stand for the rest."""
    out: dict[str, list[list[float]]] = {}
    for key, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for layout in LAYOUTS:
            for cls, (k, stride) in DEPTHWISE_CLASSES.items():
                for channels, plane in shapes:
                    s = ConvShape(cls, channels, channels, k, stride, channels, plane)
                    for n in batches:
                        calls = _calls(*_tensors(s, n, dtype, layout, dev))
                        for direction in ("forward", "backward"):
                            name, fn = calls[direction]
                            nbytes = op_cost(_record(fn, name)).bytes
                            out.setdefault(f"{direction}:{key}:{layout}:{cls}", []).append(
                                [float(channels), nbytes, nbytes / time_op(fn, dev, REPS)]
                            )
                        _free(dev)
    return out
