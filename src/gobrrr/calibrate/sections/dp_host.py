"""Calibration of the host time FSDP2's hooks add per unit, as `torch.distributed` runs them.

    torchrun --nproc-per-node 4 -m gobrrr.calibrate.sections.dp_host --out dp_host.json

FSDP2 (`fully_shard`) runs Python before and after every unit's forward and backward: the
all-gather's copy-in and copy-out, the reshard, the reduce-scatter's copy-in and the
bookkeeping of DTensor shards. On a training step whose units are short on the GPU, that host
time sets the pace. It is measured here on a model whose kernels are too small to hold the
host back: `UNITS` units of `L` Linear(256, 256) layers (2L parameters each) and a head, run
plain and under `fully_shard` (every unit, then the root; `MixedPrecisionPolicy(bf16, fp32)`,
as torchtitan sets it up), reshard_after_forward on and off. Per unit and phase, the host
time the wrapped model takes beyond the plain one (forward: from the call to its return;
backward: `loss.backward()` to its return), the median over `REPS` steps on each rank, and
the slowest rank's figure: every collective waits for the slowest rank, so a host-bound step
runs at its pace.

The same runs measure the ranks' skew: each step starts on every rank together, and per step
the slowest rank's host time for the plain model over the ranks' mean (`skew`): a step whose
host sets the pace runs at the slowest rank's, as every collective waits for it.

The section: {"points": [{"ranks", "reshard", "phase", "params", "seconds"}, ...],
"skew": [{"ranks", "phase", "host_s", "factor"}, ...], "meta"}.
`gobrrr.cost.dp_host` reads it. Only torch is imported, so the module runs on any machine
with CUDA and NCCL, whatever version of gobrrr is installed there.
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import os
import platform
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

UNITS, WIDTH, WARMUP, REPS = 16, 256, 5, 30
LAYERS = (1, 2, 4, 8, 12)
KINDS = ("plain", "fsdp", "fsdp_noreshard")


class _Unit(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.ls = nn.ModuleList(nn.Linear(WIDTH, WIDTH) for _ in range(layers))

    def forward(self, x):
        for layer in self.ls:
            x = layer(x)
        return x


class _Net(nn.Module):
    def __init__(self, layers: int) -> None:
        super().__init__()
        self.units = nn.ModuleList(_Unit(layers) for _ in range(UNITS))
        self.head = nn.Linear(WIDTH, 8)

    def forward(self, x):
        for u in self.units:
            x = u(x)
        return self.head(x)


def _wrapped(layers: int, kind: str, device: torch.device) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    torch.manual_seed(0)
    model = _Net(layers).to(device)
    if kind == "plain":
        return model
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    reshard = kind == "fsdp"
    for u in model.units:
        fully_shard(u, mp_policy=mp, reshard_after_forward=reshard)
    fully_shard(model, mp_policy=mp, reshard_after_forward=reshard)
    return model


def _host_times(
    model: nn.Module, kind: str, device: torch.device
) -> tuple[float, float, list[float], list[float]]:
    """(forward s, backward s, forward per step, backward per step): medians of the host time
    each takes over REPS steps, and each step's (every rank starts each step together)."""
    x = torch.randn(16, WIDTH, device=device)
    cast = (
        torch.autocast(device.type, torch.bfloat16) if kind == "plain" else contextlib.nullcontext()
    )
    fw, bw = [], []
    for i in range(WARMUP + REPS):
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with cast:
            y = model(x).float().sum()
        t1 = time.perf_counter()
        y.backward()
        t2 = time.perf_counter()
        torch.cuda.synchronize()
        for p in model.parameters():
            p.grad = None
        if i >= WARMUP:
            fw.append(t1 - t0)
            bw.append(t2 - t1)
    return statistics.median(fw), statistics.median(bw), fw, bw


def measure(device: torch.device) -> list[dict]:
    """This rank's rows: {layers, kind, forward_s, backward_s, forward_steps,
    backward_steps} for every grid point."""
    rows = []
    for layers in LAYERS:
        for kind in KINDS:
            model = _wrapped(layers, kind, device)
            fw, bw, fws, bws = _host_times(model, kind, device)
            rows.append(
                dict(
                    layers=layers,
                    kind=kind,
                    forward_s=fw,
                    backward_s=bw,
                    forward_steps=fws,
                    backward_steps=bws,
                )
            )
            del model
            torch.cuda.empty_cache()
    return rows


def section(ranks: list[list[dict]], world: int, units: int = UNITS + 1) -> list[dict]:
    """The section's points from every rank's rows: per unit (the root counts as one), the
    wrapped model's host time beyond the plain one, the slowest rank's."""
    points = []
    for kind in KINDS[1:]:
        for phase in ("forward", "backward"):
            for layers in LAYERS:
                extra = []
                for rows in ranks:
                    by = {(r["layers"], r["kind"]): r for r in rows}
                    wrapped, plain = by[(layers, kind)], by[(layers, "plain")]
                    extra.append((wrapped[f"{phase}_s"] - plain[f"{phase}_s"]) / units)
                points.append(
                    dict(
                        ranks=world,
                        reshard=kind == "fsdp",
                        phase=phase,
                        params=2 * layers,
                        seconds=max(max(extra), 0.0),
                    )
                )
    return points


def skew(ranks: list[list[dict]], world: int) -> list[dict]:
    """How much later than the average rank the slowest one issues the same host work: per
    phase and layer count of the plain (unwrapped) model, the median over steps of (the
    slowest rank's host seconds that step) / (the ranks' mean that step), beside the mean
    host seconds. Every rank starts each step together, so a rank that the operating system
    or its core slows is the one every collective of that step waits for."""
    points = []
    for phase in ("forward", "backward"):
        for layers in LAYERS:
            steps = [
                next(r for r in rows if r["layers"] == layers and r["kind"] == "plain")[
                    f"{phase}_steps"
                ]
                for rows in ranks
            ]
            ratios = [max(ts) / (sum(ts) / len(ts)) for ts in zip(*steps, strict=True)]
            mean = statistics.mean(t for ts in steps for t in ts)
            points.append(
                dict(
                    ranks=world,
                    phase=phase,
                    host_s=mean,
                    factor=statistics.median(ratios),
                )
            )
    return points


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="the JSON written by rank 0")
    args = ap.parse_args()
    local = int(os.environ["LOCAL_RANK"])
    torch.cuda.set_device(local)
    device = torch.device("cuda", local)
    dist.init_process_group("nccl", device_id=device, timeout=datetime.timedelta(seconds=300))
    rows = measure(device)
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, rows)
    if dist.get_rank() == 0:
        doc = {
            "points": section(ranks, dist.get_world_size()),
            "skew": skew(ranks, dist.get_world_size()),
            "meta": {
                "device": torch.cuda.get_device_name(),
                "torch": torch.__version__,
                "host": platform.node(),
                "cpu_count": os.cpu_count(),
                "units": UNITS + 1,
                "reps": REPS,
            },
            "ranks": ranks,
        }
        with open(args.out, "w") as f:
            json.dump(doc, f, indent=1)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
