"""Pointwise ops, reductions, copies, creation ops and views (all on CUDA cores, "vector").

FLOPs: pointwise ops count per output element the rough number of arithmetic operations in
_PER_ELEM (1 unless listed; a transcendental such as exp or tanh counts as 1). Copies, casts,
fills and creation ops count 1 per element written. Reductions count per input element
(1 for sum/mean/max, 2 for norms, 3 for var/std, 4 for logsumexp).
Bytes: every input read once at its own size (a broadcast input at its own, smaller size; a
Python scalar costs nothing) + every output written once. In-place ops write `self` in place.
"""

from __future__ import annotations

from gobrrr.cost._ops_common import (
    VIEW_COST,
    CostFn,
    OpCost,
    first_out,
    io_bytes,
    read_bytes,
    sum_read,
    vector,
)
from gobrrr.graph.ir import OpNode

_UNARY = """abs neg exp exp2 expm1 log log2 log10 log1p sqrt rsqrt reciprocal sin cos tan tanh asin
acos atan sinh cosh asinh acosh atanh erf erfc erfinv sign sgn signbit floor ceil round trunc frac
sigmoid relu relu6 square lgamma digamma i0 sinc nan_to_num bitwise_not logical_not isnan isinf
isfinite isneginf isposinf positive angle conj_physical tril triu""".split()
_BINARY = """add sub rsub mul div true_divide floor_divide remainder fmod pow maximum minimum fmax
fmin atan2 hypot logaddexp logaddexp2 xlogy copysign heaviside nextafter eq ne lt le gt ge
logical_and logical_or logical_xor bitwise_and bitwise_or bitwise_xor bitwise_left_shift
bitwise_right_shift __and__ __or__ __xor__ __lshift__ __rshift__ clamp clamp_min clamp_max clip
where masked_fill lerp addcmul addcdiv threshold threshold_backward hardtanh hardtanh_backward
gelu gelu_backward silu silu_backward mish mish_backward elu elu_backward leaky_relu
leaky_relu_backward hardswish hardswish_backward hardsigmoid hardsigmoid_backward softplus
softplus_backward sigmoid_backward tanh_backward logit logit_backward glu glu_backward prelu
_prelu_kernel _prelu_kernel_backward softshrink softshrink_backward hardshrink
hardshrink_backward native_dropout native_dropout_backward _masked_scale rrelu_with_noise
bernoulli normal polar complex float_power isin bucketize _fused_dropout""".split()
_PER_ELEM = {
    "addcmul": 3,
    "addcdiv": 3,
    "lerp": 3,
    "gelu": 8,
    "gelu_backward": 12,
    "silu": 4,
    "silu_backward": 6,
    "sigmoid": 3,
    "sigmoid_backward": 3,
    "tanh_backward": 3,
    "softplus": 4,
    "softplus_backward": 4,
    "mish": 8,
    "mish_backward": 12,
    "elu": 3,
    "elu_backward": 3,
    "hardswish": 4,
    "hardswish_backward": 4,
    "logit": 3,
    "logaddexp": 4,
    "hypot": 3,
    "glu": 4,
    "glu_backward": 6,
    "native_dropout": 2,
    "clamp": 2,
    "xlogy": 2,
}
# Write their output without reading any tensor input (in-place ones write `self`).
_WRITE_ONLY = """fill fill_ zero_ zeros ones full zeros_like ones_like full_like new_zeros new_ones
new_full scalar_tensor arange linspace logspace eye rand randn randint randperm rand_like
randn_like randint_like normal_ uniform_ exponential_ random_ geometric_ cauchy_ log_normal_
bernoulli_ tril_indices triu_indices""".split()
_COPIES = """clone _to_copy copy _copy_from _copy_from_and_resize lift_fresh_copy cat stack hstack
vstack concat concatenate repeat tile roll flip repeat_interleave constant_pad_nd
reflection_pad1d reflection_pad2d replication_pad1d replication_pad2d index_select gather take
masked_select nonzero _local_scalar_dense""".split()
VIEWS = """view _unsafe_view _reshape_alias permute transpose t expand expand_as slice select
unsqueeze squeeze as_strided detach alias lift_fresh view_as unfold diagonal narrow split
split_with_sizes
chunk unbind tensor_split movedim moveaxis swapaxes swapdims unflatten view_as_real
view_as_complex _conj conj _neg_view resolve_conj resolve_neg real imag squeeze_ unsqueeze_ t_
transpose_ as_strided_ detach_ set_ resize_ resize_as_ empty empty_like empty_strided new_empty
new_empty_strided empty_permuted _has_compatible_shallow_copy_type is_same_size sym_size
sym_stride sym_numel sym_storage_offset record_stream _assert_async _assert_tensor_metadata
_functional_assert_async _make_dep_token lift _indices _values indices values
_nested_tensor_size _version""".split()
_RANDOM = (
    "rand",
    "normal",
    "uniform",
    "exponential",
    "random",
    "geometric",
    "cauchy",
    "log_normal",
    "bernoulli",
)
# view-or-copy ops: a view when the output shares the input's storage, else a copy
_MAYBE_VIEWS = "reshape reshape_as flatten contiguous to _unsafe_view_copy".split()
_REDUCE_PER_ELEM = {
    "sum": 1,
    "mean": 1,
    "nansum": 1,
    "nanmean": 1,
    "prod": 1,
    "amax": 1,
    "amin": 1,
    "max": 1,
    "min": 1,
    "argmax": 1,
    "argmin": 1,
    "any": 1,
    "all": 1,
    "aminmax": 1,
    "count_nonzero": 1,
    "cumsum": 1,
    "cumprod": 1,
    "cummax": 1,
    "cummin": 1,
    "logcumsumexp": 4,
    "logsumexp": 4,
    "var": 3,
    "std": 3,
    "var_mean": 3,
    "std_mean": 3,
    "norm": 2,
    "linalg_vector_norm": 2,
    "median": 1,
    "nanmedian": 1,
    "mode": 1,
    "kthvalue": 1,
    "sort": 1,
    "topk": 1,
    "_cdist_forward": 3,
}


def pointwise(node: OpNode, tf32: bool) -> OpCost:
    """FLOPs = per-element count × output elements; bytes = inputs + outputs."""
    base = node.name.rstrip("_")
    out = first_out(node)
    flops = _PER_ELEM.get(base, 1) * (out.numel if out is not None else 0)
    return vector(flops, io_bytes(node), "pointwise")


def write_only(node: OpNode, tf32: bool) -> OpCost:
    """fill_/zero_/zeros/ones/full/rand*: write the output (or self), read only tensor values."""
    in_place = node.name.endswith("_")
    out = first_out(node)
    extra = node.inputs[1:] if in_place else ()
    n = out.numel if out is not None else 0
    kind = "pointwise" if node.name.startswith(_RANDOM) else "copy"
    return vector(n, read_bytes(out) + sum_read(extra), kind)


def copy(node: OpNode, tf32: bool) -> OpCost:
    """clone/_to_copy/cat/stack/...: bytes = inputs + outputs, 1 FLOP per element written."""
    if node.name in ("index_select", "gather", "take", "masked_select"):
        return gather_like(node, tf32)
    n = sum(t.numel for t in node.outputs)
    return vector(n, io_bytes(node), "copy")


def copy_(node: OpNode, tf32: bool) -> OpCost:
    """copy_(self, src): read src, write self (a cast when the dtypes differ)."""
    dst = first_out(node)
    src = node.inputs[1] if len(node.inputs) > 1 else None
    return vector(dst.numel, read_bytes(src) + read_bytes(dst), "copy")


def gather_like(node: OpNode, tf32: bool) -> OpCost:
    """gather/index_select/index: read the index and only the gathered elements, write them."""
    out = node.outputs[0]
    index_bytes = sum_read(t for t in node.inputs[1:])
    return vector(0, index_bytes + 2 * read_bytes(out), "copy")


def view(node: OpNode, tf32: bool) -> OpCost:
    return VIEW_COST


def maybe_view(node: OpNode, tf32: bool) -> OpCost:
    if node.inputs and node.outputs and node.outputs[0].storage == node.inputs[0].storage:
        return VIEW_COST
    return copy(node, tf32)


def view_copy(node: OpNode, tf32: bool) -> OpCost:
    """permute_copy/view_copy/...: a view materialized into a new tensor."""
    return copy(node, tf32)


def reduction(node: OpNode, tf32: bool) -> OpCost:
    """FLOPs = per-element count × input elements; bytes = input + output."""
    base = node.name
    if base in ("max", "min") and node.op.endswith(".other"):
        return pointwise(node, tf32)
    x = node.inputs[0] if node.inputs else None
    flops = _REDUCE_PER_ELEM.get(base, 1) * (x.numel if x is not None else 0)
    return vector(flops, io_bytes(node), "reduction")


def _table() -> dict[str, CostFn]:
    costs: dict[str, CostFn] = {}
    for name in _UNARY + _BINARY:
        costs[f"aten.{name}"] = costs[f"aten.{name}_"] = pointwise
    costs.update({f"aten.{n}": reduction for n in _REDUCE_PER_ELEM})
    costs.update({f"aten.{n}": copy for n in _COPIES})
    costs.update({f"aten.{n}_copy": view_copy for n in VIEWS})
    costs.update({f"aten.{n}": view for n in VIEWS})
    costs.update({f"aten.{n}": maybe_view for n in _MAYBE_VIEWS})
    costs.update({f"aten.{n}": write_only for n in _WRITE_ONLY})
    costs.update(
        {"aten.copy_": copy_, "aten.index": gather_like, "prim.device": view, "prim.layout": view}
    )
    return costs


COSTS: dict[str, CostFn] = _table()
