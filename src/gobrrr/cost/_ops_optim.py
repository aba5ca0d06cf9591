"""Optimizer ops: torch's `_foreach_*` list ops and the fused Adam/AdamW/SGD kernels.

FLOPs per parameter element (arithmetic ops, sqrt = 1):
  fused Adam/AdamW: 13 = exp_avg lerp (3) + exp_avg_sq update (4) + denom sqrt/÷/+eps (3)
    + step ÷, ×lr, − (3); + 1 decoupled weight decay (AdamW, weight_decay != 0), + 2 L2 weight
    decay (Adam, weight_decay != 0), + 1 amsgrad max, + 1 grad unscale (grad_scale given).
    So fused AdamW with weight decay = 14.
  fused SGD: 2 (p -= lr·g) + 2 weight decay + 3 momentum (after the first step) + 2 nesterov.
  _foreach_*: the pointwise count of the op per element of `self` (addcmul/addcdiv/lerp 3,
    norm 2, others 1), summed over the list.
Bytes: fused Adam reads param, grad, exp_avg, exp_avg_sq (+ max_exp_avg_sq, state steps) and
writes param, exp_avg, exp_avg_sq (+ max); foreach ops read every tensor argument and write
their outputs (in-place ones: `self`).
Launches: torch's multi_tensor_apply chunking, simulated exactly: tensors are cut into chunks
of 65536 elements, one block per chunk; a launch happens when its block list reaches 320
blocks, when its tensor list reaches depth_to_max_tensors[depth-1] (110, 64, 48, 36, 30; 96 for
the first depth with scalar lists) or at the last chunk. depth = number of tensor lists (+1 for
an out-of-place result list). These are the 4 KB kernel-argument limits of CUDA 12 builds;
CUDA 13 builds use 7× more tensors per launch (fewer launches).
"""

from __future__ import annotations

from gobrrr.cost._ops_common import CostFn, OpCost, refs, sum_read, vector
from gobrrr.graph.ir import OpNode

CHUNK = 65536
MAX_BLOCKS = 320
MAX_TENSORS = (110, 64, 48, 36, 30)
MAX_TENSORS_SCALARLIST = (96, 64, 48, 36, 30)
_FOREACH_PER_ELEM = {"addcmul": 3, "addcdiv": 3, "lerp": 3, "norm": 2}


def mta_launches(numels: list[int], depth: int, scalar_list: bool = False) -> int:
    """Kernel launches of torch's multi_tensor_apply over tensors of `numels` elements."""
    limits = MAX_TENSORS_SCALARLIST if scalar_list else MAX_TENSORS
    max_tensors = limits[min(max(depth, 1), 5) - 1]
    numels = [n for n in numels if n > 0]
    launches = tensors = blocks = 0
    for i, n in enumerate(numels):
        tensors += 1
        left = -(-n // CHUNK)
        while left:
            take = min(left, MAX_BLOCKS - blocks)
            blocks, left = blocks + take, left - take
            done = left == 0
            if blocks == MAX_BLOCKS or (done and (tensors == max_tensors or i == len(numels) - 1)):
                launches, blocks = launches + 1, 0
                tensors = 0 if done else 1  # a tensor cut mid-way carries into the next launch
    return launches


def _tensor_lists(node: OpNode) -> list[list]:
    return [
        refs(node, a)
        for a in node.args
        if isinstance(a, (list, tuple)) and any(isinstance(x, dict) for x in a)
    ]


def foreach(node: OpNode, tf32: bool) -> OpCost:
    """_foreach_<op>[_](self[], ...): the pointwise op applied to each tensor of the list."""
    base = node.name[len("_foreach_") :].rstrip("_")
    lists = _tensor_lists(node)
    selves = lists[0] if lists else list(node.inputs)
    numels = [t.numel for t in selves]
    in_place = node.name.endswith("_")
    if base == "zero" or base == "copy":  # write-only / read src, write self
        reads = lists[1] if base == "copy" and len(lists) > 1 else []
        nbytes = sum_read(reads) + sum_read(selves)
    else:
        nbytes = sum_read(node.inputs) + sum_read(node.outputs if node.outputs else selves)
    depth = len([lst for lst in lists if len(lst) == len(selves)]) + (not in_place)
    depth = 1 if base == "norm" else depth  # norm reduces into a side buffer
    scalar_list = any(
        isinstance(a, (list, tuple)) and a and not isinstance(a[0], dict) for a in node.args
    )
    if slow_route(selves, lists):  # one TensorIterator kernel per tensor
        n = sum(1 for x in numels if x > 0)
        return vector(_FOREACH_PER_ELEM.get(base, 1) * sum(numels), nbytes, "pointwise", n)
    launches = mta_launches(numels, depth, scalar_list) + (base == "norm")  # + norm cleanup
    kind = "reduction" if base == "norm" else "optimizer"
    return vector(_FOREACH_PER_ELEM.get(base, 1) * sum(numels), nbytes, kind, launches)


def slow_route(selves: list, lists: list[list]) -> bool:
    """Whether a _foreach_ op over tensor lists leaves multi_tensor_apply for a loop of the
    op per tensor (ATen's `check_fast_path_restrictions`): the i-th tensors of the lists
    must share shape, dtype and strides (but in size-1 dimensions). E.g. a capturable
    Adam's `_foreach_div_(exp_avg_sq_sqrt, bias_correction2_sqrt)` divides each state by a
    0-dim tensor: on a GPU, a kernel per parameter."""
    for other in lists[1:]:
        if len(other) != len(selves):
            continue
        for a, b in zip(selves, other, strict=True):
            if a.shape != b.shape or a.dtype != b.dtype or not _same_strides(a, b):
                return True
    return False


def _same_strides(a, b) -> bool:
    """Equal strides but in size-1 dimensions, whose stride ATen's check skips (a depthwise
    convolution's weight (C, 1, k, k) and its gradient may differ there)."""
    return all(n == 1 or x == y for n, x, y in zip(a.shape, a.stride, b.stride, strict=True))


def _list(node: OpNode, i: int, name: str) -> list:
    return refs(node, node.arg(i, name, []))


def fused_adam(node: OpNode, tf32: bool) -> OpCost:
    """_fused_adam_/_fused_adamw_(params, grads, exp_avgs, exp_avg_sqs, max_exp_avg_sqs,
    state_steps, *, lr, beta1, beta2, weight_decay, eps, amsgrad, maximize, grad_scale?,
    found_inf?)."""
    params, grads, m, v, vmax, steps = (
        _list(node, i, n)
        for i, n in enumerate(
            ("self", "grads", "exp_avgs", "exp_avg_sqs", "max_exp_avg_sqs", "state_steps")
        )
    )
    amsgrad = bool(node.arg(11, "amsgrad", False)) and bool(vmax)
    wd = float(node.arg(9, "weight_decay", 0.0) or 0.0)
    per = 13 + (wd != 0) * (1 if node.name.startswith("_fused_adamw") else 2)
    per += amsgrad + (node.arg(13, "grad_scale") is not None)
    states = m + v + (vmax if amsgrad else [])
    scalars = [
        t
        for i, k in ((6, "lr"), (13, "grad_scale"), (14, "found_inf"))
        for t in refs(node, node.arg(i, k))
    ]
    nbytes = 2 * sum_read(params + states) + sum_read(grads + steps + scalars)
    numels = [t.numel for t in params]
    return vector(per * sum(numels), nbytes, "optimizer", mta_launches(numels, 4 + amsgrad))


def fused_sgd(node: OpNode, tf32: bool) -> OpCost:
    """_fused_sgd_(params, grads, momentum_buffer_list, *, weight_decay, momentum, lr,
    dampening, nesterov, maximize, is_first_step, grad_scale?, found_inf?)."""
    params, grads, bufs = (
        _list(node, i, n) for i, n in enumerate(("self", "grads", "momentum_buffer_list"))
    )
    momentum = float(node.arg(4, "momentum", 0.0) or 0.0) != 0 and bool(bufs)
    first = bool(node.arg(9, "is_first_step", False))
    per = 2 + 2 * (float(node.arg(3, "weight_decay", 0.0) or 0.0) != 0)
    per += momentum * (0 if first else 3) + 2 * (momentum and bool(node.arg(7, "nesterov", False)))
    scalars = [
        t
        for i, k in ((5, "lr"), (10, "grad_scale"), (11, "found_inf"))
        for t in refs(node, node.arg(i, k))
    ]
    nbytes = 2 * sum_read(params) + sum_read(grads + scalars)
    if momentum:  # the buffer is written, and read unless this is the first step
        nbytes += sum_read(bufs) * (1 if first else 2)
    numels = [t.numel for t in params]
    return vector(per * sum(numels), nbytes, "optimizer", mta_launches(numels, 2 + momentum))


#: torchao's 8-bit Adam: moments quantised in blocks of BLOCK elements, for tensors of at least
#: MIN_QUANTIZED elements whose size BLOCK divides (bitsandbytes' rule); a 256-entry fp32 code
#: book (qmap) per moment.
BLOCK, MIN_QUANTIZED, QMAP = 256, 4096, 256
ADAM8_PER_ELEM = 30  # see adam8bit_update


def block_rows(shape: tuple[int, ...]) -> bool:
    """Whether a parameter's rows are one quantisation block wide ((n, 256)): Inductor then
    makes torchao's update one fused kernel; any other layout takes several kernels with the
    new moments in fp32 in between (profile.calibrate_optim)."""
    return bool(shape) and shape[-1] == BLOCK


def adam8bit_scratch(node: OpNode) -> tuple[int, ...]:
    """Blocks a torchao 8-bit update allocates and frees inside itself, in order: for a
    quantised parameter whose rows are not one block, two fp32 buffers of its block count
    then two of its size (the fp32 moments between Inductor's kernels:
    benchmarks/results/optim8_transient_h100.json, e.g. a (50257, 768) embedding's
    603084 x 2 and 154389504 x 2 bytes); () otherwise."""
    if node.name != "adam8bit_update" or not node.inputs:
        return ()
    p = node.inputs[0]
    if not quantized(p.numel) or block_rows(p.shape):
        return ()
    blocks = p.numel // BLOCK
    return (4 * blocks, 4 * blocks, 4 * p.numel, 4 * p.numel)


def quantized(numel: int) -> bool:
    """Whether torchao's 8-bit Adam keeps this tensor's moments in 8 bits (else in the
    parameter's dtype)."""
    return numel >= MIN_QUANTIZED and numel % BLOCK == 0


def adam8bit_bytes(numel: int, param_itemsize: int, grad_itemsize: int) -> int:
    """Bytes one update of a parameter of `numel` elements must move: the parameter read and
    written, the gradient read, and each moment read and written — 8-bit codes, one fp32 scale
    per block and the code book read, or (small tensors) the moment in the parameter's dtype."""
    if quantized(numel):
        state = 2 * (numel + 4 * (numel // BLOCK)) + 4 * QMAP
    else:
        state = 2 * numel * param_itemsize
    return numel * (2 * param_itemsize + grad_itemsize) + 2 * state


def adam8bit_update(node: OpNode, tf32: bool) -> OpCost:
    """gobrrr::adam8bit_update(param, grad, step, exp_avg, exp_avg_scale?, exp_avg_qmap?,
    exp_avg_sq, exp_avg_sq_scale?, exp_avg_sq_qmap?, ...): one parameter's torchao 8-bit
    Adam(W) update (its compiled `single_param_adam`), one fused kernel that moves the
    minimal bytes (`adam8bit_bytes`). FLOPs per element: Adam's 14, dequantisation (2 per
    moment), the block absmax and division (2 per moment) and the 8-step code search with its
    rounding (10 per moment, counted as 5): 30. A calibration's `optim8` section replaces
    this op's device and host time with what was measured on the GPU (see
    cost.roofline.Rates.adam8bit)."""
    p, g = node.inputs[0], node.inputs[1]
    return vector(
        ADAM8_PER_ELEM * p.numel, adam8bit_bytes(p.numel, p.itemsize, g.itemsize), "optimizer", 1
    )


COSTS: dict[str, CostFn] = {
    "gobrrr.adam8bit_update": adam8bit_update,
    "aten._fused_adam_": fused_adam,
    "aten._fused_adamw_": fused_adam,
    "aten._fused_adam": fused_adam,
    "aten._fused_adamw": fused_adam,
    "aten._fused_sgd_": fused_sgd,
    "aten._fused_sgd": fused_sgd,
}
