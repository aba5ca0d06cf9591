"""Measure the host cost of gobrrr's kernel ops on this machine and merge it into a calibration.

Writes the measurement (`kernel_host_s`, seconds per call by op name) as results JSON, and with
--into sets `kernel_host` of that calibration file, recording where and when it was measured in
its meta ("kernel_host"). `gobrrr calibrate` measures the same as part of a full calibration.

    PYTHONPATH=src python benchmarks/calibrate_kernel_host.py OUT.json \\
        [--into src/gobrrr/data/calibration/h100-sxm.json]
"""

from __future__ import annotations

import argparse
from dataclasses import replace
from pathlib import Path

import torch

from gobrrr.hardware import Calibration
from gobrrr.kernels.bench import env_info, table, write_json
from gobrrr.profile.calibrate_kernels import kernel_host_costs


def run(out_path: str | Path, into: str | Path | None = None) -> Path:
    costs = kernel_host_costs(torch.device("cuda"))
    path = write_json(out_path, {"benchmark": "host seconds per call of gobrrr's kernel ops",
                                 "kernel_host_s": costs, "merged_into": str(into or "")})
    if into:
        cal = Calibration.load(into)
        replace(cal, kernel_host=costs, meta={**cal.meta, "kernel_host": env_info()}).save(into)
    print(table([{"op": k, "host_us": v * 1e6} for k, v in costs.items()], ["op", "host_us"]))
    return path


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out", help="output JSON path")
    p.add_argument("--into", help="calibration JSON whose kernel_host to set")
    args = p.parse_args(argv)
    run(args.out, args.into)


if __name__ == "__main__":
    main()
