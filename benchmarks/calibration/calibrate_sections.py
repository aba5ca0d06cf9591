"""Measure some sections of a calibration on this GPU and merge them into a calibration file.

A full `gobrrr calibrate` measures everything on one machine. This re-measures chosen sections
(the GPU's own rates, the host cost of gobrrr's kernel ops, or of the fused attention ops:
`attention_host`, merged into `op_host`) and sets them in an existing
calibration, recording where and when each was measured in its meta (under the section's
name); the measurement is also written as results JSON.

    PYTHONPATH=src python benchmarks/calibration/calibrate_sections.py OUT.json \\
        --sections matmul_grid attention_curve kernel_host \\
        [--into src/gobrrr/data/calibration/h100-sxm.json]
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace
from pathlib import Path

import torch

from gobrrr.calibrate.api import gpu_sections
from gobrrr.calibrate.sections import host as ch
from gobrrr.hardware import Calibration
from gobrrr.kernels.bench import env_info, write_json

# section -> the calibration fields it measures, {field: value}: the GPU sections of a full
# calibration, and the host's per-op cost by phase, merged as ratios to the forward's (below)
SECTIONS = {
    **gpu_sections(),
    "checkpoint_overhead": lambda d: dict(
        zip(("op_overhead", "checkpoint_rows"), ch.step_overhead_rows(d), strict=True)
    ),
    "attention_host": lambda d: {"attention_host": ch.attention_host_costs(d)},
}


def run(out_path: str | Path, sections: list[str], into: str | Path | None = None) -> Path:
    dev, measured, seconds = torch.device("cuda"), {}, {}
    for name in sections:
        t0 = time.perf_counter()
        measured.update(SECTIONS[name](dev))
        seconds[name] = time.perf_counter() - t0
        print(f"{name}: {seconds[name]:.1f} s", flush=True)
    path = write_json(
        out_path,
        {
            "benchmark": "calibration sections",
            "seconds": seconds,
            "sections": measured,
            "merged_into": str(into or ""),
        },
    )
    if into:
        cal = Calibration.load(into)
        meta = {**cal.meta, **{name: env_info() for name in sections}}
        if "checkpoint_overhead" in sections:
            # host speed differs between machines: keep the file's own per-op costs and add
            # the checkpointed phases' at their ratios to the forward's measured here
            here, rows = measured.pop("op_overhead"), measured.pop("checkpoint_rows")
            ratios = {
                k: here[k] / here["forward"]
                for k in (
                    "recompute",
                    "checkpointed",
                    "recompute_selective",
                    "checkpointed_selective",
                    "checkpointed_fit_per_op",
                    "checkpointed_fit_per_saved",
                    "checkpointed_selective_fit_per_op",
                    "checkpointed_selective_fit_per_saved",
                )
                if k in here
            }
            measured["op_overhead"] = {
                **cal.op_overhead,
                **{k: cal.op_overhead["forward"] * r for k, r in ratios.items()},
            }
            meta["checkpoint_overhead"] = {
                **meta["checkpoint_overhead"],
                "measured": here,
                "over_forward": ratios,
                "rows": rows,  # the surcharge fit's tiny models, as timed here
            }
        if "attention_host" in measured:
            # the fused attention ops' keys of op_host, the rest of it as the file has it
            measured["op_host"] = {**cal.op_host, **measured.pop("attention_host")}
        replace(cal, **measured, meta=meta).save(into)
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    p.add_argument("--sections", nargs="+", required=True, choices=sorted(SECTIONS))
    p.add_argument("--into", help="calibration JSON whose sections to set")
    args = p.parse_args(argv)
    if args.into and not Path(args.into).is_file():
        p.error(f"--into {args.into}: no such calibration file; give an existing one")
    run(args.out, args.sections, args.into)


if __name__ == "__main__":
    main()
