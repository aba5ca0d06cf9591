"""What the cost model reads off an op's tensors: GEMM dimensions, misaligned and transposed
operands, depthwise convolutions, layout copies, sums over leading dimensions, and which
modules run under activation checkpointing. Pure functions of the step graph."""

from __future__ import annotations

import math

from gobrrr.cost._ops_common import targ
from gobrrr.cost._ops_matmul import conv_backward_flops, grouped_mm_groups
from gobrrr.cost.flops import OpCost
from gobrrr.graph.ir import OpNode, StepGraph

# host-cost keys beyond the graph's phases: a recomputed op, a forward op inside a checkpointed
# block; "_selective" for a block under a selective policy (every op of it passes through the
# policy's dispatch mode, in forward and in recompute)
CHECKPOINT_PHASES = ("recompute", "checkpointed", "recompute_selective", "checkpointed_selective")


def checkpointed_modules(graph: StepGraph) -> set[str]:
    """Modules whose forward runs under activation checkpointing: those recomputed in the
    backward. Their forward ops cost the host more (the checkpoint's saved-tensor hooks)."""
    return {n.module for n in graph.nodes if n.phase == "recompute"}


def selective_modules(graph: StepGraph) -> set[str]:
    """Modules inside the blocks the step checkpoints selectively (meta.checkpoint maps
    block names to policies when the blocks are not all checkpointed fully)."""
    policies = graph.meta.checkpoint
    if not isinstance(policies, dict):
        return set()
    blocks = {b for b, p in policies.items() if p == "selective"}
    return {n.module for n in graph.nodes if n.module and _within(n.module, blocks)}


def _within(module: str, blocks: set[str]) -> bool:
    name = module
    while name:
        if name in blocks:
            return True
        name = name.rpartition(".")[0]
    return False


def host_key(node: OpNode, checkpointed: set[str], selective: set[str]) -> str | None:
    """The host-cost key of `node` when it is not its phase (see CHECKPOINT_PHASES)."""
    sel = "_selective" if node.module in selective else ""
    if node.phase == "forward" and node.module in checkpointed:
        return "checkpointed" + sel
    if node.phase == "recompute" and sel:
        return "recompute" + sel
    return None


def outer_sum_columns(node: OpNode) -> int | None:
    """The output elements of a sum over leading dimensions only (a bias gradient: the sum
    over tokens), whose kernel strides across rows, unlike a sum over the last, contiguous
    dimension; None for any other op."""
    if node.name != "sum" or not node.inputs or not node.inputs[0].shape or not node.outputs:
        return None
    dims, ndim = node.arg(1, "dim"), len(node.inputs[0].shape)
    if dims and all(isinstance(d, int) and d % ndim != ndim - 1 for d in dims):
        return node.outputs[0].numel
    return None


def gemm_dims(node: OpNode) -> tuple[float, float] | None:
    """(output elements, reduction depth) of a matmul or convolution (as an implicit GEMM:
    N·Ho·Wo·Cout outputs, Cin/groups·kh·kw depth), or None."""
    name = node.name
    if name in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm") and node.outputs:
        out = node.outputs[0]
        a = (
            node.inputs[1]
            if name in ("addmm", "baddbmm") and len(node.inputs) > 2
            else node.inputs[0]
        )
        return float(out.numel), float(a.shape[-1])
    if name == "_grouped_mm" and node.outputs:
        # one GEMM per group (CUDA's fallback for non-16-bit dtypes: one kernel each)
        a, b, out = node.inputs[0], node.inputs[1], node.outputs[0]
        groups = grouped_mm_groups(node)
        kernels = 1 if a.dtype in ("bfloat16", "float16") else groups
        depth = a.shape[-1] / groups if len(a.shape) == len(b.shape) == 2 else a.shape[-1]
        return float(out.numel) / kernels, float(depth)
    if name.startswith("convolution") or name.startswith("cudnn_convolution"):
        # by argument position: a late-stage weight can be larger than the activations
        backward = name.endswith("backward")
        acts = (
            [targ(node, 0, "grad_output"), targ(node, 1, "input")]
            if backward
            else (node.outputs[:1] or [targ(node, 0, "input")])
        )
        w = targ(node, 2 if backward else 1, "weight")
        acts = [t for t in acts if t is not None]
        if w is None or len(w.shape) < 3 or not acts:
            return None
        spatial = 1
        for d in w.shape[2:]:
            spatial *= d
        return float(max(t.numel for t in acts)), float(w.shape[1] * spatial)
    return None


def depthwise(node: OpNode) -> bool:
    """A convolution with one input channel per group and more than one group."""
    if not _conv_node(node):
        return False
    w = targ(node, 2 if node.name.endswith("backward") else 1, "weight")
    groups = node.arg(9 if node.name.endswith("backward") else 8, "groups", 1)
    return w is not None and len(w.shape) >= 3 and w.shape[1] == 1 and (groups or 1) > 1


def _conv_node(node: OpNode) -> bool:
    return node.name.startswith("convolution") or node.name.startswith("cudnn_convolution")


def channels_last_strides(t) -> bool:
    """PyTorch's test of a 4-D tensor's strides for the channels-last layout
    (c10's is_channels_last_strides_2d: a contiguous 1x1 conv weight is not, an N,C,1,1
    tensor is ambiguous and taken as channels-first)."""
    if t is None or len(t.shape) != 4 or t.stride[1] == 0:
        return False
    low = 0
    for d in (1, 3, 2, 0):
        if t.shape[d] == 0 or t.stride[d] < low or (d == 0 and low == t.stride[1]):
            return False
        low = t.stride[d] * (t.shape[d] if t.shape[d] > 1 else 1)
    return True


def contiguous_in(t, layout: str) -> bool:
    """PyTorch's t.is_contiguous(memory_format) for the layout a convolution runs in:
    "channels_last" (c10's compute_channels_last_contiguous_2d: strides 1, C, W·C, H·W·C
    over C, W, H, N, dims of size 1 skipped, so a contiguous 1x1 weight is both) on 4-D
    tensors, row-major contiguity otherwise."""
    if layout != "channels_last" or len(t.shape) != 4:
        return t.is_contiguous()
    expected = 1
    for d in (1, 3, 2, 0):
        if t.shape[d] != 1:
            if t.stride[d] != expected:
                return False
            expected *= t.shape[d]
    return True


def conv_layout(node: OpNode) -> str:
    """The layout cuDNN runs a convolution in, as PyTorch picks it
    (cudnn_conv_suggest_memory_format): "channels_last" when its input or its weight is
    stored channels-last (other operands are copied to match), "channels_first" otherwise
    (PyTorch's default, and every 1-D or 3-D convolution)."""
    backward = node.name.endswith("backward")
    x = targ(node, 1 if backward else 0, "input")
    w = targ(node, 2 if backward else 1, "weight")
    if w is None or len(w.shape) != 4:
        return "channels_first"
    return (
        "channels_last"
        if channels_last_strides(x) or channels_last_strides(w)
        else "channels_first"
    )


STEM_CHANNELS = 8  # fewer input channels than this: an image stem (cuDNN pads them to 8)
STEM_WINDOW = 49  # ... with a kernel window over 1x1 and up to 7x7 (a squeeze-and-excitation
# block's 1x1 from a few channels and a ViT's 16x16 patches are GEMMs)


def conv_class(node: OpNode) -> str | None:
    """The calibration's shape class of a convolution: "grouped-1d" (a 1-D one with groups >
    1), "grouped" (groups > 1), "patchify" (a kernel over 1x1 whose stride is the kernel, no
    padding: ConvNeXt's downsampling) and "stem-patchify" (the same on under 8 input channels:
    ViT's and Swin's patch embeddings, ConvNeXt's stem), "stem" (under
    8 input channels, kernel over 1x1 and up to 7x7), "1x1" / "1x1-reduce" / "1x1-expand"
    (C_out over C_in between 1/2 and 2, at most 1/2, at least 2), "1xk" / "kx1" (a stride-1
    2-D kernel one pixel high / wide: Inception's factorized 1x7 and 7x1, 1x3 and 3x1, whose
    backward asks cuDNN for other workspaces than a square kernel's), "3x3-s2" (a larger
    kernel, strided), "3x3" (a larger kernel, stride 1); None for an op that is no
    convolution."""
    backward = node.name.endswith("backward")
    w = targ(node, 2 if backward else 1, "weight")
    if not _conv_node(node) or w is None or len(w.shape) < 3:
        return None
    if (node.arg(9 if backward else 8, "groups", 1) or 1) > 1:
        return "grouped-1d" if len(w.shape) == 3 else "grouped"
    window = math.prod(w.shape[2:])
    stride = node.arg(4 if backward else 3, "stride", (1,)) or (1,)
    padding = node.arg(5 if backward else 4, "padding", (0,)) or (0,)
    if window > 1 and list(stride) == list(w.shape[2:]) and not any(padding):
        return "stem-patchify" if w.shape[1] < STEM_CHANNELS else "patchify"
    if w.shape[1] < STEM_CHANNELS and 1 < window <= STEM_WINDOW:
        return "stem"
    if window == 1:
        ratio = w.shape[0] / w.shape[1]
        return "1x1-reduce" if ratio <= 0.5 else "1x1-expand" if ratio >= 2 else "1x1"
    if any(s > 1 for s in stride):
        return "3x3-s2"
    if len(w.shape) == 4 and 1 in w.shape[2:]:
        return "1xk" if w.shape[2] == 1 else "kx1"
    return "3x3"


# where a convolution's shape class was not measured, the class whose kernels come closest
# (the asymmetric kernels' classes: what calibrations before them measured them as)
CONV_FALLBACK = {
    "1xk": ("3x3",),
    "kx1": ("3x3",),
    "1x1-reduce": ("1x1",),
    "1x1-expand": ("1x1",),
    "3x3-s2": ("3x3",),
    "patchify": ("3x3-s2", "3x3"),
    "stem-patchify": ("stem", "3x3-s2"),
    "stem": ("3x3-s2", "3x3"),
    "grouped-1d": ("grouped",),
}


def conv_points(
    table: dict[str, list[list[float]]], layout: str, cls: str | None, direction: str
) -> list[list[float]] | None:
    """The measured [[outputs, depth, FLOP/s], ...] of a convolution grid ({"layout:class:
    direction": points}) for this layout, shape class and direction: the class's own, else
    the nearest class's (CONV_FALLBACK), else the same from the channels-first grid (a
    channels_last one pays no layout copies, so that errs slow); None when none was measured
    (a grid without layouts)."""
    classes = (cls, *CONV_FALLBACK.get(cls, ())) if cls else ()
    for lay in dict.fromkeys((layout, "channels_first")):
        for c in classes:
            if table.get(key := f"{lay}:{c}:{direction}"):
                return table[key]
    return None


def depthwise_class(node: OpNode) -> str:
    """The calibration's kernel class of a depthwise convolution: "3x3", "5x5", "7x7", with
    "-s2" when strided."""
    backward = node.name.endswith("backward")
    w = targ(node, 2 if backward else 1, "weight")
    stride = node.arg(4 if backward else 3, "stride", (1,)) or (1,)
    k = w.shape[-1] if w is not None else 3
    return f"{k}x{k}" + ("-s2" if any(s > 1 for s in stride) else "")


def conv_directions(node: OpNode, flops: float) -> dict[str, float]:
    """A convolution's FLOPs by the calibration's direction: {"forward": flops}, or for a
    convolution_backward {"backward_input": ..., "backward_weight": ...} (the gradients its
    output_mask asks for; none when it asks for the bias's only)."""
    if not node.name.endswith("backward"):
        return {"forward": flops}
    grad_input, grad_weight = conv_backward_flops(node)
    parts = {"backward_input": float(grad_input), "backward_weight": float(grad_weight)}
    return {d: f for d, f in parts.items() if f > 0}


def wave_efficiency(node: OpNode, sms: int, tile: int = 128) -> float:
    """Fraction of the chip a matmul keeps busy: output tiles over full waves of SMs."""
    if node.name not in ("mm", "addmm", "bmm", "baddbmm", "_scaled_mm") or not node.outputs:
        return 1.0
    shape = node.outputs[0].shape
    batch = shape[0] if len(shape) == 3 else 1
    m, n = shape[-2], shape[-1]
    tiles = batch * math.ceil(m / tile) * math.ceil(n / tile)
    waves = math.ceil(tiles / sms)
    return tiles / (waves * sms) if waves else 1.0


def alignment(node: OpNode) -> int:
    """The largest power of two, up to 16, that divides every matmul operand's and result's
    leading dimension and start in bytes: 16 = aligned. cuBLAS picks its kernels by it (GPT-2's
    vocabulary of 50257 in bf16 is 2-byte aligned and runs the head ~5x slower than a padded
    50304; BERT's 30522 is 4-byte aligned). A non-unit inner stride counts as the element."""
    if node.name not in ("mm", "addmm", "bmm", "baddbmm", "addbmm"):
        return 16
    worst = 16
    for t in (*node.inputs, *node.outputs):
        if len(t.shape) < 2:
            continue  # a bias vector
        inner = min(t.stride[-1], t.stride[-2])
        ld = max(t.stride[-1], t.stride[-2])
        if inner != 1 and t.shape[-1] != 1 and t.shape[-2] != 1:
            return t.itemsize
        for nbytes in (ld * t.itemsize, t.offset * t.itemsize):
            while worst > 1 and nbytes % worst:
                worst //= 2
    return worst


def misaligned(node: OpNode) -> bool:
    """True when a matmul operand or result has a leading dimension (or start) that is not a
    multiple of 16 bytes: cuBLAS then cannot use its fast tensor-core kernels."""
    return alignment(node) < 16


def misaligned_nt(node: OpNode) -> bool:
    """True when a matmul's output has an odd leading dimension and its second operand is a
    transposed (column-major) view: `x @ w.t()`, a linear layer with an odd output width."""
    if not node.outputs or len(node.outputs[0].shape) < 2 or len(node.inputs) < 2:
        return False
    out, b = node.outputs[0], node.inputs[-1]
    odd_out = (max(out.stride[-1], out.stride[-2]) * out.itemsize) % 16 != 0
    return odd_out and len(b.shape) >= 2 and b.stride[-2] == 1 and b.stride[-1] != 1


def layout_bytes(node: OpNode, cost: OpCost) -> float:
    """Bytes cuDNN moves converting channels-first (NCHW) tensors to the channels-last layout
    its 16-bit tensor-core kernels need, and back: each 4-D activation read and written once.
    None where cuDNN runs channels-last: PyTorch copies a channels-first operand to
    channels-last before the call then (`cost.conv.operand_copies`, timed apart)."""
    if cost.kind != "conv" or cost.math not in ("bf16", "fp16"):
        return 0.0
    if conv_layout(node) == "channels_last":
        return 0.0
    acts = [t for t in (*node.inputs, *node.outputs) if len(t.shape) == 4]
    if not any(t.stride[1] != 1 and t.shape[1] > 1 for t in acts):
        return 0.0  # already channels-last
    weight = min(acts, key=lambda t: t.numel) if len(acts) > 1 else None
    return 2.0 * sum(t.nbytes for t in acts if t is not weight)


# Elementwise kernels by the path CUDA's TensorIterator takes (ATen's CUDALoops.cuh):
# operands all dense in one layout and of one dtype run the vectorized kernel; a dtype that
# differs (an input cast on the fly: bf16 + fp32, a bf16 -> fp32 copy) runs the unrolled kernel
# with per-element casts; any other layout runs the generic kernel that computes every
# operand's offset per element, and when dtypes also differ, the same generic kernel fetches
# and casts every operand through a switch on its dtype ("generic_cast": a bf16 activation
# times an fp32 per-channel scale, an RMSNorm's fp32 weight times bf16 rows). fp32 -> bf16/fp16
# copies have a vectorized kernel of their own.
ELEMENTWISE_COPIES = frozenset(("clone", "_to_copy", "copy", "copy_", "_copy_from"))
_OWN_KERNELS = frozenset(
    (
        "native_dropout",
        "_fused_dropout",
        "bernoulli",
        "normal",
        "rrelu_with_noise",
        "isin",
        "bucketize",
        "polar",
        "complex",
    )
)
_CAST_DOWN = (("float32", "bfloat16"), ("float32", "float16"))
# kernels that take a bool operand as bool (a condition, a mask), not cast to the data's dtype
_BOOL_OPERAND = frozenset(("where", "masked_fill"))


CATS = frozenset(("cat", "stack"))


def cat_path(node: OpNode) -> str | None:
    """The kernel path of a cat or stack: "cat_strided" where an input is not contiguous in
    the output's memory format (CUDA's CatArrayBatchedCopy then computes every element's
    offset from the input's strides: a stack of attention's q, k and v gradients in their
    (batch, token, head) layout), else None (the batched copy of contiguous inputs, at a
    copy's bandwidth)."""
    if node.name not in CATS or not node.outputs:
        return None
    cl = channels_last_strides(node.outputs[0])
    for t in node.inputs:
        if t.numel <= 1:
            continue
        if not (t.is_contiguous() or (cl and channels_last_strides(t))):
            return "cat_strided"
    return None


def elementwise_path(node: OpNode, kind: str) -> str | None:
    """The kernel path of a TensorIterator copy or pointwise op, or None for any other op:
    "vector" (dense operands of one layout and dtype), "cast_down" (a dense fp32 -> bf16/fp16
    copy), "dyncast" (dense, one layout, dtypes that differ), "bcast" (an input broadcast
    along leading dims: a bias), "bcast_inner" (an input broadcast along the output's fastest
    dim: a per-row scale), "strided" (layouts that differ, every operand read in runs along
    the output's fastest dim: a head transpose), "generic_cast" (a pointwise op that is
    "bcast", "bcast_inner" or "strided" with dtypes that differ), "transposed" (an operand
    strided along it); for a cat or stack, `cat_path`'s. Inputs of one element travel as
    scalars and do not count."""
    base = node.name.rstrip("_") if node.name != "copy_" else "copy"
    if kind == "copy":
        if node.name in CATS:
            return cat_path(node)
        if node.name not in ELEMENTWISE_COPIES:
            return None
    elif kind != "pointwise" or base in _OWN_KERNELS:
        return None
    if not node.outputs:
        return None
    out = node.outputs[0]
    if out.numel <= 1:
        return None
    ins = [t for t in node.inputs if t.numel > 1]
    if kind == "copy":
        ins = ins[-1:]  # copy_(self, src): the source
    dims = [d for d, s in enumerate(out.shape) if s > 1]
    inner = min(dims, key=lambda d: out.stride[d]) if dims else None
    if inner is None or out.stride[inner] != 1 or not out.is_dense():
        return "transposed"
    layouts, bcast, bcast_inner = [], False, False
    for t in ins:
        strides = _aligned_strides(t, out.shape)
        if strides is None:
            return None  # shapes that do not broadcast: not an elementwise op as recorded
        if any(s == 0 for d, s in enumerate(strides) if out.shape[d] > 1):
            bcast = True
            if strides[inner] == 0:
                bcast_inner = True
            elif strides[inner] != 1:
                return "transposed"
            continue
        if strides[inner] != 1:
            return "transposed"
        layouts.append(tuple(strides[d] for d in dims))
    dtypes = {t.dtype for t in ins if not (t.dtype == "bool" and base in _BOOL_OPERAND)}
    mixed = len(dtypes) > 1 or bool(dtypes and out.dtype not in dtypes and out.dtype != "bool")
    generic = (
        "bcast_inner"
        if bcast_inner
        else "bcast"
        if bcast
        else "strided"
        if any(lay != tuple(out.stride[d] for d in dims) for lay in layouts)
        else None
    )
    if generic:
        return "generic_cast" if mixed and kind == "pointwise" else generic
    if kind == "copy":
        src = ins[0].dtype if ins else out.dtype
        if src == out.dtype:
            return "vector"
        return "cast_down" if (src, out.dtype) in _CAST_DOWN else "dyncast"
    return "dyncast" if mixed else "vector"


def _aligned_strides(t, shape: tuple[int, ...]) -> list[int] | None:
    """t's strides over the dims of `shape` it broadcasts to (0 where it is broadcast), or
    None when it does not broadcast to `shape`."""
    pad = len(shape) - len(t.shape)
    if pad < 0:
        return None
    out = []
    for d, size in enumerate(shape):
        if d < pad:
            out.append(0)
            continue
        ts, st = t.shape[d - pad], t.stride[d - pad]
        if ts == size:
            out.append(st if size > 1 else 0)
        elif ts == 1:
            out.append(0)
        else:
            return None
    return out
