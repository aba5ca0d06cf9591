"""Multi-GPU training steps measured as users run them: DDP or FSDP2 (`fully_shard`) on Hugging
Face decoder shapes, one torchrun job per case, every rank's peaks, the step time and the
communication a profiled step leaves exposed.

    python benchmarks/multigpu/steps.py --out results.json --gpus 4 [--cases NAME ...]
    torchrun --nproc-per-node 4 benchmarks/multigpu/steps.py --one NAME --out part.json

The parent runs each case in a fresh torchrun job (a process that ran other work first carries
its leftovers into the peak) and gathers the parts. A case:
- builds the model from its `transformers` config with random weights (nothing downloaded) on
  the GPU, then wraps it: DDP (autocast bf16 over fp32 weights, gradients all-reduced in
  buckets during backward) or FSDP2 as torchtitan does (every decoder layer a unit, then the
  root; `MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)`, no autocast;
  `reshard_after_forward` as the case says); activation checkpointing through the model's own
  `gradient_checkpointing_enable` (non-reentrant), as a user of the library turns it on;
- runs torchtitan's loop: logits, cross-entropy against the shifted tokens, the logits dropped
  before `backward`; AdamW (lr 1e-4, foreach); with accumulation, the gradient sync skipped on
  every micro-batch but the last (`no_sync` / `set_requires_gradient_sync(False)`);
- warms up 3 steps, resets the peak stats (after `empty_cache`, so the model's unsharded build
  is not in the reserved figure), times 10 steps with CUDA events between barriers, then
  profiles one more step: NCCL kernels against every other kernel on each rank, their union's
  length (communication busy) and the part of it no other kernel overlaps (exposed); each NCCL
  kernel split where the last rank enters that collective (the ranks swap their kernels'
  starts): waiting for other ranks before, transfer after (`comm_wait_s`,
  `comm_transfer_busy_s`, `comm_transfer_exposed_s`; `gobrrr.profile.comm`).
Per rank: `max_memory_allocated`, `max_memory_reserved`, step times; the job's figures are the
max over ranks (memory, communication) and the slowest rank's median (time).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

WARMUP, STEPS = 3, 10

#: name -> (config class, config kwargs) of the model shapes, from their published configs
SHAPES = {
    "gpt2": (
        "GPT2Config",
        dict(
            n_embd=768,
            n_layer=12,
            n_head=12,
            vocab_size=50257,
            n_positions=8192,
            attn_pdrop=0.0,
            embd_pdrop=0.0,
            resid_pdrop=0.0,
        ),
    ),
    "llama3.2-1b": (
        "LlamaConfig",
        dict(
            hidden_size=2048,
            num_hidden_layers=16,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=128256,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            max_position_embeddings=8192,
        ),
    ),
    "llama3.2-3b": (
        "LlamaConfig",
        dict(
            hidden_size=3072,
            num_hidden_layers=28,
            num_attention_heads=24,
            num_key_value_heads=8,
            intermediate_size=8192,
            vocab_size=128256,
            tie_word_embeddings=True,
            rope_theta=500000.0,
            max_position_embeddings=8192,
        ),
    ),
    "qwen2-1.5b": (
        "Qwen2Config",
        dict(
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            vocab_size=151936,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
}

#: name -> dict(shape, parallel, batch (per rank, per micro-batch), seq, accumulation,
#: checkpoint, reshard (FSDP2's reshard_after_forward))
CASES = {}


def _case(shape, parallel, batch=1, seq=8192, accumulation=1, checkpoint=False, reshard=True):
    name = (
        f"{shape}-{parallel}-b{batch}-s{seq}"
        + (f"-acc{accumulation}" if accumulation > 1 else "")
        + ("-ckpt" if checkpoint else "")
        + ("-noreshard" if parallel == "fsdp" and not reshard else "")
    )
    CASES[name] = dict(
        shape=shape,
        parallel=parallel,
        batch=batch,
        seq=seq,
        accumulation=accumulation,
        checkpoint=checkpoint,
        reshard=reshard,
    )


_case("gpt2", "ddp", batch=2)
_case("gpt2", "fsdp", batch=2)
_case("gpt2", "ddp", batch=2, accumulation=2)
_case("llama3.2-1b", "ddp")
_case("llama3.2-1b", "fsdp")
_case("llama3.2-1b", "fsdp", reshard=False)
_case("llama3.2-1b", "fsdp", checkpoint=True)
_case("llama3.2-1b", "ddp", accumulation=2, checkpoint=True)
_case("qwen2-1.5b", "ddp", checkpoint=True)
_case("qwen2-1.5b", "fsdp")
_case("qwen2-1.5b", "fsdp", accumulation=2)
_case("llama3.2-3b", "fsdp", checkpoint=True)
_case("llama3.2-3b", "fsdp", checkpoint=True, reshard=False)
_case("llama3.2-3b", "fsdp", batch=2, checkpoint=True)


# -- inside the torchrun job ------------------------------------------------------------------
def build(case: dict):
    """(model, blocks) of the case on this rank's GPU, fp32 weights, random init."""
    import torch
    import transformers

    cls, kw = SHAPES[case["shape"]]
    config = getattr(transformers, cls)(**kw)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    if case["checkpoint"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return model, list(blocks)


def wrap(model, blocks, case: dict):
    """The model under DDP or FSDP2, as the case says."""
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if case["parallel"] == "ddp":
        return DistributedDataParallel(model, device_ids=[torch.cuda.current_device()])
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=mp, reshard_after_forward=case["reshard"])
    fully_shard(model, mp_policy=mp, reshard_after_forward=case["reshard"])
    return model


def step_fn(model, opt, case: dict, vocab: int, device="cuda", marks: list | None = None):
    """One optimizer step (all its micro-batches of case["batch"] sequences) of torchtitan's
    loop on `device`. `marks`: where given, the host's clock (perf_counter) is appended after
    each micro-batch's forward and loss ("forward"), its backward ("backward") and the
    optimizer step and zero_grad ("optimizer"), for `host_phases`."""
    import torch
    import torch.nn.functional as F

    n, ddp = case["accumulation"], case["parallel"] == "ddp"
    device = torch.device(device)
    tokens = torch.randint(0, vocab, (n, case["batch"], case["seq"] + 1), device=device)

    def sync(last: bool):
        if ddp:
            return contextlib.nullcontext() if last else model.no_sync()
        model.set_requires_gradient_sync(last)
        return contextlib.nullcontext()

    def step():
        for i in range(n):
            x, y = tokens[i, :, :-1], tokens[i, :, 1:]
            with sync(i == n - 1):
                cast = torch.autocast(device.type, torch.bfloat16) if ddp else None
                with cast or contextlib.nullcontext():
                    logits = model(input_ids=x).logits
                    loss = F.cross_entropy(logits.flatten(0, 1).float(), y.flatten()) / n
                del logits
                mark("forward")
                loss.backward()
                mark("backward")
        opt.step()
        opt.zero_grad(set_to_none=True)
        mark("optimizer")

    def mark(what: str) -> None:
        if marks is not None:
            marks.append((what, time.perf_counter()))

    return step


def host_phases(step, marks: list, steps: int = 5) -> dict:
    """The host's issue time of the step, per phase, against the step's device time: each of
    `steps` steps starts after a barrier with the GPU idle (every rank at once); the host's
    seconds from the step's start to each mark (forward, backward, optimizer, summed over
    micro-batches), to the step's return (`issue_s`) and the CUDA events' step (`step_s`),
    medians over the steps. A host that issues the step in about its device time sets the
    pace; one far under it runs ahead of the GPU."""
    import torch
    import torch.distributed as dist

    rows = []
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        marks.clear()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        t0 = time.perf_counter()
        a.record()
        step()
        issue = time.perf_counter() - t0
        b.record()
        b.synchronize()
        row = {"issue_s": issue, "step_s": a.elapsed_time(b) / 1e3}
        last = t0
        for what, t in marks:
            row[what] = row.get(what, 0.0) + (t - last)
            last = t
        rows.append(row)
    return {k: statistics.median(r[k] for r in rows) for k in rows[0]}


def _load_comm():
    """`gobrrr.profile.comm` (the interval arithmetic `gobrrr profile --parallel` shares),
    loaded from its file: the rest of gobrrr need not import on the GPU machine."""
    path = Path(__file__).resolve().parents[2] / "src" / "gobrrr" / "profile" / "comm.py"
    spec = importlib.util.spec_from_file_location("gobrrr_profile_comm", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


comm = _load_comm()


def communication(step, exchange) -> dict:
    """One profiled step: NCCL kernels' busy time, the part of it no other kernel overlaps,
    the compute kernels' busy time and the kernels' span (seconds), and the same per
    collective, the NCCL kernels split into waiting for other ranks and transfer against every
    rank's (`exchange`: this rank's starts -> every rank's, an all-gather;
    `gobrrr.profile.comm.rank_communication`)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        step()
        torch.cuda.synchronize()
    kernels = [
        (ev.name, ev.time_range.start / 1e6, ev.time_range.end / 1e6)
        for ev in prof.events()
        if ev.device_type == torch.autograd.DeviceType.CUDA
    ]
    # the events count from this rank's trace start; the ranks' clocks are the host's
    clock_ns = prof.profiler.kineto_results.trace_start_ns()
    return comm.rank_communication(kernels, exchange, clock_ns)


def all_gather(payload) -> list:
    """Every rank's `payload`, in rank order, on every rank."""
    import torch.distributed as dist

    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, payload)
    return out


def job(ranks: list[dict], tokens: int) -> dict:
    """A case's measured figures from every rank's: the slowest rank's median step, the max
    over ranks of memory and communication (waiting for other ranks and the exposed transfer
    None where the ranks' NCCL kernels were not matched; `comm_split` says why)."""
    slow = max(ranks, key=lambda r: r["median_s"])
    out = {
        "step_s": slow["median_s"],
        "tokens_per_s": tokens / slow["median_s"],
        "tokens_per_s_per_gpu": tokens / slow["median_s"] / len(ranks),
        "peak_allocated": max(r["peak_allocated"] for r in ranks),
        "peak_reserved": max(r["peak_reserved"] for r in ranks),
        "comm_exposed_s": max(r["comm_exposed_s"] for r in ranks),
        "comm_busy_s": max(r["comm_busy_s"] for r in ranks),
        "comm_split": ranks[0].get("comm_split"),
    }
    for key in ("comm_wait_s", "comm_transfer_exposed_s"):
        xs = [r.get(key) for r in ranks]
        out[key] = None if None in xs else max(xs)
    return out


def run_one(name: str) -> dict | None:
    import torch
    import torch.distributed as dist

    case = CASES[name]
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    dist.init_process_group(
        "nccl", device_id=torch.device("cuda", local), timeout=datetime.timedelta(seconds=300)
    )
    model, blocks = build(case)
    vocab = model.config.vocab_size
    params = sum(p.numel() for p in model.parameters())
    model = wrap(model, blocks, case)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
    step = step_fn(model, opt, case, vocab)
    for _ in range(WARMUP):
        step()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(STEPS):
        dist.barrier()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        step()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b) / 1e3)
    peaks = torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved()
    marks: list = []
    host = host_phases(step_fn(model, opt, case, vocab, marks=marks), marks)
    rank = {
        "rank": dist.get_rank(),
        "host": host,
        "step_s": times,
        "median_s": statistics.median(times),
        "peak_allocated": peaks[0],
        "peak_reserved": peaks[1],
        **communication(step, all_gather),
    }
    ranks = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rank)
    dist.destroy_process_group()
    if rank["rank"] != 0:
        return None
    tokens = case["batch"] * case["seq"] * case["accumulation"] * len(ranks)
    return {
        "name": name,
        **case,
        "world": len(ranks),
        "params": params,
        "loop": "torchtitan: logits dropped before backward",
        "precision": "bf16-mixed (DDP: autocast; FSDP2: param bf16, reduce fp32)",
        "optimizer": "AdamW foreach",
        "measured": job(ranks, tokens),
        "ranks": ranks,
    }


def environment() -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "driver": _smi("driver_version"),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "nccl": ".".join(map(str, torch.cuda.nccl.version())),
        "transformers": __import__("transformers").__version__,
        "memory_bytes": torch.cuda.get_device_properties(0).total_memory,
        "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"),
    }


def _smi(field: str) -> str | None:
    try:
        out = subprocess.run(
            ["nvidia-smi", f"--query-gpu={field}", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        return out.stdout.splitlines()[0].strip()
    except (OSError, IndexError, subprocess.SubprocessError):
        return None


def parent(args) -> int:
    names = args.cases or list(CASES)
    if bad := [n for n in names if n not in CASES]:
        print(
            f"error: unknown case(s) {', '.join(bad)}; choose from {', '.join(CASES)}",
            file=sys.stderr,
        )
        return 2
    out = Path(args.out)
    result = json.loads(out.read_text()) if out.exists() else {"version": 1, "cases": {}}
    result["meta"] = environment()
    for name in names:
        part = out.with_name(out.stem + f".{name}.part.json")
        t = time.perf_counter()
        cmd = [
            "torchrun",
            "--nproc-per-node",
            str(args.gpus),
            __file__,
            "--one",
            name,
            "--out",
            str(part),
        ]
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        row = (
            json.loads(part.read_text())
            if proc.returncode == 0 and part.exists()
            else {
                "name": name,
                **CASES[name],
                "world": args.gpus,
                "error": (proc.stderr.strip().splitlines() or ["failed"])[-1][:500],
                "oom": "OutOfMemoryError" in proc.stderr,
            }
        )
        part.unlink(missing_ok=True)
        result["cases"][f"{name}@{args.gpus}"] = row
        out.write_text(json.dumps(result, indent=1))
        m = row.get("measured", {})
        print(
            f"{name} x{args.gpus}: "
            + (
                f"{m['step_s'] * 1e3:.1f} ms, "
                f"{m['peak_allocated'] / 2**30:.2f} / {m['peak_reserved'] / 2**30:.2f} GiB, "
                f"comm exposed {m['comm_exposed_s'] * 1e3:.2f} of {m['comm_busy_s'] * 1e3:.2f} ms"
                + _split_line(m)
                if m
                else f"FAILED {row['error']}"
            )
            + f"  ({time.perf_counter() - t:.0f} s)",
            flush=True,
        )
    return 0


def _split_line(m: dict) -> str:
    """The progress line's split (max over ranks), or nothing where not split."""
    if m.get("comm_transfer_exposed_s") is None:
        return ""
    return (
        f" (transfer exposed {m['comm_transfer_exposed_s'] * 1e3:.2f} ms, waiting for other "
        f"ranks {m['comm_wait_s'] * 1e3:.2f} ms)"
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--cases", nargs="*")
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--timeout", type=int, default=300)
    args = ap.parse_args()
    if args.one:
        row = run_one(args.one)
        if row is not None:
            Path(args.out).write_text(json.dumps(row))
        return 0
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
