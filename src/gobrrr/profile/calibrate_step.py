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


def attention_rate(dev: torch.device, b: int = 8, h: int = 16, s: int = 2048,
                   d: int = 64) -> dict[str, float]:
    """Achieved FLOP/s of F.scaled_dot_product_attention fwd+bwd (causal), default backend,
    FlashAttention's count: fwd 4·B·H·S²·D / 2, bwd 2.5 x fwd."""
    from gobrrr.profile.calibrate import time_op

    out = {}
    for name, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
        q, k, v = (torch.randn(b, h, s, d, device=dev, dtype=dtype, requires_grad=True)
                   for _ in range(3))
        g = torch.randn(b, h, s, d, device=dev, dtype=dtype)

        def fwd_bwd(q=q, k=k, v=v, g=g):
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
            torch.autograd.grad(o, (q, k, v), g)

        flops = 3.5 * 4 * b * h * s * s * d / 2
        out[name] = flops / time_op(fwd_bwd, dev, 10)
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
