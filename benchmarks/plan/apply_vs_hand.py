"""`gobrrr.apply`'s step against the same configuration written by hand, on a real GPU.

    PYTHONUNBUFFERED=1 python benchmarks/plan/apply_vs_hand.py OUT.json [--cases NAME,NAME]


For each case (a zoo workload x a knob: plain micro-batch x accumulation, every block
checkpointed, torch.compile), in a fresh process: two copies of the model (the same seed),
one changed by `gobrrr.apply`, the other by hand as a user writes it (torch.utils.checkpoint
around each repeated block's forward, torch.compile(model)), each with its own optimizer
(the workload's), each batch on the device. The hand loop:

    for x in micro_batches:                       # the batch's dim 0 split evenly
        with torch.autocast("cuda", torch.bfloat16):
            loss = <the workload's loss>(model, x) / accumulation
        loss.backward()
    opt.step(); opt.zero_grad(set_to_none=True)

After two warm-up steps of each, ten rounds alternate one timed step of each (CUDA
events), so both see the same clocks and the same allocator history; the figure is the
median of each and applied / hand - 1. OUT.json is rewritten after every case.
`APPLY_VS_HAND_DRY=1` runs every case on the CPU at tiny sizes (the logic, not the figures);
`APPLY_VS_HAND_ROUNDS=N` times N rounds in place of ten; `APPLY_VS_HAND_SWAP=1` applies the
plan to the deep copy and runs the hand loop on the original model (which of the two models
came first in memory, held apart from which of the two steps runs it).
"""

from __future__ import annotations

import copy
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parents[1])]

from child_rows import cases_main  # noqa: E402

VERSION = 1

#: name -> (zoo case, micro-batch, accumulation, knob)
CASES = {
    f"{case}/{knob}": (case, mb, acc, knob)
    for case, mb, acc in (
        ("gpt2-124m", 8, 2),
        ("llama3.2-1b", 2, 2),
        ("vit_b_16-tv", 64, 2),
        ("resnet50-tv-cl", 128, 2),
    )
    for knob in ("plain", "checkpoint", "compile")
}


def _hand_loss(w):
    """The workload's loss written as a hand loop computes it."""
    if w.step is not None:
        return w.step
    if w.loss is not None:
        return lambda m, b: w.loss(m(**b) if isinstance(b, dict) else m(*b), b)
    return lambda m, b: (m(**b) if isinstance(b, dict) else m(*b)).loss


def _checkpoint_by_hand(model) -> None:
    """Every repeated block checkpointed as a user writes it: a Hugging Face model through its
    own `gradient_checkpointing_enable` (non-reentrant), which also stops the layers writing a
    KV cache (a checkpointed layer that writes one writes it again as it recomputes, and
    attends over both copies: measured 3-9% slower on gpt2 and Llama); any other model with
    torch.utils.checkpoint around each repeated block's forward, non-reentrant."""
    import torch.utils.checkpoint as cp

    from gobrrr.training.checkpointing import repeated_blocks

    if getattr(model, "supports_gradient_checkpointing", False):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        return
    for block in repeated_blocks(model):
        forward = block.forward
        block.forward = lambda *a, _f=forward, **k: cp.checkpoint(_f, *a, use_reentrant=False, **k)


DRY = os.environ.get("APPLY_VS_HAND_DRY") == "1"


def one(name: str, rounds: int | None = None) -> dict:
    import torch

    from gobrrr.plan.apply import apply
    from gobrrr.plan.knobs import Knobs, every_kth
    from gobrrr.profile.timing import time_steps
    from gobrrr.training.checkpointing import block_names
    from gobrrr.training.step import split_batch
    from gobrrr.workload import map_tensors
    from zoo.cases import get_case

    rounds = rounds or int(os.environ.get("APPLY_VS_HAND_ROUNDS", "10"))
    swap = os.environ.get("APPLY_VS_HAND_SWAP") == "1"
    case_name, mb, acc, knob = CASES[name]
    case = get_case(case_name)
    device, seq = ("cpu", case.seq and 32) if DRY else ("cuda", case.seq)
    if DRY:
        mb, rounds = 2, 2
    torch.manual_seed(0)
    w = case.build(mb * acc, seq)
    if getattr(getattr(w.model, "config", None), "use_cache", False):
        # Both copies train without a KV cache, as Hugging Face's gradient checkpointing sets
        # it: with the cache on (apply keeps the model's setting) and off (HF's recipe) the two
        # steps run different ops, and without a cache transformers' mask code syncs the host
        # once a forward (find_packed_sequence_indices' .all())
        w.model.config.use_cache = False
    w.model.to(device)
    w.batch = map_tensors(w.batch, lambda t: t.to(device))
    hand_model = copy.deepcopy(w.model)
    if swap:  # the plan applied to the copy, the hand loop on the original
        w.model, hand_model = hand_model, w.model
    blocks = block_names(w.model)
    knobs = Knobs(
        micro_batch=mb,
        accumulation=acc,
        checkpoint=every_kth(blocks, 1) if knob == "checkpoint" else (),
        compile=knob == "compile",
    )
    step = apply(w, knobs, case.precision)
    if knob == "checkpoint":
        _checkpoint_by_hand(hand_model)
    runner = torch.compile(hand_model) if knob == "compile" else hand_model
    mine = copy.copy(w)
    mine.model = hand_model
    opt = mine.make_optimizer()  # the workload's own optimizer, over the hand model
    loss_of = _hand_loss(w)
    micro = split_batch(w.batch, acc)
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(case.precision)

    def hand():
        for x in micro:
            with torch.autocast(device, dtype=dtype, enabled=dtype is not None):
                loss = loss_of(runner, x) / acc
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    def timed(fn) -> float:
        return time_steps(fn, 1, device)[0]

    for _ in range(2):
        hand()
        step()
    if not DRY:
        torch.cuda.synchronize()
    times = {"applied": [], "hand": []}
    for r in range(rounds):  # alternate which goes first, round by round
        for who in ("applied", "hand") if r % 2 == 0 else ("hand", "applied"):
            times[who].append(timed(step if who == "applied" else hand))
    med = {k: statistics.median(v) for k, v in times.items()}
    # each round's applied / hand: the drift of the host's clocks between rounds cancels
    paired = [a / h for a, h in zip(times["applied"], times["hand"], strict=True)]
    return {
        "case": case_name,
        "knob": knob,
        "rounds": rounds,
        "applied_to": "the copy" if swap else "the original",
        "micro_batch": mb,
        "accumulation": acc,
        "precision": case.precision,
        "changes": list(step.changes),
        "times_s": times,
        "applied_s": med["applied"],
        "hand_s": med["hand"],
        "applied_over_hand": med["applied"] / med["hand"] - 1,
        "paired_median": statistics.median(paired) - 1,
        "paired_spread": [min(paired) - 1, max(paired) - 1],
    }


def report(row: dict) -> None:
    if "error" in row:
        print(f"{row['name']}: {row['error']}", flush=True)
        return
    print(
        f"{row['name']}: applied {row['applied_s'] * 1e3:.1f} ms, hand "
        f"{row['hand_s'] * 1e3:.1f} ms, {row['applied_over_hand']:+.2%} "
        f"(paired {row['paired_median']:+.2%})",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(cases_main(sys.argv[1:], __doc__, str(HERE), CASES, VERSION, one, report))
