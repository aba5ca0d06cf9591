"""What the profiler's record of an op says: its kind (for grouping), its math mode, and its
FLOPs and bytes read from the recorded shapes, for an op no step-graph node was joined to
(a node's cost comes from gobrrr.cost, as the prediction's does; see profile.analyze).
"""

from __future__ import annotations

from math import prod

from gobrrr.profile.join import TraceOp

_DTYPE_BYTES = {
    "float": 4,
    "c10::BFloat16": 2,
    "c10::Half": 2,
    "double": 8,
    "long int": 8,
    "int": 4,
    "bool": 1,
    "unsigned char": 1,
    "signed char": 1,
    "short int": 2,
    "c10::Float8_e4m3fn": 1,
    "c10::Float8_e5m2": 1,
    "c10::complex<float>": 8,
}
_MATH = {"c10::BFloat16": "bf16", "c10::Half": "fp16", "float": "fp32", "double": "fp32"}

_KINDS = {
    "matmul": "matmul",
    "attention": "attention",
    "attention_backward": "attention",
    "native_layer_norm": "norm",
    "native_layer_norm_backward": "norm",
    "rms_norm": "norm",
    "fused_rms_norm": "norm",
    "native_group_norm": "norm",
    "native_batch_norm": "norm",
    "cudnn_batch_norm": "norm",
    "log_softmax": "softmax",
    "softmax": "softmax",
    "log_softmax_backward_data": "softmax",
    "softmax_backward_data": "softmax",
    "nll_loss_forward": "loss",
    "nll_loss_backward": "loss",
    "nll_loss2d_forward": "loss",
    "embedding": "embedding",
    "embedding_dense_backward": "embedding",
    "copy": "copy",
    "view": "view",
    "compiled": "compiled",
    "convolution": "conv",
    "convolution_backward": "conv",
    "cudnn_convolution": "conv",
    "sum": "reduction",
    "mean": "reduction",
    "amax": "reduction",
    "max": "reduction",
    "norm": "reduction",
    "linalg_vector_norm": "reduction",
    "var_mean": "reduction",
}


def op_kind(family: str) -> str:
    """Op class for grouping: matmul, attention, norm, softmax, loss, embedding, copy, view,
    reduction, optimizer, conv, compiled, or pointwise (everything elementwise)."""
    if family in _KINDS:
        return _KINDS[family]
    if family.startswith(("foreach", "fused_adam", "fused_sgd")):
        return "optimizer"
    if family in ("empty", "empty_strided", "empty_like", "resize", "set", "record_stream"):
        return "view"
    return "pointwise"


def math_mode(input_types: list, tf32: bool) -> str:
    """Math mode of a matmul from its first floating input dtype."""
    for t in input_types:
        if t in _MATH:
            mode = _MATH[t]
            return "tf32" if mode == "fp32" and tf32 else mode
    return "fp32"


def _tensors(dims: list, types: list):
    """(shape, itemsize) of every tensor argument, TensorLists flattened."""
    for d, t in zip(dims, types, strict=False):
        if t == "TensorList" or (d and isinstance(d[0], list)):
            for sub in d:
                if isinstance(sub, list) and sub:
                    yield sub, 4
        elif t in _DTYPE_BYTES and isinstance(d, list):
            yield d, _DTYPE_BYTES[t]


def shape_cost(op: TraceOp, tf32: bool = False, causal: bool = True) -> tuple[float, float, str]:
    """(FLOPs, bytes, math mode) of an op estimated from the shapes the profiler recorded.

    Matmuls: 2·M·N·K (batched: ×B); bytes = inputs + output. SDPA: forward 4·B·H·S²·D
    (halved when causal; backward 2.5×), bytes = q, k, v, out once (backward ×2).
    Everything else: 1 FLOP per output element; bytes = all tensor inputs + one output the
    size of the largest input (an in-place op writes its first input). Views move nothing.
    The profiler records no shapes inside TensorLists, so foreach optimizer ops cost (0, 0)
    here (regime "none"): give profile() the StepGraph to cost them.
    """
    fam = op.family
    kind = op_kind(fam)
    ts = list(_tensors(op.input_dims, op.input_types))
    if kind in ("view", "compiled") or not ts:
        return 0.0, 0.0, ""
    if kind == "matmul":
        return _matmul_cost(ts, math_mode(op.input_types, tf32))
    if kind == "attention":
        return _attention_cost(
            ts,
            backward=fam.endswith("backward"),
            causal=causal,
            math=math_mode(op.input_types, False),
        )
    if fam == "embedding" and len(ts) >= 2:
        (w, wb), (idx, _) = ts[0], ts[1]
        rows = prod(idx)
        return 0.0, 2.0 * rows * w[-1] * wb + rows * 8, ""
    nbytes = [prod(s) * b for s, b in ts]
    out = nbytes[0] if op.op.endswith("_") else max(nbytes)
    numel = max(prod(s) for s, _ in ts)
    return float(numel), float(sum(nbytes) + out), "fp32"


def _matmul_cost(ts, math: str) -> tuple[float, float, str]:
    mats = [(s, b) for s, b in ts if len(s) >= 2]
    if len(mats) < 2:
        return 0.0, 0.0, math
    (a, ab), (w, _) = mats[-2], mats[-1]
    batch = prod(a[:-2]) if len(a) > 2 else 1
    m, k, n = a[-2], a[-1], w[-1]
    flops = 2.0 * batch * m * n * k
    nbytes = sum(prod(s) * b for s, b in ts) + batch * m * n * ab
    return flops, float(nbytes), math


def _attention_cost(ts, backward: bool, causal: bool, math: str) -> tuple[float, float, str]:
    qkv = [(s, b) for s, b in ts if len(s) == 4]
    if not qkv:
        return 0.0, 0.0, math
    q = qkv[1][0] if backward and len(qkv) > 1 else qkv[0][0]  # backward: grad_out first
    b, h, s, d = q
    fwd = 4.0 * b * h * s * s * d * (0.5 if causal else 1.0)
    nbytes = 4.0 * b * h * s * d * qkv[0][1]
    return (2.5 * fwd, 2 * nbytes, math) if backward else (fwd, nbytes, math)
