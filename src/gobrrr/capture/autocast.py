"""CUDA autocast, reproduced on the CPU so a fake-tensor trace keeps CUDA's dtypes.

gobrrr traces on CPU fake tensors (a CPU-only PyTorch cannot build CUDA tensors with autograd),
but CPU autocast follows different op lists from CUDA autocast: on the CPU `layer_norm`,
`softmax` and `sum` keep bf16, on CUDA they run in fp32. The dtype decides the bytes of every
activation, so the trace would get the memory wrong. While `cuda_autocast_policy()` is active,
the AutocastCPU dispatch key of the listed ops runs CUDA's policy instead (lists from PyTorch's
aten/src/ATen/autocast_mode.cpp, `AT_FORALL_*` for CUDA), and CPU-only entries fall through.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Iterator
from typing import Any

import torch

# (op, overload) pairs; "" = the default overload.
LOWER_PRECISION = [
    ("_convolution", "deprecated"), ("_convolution", ""), ("conv1d", ""), ("conv2d", ""),
    ("conv3d", ""), ("conv_tbc", ""), ("conv_transpose1d", ""), ("conv_transpose2d", "input"),
    ("conv_transpose3d", "input"), ("convolution", ""), ("prelu", ""), ("addmm", ""),
    ("addmv", ""), ("addr", ""), ("matmul", ""), ("einsum", ""), ("mm", ""), ("mv", ""),
    ("linalg_vecdot", ""), ("linear", ""), ("addbmm", ""), ("baddbmm", ""), ("bmm", ""),
    ("chain_matmul", ""), ("linalg_multi_dot", ""), ("lstm_cell", ""), ("gru_cell", ""),
    ("rnn_tanh_cell", ""), ("rnn_relu_cell", ""), ("scaled_dot_product_attention", ""),
    ("conv1d", "padding"), ("conv2d", "padding"), ("conv3d", "padding"),
]
FP32 = [
    ("acos", ""), ("asin", ""), ("cosh", ""), ("erfinv", ""), ("exp", ""), ("expm1", ""),
    ("log", ""), ("log10", ""), ("log2", ""), ("log1p", ""), ("reciprocal", ""), ("rsqrt", ""),
    ("sinh", ""), ("tan", ""), ("pow", "Tensor_Scalar"), ("pow", "Tensor_Tensor"),
    ("pow", "Scalar"), ("softplus", ""), ("layer_norm", ""), ("native_layer_norm", ""),
    ("group_norm", ""), ("frobenius_norm", "dim"), ("nuclear_norm", ""), ("nuclear_norm", "dim"),
    ("cosine_similarity", ""), ("poisson_nll_loss", ""), ("cosine_embedding_loss", ""),
    ("nll_loss", ""), ("nll_loss2d", ""), ("hinge_embedding_loss", ""), ("kl_div", ""),
    ("l1_loss", ""), ("smooth_l1_loss", ""), ("huber_loss", ""), ("mse_loss", ""),
    ("margin_ranking_loss", ""), ("multilabel_margin_loss", ""), ("soft_margin_loss", ""),
    ("triplet_margin_loss", ""), ("multi_margin_loss", ""),
    ("binary_cross_entropy_with_logits", ""), ("dist", ""), ("pdist", ""), ("cdist", ""),
    ("renorm", ""), ("logsumexp", ""),
]
FP32_SET_OPT_DTYPE = [
    ("prod", ""), ("prod", "dim_int"), ("softmax", "int"), ("log_softmax", "int"),
    ("cumprod", ""), ("cumsum", ""), ("linalg_vector_norm", ""), ("linalg_matrix_norm", ""),
    ("sum", ""), ("sum", "dim_IntList"),
]
PROMOTE = [
    ("addcdiv", ""), ("addcmul", ""), ("atan2", ""), ("bilinear", ""), ("cross", ""),
    ("dot", ""), ("grid_sampler", ""), ("index_put", ""), ("tensordot", ""), ("scatter_add", ""),
]
# On the CPU these have a policy that CUDA does not: let them fall through to the plain op.
CPU_ONLY = [
    ("cross_entropy_loss", ""), ("stack", ""), ("cat", ""), ("index_copy", ""),
    ("avg_pool3d", ""), ("max_pool3d", ""), ("adaptive_avg_pool3d", ""), ("trace", ""),
    ("grid_sampler_2d", ""), ("grid_sampler_3d", ""), ("polar", ""),
    ("_native_multi_head_attention", ""), ("mkldnn_rnn_layer", ""), ("stft", ""),
    ("stft", "center"), ("quantile", ""), ("nanquantile", ""),
]

_EXCLUDE = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _lower_dtype() -> torch.dtype:
    if hasattr(torch, "get_autocast_dtype"):
        return torch.get_autocast_dtype("cpu")
    return torch.get_autocast_cpu_dtype()


def _eligible(x: Any) -> bool:
    return isinstance(x, torch.Tensor) and x.is_floating_point() and x.dtype != torch.float64


class _CastCache:
    """Autocast's weight-cast cache: a leaf fp32 tensor that requires grad is cast once per
    autocast region and the cast is kept alive until the region ends (it shows in memory)."""

    def __init__(self) -> None:
        self.casts: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def cast(self, x: Any, dtype: torch.dtype) -> Any:
        if isinstance(x, (list, tuple)):
            return type(x)(self.cast(v, dtype) for v in x)
        if not _eligible(x) or x.dtype == dtype:
            return x
        cacheable = (dtype != torch.float32 and x.dtype == torch.float32 and x.requires_grad
                     and x.is_leaf and not x._is_view() and torch.is_autocast_cache_enabled())
        if cacheable:
            hit = self.casts.get(id(x))
            if hit is not None and hit[0] is x:
                return hit[1]
        y = x.to(dtype)
        if cacheable:
            self.casts[id(x)] = (x, y)
        return y

    def clear(self) -> None:
        self.casts.clear()


def _widest(args: tuple, kwargs: dict) -> torch.dtype | None:
    widest = None
    for v in list(args) + list(kwargs.values()):
        for t in v if isinstance(v, (list, tuple)) else (v,):
            if _eligible(t):
                widest = t.dtype if widest is None else torch.promote_types(widest, t.dtype)
    return widest


def _kernel(op: Any, policy: str, cache: _CastCache):
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(_EXCLUDE):
            if policy == "lower":
                dt = _lower_dtype()
                args = tuple(cache.cast(a, dt) for a in args)
                kwargs = {k: cache.cast(v, dt) for k, v in kwargs.items()}
            elif policy == "fp32":
                args = tuple(cache.cast(a, torch.float32) for a in args)
                kwargs = {k: cache.cast(v, torch.float32) for k, v in kwargs.items()}
            elif policy == "fp32_set_opt_dtype":
                if args and _eligible(args[0]):
                    args, kwargs = _set_dtype(op, args, kwargs)
            elif policy == "promote":
                dt = _widest(args, kwargs)
                if dt is not None:
                    args = tuple(cache.cast(a, dt) for a in args)
                    kwargs = {k: cache.cast(v, dt) for k, v in kwargs.items()}
            return op(*args, **kwargs)

    return run


def _set_dtype(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pass dtype=float32 unless the caller gave one, wherever `dtype` sits in the schema."""
    names = [a.name for a in op._schema.arguments]
    pos = names.index("dtype")
    if pos < len(args):
        if args[pos] is None:
            args = args[:pos] + (torch.float32,) + args[pos + 1:]
    elif kwargs.get("dtype") is None:
        kwargs = {**kwargs, "dtype": torch.float32}
    return args, kwargs


def _overload(name: str, overload: str) -> Any | None:
    packet = getattr(torch.ops.aten, name, None)
    if packet is None:
        return None
    return getattr(packet, overload or "default", None)


@contextlib.contextmanager
def cuda_autocast_rules() -> Iterator[_CastCache]:
    """Within this context, `torch.autocast("cpu", dtype)` follows CUDA autocast's op lists.

    Stays active for the whole step: checkpointed blocks re-enter autocast in backward."""
    lib = torch.library.Library("aten", "IMPL")
    cache = _CastCache()
    table = [(LOWER_PRECISION, "lower"), (FP32, "fp32"),
             (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"), (PROMOTE, "promote"), (CPU_ONLY, "none")]
    original_clear = torch.clear_autocast_cache

    def clear() -> None:  # autocast's __exit__ calls this when the outermost region ends
        cache.clear()
        original_clear()

    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": intended
            warnings.simplefilter("ignore")
            for entries, policy in table:
                for name, ov in entries:
                    op = _overload(name, ov)
                    if op is None:
                        continue
                    # CPU-only entries fall through, so the ops inside them still autocast
                    fn = torch.library.fallthrough_kernel if policy == "none" else _kernel(
                        op, policy, cache)
                    lib.impl(f"{name}.{ov}" if ov else name, fn, "AutocastCPU")
        torch.clear_autocast_cache = clear
        yield cache
    finally:
        torch.clear_autocast_cache = original_clear
        cache.clear()
        lib._destroy()
