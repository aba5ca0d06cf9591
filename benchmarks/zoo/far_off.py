"""Three models far from gobrrr's prediction on an H100, measured beside the prediction.

- qwen2-0.5b: an HF Qwen2 shaped as Qwen2-0.5B (24 layers, 896 wide, 14 query and 2 K/V heads,
  random weights), fp32, batch 4 x 1024: fp32 grouped-query attention runs SDPA's math path on
  CUDA (the S x S probabilities kept, 4·4·14·1024² bytes a layer: 5.6 GB over 24 layers, the
  allocated gap measured against the earlier trace's 24.7 GB).
- lstm-lm: embedding, nn.LSTM 2 layers x 1024, a vocabulary head; batch 32 x 256 steps,
  bf16-mixed: cuDNN's fused RNN.
- segformer-b0: HF SegFormer-B0 (its default config), 150 classes, 512 x 512, batch 8,
  bf16-mixed: logits upsampled bilinearly to the labels, cross-entropy over every pixel.

Each case: gobrrr's prediction for `--gpu` (step time, peak allocated and reserved), then on
`--device` the step as gobrrr's TrainStep runs it (the loss not kept), the median step time
over `--steps` (CUDA events) and the allocator's peaks. One JSON line per case, and `--out`.

    PYTHONPATH=src python benchmarks/zoo/far_off.py --out far_off_h100.json
    PYTHONPATH=src python benchmarks/zoo/far_off.py --device cpu --tiny   # a dry run
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from torch import nn

import gobrrr
from gobrrr.profile.runner import prepare
from gobrrr.profile.timing import time_steps
from gobrrr.training.step import TrainStep


class _Loss(nn.Module):
    """An HF model's own loss, as a scalar: forward(*batch) -> loss."""

    def __init__(self, model: nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, x, labels):
        return self.model(x, labels=labels).loss


class LstmLM(nn.Module):
    def __init__(self, vocab: int, width: int, layers: int) -> None:
        super().__init__()
        self.emb = nn.Embedding(vocab, width)
        self.rnn = nn.LSTM(width, width, num_layers=layers, batch_first=True)
        self.head = nn.Linear(width, vocab)

    def forward(self, x, labels):
        y = self.head(self.rnn(self.emb(x))[0])
        return nn.functional.cross_entropy(y.flatten(0, 1), labels.flatten())


def qwen2(tiny: bool) -> gobrrr.Workload:
    from transformers import Qwen2Config, Qwen2ForCausalLM

    size = (
        dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=512)
        if tiny
        else dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24)
    )
    cfg = Qwen2Config(
        num_attention_heads=14 if not tiny else 4,
        num_key_value_heads=2,
        tie_word_embeddings=True,
        attn_implementation="sdpa",
        **size,
    )
    b, s = (1, 32) if tiny else (4, 1024)
    x = torch.randint(0, cfg.vocab_size, (b, s))
    return gobrrr.Workload(model=_Loss(Qwen2ForCausalLM(cfg)), batch=(x, x.clone()), loss=None)


def lstm_lm(tiny: bool) -> gobrrr.Workload:
    vocab, width, b, s = (256, 64, 2, 16) if tiny else (32000, 1024, 32, 256)
    x = torch.randint(0, vocab, (b, s))
    return gobrrr.Workload(model=LstmLM(vocab, width, 2), batch=(x, x.clone()), loss=None)


def segformer(tiny: bool) -> gobrrr.Workload:
    from transformers import SegformerConfig, SegformerForSemanticSegmentation

    cfg = SegformerConfig(num_labels=150)  # the default config is B0
    b, side = (1, 64) if tiny else (8, 512)
    x = torch.randn(b, 3, side, side)
    y = torch.randint(0, 150, (b, side, side))
    model = _Loss(SegformerForSemanticSegmentation(cfg))
    return gobrrr.Workload(model=model, batch=(x, y), loss=None)


CASES = {
    "qwen2-0.5b": (qwen2, "fp32"),
    "lstm-lm": (lstm_lm, "bf16-mixed"),
    "segformer-b0": (segformer, "bf16-mixed"),
}


def predict(build, precision: str, gpu: str, tiny: bool) -> dict:
    est = gobrrr.estimate(lambda: build(tiny), gpu, precision=precision)
    return {
        "step_s": est.time.step_s,
        "peak_allocated": est.memory.peak,
        "peak_reserved": est.memory.reserved,
        "sdpa_backends": dict(est.graph.meta.sdpa_backends or {}),
    }


def measure(build, precision: str, device: str, tiny: bool, warmup: int, steps: int) -> dict:
    torch.manual_seed(0)
    wl, opt, scaler = prepare(build(tiny), device, precision)
    dev = device.split(":")[0]
    step = TrainStep(wl, opt, precision, device_type=dev, scaler=scaler, keep_loss=False)
    for _ in range(warmup):
        step()
    out: dict = {}
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = time_steps(step, steps, dev)
    out["step_s"] = statistics.median(times)
    out["step_times"] = times
    if dev == "cuda":
        out["peak_allocated"] = torch.cuda.max_memory_allocated()
        out["peak_reserved"] = torch.cuda.max_memory_reserved()
    return out


def _ratio(pred: dict, meas: dict, key: str) -> float | None:
    return pred[key] / meas[key] - 1 if meas.get(key) else None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cuda")
    p.add_argument("--gpu", default="h100", help="the GPU the prediction is for")
    p.add_argument("--tiny", action="store_true", help="small shapes: a dry run on the CPU")
    p.add_argument("--cases", nargs="*", default=list(CASES))
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--out", type=Path)
    a = p.parse_args(argv)
    rows = []
    for name in a.cases:
        build, precision = CASES[name]
        t = time.perf_counter()
        row = {"case": name, "precision": precision, "tiny": a.tiny, "device": a.device}
        row["predicted"] = predict(build, precision, a.gpu, a.tiny)
        row["measured"] = measure(build, precision, a.device, a.tiny, a.warmup, a.steps)
        row["step_error"] = _ratio(row["predicted"], row["measured"], "step_s")
        row["allocated_error"] = _ratio(row["predicted"], row["measured"], "peak_allocated")
        row["seconds"] = time.perf_counter() - t
        print(json.dumps({k: v for k, v in row.items() if k != "measured"}), flush=True)
        rows.append(row)
    if a.out:
        a.out.write_text(json.dumps({"benchmark": "far_off", "rows": rows}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
