"""Calibration measurements that need a training step or a specific kernel, not a microloop:

- the host time eager PyTorch spends per ATen op inside a real training step, per phase
  (Python module calls, autograd recording, dispatch and launch amortised over the ops), on a
  tiny model whose GPU work is negligible;
- what a tensor-core matmul with a misaligned leading dimension achieves;
- the achieved FLOP/s of the default scaled-dot-product-attention backend, fwd+bwd;
- the workspace cuBLASLt keeps once an addmm with a bias ran.
"""

from __future__ import annotations

import statistics
import time

import torch
import torch.nn.functional as F

PHASES = ("forward", "backward", "optimizer")


def _sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _tiny_workloads():
    from gobrrr.models.registry import get_workload

    yield lambda: get_workload("gpt2", batch_size=1, seq_len=16, n_layer=4, n_embd=64,
                               n_head=4, vocab_size=128)
    yield lambda: get_workload("llama3-1b", batch_size=1, seq_len=16, n_layer=4, dim=64,
                               n_head=4, n_kv_head=2, ffn_dim=128, vocab_size=128)


def step_overhead(dev: torch.device, reps: int = 20) -> dict[str, float]:
    """Host seconds per traced ATen op, per phase, in eager training steps of tiny models."""
    from gobrrr.capture import capture
    from gobrrr.profile.runner import prepare

    totals = {p: [0.0, 0] for p in PHASES}
    for make in _tiny_workloads():
        graph = capture(make, precision="fp32")
        counts = {p: sum(1 for n in graph.nodes if n.phase == p) for p in PHASES}
        wl, opt, _ = prepare(make(), dev.type, "fp32")
        times = {p: [] for p in PHASES}
        for i in range(reps + 3):
            t = _phase_times(wl, opt, dev)
            if i >= 3:
                for p in PHASES:
                    times[p].append(t[p])
        for p in PHASES:
            totals[p][0] += statistics.median(times[p])
            totals[p][1] += counts[p]
    return {p: s / n for p, (s, n) in totals.items() if n}


def _phase_times(wl, opt, dev) -> dict[str, float]:
    out = {}
    _sync(dev)
    t0 = time.perf_counter()
    loss = wl.compute_loss(wl.batch)
    _sync(dev)
    t1 = time.perf_counter()
    loss.backward()
    _sync(dev)
    t2 = time.perf_counter()
    opt.step()
    opt.zero_grad(set_to_none=True)
    _sync(dev)
    t3 = time.perf_counter()
    out["forward"], out["backward"], out["optimizer"] = t1 - t0, t2 - t1, t3 - t2
    return out


def misaligned_fractions(dev: torch.device, n: int = 4096) -> dict[str, float]:
    """Rate of an n x n x (n-1) matmul (odd leading dimension) over the n x n x n one."""
    from gobrrr.profile.calibrate import time_op

    out = {}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16),
                            ("tf32", torch.float32)):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            a = torch.randn(n, n, device=dev, dtype=dtype)
            rates = []
            for m in (n, n - 1):
                b = torch.randn(n, m, device=dev, dtype=dtype)
                rates.append(2.0 * n * n * m / time_op(lambda a=a, b=b: a @ b, dev, 10))
            out[name] = min(rates[1] / rates[0], 1.0)
    finally:
        torch.backends.cuda.matmul.allow_tf32 = old
    return out


def attention_rate(dev: torch.device, d: int = 64, tokens: int = 16384,
                   seqs: tuple[int, ...] = (256, 1024, 4096)) -> dict[str, list[list[float]]]:
    """Achieved FLOP/s of F.scaled_dot_product_attention fwd+bwd (causal), default backend,
    at B·S = `tokens`, 16 heads of `d`, over sequence lengths: {dtype: [[S, FLOP/s], ...]}.
    FlashAttention's count: fwd 4·B·H·S²·D / 2, bwd 2.5 x fwd."""
    from gobrrr.profile.calibrate import time_op

    out: dict[str, list[list[float]]] = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        out[name] = []
        for s in seqs:
            b, h = max(tokens // s, 1), 16
            q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True)
                       for _ in range(3))
            g = torch.randn(b, h, s, d, device=dev, dtype=dtype)

            def fwd_bwd(q=q, k=k, v=v, g=g):
                o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
                torch.autograd.grad(o, (q, k, v), g)

            flops = 3.5 * 4 * b * h * s * s * d / 2
            out[name].append([float(s), flops / time_op(fwd_bwd, dev, 10)])
    return out


def matmul_grid(dev: torch.device, mns: tuple[int, ...] = (512, 1024, 2048, 4096, 8192),
                ks: tuple[int, ...] = (64, 256, 1024, 4096)) -> dict[str, list[list[float]]]:
    """Achieved FLOP/s of (m x k) @ (k x m) over output sizes m² and depths k, per math mode:
    {mode: [[m*m, k, FLOP/s], ...]}. Small outputs leave SMs idle; a short k leaves each
    tile's fixed cost (prologue, epilogue) unamortised."""
    from gobrrr.profile.calibrate import time_op

    out: dict[str, list[list[float]]] = {}
    old = torch.backends.cuda.matmul.allow_tf32
    try:
        for name, dtype in (("bf16", torch.bfloat16), ("tf32", torch.float32),
                            ("fp32", torch.float32)):
            torch.backends.cuda.matmul.allow_tf32 = name == "tf32"
            out[name] = []
            for m in mns:
                for k in ks:
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
    _sync(dev)
    before = torch.cuda.memory_allocated(dev)
    c = torch.addmm(bias, a, a)
    _sync(dev)
    gained = torch.cuda.memory_allocated(dev) - before - c.untyped_storage().nbytes()
    return int(gained) if gained >= 0 else None


def _bn_inputs(dev, n=64, c=128, hw=56):
    x = torch.randn(n, c, hw, hw, device=dev, dtype=torch.bfloat16)
    w, b = torch.ones(c, device=dev), torch.zeros(c, device=dev)
    rm, rv = torch.zeros(c, device=dev), torch.ones(c, device=dev)
    return x, w, b, rm, rv


def _op_cases(dev: torch.device):
    """(op name, a zero-argument function running exactly that ATen op) on real inputs at
    representative sizes, bf16 activations as under autocast."""
    aten = torch.ops.aten
    x, w, b, rm, rv = _bn_inputs(dev)
    _, mean, invstd = aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
    gy = torch.randn_like(x)
    yield "native_batch_norm", lambda: aten.native_batch_norm(x, w, b, rm, rv, True, 0.1, 1e-5)
    yield "native_batch_norm_backward", lambda: aten.native_batch_norm_backward(
        gy, x, w, rm, rv, mean, invstd, True, 1e-5, [True, True, True])
    h = torch.randn(16384, 1024, device=dev)  # layer norm runs in fp32 under autocast
    lw, lb = torch.ones(1024, device=dev), torch.zeros(1024, device=dev)
    _, lmean, lrstd = aten.native_layer_norm(h, [1024], lw, lb, 1e-5)
    gh = torch.randn_like(h)
    yield "native_layer_norm", lambda: aten.native_layer_norm(h, [1024], lw, lb, 1e-5)
    yield "native_layer_norm_backward", lambda: aten.native_layer_norm_backward(
        gh, h, [1024], lmean, lrstd, lw, lb, [True, True, True])
    logits = torch.randn(8192, 32000, device=dev, dtype=torch.bfloat16)
    lsm = aten._log_softmax(logits, 1, False)
    yield "_log_softmax", lambda: aten._log_softmax(logits, 1, False)
    yield "_log_softmax_backward_data", lambda: aten._log_softmax_backward_data(
        lsm, lsm, 1, torch.bfloat16)
    idx = torch.randint(0, 32000, (8192,), device=dev)
    ge = torch.randn(8192, 1024, device=dev, dtype=torch.bfloat16)
    yield "embedding_dense_backward", lambda: aten.embedding_dense_backward(
        ge, idx, 32000, -1, False)
    p = torch.randn(64, 64, 112, 112, device=dev, dtype=torch.bfloat16)
    out, ind = aten.max_pool2d_with_indices(p, [3, 3], [2, 2], [1, 1])
    yield "max_pool2d_with_indices_backward", lambda: aten.max_pool2d_with_indices_backward(
        torch.randn_like(out), p, [3, 3], [2, 2], [1, 1], [1, 1], False, ind)


def op_bandwidths(dev: torch.device) -> dict[str, float]:
    """Achieved bytes/s of memory-bound ops whose kernels fall far from a copy's bandwidth
    (batch norm, layer norm, log-softmax, embedding backward, pooling), counting the bytes
    exactly as the cost model does (gobrrr.cost.flops on the recorded op)."""
    from gobrrr.capture.recorder import Recorder, StorageTable
    from gobrrr.cost.flops import op_cost
    from gobrrr.profile.calibrate import time_op

    out = {}
    for name, fn in _op_cases(dev):
        rec = Recorder(StorageTable(), lambda: "", lambda: "forward")
        with rec:
            fn()
        node = next(n for n in rec.nodes if n.name == name)
        nbytes = op_cost(node).bytes
        out[name] = nbytes / time_op(fn, dev, 10)
    return out
