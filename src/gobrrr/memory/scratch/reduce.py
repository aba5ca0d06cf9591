"""What PyTorch's CUDA reductions allocate inside the call: the staging buffer and semaphores of
a reduction split across thread blocks.

ATen's reduction kernel (aten/src/ATen/native/cuda/Reduce.cuh, `setReduceConfig` and
`gpu_reduce_kernel`) chooses its launch from the TensorIterator's shape and strides. When each
output has many inputs and there are few outputs (a bias gradient: (tokens, hidden) summed
over the tokens), it splits every output across `ctas_per_output` blocks, which meet in a
global-memory buffer of `sizeof(acc) x outputs x ctas_per_output` (x block width x vector width
when the reduced dimension is not the fastest one) and an int semaphore per block column; both
come from the caching allocator and are freed when the op returns. This module reproduces that
choice (for an H100: 132 SMs, 2048 threads per SM, warps of 32). Checked request by request
against the allocator traces of the zoo's steps (`tests/fixtures/zoo_diagnose_h100.json`):
BERT's bias gradients in fp32 (768 and 3072 wide, 30522 for the decoder: 48 MiB, 132 MiB and
29.8 MiB buffers), ViT's and Whisper's under autocast, and the bias gradient a
convolution_backward sums inside itself (ViT's patch embedding, Whisper's second conv).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from gobrrr.graph.ir import OpNode, StepGraph

SMS = 132  # H100 SXM multiprocessors
THREADS_PER_SM = 2048
WARP = 32
MAX_THREADS = 512
MIN_VALUES_PER_THREAD = 16
MAX_VALUES_PER_THREAD = 256
VT0 = 4  # values per thread per step (and the input vector width) of the sum kernels
REDUCTIONS = ("sum", "mean")  # ops that run ATen's generic reduction kernel


def _div_up(a: int, b: int) -> int:
    return -(-a // b)


def _last_pow2(n: int) -> int:
    return max(1, 1 << (max(n, 1).bit_length() - 1))


def _iter_dims(
    shape: Sequence[int], strides: Sequence[int], reduced: set[int], itemsize: int
) -> tuple[list[int], list[int], list[int]]:
    """TensorIterator's view of a reduction: dims ordered fastest first (reduced ones in
    front), size-1 and adjacent compatible dims coalesced. Returns (shape, input strides in
    bytes, output strides in bytes), output stride 0 on reduced dims."""
    nd = len(shape)
    out_shape = [1 if d in reduced else shape[d] for d in range(nd)]
    ostr, acc = [0] * nd, itemsize
    for d in reversed(range(nd)):
        if d not in reduced and out_shape[d] != 1:
            ostr[d] = acc
            acc *= out_shape[d]
    istr = [s * itemsize for s in strides]

    def swap(d0: int, d1: int) -> int:
        if (ostr[d0] == 0) != (ostr[d1] == 0):
            return 1 if ostr[d1] == 0 else -1
        for st in (ostr, istr):
            if st[d0] == 0 or st[d1] == 0:
                continue
            if st[d0] != st[d1]:
                return -1 if st[d0] < st[d1] else 1
            if shape[d0] > shape[d1]:
                return 1
        return 0

    perm = list(reversed(range(nd)))
    for i in range(1, nd):
        d1 = i
        for d0 in range(i - 1, -1, -1):
            c = swap(perm[d0], perm[d1])
            if c > 0:
                perm[d0], perm[d1] = perm[d1], perm[d0]
                d1 = d0
            elif c < 0:
                break
    dims = [[shape[d], istr[d], ostr[d]] for d in perm if shape[d] != 1] or [[1, itemsize, 0]]
    out = [dims[0]]
    for n, si, so in dims[1:]:
        pn, psi, pso = out[-1]
        if psi * pn == si and pso * pn == so:
            out[-1] = [pn * n, psi, pso]
        else:
            out.append([n, si, so])
    return [d[0] for d in out], [d[1] for d in out], [d[2] for d in out]


def _output_vec(shape: list[int], istr: list[int], out_dim: int, itemsize: int) -> int:
    vec = 4
    for n in [shape[out_dim]] + [s // itemsize for j, s in enumerate(istr) if j != out_dim]:
        while n % vec:
            vec //= 2
    return vec


def reduce_buffers(
    shape: Sequence[int],
    strides: Sequence[int],
    dims: Sequence[int],
    itemsize: int,
    acc_size: int = 4,
) -> tuple[int, int]:
    """(staging buffer bytes, semaphore bytes) a CUDA sum/mean of a tensor (`shape`, element
    `strides`, `itemsize` bytes) over `dims` allocates; (0, 0) when it reduces within a
    block. `acc_size`: bytes of the accumulator (4: float, also for 16-bit inputs)."""
    reduced = {d % len(shape) for d in dims} if shape else set()
    sh, istr, ostr = _iter_dims(shape, strides, reduced, itemsize)
    numel = math.prod(sh)
    n_red = sum(1 for s in ostr if s == 0)
    outputs = max(1, numel // math.prod(sh[:n_red])) if n_red else numel
    per_output = numel // outputs
    fastest = n_red == len(sh) or istr[0] < istr[n_red]
    dim0, dim1 = (per_output, outputs) if fastest else (outputs, per_output)
    moving = istr[0] if fastest else istr[n_red]
    out_vec = 1
    if moving == itemsize:
        if fastest and dim0 >= 128 and n_red == 1:
            dim0 //= VT0
        elif not fastest:
            out_vec = _output_vec(sh, istr, n_red, itemsize)
            dim0 //= out_vec
    max_t = MAX_THREADS // out_vec
    p0 = _last_pow2(dim0) if dim0 < max_t else max_t
    p1 = _last_pow2(dim1) if dim1 < max_t else max_t
    bw = min(p0, WARP)
    bh = min(p1, max_t // bw)
    bw = min(p0, max_t // bh)
    threads = bw * bh
    step_in = step_out = 1
    if fastest:
        step_in *= bw
    else:
        step_out *= bw
    vpt = _div_up(per_output, step_in)
    split_warps = vpt >= min(bh * 16, MAX_VALUES_PER_THREAD)
    if split_warps:
        step_in *= bh
    else:
        step_out *= bh
    grid = _div_up(outputs // out_vec, step_out)
    vpt = _div_up(per_output, step_in)
    target = SMS * (THREADS_PER_SM // threads)
    if not (split_warps and vpt >= MAX_VALUES_PER_THREAD and grid <= target):
        return 0, 0
    ctas = min(
        max(_div_up(target, grid), _div_up(vpt, MAX_VALUES_PER_THREAD)),
        _div_up(vpt, MIN_VALUES_PER_THREAD),
    )
    if ctas <= 1:
        return 0, 0
    size = acc_size * outputs * ctas
    if not fastest:
        size *= bw * out_vec
    return size, 4 * grid


def _cast_copy(node: OpNode) -> int:
    """Bytes of the copy a reduction makes of an input whose dtype is not the one it reduces
    in (ATen's make_reduction: `self.to(in_dtype)`, e.g. a sum of bools counts in int64; a
    16-bit float input reduced into fp32 is read as it is)."""
    x, out = node.inputs[0], node.outputs[0] if node.outputs else None
    if out is None or out.dtype == x.dtype:
        return 0
    if x.dtype in ("bfloat16", "float16") and out.dtype == "float32":
        return 0
    return x.numel * out.itemsize


def _conv_bias_grad(node: OpNode) -> tuple[int, ...]:
    """A convolution_backward that returns the bias's gradient sums grad_output over every dim
    but the channels (as the tensor is laid out: a channels-last gradient reduces across
    blocks); its staging blocks."""
    mask = node.arg(10, "output_mask")
    go = node.inputs[0] if node.inputs else None
    if (
        not mask
        or len(mask) < 3
        or not mask[2]
        or go is None
        or len(go.shape) < 3
        or go.dtype not in ("float32", "bfloat16", "float16")
    ):
        return ()
    buf, sem = reduce_buffers(go.shape, go.stride, [0, *range(2, len(go.shape))], go.itemsize)
    return (buf, sem) if buf else ()


def op_scratch(node: OpNode) -> tuple[int, ...]:
    """The blocks (bytes) a sum or mean op allocates inside itself, in order: a copy of an
    input of another dtype, the staging buffer and semaphores; for a convolution_backward,
    its bias gradient's staging blocks; () for other ops."""
    if node.name == "convolution_backward":
        return _conv_bias_grad(node)
    if node.name not in REDUCTIONS or not node.inputs or not node.inputs[0].shape:
        return ()
    x, copy = node.inputs[0], _cast_copy(node)
    dims = node.arg(1, "dim")
    if isinstance(dims, int):
        dims = [dims]
    if not dims:
        dims = list(range(len(x.shape)))
    buf = sem = 0
    if x.dtype in ("float32", "bfloat16", "float16"):
        buf, sem = reduce_buffers(x.shape, x.stride, dims, x.itemsize)
    return tuple(b for b in (copy, buf, sem) if b)


def scratch(graph: StepGraph) -> dict[int, tuple[int, ...]]:
    """{op index: blocks} for the graph's reductions that stage through global memory."""
    out = {}
    for node in graph.nodes:
        blocks = op_scratch(node)
        if blocks:
            out[node.index] = blocks
    return out
