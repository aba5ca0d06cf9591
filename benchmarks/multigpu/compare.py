"""gobrrr's DDP predictions against the measured multi-GPU steps.

    PYTHONPATH=src python benchmarks/multigpu/compare.py [--cases NAME ...]

For every DDP case of `benchmarks/results/multigpu_steps_h200_x4.json` and `_x2of4.json`
(recorded by `steps.py`), the same step is traced on this machine's CPU (fake tensors): the
`transformers` model of the case's shape (`steps.SHAPES`, sequence 8192), the case's batch per
rank, torchtitan's loop (cross-entropy on the `.float()` logits, AdamW lr 1e-4 foreach),
bf16-mixed autocast over fp32 weights, checkpointing through the model's own
`gradient_checkpointing_enable` (non-reentrant), accumulation by `passes.accumulate`; then
`passes.ddp` over the case's ranks on one host. Prints measured vs predicted per-rank peaks
(allocated, reserved), step time and exposed communication; writes
`benchmarks/results/multigpu_predictions.json`.

The runs were on H200s; the predictions use the H100 spec and calibration (the only one with
measured collectives). Memory does not depend on the GPU; time is an indication only.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
import transformers

from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.evaluate import evaluate
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.ddp import ddp

HERE = Path(__file__).resolve().parent
RESULTS = HERE.parent / "results"
sys.path.insert(0, str(HERE))
from steps import SHAPES  # noqa: E402

SOURCES = ("multigpu_steps_h200_x4.json", "multigpu_steps_h200_x2of4.json")
GPU = "h100"


def workload(case: dict) -> Workload:
    """The case's step on one rank, as `steps.py` runs it (without the DDP wrapper)."""
    cls, kw = SHAPES[case["shape"]]
    config = getattr(transformers, cls)(**kw)
    config._attn_implementation = "sdpa"
    model = transformers.AutoModelForCausalLM.from_config(config)
    if case["checkpoint"]:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.config.use_cache = False
    b, s = case["batch"], case["seq"]
    tokens = torch.randint(0, config.vocab_size, (b, s + 1))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()

    def step(m, batch):
        logits = m(input_ids=batch[0]).logits
        return F.cross_entropy(logits.flatten(0, 1).float(), batch[1].flatten())

    return Workload(
        model,
        (x, y),
        step=step,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
        tokens=b * s,
        seq_len=s,
    )


def predict(case: dict) -> dict:
    t0 = time.perf_counter()
    graph = capture(lambda: workload(case), precision="bf16-mixed")
    graph = accumulate(graph, case["accumulation"])
    est = evaluate(ddp(graph, case["world"]), GPU)
    t = est.time
    return {
        "peak_allocated": est.memory.peak,
        "peak_reserved": est.memory.reserved,
        "step_s": t.step_s,
        "comm_busy_s": t.comm_s,
        "comm_exposed_s": t.exposed_comm_s,
        "persistent": est.memory.persistent,
        "at_peak": est.memory.at_peak,
        "peak_op": est.memory.peak_op,
        "peak_phase": est.memory.peak_phase,
        "seconds": time.perf_counter() - t0,
    }


def cases(names: list[str] | None) -> list[tuple[str, dict]]:
    out = []
    for src in SOURCES:
        for key, case in json.loads((RESULTS / src).read_text())["cases"].items():
            if case["parallel"] == "ddp" and (not names or case["name"] in names or key in names):
                out.append((key, case))
    return out


def row(key: str, m: dict, p: dict) -> str:
    gib = 2**30

    def pair(k: str, scale: float, fmt: str) -> str:
        a, b = m.get(k), p.get(k)
        err = f"{(b - a) / a:+.0%}" if a else "  -"
        return f"{a / scale:{fmt}} {b / scale:{fmt}} {err:>5}"

    return (
        f"{key:38s} {pair('peak_allocated', gib, '6.2f')} | {pair('peak_reserved', gib, '6.2f')}"
        f" | {pair('step_s', 1e-3, '7.1f')} | {pair('comm_exposed_s', 1e-3, '6.1f')}"
    )


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cases", nargs="*", help="case names (default: every DDP case)")
    ap.add_argument("--out", type=Path, default=RESULTS / "multigpu_predictions.json")
    args = ap.parse_args()
    print(
        f"{'case':38s} {'alloc GiB meas pred err':>24s} | {'reserved GiB':>24s}"
        f" | {'step ms':>26s} | {'exposed comm ms':>24s}"
    )
    out = {}
    for key, case in cases(args.cases):
        p = predict(case)
        ranks = sorted(r["comm_exposed_s"] for r in case.get("ranks", []))
        measured = {**case["measured"], "comm_exposed_s_ranks": ranks}
        out[key] = {
            "case": {k: v for k, v in case.items() if k not in ("ranks", "measured")},
            "measured": measured,
            "predicted": p,
        }
        print(row(key, case["measured"], p), flush=True)
        if ranks:  # the job's figure is the worst rank's: it includes waiting for the others
            print(
                f"{'':38s} exposed comm by rank (ms): " + ", ".join(f"{x * 1e3:.1f}" for x in ranks)
            )
    args.out.write_text(
        json.dumps(
            {
                "gpu": GPU,
                "note": "measured on H200s; predicted with the H100 spec and calibration",
                "cases": out,
            },
            indent=1,
        )
    )
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
