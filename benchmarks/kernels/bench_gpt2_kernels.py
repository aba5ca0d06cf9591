"""GPT-2 124M training step with gobrrr's kernels vs PyTorch's, eager and torch.compile.

B=16, S=1024, bf16 autocast, fused AdamW, tied embeddings. A nanoGPT-style model written here;
Kernels flags swap in gobrrr's attention, LayerNorm, fused linear+cross-entropy and GELU.
Reports tokens/s, MFU (6 N + 12 L d S FLOPs per token; N counts every weight that multiplies,
the tied embedding once as the output layer, not the position table) and peak memory.

    PYTHONPATH=src python benchmarks/kernels/bench_gpt2_kernels.py OUT.json
"""

from __future__ import annotations

import argparse
import math
import time
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from gobrrr.kernels import LayerNorm, _util, gelu, linear_cross_entropy
from gobrrr.kernels.bench import GiB, generator, table, write_json

DEVICE = "cuda"  # the benchmarks need a GPU; a CPU dry run may override this

PEAK_TFLOPS = 989.0  # H100 SXM dense bf16


@dataclass(frozen=True)
class GPTConfig:
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    vocab: int = 50304  # GPT-2's 50257 padded to a multiple of 64, as nanoGPT does
    seq: int = 1024


@dataclass(frozen=True)
class Kernels:
    """Which of gobrrr's kernels the model uses (False: PyTorch's)."""

    attention: bool = False
    norms: bool = False
    loss: bool = False
    gelu: bool = False


ALL = Kernels(True, True, True, True)


def attention_fn(ours: bool):
    if not ours:
        return lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)
    from gobrrr.kernels import attention

    return lambda q, k, v: attention(q, k, v, causal=True)


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig, k: Kernels):
        super().__init__()
        d = cfg.n_embd
        norm = LayerNorm if k.norms else nn.LayerNorm
        self.ln_1, self.ln_2 = norm(d), norm(d)
        self.c_attn, self.attn_proj = nn.Linear(d, 3 * d), nn.Linear(d, d)
        self.c_fc, self.mlp_proj = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)
        self.n_head, self.ours_gelu = cfg.n_head, k.gelu
        self.attend = attention_fn(k.attention)

    def forward(self, x):
        b, s, d = x.shape
        q, k, v = self.c_attn(self.ln_1(x)).split(d, dim=2)
        q, k, v = (t.view(b, s, self.n_head, d // self.n_head).transpose(1, 2) for t in (q, k, v))
        y = self.attend(q, k, v).transpose(1, 2).reshape(b, s, d)  # (B, S, d)
        x = x + self.attn_proj(y)
        h = self.c_fc(self.ln_2(x))
        h = gelu(h, "tanh") if self.ours_gelu else F.gelu(h, approximate="tanh")
        return x + self.mlp_proj(h)


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig, k: Kernels = Kernels()):
        super().__init__()
        self.cfg, self.kernels = cfg, k
        self.wte = nn.Embedding(cfg.vocab, cfg.n_embd)
        self.wpe = nn.Embedding(cfg.seq, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, k) for _ in range(cfg.n_layer))
        self.ln_f = LayerNorm(cfg.n_embd) if k.norms else nn.LayerNorm(cfg.n_embd)
        self.lm_head = nn.Linear(cfg.n_embd, cfg.vocab, bias=False)
        self.lm_head.weight = self.wte.weight  # tied
        self.apply(self._init)
        for name, p in self.named_parameters():
            if name.endswith("proj.weight"):
                nn.init.normal_(p, 0.0, 0.02 / math.sqrt(2 * cfg.n_layer))

    @staticmethod
    def _init(m):
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, 0.0, 0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx, targets):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)  # (B, S, d)
        for block in self.blocks:
            x = block(x)
        x = self.ln_f(x)
        if self.kernels.loss:
            return linear_cross_entropy(x, self.lm_head.weight, targets)
        logits = self.lm_head(x)  # (B, S, V)
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.view(-1))

    def flops_per_token(self) -> float:
        c = self.cfg
        n = sum(p.numel() for p in self.parameters()) - self.wpe.weight.numel()
        return 6 * n + 12 * c.n_layer * c.n_embd * c.seq


def attention_works() -> str | None:
    """None if gobrrr's attention imports and matches SDPA on a small causal case, else why not."""
    try:
        from gobrrr.kernels import attention

        g = generator(2, DEVICE)
        q, k, v = (
            torch.randn(2, 256, 4, 64, device=DEVICE, dtype=torch.bfloat16, generator=g).transpose(
                1, 2
            )
            for _ in range(3)
        )  # (B, H, S, D) views, as the model has
        err = (
            (
                attention(q, k, v, causal=True).float()
                - F.scaled_dot_product_attention(q, k, v, is_causal=True).float()
            )
            .abs()
            .max()
        )
        return None if err < 3e-2 else f"max error {err.item():.3g} vs SDPA"
    except Exception as e:  # noqa: BLE001 - any failure means: benchmark without it
        return repr(e)[:300]


def make_step(model, compile_model: bool):
    opt = torch.optim.AdamW(
        model.parameters(), lr=6e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=True
    )
    fwd = torch.compile(model) if compile_model else model

    def step(idx, targets):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = fwd(idx, targets)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss.detach()

    return step


def measure(name, cfg, kernels, compile_model, batch, steps=10, warmup=3, fast_host=True):
    """One configuration's step. fast_host=False runs gobrrr's kernels the slower way they ran
    before: through the gobrrr:: ops (gobrrr.kernels._util.DIRECT)."""
    _util.DIRECT = fast_host
    try:
        return {
            **_measure(name, cfg, kernels, compile_model, batch, steps, warmup),
            "fast_host": fast_host,
        }
    finally:
        _util.DIRECT = True


def _measure(name, cfg, kernels, compile_model, batch, steps, warmup):
    torch.manual_seed(0)
    model = GPT(cfg, kernels).to(DEVICE)
    step = make_step(model, compile_model)
    idx, targets = batch
    start = time.perf_counter()
    first_loss = step(idx, targets).item()
    for _ in range(warmup - 1):
        step(idx, targets)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - start
    torch.cuda.reset_peak_memory_stats()
    t0, t1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    t0.record()
    for _ in range(steps):
        step(idx, targets)
    t1.record()
    torch.cuda.synchronize()
    ms = t0.elapsed_time(t1) / steps
    tokens = idx.numel()
    row = {
        "config": name,
        "kernels": asdict(kernels),
        "compile": compile_model,
        "step_ms": ms,
        "tokens_per_s": tokens / ms * 1e3,
        "mfu": model.flops_per_token() * tokens / (ms * 1e-3) / (PEAK_TFLOPS * 1e12),
        "peak_gib": torch.cuda.max_memory_allocated() / GiB,
        "first_loss": first_loss,
        "warmup_s": warm_s,
    }
    del model, step
    torch.cuda.empty_cache()
    return row


def workload(batch_size: int = 16, seq_len: int = 1024, kernels: Kernels = Kernels()):
    """This model as a gobrrr Workload (for `gobrrr estimate` / `gobrrr profile`
    benchmarks/kernels/bench_gpt2_kernels.py:workload; `workload_gobrrr` uses all of gobrrr's
    kernels)."""
    import gobrrr

    cfg = replace(GPTConfig(), seq=seq_len)
    idx = torch.randint(0, cfg.vocab, (batch_size, cfg.seq))
    return gobrrr.Workload(
        model=GPT(cfg, kernels),
        batch=(idx, idx),
        loss=None,
        optimizer=lambda p: torch.optim.AdamW(p, lr=6e-4, fused=True),
    )


def workload_gobrrr(batch_size: int = 16, seq_len: int = 1024):
    return workload(batch_size, seq_len, ALL)


def predicted(cfg, kernels, batch: int) -> dict:
    """gobrrr's prediction of this configuration's eager step on this GPU's calibration, with
    and without the measured host cost of gobrrr's kernel ops (`Calibration.kernel_host`)."""
    import gobrrr
    from gobrrr.evaluate import predict
    from gobrrr.hardware import find_calibration, get_gpu

    gpu = get_gpu("h100")
    cal = find_calibration(gpu)
    if cal is None:
        return {}
    est = gobrrr.estimate(
        lambda: workload(batch, cfg.seq, kernels),
        gpu,
        precision="bf16-mixed",
        calibration=cal,
        loop="drops-output",
    )
    without = predict(est.graph, gpu, replace(cal, kernel_host={}))  # the same trace
    return {
        "predicted_ms": est.time.step_s * 1e3,
        "predicted_ms_no_kernel_host": without.step_s * 1e3,
        "predicted_peak_gib": est.memory.peak / GiB,
    }


def configs(attn_ok: bool):
    k_all = ALL if attn_ok else replace(ALL, attention=False)
    out = [
        ("torch eager", Kernels(), False),
        ("gobrrr all", k_all, False),
        ("gobrrr all, through the ops", k_all, False, False),
        ("gobrrr all but attention", replace(ALL, attention=False), False),
    ]
    for field in ("attention", "norms", "loss", "gelu"):
        if field != "attention" or attn_ok:
            out.append((f"+{field} only", replace(Kernels(), **{field: True}), False))
    return out + [("torch compile", Kernels(), True), ("gobrrr all + compile", k_all, True)]


def run(
    out_path: str | Path,
    sweep: bool = False,
    budget_s: float = 1e9,
    batch: int = 16,
    predict: bool = False,
) -> Path:
    deadline = time.perf_counter() + budget_s
    cfg = GPTConfig()
    why_not = attention_works()
    g = torch.Generator(device=DEVICE).manual_seed(1)
    idx = torch.randint(0, min(50257, cfg.vocab), (batch, cfg.seq), device=DEVICE, generator=g)
    tgt = torch.randint(0, min(50257, cfg.vocab), (batch, cfg.seq), device=DEVICE, generator=g)
    rows = []
    for name, k, comp, *fast in configs(why_not is None):
        if comp and deadline - time.perf_counter() < 120:
            rows.append({"config": name, "skipped": "time budget"})
            continue
        try:
            rows.append(measure(name, cfg, k, comp, (idx, tgt), fast_host=all(fast)))
            if predict and not comp and all(fast):
                rows[-1].update(predicted(cfg, k, batch))
        except Exception as e:  # noqa: BLE001 - keep the other configurations
            rows.append({"config": name, "error": repr(e)[:300]})
            torch.cuda.empty_cache()
    base = rows[0]
    for r in rows:
        if "step_ms" in r:
            r["speedup_vs_eager"] = base["step_ms"] / r["step_ms"]
    path = write_json(
        out_path,
        {
            "benchmark": "GPT-2 124M training step",
            "model": asdict(cfg),
            "batch": batch,
            "dtype": "bf16 autocast, fp32 master weights, fused AdamW",
            "attention_unavailable": why_not,
            "flops_convention": "6N + 12 L d S per token",
            "rows": rows,
        },
    )
    print("gobrrr attention:", "used" if why_not is None else f"not used ({why_not})")
    print(
        table(
            rows,
            [
                "config",
                "compile",
                "step_ms",
                "tokens_per_s",
                "mfu",
                "peak_gib",
                "first_loss",
                "speedup_vs_eager",
                "predicted_ms",
                "predicted_ms_no_kernel_host",
                "predicted_peak_gib",
            ],
        )
    )
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    p.add_argument("--budget-s", type=float, default=1e9, help="skip compiles past this time")
    p.add_argument(
        "--predict",
        action="store_true",
        help="also record gobrrr's prediction of each eager configuration",
    )
    args = p.parse_args(argv)
    run(args.out, budget_s=args.budget_s, predict=args.predict)


if __name__ == "__main__":
    main()
