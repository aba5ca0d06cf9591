"""Measure some shape classes of the convolution grid and merge them into a calibration.

A full `gobrrr calibrate` measures every class of `gobrrr.calibrate.sections.conv.conv_shapes`.
This measures the chosen ones (`conv_grid` on their shapes only) and sets their grid keys and
their "inside:<layout>:<class>:<direction>" workspace fractions in an existing calibration,
leaving every other class and the typical workspace fractions as they were; the measurement
is also written as results JSON, with the kernels cuDNN ran for one point of each class.

    PYTHONPATH=src python benchmarks/calibration/conv_classes.py OUT.json --classes grouped-1d \\
        [--into src/gobrrr/data/calibration/h100-sxm.json]
    python benchmarks/calibration/conv_classes.py - --classes grouped-1d --into CAL.json \
        --from-results benchmarks/results/conv_classes_grouped1d_h100.json
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch

from gobrrr.calibrate.sections.conv import (
    INSIDE,
    _calls,
    _tensors,
    class_rows,
    conv_grid,
    conv_shapes,
    snap,
)
from gobrrr.hardware import Calibration
from gobrrr.kernels.bench import cuda_kernels, env_info, write_json


def kernels_of(shape, dev) -> dict[str, list[str]]:
    """direction -> the CUDA kernels one bf16 call of this shape ran (batch 1)."""
    out = {}
    for direction, (_, fn) in _calls(
        *_tensors(shape, 1, torch.bfloat16, "channels_first", dev)
    ).items():
        fn()
        out[direction] = sorted({name[:160] for name, _ in cuda_kernels(fn)})
    return out


def merge(
    cal: Calibration, rates: dict, spaces: dict, classes: list[str], env: dict
) -> Calibration:
    """cal with the classes' grid keys and inside-fractions replaced by the measured ones,
    `env` (where they were measured) in its meta."""
    grid = {mode: dict(table) for mode, table in cal.conv_grid.items()}
    for mode, table in rates.items():
        grid.setdefault(mode, {}).update(table)
    work = {mode: dict(f) for mode, f in cal.conv_workspace.items()}
    for mode, fractions in spaces.items():
        for key, value in fractions.items():
            if key.startswith(INSIDE) and key.split(":")[2] in classes:
                work.setdefault(mode, {})[key] = value
    return replace(
        cal,
        conv_grid=grid,
        conv_workspace=work,
        meta={**cal.meta, **{f"conv_grid:{c}": env for c in classes}},
    )


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--classes", nargs="+", required=True)
    ap.add_argument("--into", default=None, help="a calibration file to merge them into")
    ap.add_argument(
        "--from-results",
        metavar="RESULTS.json",
        default=None,
        help="merge a results file of this script (its points put on their grid "
        "rows, `calibrate_conv.snap`) into --into instead of measuring",
    )
    args = ap.parse_args(argv)
    if args.from_results:
        import json

        doc = json.loads(Path(args.from_results).read_text())
        rates = {
            mode: {
                k: [[snap(p[0], class_rows(k.split(":")[1])), *p[1:]] for p in pts]
                for k, pts in table.items()
            }
            for mode, table in doc["conv_grid"].items()
        }
        merge(
            Calibration.load(args.into), rates, doc["conv_workspace"], args.classes, doc["env"]
        ).save(args.into)
        return 0
    if not torch.cuda.is_available():
        print("conv_classes: needs a CUDA GPU", file=sys.stderr)
        return 2
    shapes = tuple(s for s in conv_shapes() if s.cls in args.classes)
    unknown = set(args.classes) - {s.cls for s in shapes}
    if unknown:
        print(
            f"conv_classes: no such class {sorted(unknown)}; the classes are "
            f"{sorted({s.cls for s in conv_shapes()})}",
            file=sys.stderr,
        )
        return 2
    dev = torch.device("cuda")
    t0 = time.perf_counter()
    rates, spaces = conv_grid(dev, shapes=shapes)
    kernels = {c: kernels_of(next(s for s in shapes if s.cls == c), dev) for c in args.classes}
    write_json(
        args.out,
        {
            "benchmark": "convolution grid classes",
            "classes": args.classes,
            "seconds": time.perf_counter() - t0,
            "conv_grid": rates,
            "conv_workspace": spaces,
            "kernels": kernels,
            "merged_into": args.into or "",
        },
    )
    if args.into:
        merge(Calibration.load(args.into), rates, spaces, args.classes, env_info()).save(args.into)
    print(args.out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
