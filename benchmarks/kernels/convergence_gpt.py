"""Convergence: a small GPT trained ~300 steps with gobrrr's kernels and with PyTorch's.

4 layers, d=256, 4 heads, seq 256, vocab 512, batch 16, bf16 autocast, AdamW lr 1e-3. Data with
learnable structure: windows of a random 97-token sequence repeated end to end, so the loss can
fall from ln 512 towards 0 (by copying from 97 tokens back, or by memorising the sequence). Same
seed, same init, same batches for both runs; reports the largest gap of the smoothed losses
(EMA, 0.9).

    PYTHONPATH=src python benchmarks/kernels/convergence_gpt.py OUT.json
"""

from __future__ import annotations

import importlib.util
import sys
from dataclasses import asdict, replace
from pathlib import Path

import torch

from gobrrr.kernels.bench import out_only_main, table, write_json

DEVICE = "cuda"  # the benchmarks need a GPU; a CPU dry run may override this

STEPS, BATCH, PERIOD, LR, EMA = 300, 16, 97, 1e-3, 0.9


def _gpt_module():
    path = Path(__file__).with_name("bench_gpt2_kernels.py")
    spec = importlib.util.spec_from_file_location("gobrrr_bench_gpt2_model", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def batches(cfg, steps):
    g = torch.Generator().manual_seed(123)
    pattern = torch.randint(0, cfg.vocab, (PERIOD,), generator=g)
    stream = pattern.repeat((cfg.seq + 1) // PERIOD + 2)
    for _ in range(steps):
        starts = torch.randint(0, PERIOD, (BATCH,), generator=g)
        rows = torch.stack([stream[s : s + cfg.seq + 1] for s in starts.tolist()])
        yield rows[:, :-1].to(DEVICE), rows[:, 1:].to(DEVICE)


def train(gpt, cfg, kernels):
    torch.manual_seed(0)
    model = gpt.GPT(cfg, kernels).to(DEVICE)
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.1)
    losses = []
    for idx, tgt in batches(cfg, STEPS):
        with torch.autocast(DEVICE, dtype=torch.bfloat16):
            loss = model(idx, tgt)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def smooth(xs):
    out, s = [], xs[0]
    for x in xs:
        s = EMA * s + (1 - EMA) * x
        out.append(s)
    return out


def run(out_path: str | Path, sweep: bool = False) -> Path:
    gpt = _gpt_module()
    cfg = gpt.GPTConfig(n_layer=4, n_head=4, n_embd=256, vocab=512, seq=256)
    why_not = gpt.attention_works()
    kernels = gpt.ALL if why_not is None else replace(gpt.ALL, attention=False)
    ref = train(gpt, cfg, gpt.Kernels())
    ours = train(gpt, cfg, kernels)
    s_ref, s_ours = smooth(ref), smooth(ours)
    gaps = [abs(a - b) for a, b in zip(s_ref, s_ours, strict=True)]
    summary = {
        "max_smoothed_gap": max(gaps),
        "step_of_max_gap": gaps.index(max(gaps)),
        "max_raw_gap": max(abs(a - b) for a, b in zip(ref, ours, strict=True)),
        "first_loss": [ref[0], ours[0]],
        "final_smoothed": [s_ref[-1], s_ours[-1]],
    }
    path = write_json(
        out_path,
        {
            "benchmark": "convergence, small GPT",
            "model": asdict(cfg),
            "steps": STEPS,
            "batch": BATCH,
            "period": PERIOD,
            "lr": LR,
            "ema": EMA,
            "kernels": asdict(kernels),
            "attention_unavailable": why_not,
            "summary": summary,
            "loss_torch": ref,
            "loss_gobrrr": ours,
        },
    )
    rows = [
        {"step": i, "torch": s_ref[i], "gobrrr": s_ours[i], "gap": gaps[i]}
        for i in sorted({0, 50, 100, 150, 200, 250, STEPS - 1})
        if i < STEPS
    ]
    print(table(rows, ["step", "torch", "gobrrr", "gap"]))
    print({k: v for k, v in summary.items()})
    return path


def main(argv=None):
    out_only_main(run, __doc__, argv)


if __name__ == "__main__":
    main()
