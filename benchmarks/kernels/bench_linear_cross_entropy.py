"""Fused linear + cross-entropy vs eager and torch.compile: fwd+bwd time and peak extra memory.

Shape: tokens 8192, hidden 4096, vocab 128256, bf16 (a Llama-3-8B output layer). Baselines in
the same process: eager F.cross_entropy((h @ W.T).float(), t) and torch.compile of it.

    PYTHONPATH=src python benchmarks/kernels/bench_linear_cross_entropy.py OUT.json [--sweep]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from gobrrr.kernels import linear_cross_entropy
from gobrrr.kernels.bench import (
    GiB,
    generator,
    peak_extra_bytes,
    rel_err,
    table,
    time_ms,
    write_json,
)
from gobrrr.kernels.linear_cross_entropy import _ce_launch, default_chunk

DEVICE = "cuda"  # the benchmarks need a GPU; a CPU dry run may override this

T, D, V = 8192, 4096, 128256
DTYPE = torch.bfloat16


def eager_loss(h, w, t):
    return F.cross_entropy((h @ w.T).float(), t)


def make_inputs():
    g = generator(0, DEVICE)
    h = torch.randn(T, D, device=DEVICE, dtype=DTYPE, generator=g).requires_grad_()
    w = (0.02 * torch.randn(V, D, device=DEVICE, generator=g)).to(DTYPE).requires_grad_()
    t = torch.randint(0, V, (T,), device=DEVICE, generator=g)
    t[::17] = -100  # some ignored positions, as padding would give
    return h, w, t


def grads_of(loss_fn, h, w, t):
    h.grad = w.grad = None
    loss = loss_fn(h, w, t)
    loss.backward()
    out = loss.detach().float(), h.grad.clone(), w.grad.clone()
    h.grad = w.grad = None
    return out


def measure(name, loss_fn, h, w, t, chunk=None):
    def step():
        loss_fn(h, w, t).backward()

    start = time.perf_counter()
    h.grad = w.grad = None
    step()  # warm-up: compilation, autotuning, allocator
    torch.cuda.synchronize()
    first_s = time.perf_counter() - start
    h.grad = w.grad = None
    peak = peak_extra_bytes(step)
    h.grad = w.grad = None
    timing = time_ms(step, warmup=200, rep=1500, grad_to_none=[h, w])
    h.grad = w.grad = None
    torch.cuda.empty_cache()
    return {
        "impl": name,
        "chunk": chunk,
        **timing,
        "peak_extra_gib": peak / GiB,
        "first_call_s": first_s,
    }


def ce_kernel_only() -> dict:
    """The Triton loss/gradient kernel alone on one default chunk of logits (in place)."""
    c = default_chunk(T, D, V)
    g = generator(1, DEVICE)
    logits = torch.randn(c, V, device=DEVICE, dtype=DTYPE, generator=g)
    targets = torch.randint(0, V, (c,), device=DEVICE, generator=g)
    loss_rows = torch.empty(c, device=DEVICE)
    n_valid = torch.tensor(float(c), device=DEVICE)
    t = time_ms(lambda: _ce_launch(logits, targets, loss_rows, n_valid, -100, 0.0, True))
    # it reads each logit twice (max/sum-exp pass, gradient pass) and writes it once
    moved = 3 * c * V * logits.element_size()
    if "median_ms" not in t:
        return {"chunk": c, **t}
    return {
        "chunk": c,
        **t,
        "GBps_moved": moved / t["median_ms"] / 1e6,
        "ms_per_step": t["median_ms"] * T / c,
    }


def run(out_path: str | Path, sweep: bool = False) -> Path:
    h, w, t = make_inputs()
    ref = grads_of(eager_loss, h, w, t)
    mine = grads_of(linear_cross_entropy, h, w, t)
    check = {
        k: rel_err(a, e) for k, a, e in zip(("loss", "dhidden", "dweight"), mine, ref, strict=True)
    }
    del ref, mine
    rows = [measure("eager", eager_loss, h, w, t)]
    try:
        rows.append(measure("torch.compile", torch.compile(eager_loss), h, w, t))
    except Exception as e:  # noqa: BLE001 - a baseline failing must not lose the rest
        rows.append({"impl": "torch.compile", "error": repr(e)[:300]})
    chunks = [0, 256, 512, 1024, 2048, 4096] if sweep else [0, 256]
    for c in chunks:
        fn = lambda h, w, t, c=c: linear_cross_entropy(h, w, t, chunk_size=c)  # noqa: E731
        rows.append(measure("gobrrr", fn, h, w, t, chunk=c or default_chunk(T, D, V)))
    kernel = ce_kernel_only()
    base = rows[0]
    for r in rows:
        if "median_ms" in r and "median_ms" in base:
            r["time_vs_eager"] = r["median_ms"] / base["median_ms"]
            r["mem_vs_eager"] = r["peak_extra_gib"] / base["peak_extra_gib"]
    path = write_json(
        out_path,
        {
            "benchmark": "linear_cross_entropy fwd+bwd",
            "shape": {
                "tokens": T,
                "hidden": D,
                "vocab": V,
                "dtype": str(DTYPE),
                "ignored_fraction": 1 / 17,
            },
            "default_chunk": default_chunk(T, D, V),
            "check_vs_eager_rel_err": check,
            "ce_kernel": kernel,
            "targets": {"mem_vs_eager_max": 0.2, "time_vs_eager_max": 1.1},
            "rows": rows,
        },
    )
    print("correctness vs eager (rel. Frobenius error):", check)
    print("loss kernel alone, one chunk:", kernel)
    print(
        table(
            rows,
            [
                "impl",
                "chunk",
                "median_ms",
                "p20_ms",
                "p80_ms",
                "peak_extra_gib",
                "time_vs_eager",
                "mem_vs_eager",
            ],
        )
    )
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    p.add_argument("--sweep", action="store_true", help="also sweep the chunk size")
    args = p.parse_args(argv)
    run(args.out, sweep=args.sweep)


if __name__ == "__main__":
    main()
