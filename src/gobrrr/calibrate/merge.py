"""Measured NCCL collectives merged into a GPU's calibration file (`gobrrr calibrate
--collectives`), as `benchmarks/calibration/merge_collectives.py` merges them into the
shipped one.

The file is the user's calibration of the GPU (`--output`, else `default_path`); where there
is none yet, the saved calibration of that GPU (the user's, else the shipped one) is its
start. Points measured with this run's number of ranks replace those of the same number (a
run on 2 GPUs keeps the 4-GPU points); the calibration's meta["collectives"] says where each
set came from. Written atomically: a temporary file beside it, checked by loading it as a
Calibration, then moved over the old one.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path
from typing import Any

from gobrrr.calibrate.api import _gpu_key, default_path
from gobrrr.errors import GobrrrError
from gobrrr.hardware import Calibration, Target, find_calibration

#: the fields of a measured point the calibration keeps
KEEP = ("op", "dtype", "bytes", "ranks", "iters", "seconds", "min_s", "max_s")
HOW = "gobrrr calibrate --collectives: points of the same rank count replaced"


def target_path(device_name: str, output: str | Path | None) -> Path:
    """Where the merged calibration is written: `output`, else the user's file of the GPU."""
    return Path(output).expanduser() if output else default_path(_gpu_key(device_name))


def base_calibration(device_name: str, path: Path) -> dict[str, Any]:
    """The calibration the collectives are merged into, as its JSON object: `path` where it
    exists, else the saved calibration of the GPU CUDA names. None anywhere: a GobrrrError
    saying to calibrate the GPU first (the collectives alone are no calibration)."""
    if path.exists():
        return Calibration.load(path).to_dict()
    try:
        spec = Target.resolve(device_name, calibration=False).gpu
    except GobrrrError:
        spec = None
    cal = find_calibration(spec) if spec is not None else None
    if cal is None:
        raise GobrrrError(
            f"no calibration of {device_name!r} to add the collectives to ({path} does "
            "not exist and gobrrr ships none for this GPU)",
            hint="run `gobrrr calibrate` on this GPU first (it measures the rest), then "
            "this again; or pass --no-save",
        )
    return cal.to_dict()


def merge_collectives(cal: dict[str, Any], measured: dict[str, Any], source: str) -> dict:
    """`cal` (a calibration's JSON object) with `measured`'s points (a `sections.collectives`
    result) in its `collectives` section, replacing the points of the same rank count;
    `source` names where they came from."""
    meta = measured.get("meta", {})
    ranks = {p["ranks"] for p in measured["points"]}
    kept = [p for p in cal.get("collectives", []) if p.get("ranks") not in ranks]
    new = [{k: p[k] for k in KEEP if k in p} for p in measured["points"]]
    out = dict(cal)
    out["collectives"] = sorted(
        kept + new, key=lambda p: (p["op"], p["dtype"], p["ranks"], p["bytes"])
    )
    origin = {
        "file": source,
        **{k: meta.get(k) for k in ("date", "device", "torch", "nccl", "world_size")},
        "env": meta.get("env", {}),
    }
    before = out.get("meta", {}).get("collectives", {}).get("from", [])
    out["meta"] = {
        **out.get("meta", {}),
        "collectives": {
            "from": [o for o in before if o.get("world_size") not in ranks] + [origin],
            "how": HOW,
        },
    }
    return out


#: the fields of a contention point kept in a calibration (`sections.contention`)
CONTENTION_KEEP = (
    "op", "dtype", "bytes", "ranks", "kernel", "class", "kernel_alone_s", "kernel_beside_s",
    "collective_alone_s", "collective_beside_s",
)  # fmt: skip


def merge_contention(cal: dict[str, Any], measured: dict[str, Any], source: str) -> dict:
    """`cal` with its `contention` section replaced by `measured`'s points (a
    `sections.contention` result); `source` names where they came from."""
    meta = measured.get("meta", {})
    out = dict(cal)
    out["contention"] = [{k: p[k] for k in CONTENTION_KEEP if k in p} for p in measured["points"]]
    out["meta"] = {
        **out.get("meta", {}),
        "contention": {
            "from": source,
            **{k: meta.get(k) for k in ("date", "device", "torch", "nccl", "world_size")},
        },
    }
    return out


def write_calibration(cal: dict[str, Any], path: Path) -> None:
    """Write `cal` to `path` atomically, after checking it loads as a Calibration."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=path.name + ".", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(cal, f, indent=2)
        Calibration.load(tmp)  # a merge that breaks the file fails here, not at the next read
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
