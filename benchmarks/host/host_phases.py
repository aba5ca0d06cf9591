"""How long the host takes to issue each phase of a zoo step, on a GPU, beside the prediction.

    PYTHONUNBUFFERED=1 PYTHONPATH=src python benchmarks/host/host_phases.py OUT.json \
        [--cases NAME,NAME]                      # on the GPU machine
    python benchmarks/host/host_phases.py OUT.json --compare  # on any machine: the predictions

Each case in a fresh process, as benchmarks/zoo/measure.py runs it (built on the GPU,
prepared, 3 warm-up steps; a zoo case by name, a built-in model as
"model:batch:seq:checkpoint", e.g. "gpt2-xl:4:1024:full", in bf16-mixed); then 7 steps, each
with the host's clock read around its forward and loss, its backward and its optimizer step
and zero_grad, without synchronising in between (the GPU's queue never blocks the host while
the host is the slower side), and the whole step to the end of its GPU work. The medians per
phase. A phase's issue time is what the host spends on it (the Python, the dispatcher, the
launches; for backward the autograd engine's thread) as long as the GPU keeps up.
`--compare` adds gobrrr's per-phase host seconds (the sum of its ops' predicted host time,
`OpTime.host_s`) and step time for each case.
"""

from __future__ import annotations

import contextlib
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve()
# src/, the repository root (zoo/), benchmarks/ (child_rows, suite/, plan/) and this folder
sys.path[:0] = [
    str(HERE.parents[2] / "src"),
    str(HERE.parents[2]),
    str(HERE.parents[1]),
    str(HERE.parent),
]

from child_rows import cases_main  # noqa: E402

VERSION = 1
CASES = (
    "efficientnet_v2_s-tv-cl",
    "mobilenet_v3_large-tv",
    "distilbert-mlm",
    "pythia-410m",
    "t5-base",
    "gpt2-124m",
    "resnet50-tv-cl",
    "vit_small-timm",
)
PHASES = ("forward", "backward", "optimizer")


BUILTIN_PRECISION = "bf16-mixed"


def _builtin(name: str) -> tuple[str, int, int, str] | None:
    """A built-in model's case, "model:batch:seq:checkpoint" (e.g. "gpt2-xl:4:1024:full"):
    (model, batch, seq, checkpoint); None for a zoo case's name."""
    if ":" not in name:
        return None
    model, batch, seq, ckpt = name.split(":")
    return model, int(batch), int(seq), ckpt


def _prepared(name: str):
    """(precision, workload, optimizer, scaler) of a zoo case or a built-in model's case."""
    spec = _builtin(name)
    if spec is None:
        from zoo.cases import prepared

        case, wl, opt, scaler = prepared(name)
        return case.precision, wl, opt, scaler
    import torch

    from gobrrr.models.registry import get_workload
    from gobrrr.profile.runner import prepare

    model, batch, seq, ckpt = spec
    torch.manual_seed(0)
    with torch.device("cuda"):
        wl = get_workload(model, batch_size=batch, seq_len=seq)
    return (BUILTIN_PRECISION, *prepare(wl, "cuda", BUILTIN_PRECISION, ckpt))


def _predicted(name: str):
    spec = _builtin(name)
    if spec is None:
        from zoo import compare as zc
        from zoo.cases import get_case

        return zc.predict(get_case(name))
    import gobrrr

    model, batch, seq, ckpt = spec
    return gobrrr.estimate(
        model,
        gpu="h100",
        batch=batch,
        seq=seq,
        precision=BUILTIN_PRECISION,
        checkpoint=ckpt,
        loop="drops-output",
    )


def timed_step(
    precision: str, wl, opt, scaler, region=lambda phase: contextlib.nullcontext()
) -> dict[str, float]:
    """One training step with the host's clock read around each phase (forward and loss,
    backward, optimizer step and zero_grad; each inside `region(phase)`), not synchronising
    in between: the host's seconds per phase, to its last issue ("issue") and to the end of
    its GPU work ("step")."""
    import torch

    from gobrrr.training.step import autocast_for

    t0 = time.perf_counter()
    with region("forward"), autocast_for(precision, "cuda"):
        loss = wl.compute_loss(wl.batch)
    t1 = time.perf_counter()
    with region("backward"):
        (scaler.scale(loss) if scaler else loss).backward()
    t2 = time.perf_counter()
    with region("optimizer"):
        if scaler:
            scaler.step(opt)
            scaler.update()
        else:
            opt.step()
        opt.zero_grad(set_to_none=True)
    t3 = time.perf_counter()
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    return {
        "forward": t1 - t0,
        "backward": t2 - t1,
        "optimizer": t3 - t2,
        "issue": t3 - t0,
        "step": t4 - t0,
    }


def phase_medians(prepared, steps: int = 7, warmup: int = 3) -> dict[str, float]:
    """The median over `steps` of each of timed_step's figures, after `warmup` steps."""
    import torch

    for _ in range(warmup):
        timed_step(*prepared)
    torch.cuda.synchronize()
    runs = [timed_step(*prepared) for _ in range(steps)]
    return {k: statistics.median(r[k] for r in runs) for k in runs[0]}


def host_by_phase(est) -> dict[str, float]:
    """An estimate's host seconds per phase (its ops' `OpTime.host_s` summed; recomputation
    counted in the backward it runs in), with its step and device seconds."""
    host = dict.fromkeys(PHASES, 0.0)
    for o in est.time.ops:
        key = "backward" if o.phase == "recompute" else o.phase
        host[key] = host.get(key, 0.0) + o.host_s
    return {**host, "step": est.time.step_s, "device": est.time.device_s}


def one(name: str) -> dict:
    return {"name": name, **phase_medians(_prepared(name))}


def compare(path: Path) -> None:
    doc = json.loads(path.read_text())
    for row in doc["rows"]:
        if "error" in row:
            continue
        est = _predicted(row["name"])
        host = host_by_phase(est)
        row["predicted"] = host
        print(
            f"{row['name']:26s} "
            + "  ".join(f"{k} {row[k] * 1e3:6.1f}/{host[k] * 1e3:6.1f}" for k in PHASES)
            + f"  step {row['step'] * 1e3:6.1f}/{est.time.step_s * 1e3:6.1f} ms "
            "(measured/predicted)",
            flush=True,
        )
    path.write_text(json.dumps(doc, indent=1) + "\n")


def main(argv=None) -> int:
    return cases_main(
        argv,
        __doc__,
        str(HERE),
        CASES,
        VERSION,
        one,
        lambda row: print(
            row["name"],
            row.get("error")
            or {k: round(v * 1e3, 1) for k, v in row.items() if isinstance(v, float)},
            flush=True,
        ),
        actions={"--compare": compare},
    )


if __name__ == "__main__":
    sys.exit(main())
