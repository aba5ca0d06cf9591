"""What cuDNN convolutions allocate inside the call (workspace), beyond their outputs.

    python benchmarks/conv_workspace.py OUT.json

For the built-in convnet in fp32 and bf16-mixed: one step under torch.profiler with memory
profiling; for every convolution op, the bytes allocated and freed inside the op (its
temporaries) and the op's peak above its entry.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from gobrrr.models.registry import get_workload  # noqa: E402
from gobrrr.profile.runner import matmul_precision, prepare, run_step  # noqa: E402


def conv_temporaries(precision: str, batch: int) -> dict:
    with torch.device("cuda"):
        wl = get_workload("convnet", batch_size=batch)
    wl, opt, scaler = prepare(wl, "cuda", precision)
    with matmul_precision(precision):
        for _ in range(3):
            run_step(wl, opt, precision, scaler)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA],
                     profile_memory=True) as prof:
            run_step(wl, opt, precision, scaler)
            torch.cuda.synchronize()
    events = list(prof.events())
    mem = sorted((e.time_range.start, e.device_memory_usage) for e in events
                 if e.name == "[memory]" and e.device_memory_usage)
    rows = []
    for e in events:
        if e.name not in ("aten::cudnn_convolution", "aten::convolution_backward"):
            continue
        run, top = 0, 0
        for t, delta in mem:
            if e.time_range.start <= t <= e.time_range.end:
                run += delta
                top = max(top, run)
        rows.append({"op": e.name, "peak_above_entry": top, "net": run,
                     "temporaries": top - max(run, 0)})
    return {"precision": precision, "batch": batch, "ops": rows}


def main() -> None:
    out = [conv_temporaries("fp32", 32), conv_temporaries("bf16-mixed", 64)]
    for r in out:
        print(r["precision"], r["batch"])
        temps = [o["temporaries"] for o in r["ops"]]
        print(f"   {len(temps)} convolution calls; temporaries max {max(temps) / 2**20:.1f} MiB, "
              f"sum {sum(temps) / 2**20:.1f} MiB")
        for o in sorted(r["ops"], key=lambda o: -o["temporaries"])[:6]:
            print(f"   {o['op']:32s} temporaries {o['temporaries'] / 2**20:8.1f} MiB, "
                  f"net {o['net'] / 2**20:8.1f} MiB")
    Path(sys.argv[1]).write_text(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
