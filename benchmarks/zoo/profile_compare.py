"""Predicted against measured, op kind by op kind, for chosen zoo cases on a GPU.

    python benchmarks/zoo/profile_compare.py OUT.json --cases resnet50-tv-cl,bert-base-mlm

For each case: gobrrr's prediction (the shipped calibration for this GPU) traced from the case's
factory, then `gobrrr.profile` of the same workload on the GPU with that graph, joined kernel by
kernel, and `gobrrr.profile.compare`: predicted and measured seconds per op kind, module and
phase. Where a zoo case's step time is off, this says which ops are.
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import traceback
from pathlib import Path

HERE = Path(__file__).resolve()
sys.path[:0] = [str(HERE.parents[2] / "src"), str(HERE.parents[2]), str(HERE.parents[1])]

import torch  # noqa: E402

import gobrrr  # noqa: E402
import gobrrr.hardware  # noqa: E402
from gobrrr.hardware import find_calibration, match_device_name  # noqa: E402
from gobrrr.profile.api import profile  # noqa: E402
from gobrrr.profile.compare import compare  # noqa: E402
from zoo.cases import get_case  # noqa: E402


def one(name: str, device: str, batch: int | None, seq: int | None) -> dict:
    case = get_case(name)
    spec = match_device_name(torch.cuda.get_device_name()) if device == "cuda" else None
    spec = spec or gobrrr.hardware.get_gpu("h100")
    cal = find_calibration(spec)
    kw = {k: v for k, v in (("batch_size", batch), ("seq_len", seq)) if v is not None}
    est = gobrrr.estimate(
        lambda: case.factory()(**kw),
        gpu=spec,
        precision=case.precision,
        compile=case.compile,
        calibration=cal,
        loop="drops-output",  # profile measures gobrrr's TrainStep
    )
    result = profile(
        case.factory()(**kw),
        device=device,
        precision=case.precision,
        compile=case.compile,
        graph=est.graph,
        calibration=cal,
        steps=3 if device == "cpu" else 10,
    )
    cmp = compare(est.time, result).to_dict()
    return {
        "name": name,
        "predicted_step_s": est.time.step_s,
        "measured_step_s": result.step_s,
        "compare": cmp,
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("out")
    ap.add_argument("--cases", required=True, help="comma-separated zoo case names")
    ap.add_argument("--device", default="cuda", help="cuda, or cpu for a dry run")
    ap.add_argument("--batch", type=int, help="override the cases' batch (a dry run)")
    ap.add_argument("--seq", type=int, help="override the cases' sequence length")
    args = ap.parse_args(argv)
    rows = []
    for name in args.cases.split(","):
        try:
            row = one(name, args.device, args.batch, args.seq)
            top = sorted(row["compare"]["kinds"], key=lambda r: -r["measured_s"])[:6]
            print(
                f"{name}: step {row['predicted_step_s'] * 1e3:.1f} ms predicted, "
                f"{row['measured_step_s'] * 1e3:.1f} measured; "
                + ", ".join(
                    f"{r['name']} {r['predicted_s'] * 1e3:.1f}/{r['measured_s'] * 1e3:.1f}"
                    for r in top
                ),
                flush=True,
            )
        except Exception as e:  # recorded: one case failing keeps the others
            row = {
                "name": name,
                "error": f"{type(e).__name__}: {e}",
                "traceback": traceback.format_exc()[-2000:],
            }
            print(f"{name}: {row['error'][:200]}", flush=True)
        rows.append(row)
        torch.cuda.empty_cache()
    env = {
        "device": torch.cuda.get_device_name() if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
    }
    Path(args.out).write_text(
        json.dumps({"version": 1, "environment": env, "cases": rows}, indent=1)
    )


if __name__ == "__main__":
    main()
