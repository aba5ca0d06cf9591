"""CUDA autocast, reproduced on the CPU so a fake-tensor trace keeps CUDA's dtypes.

gobrrr traces on CPU fake tensors (a CPU-only PyTorch cannot build CUDA tensors with autograd),
but CPU autocast follows different op lists from CUDA autocast: on the CPU `layer_norm`,
`softmax` and `sum` keep bf16, on CUDA they run in fp32. The dtype decides the bytes of every
activation, so the trace would get the memory wrong. While `cuda_autocast_rules()` is active,
the AutocastCPU dispatch key of every op the running torch autocasts on CUDA runs CUDA's policy
(gobrrr's tables below, from PyTorch's aten/src/ATen/autocast_mode.cpp and AutocastRNN.cpp),
and every op it autocasts on the CPU only falls through. Which ops autocast is read from the
dispatcher of the running torch; tests/test_autocast_lists.py holds the tables against it and
checks each policy by running the AutocastCUDA kernels on fake CUDA tensors.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Any

import torch

from gobrrr.errors import GobrrrError

# (op, overload) pairs; "" = the default overload.
LOWER_PRECISION = [
    ("_convolution", "deprecated"),
    ("_convolution", ""),
    ("conv1d", ""),
    ("conv2d", ""),
    ("conv3d", ""),
    ("conv_tbc", ""),
    ("conv_transpose1d", ""),
    ("conv_transpose2d", "input"),
    ("conv_transpose3d", "input"),
    ("convolution", ""),
    ("cudnn_convolution", ""),
    ("cudnn_convolution_transpose", ""),
    ("prelu", ""),
    ("addmm", ""),
    ("addmv", ""),
    ("addr", ""),
    ("matmul", ""),
    ("einsum", ""),
    ("mm", ""),
    ("mv", ""),
    ("linalg_vecdot", ""),
    ("linear", ""),
    ("addbmm", ""),
    ("baddbmm", ""),
    ("bmm", ""),
    ("chain_matmul", ""),
    ("linalg_multi_dot", ""),
    ("_thnn_fused_lstm_cell", ""),
    ("_thnn_fused_gru_cell", ""),
    ("lstm_cell", ""),
    ("gru_cell", ""),
    ("rnn_tanh_cell", ""),
    ("rnn_relu_cell", ""),
    ("_scaled_dot_product_flash_attention", ""),
    ("scaled_dot_product_attention", ""),
]
# AutocastRNN.cpp casts (and re-packs) to fp16 whatever autocast's dtype (H100 profile of a
# bf16-mixed LSTM step: fp16 GEMMs and elemWiseRNNcell<__half>, an fp16 output)
HALF = [("_cudnn_rnn", "")]
_UPSAMPLE = [
    "upsample_nearest1d",
    "upsample_nearest2d",
    "upsample_nearest3d",
    "_upsample_nearest_exact1d",
    "_upsample_nearest_exact2d",
    "_upsample_nearest_exact3d",
    "upsample_linear1d",
    "upsample_bilinear2d",
    "upsample_bicubic2d",
    "upsample_trilinear3d",
    "_upsample_bilinear2d_aa",
    "_upsample_bicubic2d_aa",
]
FP32 = [
    ("acos", ""),
    ("asin", ""),
    ("cosh", ""),
    ("erfinv", ""),
    ("exp", ""),
    ("expm1", ""),
    ("log", ""),
    ("log10", ""),
    ("log2", ""),
    ("log1p", ""),
    ("reciprocal", ""),
    ("rsqrt", ""),
    ("sinh", ""),
    ("tan", ""),
    ("pow", "Tensor_Scalar"),
    ("pow", "Tensor_Tensor"),
    ("pow", "Scalar"),
    ("softplus", ""),
    ("layer_norm", ""),
    ("native_layer_norm", ""),
    ("group_norm", ""),
    ("rms_norm", ""),
    ("frobenius_norm", "dim"),
    ("nuclear_norm", ""),
    ("nuclear_norm", "dim"),
    ("linalg_matrix_sqrth", ""),
    ("cosine_similarity", ""),
    ("poisson_nll_loss", ""),
    ("cosine_embedding_loss", ""),
    ("nll_loss", ""),
    ("nll_loss2d", ""),
    ("hinge_embedding_loss", ""),
    ("kl_div", ""),
    ("l1_loss", ""),
    ("smooth_l1_loss", ""),
    ("huber_loss", ""),
    ("mse_loss", ""),
    ("margin_ranking_loss", ""),
    ("multilabel_margin_loss", ""),
    ("soft_margin_loss", ""),
    ("triplet_margin_loss", ""),
    ("multi_margin_loss", ""),
    ("binary_cross_entropy_with_logits", ""),
    ("dist", ""),
    ("pdist", ""),
    ("cdist", ""),
    ("renorm", ""),
    ("logsumexp", ""),
    *[(n, "") for n in _UPSAMPLE],
]
FP32_SET_OPT_DTYPE = [
    ("prod", ""),
    ("prod", "dim_int"),
    ("softmax", "int"),
    ("log_softmax", "int"),
    ("cumprod", ""),
    ("cumsum", ""),
    ("linalg_vector_norm", ""),
    ("linalg_matrix_norm", ""),
    ("linalg_matrix_norm", "str_ord"),
    ("sum", ""),
    ("sum", "dim_IntList"),
]
# norm without a dtype argument: CUDA calls its dtype overload with float32
FP32_APPEND_DTYPE = [("norm", "Scalar"), ("norm", "ScalarOpt_dim")]
_DTYPE_OVERLOAD = {"Scalar": "ScalarOpt_dtype", "ScalarOpt_dim": "ScalarOpt_dim_dtype"}
PROMOTE = [
    ("addcdiv", ""),
    ("addcmul", ""),
    ("atan2", ""),
    ("bilinear", ""),
    ("cross", ""),
    ("dot", ""),
    ("vdot", ""),
    ("grid_sampler", ""),
    ("index_put", ""),
    ("tensordot", ""),
    ("scatter_add", ""),
]
# CUDA autocast refuses these (the step raises on a GPU)
BANNED = [("binary_cross_entropy", "")]

_TABLES = (
    (LOWER_PRECISION, "lower"),
    (HALF, "half"),
    (FP32, "fp32"),
    (FP32_SET_OPT_DTYPE, "fp32_set_opt_dtype"),
    (FP32_APPEND_DTYPE, "fp32_append_dtype"),
    (PROMOTE, "promote"),
    (BANNED, "banned"),
)


def cuda_policies() -> dict[str, str]:
    """gobrrr's table of CUDA autocast: op ("name" or "name.overload") -> policy."""
    return {(f"{n}.{ov}" if ov else n): policy for entries, policy in _TABLES for n, ov in entries}


@functools.cache
def autocast_ops(key: str) -> frozenset[str]:
    """The aten ops ("name" or "name.overload") with a kernel for dispatch key `key`
    ("AutocastCUDA", "AutocastCPU") in the running torch."""
    return frozenset(
        n.removeprefix("aten::")
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)
    )


def cpu_only_ops() -> list[str]:
    """Ops CPU autocast casts and CUDA autocast does not: they fall through in the trace."""
    return sorted(autocast_ops("AutocastCPU") - autocast_ops("AutocastCUDA"))


EXCLUDE_AUTOCAST = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


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
        cacheable = (
            dtype != torch.float32
            and x.dtype == torch.float32
            and x.requires_grad
            and x.is_leaf
            and not x._is_view()
            and torch.is_autocast_cache_enabled()
        )
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


def _cast_all(
    cache: _CastCache, args: tuple, kwargs: dict, dtype: torch.dtype
) -> tuple[tuple, dict]:
    """Every argument cast, the last first: CUDA autocast casts them as the arguments of one
    C++ call (`WrapFunction_`), which GCC evaluates right to left, so a Linear's weight is cast
    (and allocated) before its input, as the allocator traces of the zoo's steps show."""
    kw = {k: cache.cast(v, dtype) for k, v in reversed(kwargs.items())}
    out = [cache.cast(a, dtype) for a in reversed(args)]
    return tuple(reversed(out)), {k: kw[k] for k in kwargs}


def _kernel(op: Any, policy: str, cache: _CastCache):
    def run(*args: Any, **kwargs: Any) -> Any:
        with torch._C._ExcludeDispatchKeyGuard(EXCLUDE_AUTOCAST):
            if policy in ("lower", "half"):
                dtype = torch.float16 if policy == "half" else _lower_dtype()
                args, kwargs = _cast_all(cache, args, kwargs, dtype)
            elif policy == "fp32":
                args, kwargs = _cast_all(cache, args, kwargs, torch.float32)
            elif policy == "fp32_set_opt_dtype":
                if args and _eligible(args[0]):
                    args, kwargs = _set_dtype(op, args, kwargs)
            elif policy == "fp32_append_dtype":
                if args and _eligible(args[0]):
                    if len(args) == 1 and "p" not in kwargs:  # norm's default p
                        args = (args[0], 2)
                    return _dtype_overload(op)(*args, **kwargs, dtype=torch.float32)
            elif policy == "promote":
                dt = _widest(args, kwargs)
                if dt is not None:
                    args, kwargs = _cast_all(cache, args, kwargs, dt)
            elif policy == "banned":
                raise GobrrrError(
                    f"{op} is refused by CUDA autocast (unsafe in reduced precision: the step "
                    "raises on a GPU); use binary_cross_entropy_with_logits "
                    "(nn.BCEWithLogitsLoss) on the logits, or run this loss outside autocast"
                )
            return op(*args, **kwargs)

    return run


def _dtype_overload(op: Any) -> Any:
    return getattr(op.overloadpacket, _DTYPE_OVERLOAD[op._overloadname])


def _set_dtype(op: Any, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """Pass dtype=float32 unless the caller gave one, wherever `dtype` sits in the schema."""
    names = [a.name for a in op._schema.arguments]
    pos = names.index("dtype")
    if pos < len(args):
        if args[pos] is None:
            args = args[:pos] + (torch.float32,) + args[pos + 1 :]
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
    original_clear = torch.clear_autocast_cache

    def clear() -> None:  # autocast's __exit__ calls this when the outermost region ends
        cache.clear()
        original_clear()

    try:
        with warnings.catch_warnings():  # "overriding a previously registered kernel": intended
            warnings.simplefilter("ignore")
            cuda = autocast_ops("AutocastCUDA")
            for key, policy in cuda_policies().items():
                name, _, ov = key.partition(".")
                op = _overload(name, ov)
                if op is not None and key in cuda:  # only what this torch autocasts on CUDA
                    lib.impl(key, _kernel(op, policy, cache), "AutocastCPU")
            for key in cpu_only_ops():  # CPU-only policies: fall through, so the ops inside
                lib.impl(key, torch.library.fallthrough_kernel, "AutocastCPU")  # still autocast
        torch.clear_autocast_cache = clear
        yield cache
    finally:
        torch.clear_autocast_cache = original_clear
        cache.clear()
        lib._destroy()
