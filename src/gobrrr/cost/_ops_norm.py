"""Norms, softmax, embedding, losses and scatter-style indexing (CUDA cores, "vector").

FLOPs per element of the normalized input (rough arithmetic counts, transcendentals = 1):
layer norm forward 5 (+1 weight, +1 bias), backward dx 9, dweight 2, dbias 1; RMS norm forward 3
(+1 weight), backward dx 6, dweight 2; batch / group norm as layer norm. Softmax forward 5,
backward 4; log-softmax the same. Elementwise losses (mse, l1, bce, ...) 3 per element;
pooling 1 per output element × window. Embedding forward 0 (a gather), backward 1 add per gathered
element; nll_loss 1 per target. Bytes: each input read once, each output written once; ops
that touch only some rows (embedding, nll_loss, gather) read only those.
"""

from __future__ import annotations

from gobrrr.cost._ops_common import (
    CostFn,
    OpCost,
    io_bytes,
    read_bytes,
    sum_read,
    targ,
    vector,
)
from gobrrr.graph.ir import OpNode

LN_FWD, LN_DX, NORM_DW, NORM_DB = 5, 9, 2, 1
RMS_FWD, RMS_DX = 3, 6
SOFTMAX_FWD, SOFTMAX_BWD = 5, 4
LOSS_PER_ELEM = 3
_LOSSES = """mse_loss l1_loss smooth_l1_loss huber_loss binary_cross_entropy
binary_cross_entropy_with_logits soft_margin_loss kl_div multilabel_margin_loss_forward
multi_margin_loss""".split()
_POOLS = """max_pool1d max_pool2d max_pool3d max_pool2d_with_indices max_pool3d_with_indices
avg_pool1d avg_pool2d avg_pool3d adaptive_avg_pool1d adaptive_avg_pool2d adaptive_avg_pool3d
_adaptive_avg_pool2d _adaptive_avg_pool3d adaptive_max_pool2d adaptive_max_pool3d
upsample_nearest1d upsample_nearest2d upsample_nearest3d upsample_bilinear2d upsample_linear1d
upsample_bicubic2d upsample_trilinear3d _upsample_nearest_exact2d""".split()


def _mask(node: OpNode, i: int, n: int) -> list[bool]:
    mask = node.arg(i, "output_mask", None)
    return [bool(m) for m in mask] if mask is not None else [True] * n


def _big(node: OpNode) -> int:
    """Elements of the largest input: the activation being normalized."""
    return max((t.numel for t in node.inputs), default=0)


def layer_norm(node: OpNode, tf32: bool) -> OpCost:
    """native_layer_norm(input, normalized_shape, weight?, bias?, eps) -> (out, mean, rstd)."""
    w, b = targ(node, 2, "weight"), targ(node, 3, "bias")
    per = LN_FWD + (w is not None) + (b is not None)
    return vector(per * _big(node), io_bytes(node), "norm")


def _norm_backward(node: OpNode, mask: list[bool], dx_per: int) -> OpCost:
    n = _big(node)
    flops = n * (dx_per * mask[0] + NORM_DW * mask[1] + NORM_DB * (len(mask) > 2 and mask[2]))
    launches = int(mask[0]) + int(any(mask[1:]))  # dx kernel + dweight/dbias kernel
    return vector(flops, io_bytes(node), "norm", max(launches, 1))


def layer_norm_backward(node: OpNode, tf32: bool) -> OpCost:
    """native_layer_norm_backward(grad_out, input, normalized_shape, mean, rstd, w, b, mask)."""
    return _norm_backward(node, _mask(node, 7, 3), LN_DX)


def rms_norm(node: OpNode, tf32: bool) -> OpCost:
    """_fused_rms_norm(input, normalized_shape, weight?, eps) -> (out, rstd)."""
    w = targ(node, 2, "weight")
    return vector((RMS_FWD + (w is not None)) * _big(node), io_bytes(node), "norm")


def rms_norm_backward(node: OpNode, tf32: bool) -> OpCost:
    """_fused_rms_norm_backward(grad_out, input, normalized_shape, rstd, weight?, mask[2])."""
    return _norm_backward(node, _mask(node, 5, 2), RMS_DX)


def batch_norm(node: OpNode, tf32: bool) -> OpCost:
    """native_batch_norm / _native_batch_norm_legit*: statistics (training) then normalize."""
    if node.name.endswith("no_training"):
        training = False
    else:  # the .no_stats overload has no running stats before `training`
        training = bool(node.arg(3 if node.op.endswith(".no_stats") else 5, "training", True))
    per = LN_FWD + 2 if training else 4
    return vector(per * _big(node), io_bytes(node), "norm", 2 if training else 1)


def batch_norm_backward(node: OpNode, tf32: bool) -> OpCost:
    """native_batch_norm_backward(grad_out, input, w, rmean, rvar, smean, sinvstd, train, eps,
    output_mask); cudnn_batch_norm_backward has no mask (all three gradients)."""
    mask = _mask(node, 9, 3) if node.name == "native_batch_norm_backward" else [True] * 3
    return _norm_backward(node, mask, LN_DX)


def group_norm(node: OpNode, tf32: bool) -> OpCost:
    """native_group_norm(input, weight?, bias?, N, C, HxW, group, eps) -> (out, mean, rstd)."""
    w, b = targ(node, 1, "weight"), targ(node, 2, "bias")
    per = LN_FWD + (w is not None) + (b is not None)
    return vector(per * _big(node), io_bytes(node), "norm", 2)


def group_norm_backward(node: OpNode, tf32: bool) -> OpCost:
    """native_group_norm_backward(grad_out, input, mean, rstd, weight?, N, C, HxW, group, mask)."""
    return _norm_backward(node, _mask(node, 9, 3), LN_DX)


def softmax(node: OpNode, tf32: bool) -> OpCost:
    """_softmax / _log_softmax(self, dim, half_to_float): max, sub, exp, sum, div (or log)."""
    return vector(SOFTMAX_FWD * node.inputs[0].numel, io_bytes(node), "softmax")


def softmax_backward(node: OpNode, tf32: bool) -> OpCost:
    """_softmax_backward_data / _log_softmax_backward_data(grad_output, output, dim, dtype)."""
    return vector(SOFTMAX_BWD * node.inputs[0].numel, io_bytes(node), "softmax")


def embedding(node: OpNode, tf32: bool) -> OpCost:
    """embedding(weight, indices, ...): read the indices and the gathered rows, write them."""
    out, idx = node.outputs[0], targ(node, 1, "indices")
    return vector(0, read_bytes(idx) + 2 * read_bytes(out), "embedding")


def embedding_backward(node: OpNode, tf32: bool) -> OpCost:
    """embedding_dense_backward(grad_output, indices, num_weights, padding_idx, scale): read
    grad rows and indices, write the whole (num_weights, D) gradient. CUDA launches ≈ 6 (sort
    the indices, segment offsets, partial sums, final sums, zero-fill)."""
    go = node.inputs[0]
    return vector(go.numel, io_bytes(node), "embedding", 6)


def nll_loss(node: OpNode, tf32: bool) -> OpCost:
    """nll_loss_forward(self, target, weight?, reduction, ignore_index): reads one
    log-probability per target (not the whole (N, C) input)."""
    x, target, w = node.inputs[0], targ(node, 1, "target"), targ(node, 2, "weight")
    n = target.numel
    nbytes = read_bytes(target) + n * x.itemsize + read_bytes(w) + sum_read(node.outputs)
    return vector(n * (1 + (w is not None)), nbytes, "loss")


def nll_loss_backward(node: OpNode, tf32: bool) -> OpCost:
    """nll_loss_backward(grad_output, self, target, weight?, reduction, ignore_index,
    total_weight): zero-fills grad_input (N, C) and writes one value per target; self is
    read for its shape only. 2 launches (fill + scatter)."""
    target, skip = targ(node, 2, "target"), node.arg(1, "self")
    skip_i = skip["t"] if isinstance(skip, dict) else -1
    reads = [t for i, t in enumerate(node.inputs) if i != skip_i]
    return vector(target.numel, sum_read(reads) + sum_read(node.outputs), "loss", 2)


def scatter_like(node: OpNode, tf32: bool) -> OpCost:
    """scatter/scatter_add/index_add/index_put/index_copy: functional ones read self and write
    the whole output; in-place ones touch only the indexed elements. FLOPs: 1 per source
    element for the accumulating variants (add/reduce/accumulate), else 0."""
    name = node.name.rstrip("_")
    src = list(node.inputs[1:])
    accumulate = (
        "add" in name
        or "reduce" in name
        or (name.endswith("index_put") and bool(node.arg(3, "accumulate", False)))
    )
    n_src = max((t.numel for t in src), default=0)
    flops = n_src if accumulate else 0
    if node.name.endswith("_"):  # in place: read the sources, read-modify-write those elements
        self_t = node.inputs[0]
        return vector(flops, sum_read(src) + 2 * n_src * self_t.itemsize, "copy")
    return vector(flops, io_bytes(node), "copy")


def elementwise_loss(node: OpNode, tf32: bool) -> OpCost:
    """mse/l1/smooth_l1/huber/bce losses and their backward: LOSS_PER_ELEM per input element
    (difference, square or abs, sum; the backward's scale), bytes = inputs + outputs."""
    return vector(LOSS_PER_ELEM * _big(node), io_bytes(node), "loss")


def pooling(node: OpNode, tf32: bool) -> OpCost:
    """max/avg/adaptive pooling and upsampling, forward and backward: one compare or add per
    (output element × window element), at least one per input element."""
    windowed = "pool" in node.name and "adaptive" not in node.name
    kernel = node.arg(1, "kernel_size", None) if windowed else None
    window = 1
    if isinstance(kernel, (list, tuple)) and "backward" not in node.name:
        for k in kernel:
            window *= int(k)
    out = max((t.numel for t in node.outputs), default=0)
    return vector(max(out * window, _big(node)), io_bytes(node), "reduction")


def _table() -> dict[str, CostFn]:
    costs: dict[str, CostFn] = {
        "aten.native_layer_norm": layer_norm,
        "aten.layer_norm": layer_norm,
        "aten.native_layer_norm_backward": layer_norm_backward,
        "aten._fused_rms_norm": rms_norm,
        "aten.rms_norm": rms_norm,
        "aten._fused_rms_norm_backward": rms_norm_backward,
        "aten.native_group_norm": group_norm,
        "aten.native_group_norm_backward": group_norm_backward,
        "aten.native_batch_norm_backward": batch_norm_backward,
        "aten.cudnn_batch_norm_backward": batch_norm_backward,
        "aten._softmax": softmax,
        "aten._log_softmax": softmax,
        "aten.softmax": softmax,
        "aten.log_softmax": softmax,
        "aten._safe_softmax": softmax,
        "aten._softmax_backward_data": softmax_backward,
        "aten._log_softmax_backward_data": softmax_backward,
        "aten.embedding": embedding,
        "aten.embedding_dense_backward": embedding_backward,
        "aten.nll_loss_forward": nll_loss,
        "aten.nll_loss2d_forward": nll_loss,
        "aten.nll_loss_backward": nll_loss_backward,
        "aten.nll_loss2d_backward": nll_loss_backward,
    }
    for n in (
        "native_batch_norm",
        "_native_batch_norm_legit",
        "_native_batch_norm_legit_functional",
        "_native_batch_norm_legit_no_training",
        "cudnn_batch_norm",
        "batch_norm",
    ):
        costs[f"aten.{n}"] = batch_norm
    for n in _LOSSES:
        costs[f"aten.{n}"] = costs[f"aten.{n}_backward"] = elementwise_loss
    for n in _POOLS:
        costs[f"aten.{n}"] = costs[f"aten.{n}_backward"] = pooling
    for n in (
        "scatter",
        "scatter_add",
        "scatter_reduce",
        "index_add",
        "index_put",
        "index_copy",
        "_index_put_impl",
        "index_fill",
        "masked_scatter",
    ):
        costs[f"aten.{n}"] = costs[f"aten.{n}_"] = scatter_like
    return costs


COSTS: dict[str, CostFn] = _table()
