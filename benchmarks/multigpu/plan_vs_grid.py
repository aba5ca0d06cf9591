"""`gobrrr plan --gpus N` applied, against the grid a careful user tries by hand: DDP vs FSDP2 x
micro-batch x activation checkpointing, each configuration in a fresh torchrun job.

    python benchmarks/multigpu/plan_vs_grid.py --gpus 4 --out results.json
    python benchmarks/multigpu/plan_vs_grid.py --gpus 2 --device cpu --tiny --out /tmp/t.json

For each shape (default: Llama-3.2-1B and GPT-2 from `steps.py`'s SHAPES, seq 8192, global
batch 16 over the GPUs):
- grid: plain torch as `steps.py` runs it (DDP with bf16 autocast, or FSDP2 as torchtitan
  wraps it: every decoder layer then the root, MixedPrecisionPolicy(bf16, fp32), no
  autocast), the model's own `gradient_checkpointing_enable` for "full", accumulation to the
  rank's share of the global batch with the sync skipped but on the last micro-batch, AdamW;
  micro-batch 1, 2, 4 as they divide the rank's share, larger ones skipped once one runs out
  of memory (the user stops there);
- plan: the planner run here, on this process's CPU, for the same shape (a Workload of the HF
  model whose loss is its own shifted cross-entropy), then its best plan applied in the job
  with `gobrrr.apply` (or `--plan-json FILE`, a `gobrrr plan --json` output, to skip planning).
Each job warms up, then times a few steps between barriers; per rank the allocator's peaks.
The slowest rank's median step gives the job's tokens/s. Out of memory is recorded as OOM.
On the CPU (`--device cpu`, gloo) the loop and the bookkeeping run; no peaks, no meaning in
the times.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
ROOT = HERE.parents[2]
sys.path[:0] = [str(ROOT / "src"), str(HERE.parent)]

from steps import SHAPES, step_fn  # noqa: E402  (the measured shapes and loop, one place)

WARMUP, STEPS = 2, 3
TINY = dict(hidden_size=64, n_embd=64, num_hidden_layers=2, n_layer=2, vocab_size=256)
TINY_HEADS = dict(num_attention_heads=2, num_key_value_heads=2, n_head=2, intermediate_size=128)


def config(shape: str, tiny: bool, seq: int):
    """The transformers config of `shape` (shrunk with --tiny)."""
    import transformers

    cls, kw = SHAPES[shape]
    kw = dict(kw)
    if tiny:
        keys = set(kw) | {"num_attention_heads", "n_head"}
        kw.update({k: v for k, v in {**TINY, **TINY_HEADS}.items() if k in keys})
        if "n_positions" in kw or "max_position_embeddings" in kw:
            kw["n_positions" if "n_positions" in kw else "max_position_embeddings"] = seq
    cfg = getattr(transformers, cls)(**kw)
    cfg._attn_implementation = "sdpa"
    cfg.use_cache = False
    return cfg


def build(shape: str, device: str, tiny: bool, seq: int, checkpoint: bool = False):
    """(model, blocks) as `steps.build` makes them, on `device`: fp32 weights, seed 0."""
    import torch
    import transformers

    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config(shape, tiny, seq))
    if checkpoint:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    blocks = model.transformer.h if hasattr(model, "transformer") else model.model.layers
    return model, list(blocks)


# -- the grid, in plain torch -----------------------------------------------------------------
def wrap(model, blocks, parallel: str, device):
    import torch
    from torch.nn.parallel import DistributedDataParallel

    if parallel == "ddp":
        return DistributedDataParallel(
            model, device_ids=[device] if device.type == "cuda" else None
        )
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for block in blocks:
        fully_shard(block, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    return model


def grid_step(model, opt, case: dict, vocab: int, device):
    """One optimizer step of `steps.py`'s loop over the rank's share of the global batch."""
    return step_fn(model, opt, {**case, "batch": case["micro_batch"]}, vocab, device)


# -- the plan, through gobrrr ------------------------------------------------------------------
def workload(shape: str, tiny: bool, seq: int, batch_size: int, device: str = "cpu"):
    """The shape as a gobrrr Workload: the HF model's own shifted cross-entropy (labels =
    the tokens), AdamW as the grid's."""
    import torch

    from gobrrr.workload import Workload

    model, _ = build(shape, device, tiny, seq)
    tokens = torch.randint(0, model.config.vocab_size, (batch_size, seq), device=device)
    return Workload(
        model=model,
        batch={"input_ids": tokens, "labels": tokens},
        optimizer=lambda ps: torch.optim.AdamW(ps, lr=1e-4, foreach=True),
        name=shape,
    )


def planned(args, shape: str) -> dict:
    """The best plan's knobs (JSON form) for `shape`, planned on this CPU."""
    import gobrrr

    if args.plan_json:
        doc = json.loads(Path(args.plan_json).read_text())
        if "predicted" in doc.get("best", {}):  # written by --plan-only
            PREDICTED[shape] = doc["best"]["predicted"]
        return doc["best"]["knobs"]
    r = gobrrr.plan(
        lambda batch_size=1, seq_len=args.seq: workload(shape, args.tiny, seq_len, batch_size),
        gpu=args.gpu,
        gpus=args.gpus,
        global_batch=args.global_batch,
        seq=args.seq,
    )
    best = r.require_best()
    print(f"{shape}: plan chose {best.parallel}, {', '.join(best.changes) or 'as given'}")
    PREDICTED[shape] = {
        "tokens_per_s": best.units_per_s,
        "step_s": best.step_s,
        "peak_allocated": best.peak_bytes,
        "peak_reserved": best.reserved_bytes,
        "gpu": args.gpu,
    }
    return best.knobs.to_dict()


#: shape -> the chosen plan's predicted figures (filled by `planned`)
PREDICTED: dict[str, dict] = {}


# -- one job ------------------------------------------------------------------------------------
def run_one(case: dict) -> dict | None:
    import torch
    import torch.distributed as dist

    from gobrrr.training.distributed import process_group

    group = process_group(timeout_s=300)
    device, cuda = group.device, group.device.type == "cuda"
    per_rank = case["global_batch"] // group.world
    if case["kind"] == "plan":
        from gobrrr.plan.apply import apply
        from gobrrr.plan.knobs import Knobs

        knobs = Knobs.from_dict(case["knobs"])
        wl = workload(case["shape"], case["tiny"], case["seq"], per_rank, device.type)
        applied = apply(wl, knobs)

        def step():
            applied()
    else:
        model, blocks = build(case["shape"], device.type, case["tiny"], case["seq"], case["ckpt"])
        vocab = model.config.vocab_size
        model = wrap(model, blocks, case["parallel"], device)
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4, foreach=True)
        step = grid_step(model, opt, case, vocab, device)
    times = _timed(step, cuda, dist)
    rank = {
        "rank": group.rank,
        "median_s": statistics.median(times),
        "peak_allocated": torch.cuda.max_memory_allocated() if cuda else None,
        "peak_reserved": torch.cuda.max_memory_reserved() if cuda else None,
    }
    ranks = [None] * group.world
    dist.all_gather_object(ranks, rank)
    dist.barrier()
    dist.destroy_process_group()
    if not group.is_first:
        return None
    slow = max(r["median_s"] for r in ranks)
    tokens = case["global_batch"] * case["seq"]
    peaks = [r["peak_allocated"] for r in ranks if r["peak_allocated"] is not None]
    return {
        **case,
        "world": group.world,
        "step_s": slow,
        "tokens_per_s": tokens / slow,
        "tokens_per_s_per_gpu": tokens / slow / group.world,
        "peak_allocated": max(peaks) if peaks else None,
        "peak_reserved": max((r["peak_reserved"] for r in ranks if peaks), default=None),
        "ranks": ranks,
    }


def _timed(step, cuda: bool, dist) -> list[float]:
    import torch

    for _ in range(WARMUP):
        step()
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    times = []
    for _ in range(STEPS):
        dist.barrier()
        t = time.perf_counter()
        step()
        if cuda:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    return times


# -- the parent ---------------------------------------------------------------------------------
def grid(args, shape: str):
    """The hand grid's cases of `shape`, micro-batches smallest first per (parallel, ckpt)."""
    per_rank = args.global_batch // args.gpus
    for parallel in ("ddp", "fsdp"):
        for ckpt in (False, True):
            yield [
                dict(
                    kind="grid",
                    name=f"{shape}-{parallel}-mb{mb}" + ("-ckpt" if ckpt else ""),
                    parallel=parallel,
                    micro_batch=mb,
                    accumulation=per_rank // mb,
                    ckpt=ckpt,
                )
                for mb in (1, 2, 4)
                if per_rank % mb == 0
            ]


def launch(args, case: dict) -> dict:
    """`case` in a fresh torchrun job; its row, or the error (OOM flagged)."""
    part = Path(args.out).with_suffix(f".{case['name']}.part.json")
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc-per-node",
        str(args.gpus),
        "--master-port",
        str(args.port),
        str(HERE),
        "--one",
        json.dumps(case),
        "--out",
        str(part),
    ]
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT / "src"), str(ROOT)])}
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout, env=env)
        err, ok = proc.stderr, proc.returncode == 0 and part.exists()
    except subprocess.TimeoutExpired:
        err, ok = f"timed out after {args.timeout} s", False
    if ok:
        row = json.loads(part.read_text())
    else:
        oom = "OutOfMemoryError" in err or "out of memory" in err
        lines = [ln for ln in err.strip().splitlines() if "Error" in ln] or err.splitlines()
        row = {**case, "oom": oom, "error": "OOM" if oom else (lines or ["failed"])[-1][:500]}
    part.unlink(missing_ok=True)
    return row


def parent(args) -> int:
    out = Path(args.out)
    result = {"version": 1, "meta": environment(args), "shapes": {}}
    for shape in args.shapes:
        base = dict(shape=shape, seq=args.seq, global_batch=args.global_batch, tiny=args.tiny)
        rows: list[dict] = []
        knobs = planned(args, shape)
        plan = launch(args, {**base, "kind": "plan", "name": f"{shape}-plan", "knobs": knobs})
        if shape in PREDICTED:
            plan["predicted"] = PREDICTED[shape]
        _record(out, result, shape, rows, plan)
        for series in grid(args, shape):
            for case in series:
                _record(out, result, shape, rows, launch(args, {**base, **case}))
                if rows[-1].get("oom"):
                    break  # a larger micro-batch needs more memory still
    return 0


def _record(out: Path, result: dict, shape: str, rows: list[dict], row: dict) -> None:
    """`row` added to `shape`'s rows, said, and the result written: a run cut short keeps what
    it measured."""
    rows.append(row)
    _say(row)
    result["shapes"][shape] = {"rows": rows, "summary": summary(rows)}
    out.write_text(json.dumps(result, indent=1) + "\n")


def summary(rows: list[dict]) -> dict:
    ran = [r for r in rows if "tokens_per_s" in r]
    best = max(
        (r for r in ran if r["kind"] == "grid"), key=lambda r: r["tokens_per_s"], default=None
    )
    plan = next((r for r in rows if r["kind"] == "plan"), {})
    ok = "tokens_per_s" in plan
    return {
        "plan": plan.get("name"),
        "plan_oom": bool(plan.get("oom")),
        "plan_tokens_per_s": plan.get("tokens_per_s"),
        "best_grid": best["name"] if best else None,
        "best_grid_tokens_per_s": best["tokens_per_s"] if best else None,
        "plan_over_best_grid": plan["tokens_per_s"] / best["tokens_per_s"] if ok and best else None,
        "grid_oom": [r["name"] for r in rows if r.get("oom")],
    }


def _say(row: dict) -> None:
    if "tokens_per_s" in row:
        peak = row.get("peak_allocated")
        gib = f", {peak / 2**30:.2f} GiB/rank" if peak else ""
        print(f"{row['name']}: {row['tokens_per_s']:,.0f} tok/s{gib}", flush=True)
    else:
        print(f"{row['name']}: {row['error']}", flush=True)


def environment(args) -> dict:
    import torch

    return {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu (gloo)",
        "gpus": args.gpus,
        "torch": torch.__version__,
        "transformers": __import__("transformers").__version__,
        "warmup": WARMUP,
        "steps": STEPS,
        "tiny": args.tiny,
    }


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True)
    ap.add_argument("--gpus", type=int, default=4)
    ap.add_argument("--shapes", nargs="*", default=["llama3.2-1b", "gpt2"])
    ap.add_argument("--seq", type=int, default=8192)
    ap.add_argument("--global-batch", type=int, default=16)
    ap.add_argument("--gpu", default="h100", help="the GPU the plan is made for")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda")
    ap.add_argument("--tiny", action="store_true", help="shrunk shapes (for the CPU)")
    ap.add_argument("--plan-json", help="a `gobrrr plan --json` output to apply instead")
    ap.add_argument(
        "--plan-only",
        metavar="FILE",
        help="plan the first shape here and write its knobs and prediction to FILE (for "
        "--plan-json on the GPU machine), then stop",
    )
    ap.add_argument("--port", type=int, default=29511)
    ap.add_argument("--timeout", type=int, default=240)
    ap.add_argument("--one", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        row = run_one(json.loads(args.one))
        if row is not None:
            Path(args.out).write_text(json.dumps(row))
        return 0
    if args.plan_only:
        shape = args.shapes[0]
        knobs = planned(args, shape)
        doc = {"shape": shape, "best": {"knobs": knobs, "predicted": PREDICTED[shape]}}
        Path(args.plan_only).write_text(json.dumps(doc, indent=1) + "\n")
        return 0
    if args.device == "cpu":
        os.environ["CUDA_VISIBLE_DEVICES"] = ""  # gloo on the CPU in every rank
    return parent(args)


if __name__ == "__main__":
    sys.exit(main())
