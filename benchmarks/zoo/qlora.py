"""LoRA and QLoRA fine-tunes, predicted on the CPU and measured on one GPU.

    python benchmarks/zoo/qlora.py OUT.json [--gpu h100] [--cases NAME,NAME] [--batch 4]
        [--seq 2048]                        # on the GPU machine: every case, one process each
    python benchmarks/zoo/qlora.py /tmp/dry.json --dry-run    # tiny models on the CPU
    python benchmarks/zoo/qlora.py OUT.json --repredict RUN.json --gpu h200
        # RUN.json's measurements, predicted again on this CPU for another GPU (the one it ran on)

Cases: two decoder families (Llama-3.2-1B's and Qwen2-0.5B's shapes, from transformers
configs, random weights, nothing downloaded) x a bf16 base model (LoRA) or an NF4 one (QLoRA:
double quantization, bf16 compute) x gradient checkpointing off or on; LoRA rank 16 on every
linear layer of the decoder, AdamW, bf16 autocast, loss read off the model's output.

Measured as users build it: the random model saved once as a checkpoint, loaded with
`from_pretrained` (with `BitsAndBytesConfig` for QLoRA, which quantizes on load), put in train
mode (`from_pretrained` returns it in eval mode, where HF skips checkpointing), then peft's
`prepare_model_for_kbit_training` (QLoRA) or `gradient_checkpointing_enable` +
`enable_input_require_grads` (LoRA with checkpointing), `get_peft_model`; 3 warm-up steps,
peaks reset, 10 timed steps (CUDA events, median), `max_memory_allocated` and
`max_memory_reserved` over them, gobrrr's own step (which drops the model's output before
backward, as HF's Trainer does). Predicted: the same workload function under `gobrrr.estimate`
for that loop (`loop="drops-output"`),
the model built in memory (`gobrrr.training.qlora.load_in_4bit` in place of the checkpoint).
Each case runs in a fresh process (`--one NAME`); OUT.json is rewritten after every case.

The GPU machine has no network: bitsandbytes, peft and what peft needs beyond transformers
(accelerate, psutil) come as wheels, downloaded beside the repository with
    pip download bitsandbytes==0.50.2 peft==0.21.2 accelerate==1.15.0 --no-deps -d .whl
    pip download psutil==7.2.2 --no-deps --only-binary=:all: --platform manylinux2014_x86_64 \
        --python-version 311 -d .whl
(bitsandbytes-0.50.2-py3-none-manylinux_2_24_x86_64.whl carries CUDA 11.8 to 13.2 kernels) and
installed there with `pip install --no-deps` on those four files. Eight cases, each a CPU trace
(under a minute) and a measured step: a few minutes in all; `--cases` splits the run.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2])]

import torch  # noqa: E402

VERSION = 1
RANK = 16
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
FAMILIES = {  # transformers config class, its shape
    "llama-3.2-1b": (
        "LlamaConfig",
        dict(
            vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
            num_attention_heads=32, num_key_value_heads=8, rope_theta=500000.0,
            tie_word_embeddings=True, max_position_embeddings=131072,
        ),
    ),
    "qwen2-0.5b": (
        "Qwen2Config",
        dict(
            vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
            num_attention_heads=14, num_key_value_heads=2, rope_theta=1000000.0,
            tie_word_embeddings=True, max_position_embeddings=32768,
        ),
    ),
}  # fmt: skip
TINY = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, vocab_size=256)
CASES = [
    f"{family}-{quant}{'-gc' if gc else ''}"
    for family in FAMILIES
    for quant in ("lora", "qlora")
    for gc in (False, True)
]


def parse_case(name: str) -> tuple[str, bool, bool]:
    """ "llama-3.2-1b-qlora-gc" -> (family, 4-bit, checkpointing)."""
    gc = name.endswith("-gc")
    stem = name.removesuffix("-gc")
    family, _, quant = stem.rpartition("-")
    if family not in FAMILIES or quant not in ("lora", "qlora"):
        raise SystemExit(f"unknown case {name!r}: choose from {', '.join(CASES)}")
    return family, quant == "qlora", gc


def config(family: str, tiny: bool):
    import transformers

    cls, shape = FAMILIES[family]
    shape = dict(shape, **TINY) if tiny else shape
    if tiny:
        shape["num_attention_heads"], shape["num_key_value_heads"] = 4, 2
    return getattr(transformers, cls)(**shape)


def bnb_config():
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def base_in_memory(family: str, four_bit: bool, tiny: bool):
    """The base model built from its config (gobrrr's trace: no checkpoint to load)."""
    from transformers import AutoModelForCausalLM

    from gobrrr.training.qlora import load_in_4bit

    model = AutoModelForCausalLM.from_config(config(family, tiny)).to(torch.bfloat16)
    return load_in_4bit(model, bnb_config()) if four_bit else model


def base_from_checkpoint(family: str, four_bit: bool, tiny: bool, folder: Path, device: str):
    """The base model as users load it: from a checkpoint (random weights, saved once)."""
    from transformers import AutoModelForCausalLM

    path = folder / (family + ("-tiny" if tiny else ""))
    if not (path / "config.json").exists():
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(config(family, tiny)).to(torch.bfloat16).save_pretrained(
            path
        )
    extra = {"quantization_config": bnb_config()} if four_bit else {}
    place = torch.device("cuda", torch.cuda.current_device()) if device == "cuda" else device
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.bfloat16, device_map={"": place}, **extra
    )
    # from_pretrained hands the model back in eval mode, where HF's layers skip gradient
    # checkpointing; a fine-tune (and HF's Trainer) trains it in train mode
    return model.train()


def adapt(model, four_bit: bool, gc: bool):
    """peft's recipe: k-bit preparation (QLoRA) or checkpointing by hand (LoRA), then LoRA."""
    from peft import LoraConfig, get_peft_model, prepare_model_for_kbit_training

    kwargs = {"use_reentrant": False}
    if four_bit:
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gc, gradient_checkpointing_kwargs=kwargs
        )
    elif gc:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
        model.enable_input_require_grads()
    lora = LoraConfig(r=RANK, lora_alpha=2 * RANK, target_modules=TARGETS, task_type="CAUSAL_LM")
    return get_peft_model(model, lora)


def workload(model, vocab: int, batch: int, seq: int, device: str = "cpu"):
    from gobrrr import Workload

    ids = torch.randint(0, vocab, (batch, seq), device=device)
    return Workload(
        model,
        {"input_ids": ids, "labels": ids},
        loss=lambda out, b: out.loss,
        optimizer=lambda params: torch.optim.AdamW(params, lr=1e-4),
        seq_len=seq,
    )


def predict(name: str, args) -> dict:
    """gobrrr's estimate of the case on `args.gpu`, traced on the CPU."""
    import gobrrr

    family, four_bit, gc = parse_case(name)
    vocab = config(family, args.dry_run).vocab_size

    def build():
        return workload(adapt(base_in_memory(family, four_bit, args.dry_run), four_bit, gc),
                        vocab, args.batch, args.seq)  # fmt: skip

    t = time.perf_counter()
    # measured with gobrrr's own step, which drops the model's output before backward (as HF's
    # Trainer does): predicted for that loop
    est = gobrrr.estimate(build, gpu=args.gpu, precision="bf16-mixed", loop="drops-output")
    split = est.trainable
    return {
        "peak_allocated": est.memory.peak,
        "peak_reserved": est.memory.reserved,
        "step_s": est.time.step_s,
        "trainable": split.to_dict(),
        "dequantize_ops": sum("dequantize_4bit" in n.op for n in est.graph.nodes),
        "wall_s": time.perf_counter() - t,
    }


def measure(name: str, args) -> dict:
    """The case on `args.device`: 3 warm-up steps, then 10 timed (median), peaks over them."""
    from gobrrr.profile.runner import prepare, run_step
    from gobrrr.profile.timing import time_steps

    family, four_bit, gc = parse_case(name)
    device = args.device
    torch.manual_seed(0)
    model = base_from_checkpoint(family, four_bit, args.dry_run, Path(args.checkpoints), device)
    wl = workload(adapt(model, four_bit, gc), model.config.vocab_size, args.batch, args.seq, device)
    wl, opt, scaler = prepare(wl, device, "bf16-mixed")
    step = lambda: run_step(wl, opt, "bf16-mixed", scaler, device.split(":")[0])  # noqa: E731
    for _ in range(args.warmup):
        step()
    cuda = device.startswith("cuda")
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    times = time_steps(step, args.steps, device)
    return {
        "step_s": statistics.median(times),
        "step_times": times,
        "allocated_before": before,
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else 0,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else 0,
    }


def run_one(name: str, args) -> dict:
    """One case: prediction and measurement, each failure recorded, never fatal."""
    row: dict = {"name": name, "batch": args.batch, "seq": args.seq}
    for part, fn in (("predicted", predict), ("measured", measure)):
        try:
            row[part] = fn(name, args)
        except Exception as e:
            row[f"{part}_error"] = {
                "type": type(e).__name__,
                "message": str(e)[:2000],
                "oom": "out of memory" in str(e),
                "traceback": traceback.format_exc().splitlines()[-12:],
            }
    _set_errors(row)
    return row


def _set_errors(row: dict) -> None:
    """predicted / measured - 1 of the peaks and the step, in %, where both are there."""
    p, m = row.get("predicted"), row.get("measured")
    if p and m and m["peak_allocated"]:
        keys = ("peak_allocated", "peak_reserved", "step_s")
        row["error_pct"] = {k: 100.0 * (p[k] - m[k]) / m[k] for k in keys}


def run_all(args) -> None:
    """Every case in a child process of its own; OUT.json rewritten after each."""
    names = args.cases.split(",") if args.cases else CASES
    doc = {"version": VERSION, "gpu": args.gpu, "device": args.device, "environment": env(args)}
    doc["cases"] = []
    for name in names:
        parse_case(name)
        cmd = [sys.executable, str(HERE), args.out, "--one", name, *child_args(args)]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        try:
            row = json.loads(done.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            row = {"name": name, "child_error": done.stderr[-3000:], "returncode": done.returncode}
        doc["cases"].append(row)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(summary(row), flush=True)


def repredict(args) -> None:
    """RUN.json's measured cases with their predictions made again for `args.gpu`."""
    doc = json.loads(Path(args.repredict).read_text())
    doc.update(gpu=args.gpu, repredicted_from=str(args.repredict))
    for row in doc["cases"]:
        args.batch, args.seq = row["batch"], row["seq"]
        row["predicted"] = predict(row["name"], args)
        _set_errors(row)
        Path(args.out).write_text(json.dumps(doc, indent=1) + "\n")
        print(summary(row), flush=True)


def child_args(args) -> list[str]:
    out = ["--gpu", args.gpu, "--device", args.device, "--checkpoints", args.checkpoints]
    out += ["--batch", str(args.batch), "--seq", str(args.seq)]
    out += ["--warmup", str(args.warmup), "--steps", str(args.steps)]
    return out + (["--dry-run"] if args.dry_run else [])


def env(args) -> dict:
    import importlib.metadata as md

    versions = {}
    for lib in ("torch", "transformers", "peft", "bitsandbytes", "accelerate"):
        try:
            versions[lib] = md.version(lib)
        except md.PackageNotFoundError:
            versions[lib] = None
    cuda = args.device.startswith("cuda") and torch.cuda.is_available()
    return {"versions": versions, "device_name": torch.cuda.get_device_name() if cuda else "cpu"}


def summary(row: dict) -> str:
    bad = [k for k in row if k.endswith("error")]
    if bad:
        return f"{row['name']:28s} failed: {', '.join(bad)}"
    err = row.get("error_pct")
    if err is None:  # on the CPU: no allocator peaks to hold the prediction against
        return f"{row['name']:28s} predicted and measured (no CUDA peaks)"
    return f"{row['name']:28s} " + "  ".join(f"{k} {v:+.1f}%" for k, v in err.items())


def parse(argv=None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("out", help="the results JSON, rewritten after every case")
    ap.add_argument("--cases", help=f"comma-separated, of: {', '.join(CASES)}")
    ap.add_argument("--gpu", default="h100", help="the GPU gobrrr predicts for")
    ap.add_argument("--device", default="cuda", help="where the measurement runs")
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--timeout", type=int, default=900, help="seconds per case")
    ap.add_argument("--checkpoints", default=str(Path(tempfile.gettempdir()) / "gobrrr_qlora"))
    ap.add_argument(
        "--dry-run",
        action="store_true",
        help="tiny models (2 layers, hidden 64) on the CPU, 1 warm-up and 2 steps: the logic",
    )
    ap.add_argument(
        "--repredict",
        metavar="RUN.json",
        help="predict RUN.json's cases again for --gpu, keep its measurements, write OUT.json",
    )
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.dry_run:
        args.device, args.batch, args.seq, args.warmup, args.steps = "cpu", 2, 64, 1, 2
    return args


def main(argv=None) -> int:
    args = parse(argv)
    if args.one:
        print(json.dumps(run_one(args.one, args)))
        return 0
    if args.repredict:
        repredict(args)
        return 0
    run_all(args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
