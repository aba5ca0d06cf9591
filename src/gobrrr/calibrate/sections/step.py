"""Calibration measurements that need a training step or a specific kernel, not a microloop:

- the host time eager PyTorch spends per ATen op inside a real training step, per phase
  (Python module calls, autograd recording, dispatch and launch amortised over the ops), on a
  tiny model whose GPU work is negligible;
- what a tensor-core matmul with a misaligned leading dimension achieves;
- the achieved FLOP/s of the default scaled-dot-product-attention backend, fwd+bwd;
- the workspace cuBLASLt keeps once an addmm with a bias ran.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from gobrrr.calibrate.timing import flush_buffer, time_op
from gobrrr.capture.recorder import Recorder, StorageTable
from gobrrr.cost._ops_attention import VARIANT_HEAD_DIMS
from gobrrr.cost.flops import op_cost
from gobrrr.profile.timing import sync

PHASES = ("forward", "backward", "optimizer")


def misaligned_fractions(dev: torch.device, n: int = 4096) -> dict[str, float]:
    """Rate of an n x n x (n-1) matmul (odd leading dimension) over the n x n x n one, per math
    mode; under "nt:<mode>" the same with the second operand a transposed weight, a @ w.t()
    with w (n - 1, n): a linear layer whose output width is odd (a language model's head over
    an odd vocabulary), which cuBLAS runs slower still (on an H100 in bf16, 95-102 TFLOP/s
    against 144 for the plain odd matmul)."""
    out = {}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype in (
            ("bf16", torch.bfloat16),
            ("fp16", torch.float16),
            ("tf32", torch.float32),
        ):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(n, n, device=dev, dtype=dtype)
            for key, make in (
                (name, lambda m, t=dtype: torch.randn(n, m, device=dev, dtype=t)),
                (f"nt:{name}", lambda m, t=dtype: torch.randn(m, n, device=dev, dtype=t).t()),
            ):
                rates = []
                for m in (n, n - 1):
                    b = make(m)
                    rates.append(2.0 * n * n * m / time_op(lambda a=a, b=b: a @ b, dev, 10))
                out[key] = min(rates[1] / rates[0], 1.0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out


ATTENTION_REPS = 4  # fwd(+bwd) calls per timed run: the host queues ahead of the GPU


def attention_rate(
    dev: torch.device, d: int = 64, tokens: int = 16384, seqs: tuple[int, ...] = (256, 1024, 4096)
) -> dict[str, list[list[float]]]:
    """Achieved FLOP/s of F.scaled_dot_product_attention (causal, default backend, inputs that
    require grad) at B·S = `tokens`, 16 heads of `d`, over sequence lengths: fwd+bwd under
    the dtype's key, and apart under "forward:<dtype>" and "backward:<dtype>" (backward =
    fwd+bwd minus fwd): {key: [[S, FLOP/s], ...]}. Each timed run issues ATTENTION_REPS calls
    back to back, so the GPU's rate is measured, not the host's. FlashAttention's count:
    fwd 4·B·H·S²·D / 2, bwd 2.5 x fwd."""
    out: dict[str, list[list[float]]] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for key in (name, f"forward:{name}", f"backward:{name}"):
            out[key] = []
        for s in seqs:
            b, h = max(tokens // s, 1), 16
            q, k, v = (
                torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True)
                for _ in range(3)
            )
            g = torch.randn(b, h, s, d, device=dev, dtype=dtype)

            def fwd(q=q, k=k, v=v):
                return [
                    F.scaled_dot_product_attention(q, k, v, is_causal=True)
                    for _ in range(ATTENTION_REPS)
                ]

            def fwd_bwd(q=q, k=k, v=v, g=g):
                for o in fwd(q, k, v):
                    torch.autograd.grad(o, (q, k, v), g)

            flops = 4 * b * h * s * s * d / 2 * ATTENTION_REPS  # forward, per timed run
            t_fwd, t_both = time_op(fwd, dev, 10), time_op(fwd_bwd, dev, 10)
            out[name].append([float(s), 3.5 * flops / t_both])
            out[f"forward:{name}"].append([float(s), flops / t_fwd])
            out[f"backward:{name}"].append([float(s), 2.5 * flops / max(t_both - t_fwd, 1e-9)])
    return out


def attention_variants(
    dev: torch.device, tokens: int = 16384, seqs: tuple[int, ...] = (256, 1024, 4096)
) -> dict[str, list[list[float]]]:
    """Achieved FLOP/s of F.scaled_dot_product_attention (default backend, as a step calls it)
    for each kernel variant `cost._ops_attention.variant` names: mask "causal" (is_causal),
    "full" (no mask) or "mask" (a boolean (B, 1, S, S) mask hiding the last eighth of the
    keys, as a padded batch has), without and with dropout 0.1, at head dims 64 and 128
    (1024 model width), over sequence lengths at B·S = `tokens`; forward and backward apart:
    {"<direction>:<dtype>:<variant>": [[S, FLOP/s], ...]}. fp32 at head dim 64 only. FLOPs
    by FlashAttention's count (causal halved, a mask tensor counted in full, as the cost
    model counts them)."""
    out: dict[str, list[list[float]]] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for d in VARIANT_HEAD_DIMS if name == "bf16" else VARIANT_HEAD_DIMS[:1]:
            for mask in ("causal", "full", "mask"):
                for p in (0.0, 0.1):
                    label = f"{name}:{mask}{'+dropout' if p else ''}:d{d}"
                    for s in seqs:
                        rates = _attention_point(dev, time_op, dtype, tokens, s, d, mask, p)
                        for direction, rate in zip(("forward", "backward"), rates, strict=True):
                            out.setdefault(f"{direction}:{label}", []).append([float(s), rate])
    return out


def _attention_point(
    dev, time_op, dtype, tokens: int, s: int, d: int, mask: str, p: float
) -> tuple[float, float]:
    """(forward, backward) FLOP/s of one attention variant at sequence length s."""
    b, h = max(tokens // s, 1), 1024 // d
    q, k, v = (
        torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True) for _ in range(3)
    )
    g = torch.randn(b, h, s, d, device=dev, dtype=dtype)
    kw: dict = {"is_causal": mask == "causal", "dropout_p": p}
    if mask == "mask":
        keep = torch.ones(b, 1, s, s, device=dev, dtype=torch.bool)
        keep[..., s - s // 8 :] = False
        kw["attn_mask"] = keep

    def fwd():
        return [F.scaled_dot_product_attention(q, k, v, **kw) for _ in range(ATTENTION_REPS)]

    def fwd_bwd():
        for o in fwd():
            torch.autograd.grad(o, (q, k, v), g)

    flops = 4 * b * h * s * s * d * (0.5 if mask == "causal" else 1.0) * ATTENTION_REPS
    t_fwd, t_both = time_op(fwd, dev, 10), time_op(fwd_bwd, dev, 10)
    return flops / t_fwd, 2.5 * flops / max(t_both - t_fwd, 1e-9)


GRID_MAX_FLOP = 2.0**41  # the largest matmul the grid times (~3 ms in bf16, ~45 ms in fp32)


def matmul_grid(
    dev: torch.device,
    mns: tuple[int, ...] = (128, 256, 512, 1024, 2048, 4096, 8192, 16384),
    ks: tuple[int, ...] = (64, 256, 1024, 4096, 16384, 65536, 262144),
) -> dict[str, list[list[float]]]:
    """Achieved FLOP/s of (m x k) @ (k x m) over output sizes m² and depths k, per math mode:
    {mode: [[m*m, k, FLOP/s], ...]}. Small outputs leave SMs idle; a short k leaves each
    tile's fixed cost (prologue, epilogue) unamortised. Deep k with a small output is a weight
    gradient (k = the tokens of a step, or a CNN's pixels: a 96-wide linear layer over a batch
    of 56x56 maps has k = 200k), which cuBLAS splits over k. Points above
    GRID_MAX_FLOP are left out (large outputs are at full rate by k = 4096 anyway): the grid is
    ragged at its large corner."""
    out: dict[str, list[list[float]]] = {}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype in (
            ("bf16", torch.bfloat16),
            ("tf32", torch.float32),
            ("fp32", torch.float32),
        ):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            out[name] = []
            for m in mns:
                for k in ks:
                    if 2.0 * m * m * k > GRID_MAX_FLOP:
                        continue
                    a = torch.randn(m, k, device=dev, dtype=dtype)
                    b = torch.randn(k, m, device=dev, dtype=dtype)
                    t = time_op(lambda a=a, b=b: a @ b, dev, 5 if m * m * k > 2**33 else 15)
                    out[name].append([float(m * m), float(k), 2.0 * m * m * k / t])
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out


def blaslt_workspace(dev: torch.device) -> int | None:
    """Bytes an addmm with a bias (the cuBLASLt path) adds to memory_allocated beyond its
    output, once the plain cuBLAS workspace exists."""
    try:
        torch._C._cuda_clearCublasWorkspaces()
    except (AttributeError, RuntimeError):
        return None
    a = torch.randn(256, 256, device=dev, dtype=torch.bfloat16)
    bias = torch.randn(256, device=dev, dtype=torch.bfloat16)
    _ = a @ a
    sync(dev)
    before = torch.cuda.memory_allocated(dev)
    c = torch.addmm(bias, a, a)
    sync(dev)
    gained = torch.cuda.memory_allocated(dev) - before - c.untyped_storage().nbytes()
    return int(gained) if gained >= 0 else None


def _op_cases(dev: torch.device):
    """(op name, a zero-argument function running exactly that ATen op) on real inputs at
    representative sizes, bf16 activations as under autocast."""
    aten = torch.ops.aten
    h = torch.randn(16384, 1024, device=dev)  # layer norm runs in fp32 under autocast
    lw, lb = torch.ones(1024, device=dev), torch.zeros(1024, device=dev)
    _, lmean, lrstd = aten.native_layer_norm(h, [1024], lw, lb, 1e-5)
    gh = torch.randn_like(h)
    yield "native_layer_norm", lambda: aten.native_layer_norm(h, [1024], lw, lb, 1e-5)
    yield (
        "native_layer_norm_backward",
        lambda: aten.native_layer_norm_backward(
            gh, h, [1024], lmean, lrstd, lw, lb, [True, True, True]
        ),
    )
    logits = torch.randn(8192, 32000, device=dev, dtype=torch.bfloat16)
    lsm = aten._log_softmax(logits, 1, False)
    yield "_log_softmax", lambda: aten._log_softmax(logits, 1, False)
    yield (
        "_log_softmax_backward_data",
        lambda: aten._log_softmax_backward_data(lsm, lsm, 1, torch.bfloat16),
    )
    idx = torch.randint(0, 32000, (8192,), device=dev)
    ge = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16)
    yield (
        "embedding_dense_backward",
        lambda: aten.embedding_dense_backward(ge, idx, 32000, -1, False),
    )
    p = torch.randn(64, 64, 112, 112, device=dev, dtype=torch.bfloat16)
    out, ind = aten.max_pool2d_with_indices(p, [3, 3], [2, 2], [1, 1])
    yield (
        "max_pool2d_with_indices_backward",
        lambda: aten.max_pool2d_with_indices_backward(
            torch.randn_like(out), p, [3, 3], [2, 2], [1, 1], [1, 1], False, ind
        ),
    )


def _bn_bytes(shape, dtype) -> tuple[float, float]:
    """Bytes the cost model counts for batch norm forward and backward at this shape, from the
    ops a CPU trace records (meta tensors: nothing is computed)."""
    c = shape[1]
    x = torch.empty(shape, device="meta", dtype=dtype, requires_grad=True)
    w = torch.empty(c, device="meta", requires_grad=True)
    b = torch.empty(c, device="meta", requires_grad=True)
    rm, rv = torch.empty(c, device="meta"), torch.empty(c, device="meta")
    rec = Recorder(StorageTable(), lambda: "", lambda: "forward")
    with rec:
        y = F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)
        torch.autograd.grad(y, (x, w, b), torch.empty_like(y))
    by = {n.name: op_cost(n).bytes for n in rec.nodes}
    fwd = next(v for k, v in by.items() if "batch_norm" in k and "backward" not in k)
    bwd = next(v for k, v in by.items() if "batch_norm_backward" in k)
    return fwd, bwd


BN_CHANNELS = (32, 64, 128, 256, 512, 1024)


def batch_norm_bandwidths(
    dev: torch.device,
    elements: int = 2**24,
    plane: int = 28,
    channels: tuple[int, ...] = BN_CHANNELS,
) -> dict[str, list[list[float]]]:
    """Achieved bytes/s of training-mode batch norm over the channel count, forward and
    backward, per dtype and layout: {"forward:bf16" | "backward:fp32" | ... (channels-first),
    "forward:bf16:channels_last" | ...: [[channels, B/s], ...]}.
    Through F.batch_norm so the kernels are the ones a model gets (CUDA picks cuDNN's in fp32
    and its own NCHW kernels in bf16, at very different speeds). Channels-first kernels
    reduce each channel over batch x plane, so the channel count sets their parallelism (at
    64 channels the bf16 kernels reach ~6% of HBM bandwidth, more with more channels);
    channels-last tensors (a model converted with `.to(memory_format=torch.channels_last)`)
    run other kernels, whose channels are the contiguous dimension."""
    out: dict[str, list[list[float]]] = {}
    for key, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for suffix, channels_last in (("", False), (":channels_last", True)):
            fwd_rows, bwd_rows = [], []
            for c in channels:
                shape = (max(elements // (c * plane * plane), 1), c, plane, plane)
                t_fwd, t_bwd = batch_norm_times(dev, shape, dtype, channels_last)
                nf, nb = _bn_bytes(shape, dtype)
                fwd_rows.append([float(c), nf / t_fwd])
                bwd_rows.append([float(c), nb / t_bwd])
            out[f"forward:{key}{suffix}"], out[f"backward:{key}{suffix}"] = fwd_rows, bwd_rows
    return out


BN_GRID_CHANNELS = (32, 64, 128, 256, 512, 1024, 2048)
BN_GRID_ROWS = (3136, 12544, 50176, 200704, 802816)  # N·H·W: 4..1024 images of 28 x 28


def batch_norm_grid(dev: torch.device, max_elements: int = 2**27) -> dict[str, list[list[float]]]:
    """Achieved bytes/s of training-mode batch norm over channels and rows (N·H·W, the
    reduction each channel makes), forward and backward, per dtype and layout:
    {"forward:bf16" | "backward:bf16:channels_last" | ...: [[channels, rows, B/s], ...]}.
    Both set the kernels' launch shape (the channels-last backward at 1024 channels and
    15680 rows measured 98 GB/s, at 25088 rows it runs ~10x faster): one curve over channels
    at a fixed size cannot stand for a network's layers."""
    out: dict[str, list[list[float]]] = {}
    for key, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        for suffix, channels_last in (("", False), (":channels_last", True)):
            fwd_rows, bwd_rows = [], []
            for c in BN_GRID_CHANNELS:
                for rows in BN_GRID_ROWS:
                    if c * rows > max_elements:
                        continue
                    shape = (rows // 784, c, 28, 28)
                    t_fwd, t_bwd = batch_norm_times(dev, shape, dtype, channels_last)
                    nf, nb = _bn_bytes(shape, dtype)
                    fwd_rows.append([float(c), float(rows), nf / t_fwd])
                    bwd_rows.append([float(c), float(rows), nb / t_bwd])
            out[f"forward:{key}{suffix}"], out[f"backward:{key}{suffix}"] = fwd_rows, bwd_rows
    return out


# widths from a CNN's channels (ConvNeXt's 96..768, normalised per pixel) to an LM's 8192; rows
# to a CNN's pixels (a batch of 56x56 maps is 200k rows), the most only at narrow widths; dense
# between 32k and 131k rows, where the backward's gamma/beta kernel changes strategy (2-3x faster
# per byte above it: ConvNeXt-V2's 50k-row backwards run at the 32k rows' rate)
LN_GRID_WIDTHS = (64, 96, 128, 192, 256, 384, 512, 768, 1024, 2048, 4096, 8192)
LN_GRID_ROWS = (2048, 8192, 32768, 49152, 65536, 98304, 131072, 524288)
LN_GRID_MAX_ELEMENTS = 2**28


def layer_norm_grid(dev: torch.device) -> dict[str, list[list[float]]]:
    """Achieved bytes/s of native_layer_norm and its backward over the normalised width and
    the rows, per input dtype (fp32: as autocast runs it; bf16: pure bf16), bytes counted as
    the cost model counts them: {"native_layer_norm:fp32" | "native_layer_norm_backward:bf16"
    | ...: [[width, rows, B/s], ...]}. The width sets the kernel's block shape and the rows
    its parallelism: one point at 16384 x 1024 cannot stand for ViT's 768 or a 4096-wide LM."""
    aten = torch.ops.aten
    out: dict[str, list[list[float]]] = {}
    for key, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
        fwd, bwd = (
            out.setdefault(f"native_layer_norm:{key}", []),
            out.setdefault(f"native_layer_norm_backward:{key}", []),
        )
        for w in LN_GRID_WIDTHS:
            for rows in (r for r in LN_GRID_ROWS if r * w <= LN_GRID_MAX_ELEMENTS):
                h = torch.randn(rows, w, device=dev, dtype=dtype)
                lw, lb = (
                    torch.ones(w, device=dev, dtype=dtype),
                    torch.zeros(w, device=dev, dtype=dtype),
                )
                _, mean, rstd = aten.native_layer_norm(h, [w], lw, lb, 1e-5)
                gh = torch.randn_like(h)
                f = lambda h=h, w=w, lw=lw, lb=lb: aten.native_layer_norm(  # noqa: E731
                    h, [w], lw, lb, 1e-5
                )
                b = lambda h=h, w=w, lw=lw, lb=lb, m=mean, r=rstd, g=gh: (  # noqa: E731
                    aten.native_layer_norm_backward(g, h, [w], m, r, lw, lb, [True, True, True])
                )
                fwd.append(
                    [
                        float(w),
                        float(rows),
                        op_cost(_record(f, "native_layer_norm")).bytes / time_op(f, dev, 10),
                    ]
                )
                bwd.append(
                    [
                        float(w),
                        float(rows),
                        op_cost(_record(b, "native_layer_norm_backward")).bytes
                        / time_op(b, dev, 10),
                    ]
                )
    return out


def batch_norm_times(
    dev: torch.device, shape: tuple[int, ...], dtype: torch.dtype, channels_last: bool = False
) -> tuple[float, float]:
    """(forward, backward) seconds of training-mode F.batch_norm on an NCHW tensor (stored
    channels-last if asked); backward is fwd+bwd less forward (grads of input, weight and
    bias)."""
    c = shape[1]
    x = torch.randn(shape, device=dev, dtype=dtype)
    if channels_last:
        x = x.contiguous(memory_format=torch.channels_last)
    x.requires_grad_(True)
    w = torch.ones(c, device=dev, requires_grad=True)
    b = torch.zeros(c, device=dev, requires_grad=True)
    rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
    gy = torch.randn_like(x)

    def fwd():
        return F.batch_norm(x, rm, rv, w, b, True, 0.1, 1e-5)

    def fwd_bwd():
        torch.autograd.grad(fwd(), (x, w, b), gy)

    t_fwd = time_op(fwd, dev, 10)
    return t_fwd, max(time_op(fwd_bwd, dev, 10) - t_fwd, 1e-9)


def op_bandwidths(dev: torch.device) -> dict[str, float]:
    """Achieved bytes/s of memory-bound ops whose kernels fall far from a copy's bandwidth
    (layer norm, log-softmax, embedding backward, pooling; batch norm and sums over tokens have
    their own curves, `batch_norm_bandwidths`, `outer_sum_bandwidths`), counting the bytes
    exactly as the cost model does (gobrrr.cost.flops on the recorded op)."""
    return {
        name: op_cost(_record(fn, name)).bytes / time_op(fn, dev, 10) for name, fn in _op_cases(dev)
    }


def embedding_backward_fit(dev: torch.device) -> dict[str, float | list]:
    """embedding_dense_backward's time as fill + tokens: the (V, D) gradient written (a
    zero-fill and the rows' sums) at a bandwidth, the tokens' T·D gradient values summed
    into their rows at a rate per value (in fp32 whatever the dtype: bf16 and fp32 take
    about the same time), plus a fixed part (the index sort's kernels), fitted by least
    squares to a grid over vocabulary V, tokens T, width D and dtype (max error 16% on the
    H100's grid; with the tokens' bytes in place of their values, 58%):
    {"fill_Bps", "token_values_per_s", "fixed_s", "points": [[V, T, D, itemsize, s], ...]}."""
    aten = torch.ops.aten
    flush = flush_buffer(dev)
    points = []
    for dtype in (torch.bfloat16, torch.float32):
        for v in (32000, 128256):
            for t in (4096, 32768):
                for d in (1024, 4096):
                    idx = torch.randint(0, v, (t,), device=dev)
                    g = torch.randn(t, d, device=dev, dtype=dtype)
                    sec = time_op(
                        lambda g=g, idx=idx, v=v: aten.embedding_dense_backward(
                            g, idx, v, -1, False
                        ),
                        dev,
                        5,
                        flush,
                    )
                    points.append([v, t, d, g.element_size(), sec])
                    del g, idx
    return {**fit_embedding_backward(points), "points": points}


def fit_embedding_backward(points: list[list[float]]) -> dict[str, float]:
    """Least-squares (1/fill_Bps, 1/token_values_per_s, fixed_s) of seconds = V·D·s /
    fill_Bps + T·D / token_values_per_s + fixed_s over [[V, T, D, itemsize s, seconds], ...]."""
    import numpy as np

    a = np.array([[v * d * s, t * d, 1.0] for v, t, d, s, _ in points])
    y = np.array([p[4] for p in points])
    (inv_fill, inv_tok, fixed), *_ = np.linalg.lstsq(a, y, rcond=None)
    return {
        "fill_Bps": float(1.0 / max(inv_fill, 1e-15)),
        "token_values_per_s": float(1.0 / max(inv_tok, 1e-15)),
        "fixed_s": max(float(fixed), 0.0),
    }


OUTER_SUM_COLS = (64, 96, 128, 192, 256, 384, 768, 2048, 4096, 16384)
OUTER_SUM_ROWS = (4096, 16384, 32768, 65536, 131072, 262144)


def outer_sum_bandwidths(
    dev: torch.device,
    rows: tuple[int, ...] = OUTER_SUM_ROWS,
    cols: tuple[int, ...] = OUTER_SUM_COLS,
    max_elements: int = 2**30,
) -> dict[str, list[list[float]]]:
    """Achieved bytes/s of a sum over the leading dim of a (rows, cols) tensor (a bias
    gradient over a step's tokens, or a CNN's pixels) over the column count and the rows, per
    dtype: {"sum:bf16" | "sum:fp32": [[cols, rows, B/s], ...]}. The columns set the kernel's
    parallelism across the output, the rows how far it splits each column's sum (a second
    kernel adds the partial sums); bytes as the cost model counts them."""
    aten = torch.ops.aten
    out: dict[str, list[list[float]]] = {}
    for key, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out[f"sum:{key}"] = []
        for c in cols:
            for r in (r for r in rows if r * c <= max_elements):
                g = torch.randn(r, c, device=dev, dtype=dtype)
                fn = lambda g=g: aten.sum.dim_IntList(g, [0])  # noqa: E731
                out[f"sum:{key}"].append(
                    [float(c), float(r), op_cost(_record(fn, "sum")).bytes / time_op(fn, dev, 20)]
                )
                del g
    return out


def _record(fn, name: str):
    """The OpNode of ATen op `name` as fn() runs it (shapes, strides, dtypes as the capture
    records them), so calibration counts FLOPs and bytes exactly as the cost model does."""
    rec = Recorder(StorageTable(), lambda: "", lambda: "forward")
    with rec:
        fn()
    return next(n for n in rec.nodes if n.name == name)


def _allocated_inside(fn, dev: torch.device) -> int:
    """Bytes fn() allocated and freed again within the call (its peak above both what was
    allocated before and what is left after)."""
    sync(dev)
    before = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    out = fn()
    sync(dev)
    inside = torch.cuda.max_memory_allocated(dev) - max(before, torch.cuda.memory_allocated(dev))
    del out
    return max(int(inside), 0)
