"""Where an applied step's extra time went: the workload's batch moved from the host each step.

    OUT=DIR python benchmarks/plan/apply_batch_copy.py [ARCH] [MICRO_BATCH]

torchvision ARCH (default vit_l_16), bf16-mixed, MICRO_BATCH (default 256) x 2 accumulated,
AdamW, on one GPU, in one process: the model once, three ways of running its step alternated
(CUDA events, 3 rounds x 2 steps each, median):
- hand: the loop a user writes, with the batch moved to the GPU once beforehand;
- applied: `gobrrr.apply(...)`'s step() on the workload's own batch (held on the host, as
  the zoo builds it; the step moves it once, on its first call);
- applied_copy_each: the same step given the host batch each call (moved every step, as
  step() did before it kept the moved batch).
Then one profiled step of each: the device time of aten::to / _to_copy / copy_ by input
shape, and the top kernels. Writes OUT/apply_vs_hand_ARCH.json.
"""

from __future__ import annotations

import json
import os
import statistics
import sys
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2])]

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch.profiler import ProfilerActivity, profile  # noqa: E402

from gobrrr.plan.apply import apply  # noqa: E402
from gobrrr.plan.knobs import Knobs  # noqa: E402
from gobrrr.profile.timing import time_steps  # noqa: E402
from zoo.vision import torchvision_model  # noqa: E402

CASTS = ("aten::to", "aten::_to_copy", "aten::copy_")


def main() -> None:
    arch = sys.argv[1] if len(sys.argv) > 1 else "vit_l_16"
    mb = int(sys.argv[2]) if len(sys.argv) > 2 else 256
    acc = 2
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    w = torchvision_model(mb * acc, None, arch=arch)
    w.model.cuda()
    cpu_batch = w.batch  # the workload's own batch stays on the host
    step = apply(w, Knobs(micro_batch=mb, accumulation=acc), "bf16-mixed")
    model = w.model
    opt = torch.optim.AdamW(model.parameters())
    images, labels = (t.cuda() for t in cpu_batch)

    def hand():
        for x, y in zip(images.chunk(acc), labels.chunk(acc), strict=True):
            with torch.autocast("cuda", dtype=torch.bfloat16):
                loss = F.cross_entropy(model(x), y) / acc
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    runs = {"hand": hand, "applied": step, "applied_copy_each": lambda: step(cpu_batch)}
    for fn in (*runs.values(), hand, step):  # warm-up
        fn()
    torch.cuda.synchronize()
    times = {k: [] for k in runs}
    for _ in range(3):
        for name, fn in runs.items():
            times[name] += [_timed(fn) for _ in range(2)]
    out["times"] = times
    out["median"] = {k: statistics.median(v) for k, v in times.items()}
    out["profile"] = {name: _profiled(fn) for name, fn in runs.items()}
    Path(os.environ.get("OUT", "/tmp"), f"apply_vs_hand_{arch}.json").write_text(
        json.dumps(out, indent=1)
    )
    print(json.dumps(out["median"]))


def _timed(fn) -> float:
    return time_steps(fn, 1, "cuda")[0]


def _profiled(fn) -> dict:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], record_shapes=True) as p:
        fn()
        torch.cuda.synchronize()
    casts = [
        {
            "op": ev.key,
            "shapes": str(ev.input_shapes)[:160],
            "count": ev.count,
            "device_us": ev.device_time_total,
        }
        for ev in p.key_averages(group_by_input_shape=True)
        if ev.key in CASTS
    ]
    kernels = [
        {"k": ev.key[:140], "count": ev.count, "device_us": ev.device_time_total}
        for ev in p.key_averages()
        if ev.device_type.name == "CUDA"
    ]
    casts.sort(key=lambda r: -r["device_us"])
    kernels.sort(key=lambda r: -r["device_us"])
    return {
        "casts": casts[:25],
        "kernels": kernels[:40],
        "total_device_us": sum(r["device_us"] for r in kernels),
    }


if __name__ == "__main__":
    main()
