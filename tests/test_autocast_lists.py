"""gobrrr's CUDA autocast lists (gobrrr.capture.autocast) held against this torch's own.

Every op with an AutocastCUDA kernel is found through the dispatcher (this works on a CPU-only
machine too) and must have a policy in gobrrr's tables; every op that autocasts on the CPU but
not on CUDA must fall through; and each policy is checked by running the op's AutocastCUDA
kernel on fake CUDA tensors (CUDA autocast switched on by hand, as no GPU is needed for that)
and watching what it does to fp32, bf16 and mixed inputs. A new torch that adds, drops or
changes a policy fails here instead of silently diverging."""

from __future__ import annotations

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from gobrrr.capture import autocast


def _ops_with(key: str) -> set[str]:
    return {
        n.removeprefix("aten::")
        for n in torch._C._dispatch_get_all_op_names()
        if n.startswith("aten::") and torch._C._dispatch_has_kernel_for_dispatch_key(n, key)
    }


CUDA_OPS = sorted(_ops_with("AutocastCUDA"))
CPU_ONLY_OPS = sorted(_ops_with("AutocastCPU") - set(CUDA_OPS))


def _key(name: str, overload: str) -> str:
    return f"{name}.{overload}" if overload else name


def test_every_cuda_autocast_op_has_a_policy_in_gobrrr():
    table = autocast.cuda_policies()
    missing = [op for op in CUDA_OPS if op not in table]
    assert not missing, f"ops CUDA autocasts that gobrrr's lists lack: {missing}"


def test_gobrrr_lists_only_what_cuda_autocasts():
    """An entry for an op without an AutocastCUDA kernel in this torch would apply a policy
    CUDA does not have (gobrrr registers only the entries this torch has, so this lists the
    entries a newer torch dropped)."""
    stale = [k for k in autocast.cuda_policies() if _exists(k) and k not in CUDA_OPS]
    assert not stale, f"gobrrr lists these, CUDA does not autocast them: {stale}"


def _exists(key: str) -> bool:
    name, _, ov = key.partition(".")
    return autocast._overload(name, ov) is not None


def test_ops_that_autocast_only_on_the_cpu_fall_through():
    assert set(CPU_ONLY_OPS) == set(autocast.cpu_only_ops())
    bias, a, b = torch.randn(4), torch.randn(2, 3), torch.randn(3, 4)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the CPU lowers it; CUDA does not
        assert torch.ops.aten._addmm_activation(bias, a, b).dtype == torch.bfloat16
        with autocast.cuda_autocast_rules():
            assert torch.ops.aten._addmm_activation(bias, a, b).dtype == torch.float32


# -- the policy each op follows on CUDA, observed -------------------------------------------------


def T(*shape, dtype=torch.float32):
    return torch.randn(shape, device="cuda", dtype=dtype)


def L(*shape, high=4):
    return torch.randint(0, high, shape, device="cuda")


def _conv(n: int):
    """An n-d convolution's input (1, 4, 8...) and weight (4, 4, 3...)."""
    return lambda d: ((T(1, 4, *[8] * n, dtype=d), T(4, 4, *[3] * n, dtype=d)), {})


def _upsample(k: int, corners: bool):
    """A k-d upsampling of (1, 4, 4...) to 8 per dim; `corners`: it takes align_corners."""
    return lambda d: ((T(1, 4, *[4] * k, dtype=d), [8] * k, *([False] if corners else [])), {})


# Arguments for ops whose schema alone does not say what shapes they take. (dtype) -> (args,
# kwargs); float tensors take `dtype`, index tensors stay long.
SAMPLES = {
    "_convolution": lambda d: (
        (
            T(1, 4, 8, 8, dtype=d),
            T(4, 4, 3, 3, dtype=d),
            None,
            [1, 1],
            [1, 1],
            [1, 1],
            False,
            [0, 0],
            1,
            False,
            False,
            True,
            True,
        ),
        {},
    ),
    "_convolution.deprecated": lambda d: (
        (
            T(1, 4, 8, 8, dtype=d),
            T(4, 4, 3, 3, dtype=d),
            None,
            [1, 1],
            [1, 1],
            [1, 1],
            False,
            [0, 0],
            1,
            False,
            False,
            True,
        ),
        {},
    ),
    "convolution": lambda d: (
        (
            T(1, 4, 8, 8, dtype=d),
            T(4, 4, 3, 3, dtype=d),
            None,
            [1, 1],
            [1, 1],
            [1, 1],
            False,
            [0, 0],
            1,
        ),
        {},
    ),
    "cudnn_convolution": lambda d: (
        (
            T(1, 4, 8, 8, dtype=d),
            T(4, 4, 3, 3, dtype=d),
            [1, 1],
            [1, 1],
            [1, 1],
            1,
            False,
            False,
            True,
        ),
        {},
    ),
    "cudnn_convolution_transpose": lambda d: (
        (
            T(1, 4, 8, 8, dtype=d),
            T(4, 4, 3, 3, dtype=d),
            [1, 1],
            [0, 0],
            [1, 1],
            [1, 1],
            1,
            False,
            False,
            True,
        ),
        {},
    ),
    "conv_tbc": lambda d: ((T(4, 2, 4, dtype=d), T(3, 4, 4, dtype=d), T(4, dtype=d), 1), {}),
    **{f"conv_transpose{n}d{'.input' if n > 1 else ''}": _conv(n) for n in (1, 2, 3)},
    "addr": lambda d: ((T(4, 4, dtype=d), T(4, dtype=d), T(4, dtype=d)), {}),
    "bmm": lambda d: ((T(2, 4, 4, dtype=d), T(2, 4, 4, dtype=d)), {}),
    "baddbmm": lambda d: ((T(2, 4, 4, dtype=d), T(2, 4, 4, dtype=d), T(2, 4, 4, dtype=d)), {}),
    "dot": lambda d: ((T(4, dtype=d), T(4, dtype=d)), {}),
    "vdot": lambda d: ((T(4, dtype=d), T(4, dtype=d)), {}),
    "bilinear": lambda d: ((T(2, 4, dtype=d), T(2, 4, dtype=d), T(3, 4, 4, dtype=d)), {}),
    **{f"conv{n}d": _conv(n) for n in (1, 2, 3)},
    "_scaled_dot_product_flash_attention": lambda d: (
        (T(1, 2, 8, 16, dtype=d), T(1, 2, 8, 16, dtype=d), T(1, 2, 8, 16, dtype=d)),
        {},
    ),
    "linalg_matrix_norm.str_ord": lambda d: ((T(4, 4, dtype=d),), {"ord": "fro"}),
    "addbmm": lambda d: ((T(4, 4, dtype=d), T(2, 4, 4, dtype=d), T(2, 4, 4, dtype=d)), {}),
    "addmv": lambda d: ((T(4, dtype=d), T(4, 4, dtype=d), T(4, dtype=d)), {}),
    "mv": lambda d: ((T(4, 4, dtype=d), T(4, dtype=d)), {}),
    "chain_matmul": lambda d: (([T(4, 4, dtype=d), T(4, 4, dtype=d)],), {}),
    "linalg_multi_dot": lambda d: (([T(4, 4, dtype=d), T(4, 4, dtype=d)],), {}),
    "einsum": lambda d: (("ij,jk->ik", [T(4, 4, dtype=d), T(4, 4, dtype=d)]), {}),
    "tensordot": lambda d: ((T(4, 4, dtype=d), T(4, 4, dtype=d), [1], [0]), {}),
    "cross": lambda d: ((T(4, 3, dtype=d), T(4, 3, dtype=d)), {}),
    "prelu": lambda d: ((T(2, 4, dtype=d), T(4, dtype=d)), {}),
    "cosine_embedding_loss": lambda d: ((T(4, 4, dtype=d), T(4, 4, dtype=d), T(4, dtype=d)), {}),
    "multi_margin_loss": lambda d: ((T(4, 4, dtype=d), L(4)), {}),
    "multilabel_margin_loss": lambda d: ((T(4, 4, dtype=d), L(4, 4)), {}),
    "nll_loss": lambda d: ((T(4, 4, dtype=d), L(4)), {}),
    "nll_loss2d": lambda d: ((T(1, 4, 4, 4, dtype=d), L(1, 4, 4)), {}),
    "grid_sampler": lambda d: ((T(1, 4, 8, 8, dtype=d), T(1, 4, 4, 2, dtype=d), 0, 0, False), {}),
    "index_put": lambda d: ((T(4, 4, dtype=d), [L(3)], T(3, 4, dtype=d)), {}),
    "scatter_add": lambda d: ((T(4, 4, dtype=d), 0, L(4, 4), T(4, 4, dtype=d)), {}),
    "gru_cell": lambda d: (
        (T(2, 4, dtype=d), T(2, 4, dtype=d), T(12, 4, dtype=d), T(12, 4, dtype=d)),
        {},
    ),
    "lstm_cell": lambda d: (
        (
            T(2, 4, dtype=d),
            [T(2, 4, dtype=d), T(2, 4, dtype=d)],
            T(16, 4, dtype=d),
            T(16, 4, dtype=d),
            T(16, dtype=d),
            T(16, dtype=d),
        ),
        {},
    ),
    "_thnn_fused_lstm_cell": lambda d: (
        (T(2, 16, dtype=d), T(2, 16, dtype=d), T(2, 4, dtype=d), T(16, dtype=d), T(16, dtype=d)),
        {},
    ),
    "layer_norm": lambda d: ((T(2, 4, dtype=d), [4]), {}),
    "native_layer_norm": lambda d: ((T(2, 4, dtype=d), [4], None, None, 1e-5), {}),
    "rms_norm": lambda d: ((T(2, 4, dtype=d), [4]), {}),
    "renorm": lambda d: ((T(4, 4, dtype=d), 2, 0, 1.0), {}),
    "pow.Scalar": lambda d: ((2.0, T(4, 4, dtype=d)), {}),
    "pow.Tensor_Scalar": lambda d: ((T(4, 4, dtype=d), 2.0), {}),
    "logsumexp": lambda d: ((T(4, 4, dtype=d), [-1]), {}),
    "frobenius_norm.dim": lambda d: ((T(4, 4, dtype=d), [-1]), {}),
    "nuclear_norm.dim": lambda d: ((T(4, 4, dtype=d), [0, 1]), {}),
    "norm.ScalarOpt_dim": lambda d: ((T(4, 4, dtype=d), 2, [-1]), {}),
    "linalg_matrix_norm": lambda d: ((T(4, 4, dtype=d), 1), {}),
    "sum.dim_IntList": lambda d: ((T(4, 4, dtype=d), [-1]), {}),
    **{
        n: _upsample(k, corners)
        for n, k, corners in (
            ("upsample_nearest1d", 1, False),
            ("upsample_nearest2d", 2, False),
            ("upsample_nearest3d", 3, False),
            ("_upsample_nearest_exact1d", 1, False),
            ("_upsample_nearest_exact2d", 2, False),
            ("_upsample_nearest_exact3d", 3, False),
            ("upsample_linear1d", 1, True),
            ("upsample_bilinear2d", 2, True),
            ("upsample_bicubic2d", 2, True),
            ("upsample_trilinear3d", 3, True),
            ("_upsample_bilinear2d_aa", 2, True),
            ("_upsample_bicubic2d_aa", 2, True),
        )
    },
}
# Ops whose AutocastCUDA kernel cannot run on fake tensors here; their policy stays unchecked
# (why, each): none may be added without a reason.
UNPROBED = {
    "_cudnn_rnn": "cuDNN's packed RNN weights cannot be built without cuDNN",
    "_thnn_fused_gru_cell": "no fake implementation in torch",
    "gru_cell": "its CUDA path is _thnn_fused_gru_cell, which has no fake implementation",
    "cudnn_convolution": "no fake implementation in torch",
    "cudnn_convolution_transpose": "no fake implementation in torch",
}


def _generic(op, dtype):
    """Arguments from the schema alone: every required tensor (4, 4), ints 1, floats 0.5."""
    args, kwargs = [], {}
    for a in op._schema.arguments:
        if a.has_default_value():
            continue
        t = str(a.type)
        if t == "Tensor":
            v = T(4, 4, dtype=dtype)
        elif t == "Optional[Tensor]":
            v = None
        elif t in ("int", "SymInt"):
            v = -1 if a.name == "dim" else 1
        elif t in ("float", "Scalar"):
            v = 0.5
        elif t == "bool":
            v = False
        else:
            return None
        (kwargs.__setitem__(a.name, v) if a.kwarg_only else args.append(v))
    return tuple(args), kwargs


def _args(key: str, op, dtype):
    sample = SAMPLES.get(key)
    return sample(dtype) if sample else _generic(op, dtype)


def _cuda_autocast(op, args, kwargs):
    """Run `op` with CUDA autocast (bf16) on; the first output's dtype."""
    torch.set_autocast_enabled("cuda", True)
    torch.set_autocast_dtype("cuda", torch.bfloat16)
    try:
        out = op(*args, **kwargs)
    finally:
        torch.set_autocast_enabled("cuda", False)
        torch.clear_autocast_cache()
    return (out[0] if isinstance(out, (tuple, list)) else out).dtype


def _mixed(args, kwargs):
    """The first float tensor fp32, every other one bf16."""
    seen = []

    def f(x):
        if isinstance(x, list):
            return [f(v) for v in x]
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            seen.append(x)
            return x if len(seen) == 1 else x.to(torch.bfloat16)
        return x

    return tuple(f(a) for a in args), {k: f(v) for k, v in kwargs.items()}


def observed_policy(key: str) -> str:
    """What CUDA autocast does to `key`: "lower" (fp32 in, bf16 out), "fp32" (bf16 in, fp32
    out; "fp32_set_opt_dtype" when the op takes a dtype, "fp32_append_dtype" when it calls its
    dtype overload), "banned" (raises), "promote" (mixed inputs run at the widest dtype)."""
    name, _, ov = key.partition(".")
    op = autocast._overload(name, ov)
    try:
        out32 = _cuda_autocast(op, *_args(key, op, torch.float32))
    except RuntimeError as e:
        if "unsafe to autocast" in str(e):
            return "banned"
        raise
    if out32 == torch.bfloat16:
        return "lower"
    if _cuda_autocast(op, *_args(key, op, torch.bfloat16)) == torch.float32:
        if "dtype" in [a.name for a in op._schema.arguments]:
            return "fp32_set_opt_dtype"
        return "fp32_append_dtype" if _calls_dtype_overload(op, key) else "fp32"
    _cuda_autocast(op, *_mixed(*_args(key, op, torch.float32)))  # raises unless it promotes
    return "promote"


def _calls_dtype_overload(op, key) -> bool:
    from torch.utils._python_dispatch import TorchDispatchMode

    class Ops(TorchDispatchMode):
        seen: list[str] = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    with Ops() as rec:
        _cuda_autocast(op, *_args(key, op, torch.bfloat16))
    return any("dtype" in s.rsplit(".", 1)[-1] for s in rec.seen)


@pytest.mark.parametrize("key", [k for k in CUDA_OPS if k not in UNPROBED])
def test_the_policy_is_the_one_cuda_follows(key):
    with FakeTensorMode(allow_non_fake_inputs=True):
        seen = observed_policy(key)
    assert autocast.cuda_policies().get(key) == seen, f"{key}: CUDA autocast does {seen}"
