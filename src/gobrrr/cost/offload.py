"""Times of CPU offload's ops (cost/_ops_offload.py) from the calibration's "offload" section
(gobrrr.calibrate.sections.offload): copies over the host link, the CPU's optimizer step.

The scheduler (gobrrr.schedule.scheduler) puts each on its timeline: a copy on its copy
stream (`side_s`), serial with the others on the one host link; the CPU step on the host
(`host_s`), after its gradient has landed. Nothing of them runs on the compute stream
(`device_s` 0).
"""

from __future__ import annotations

import math

from gobrrr.cost._ops_common import OpCost
from gobrrr.cost.curves import interp
from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode
from gobrrr.hardware import Calibration

NOT_CALIBRATED = (
    "CPU offload is costed from a calibration measured on the GPU's machine "
    "(the host link's bandwidth and the CPU's AdamW time), and {what} has none: "
    "run `gobrrr calibrate` on that machine"
)


def require_section(cal: Calibration | None, what: str = "this GPU's calibration") -> dict:
    """The calibration's offload section, or a GobrrrError saying how to measure it."""
    section = cal.offload if cal else {}
    if not section or not section.get("d2h") or not section.get("h2d"):
        raise GobrrrError(NOT_CALIBRATED.format(what=what))
    return section


def copy_seconds(points: list[list[float]], nbytes: float) -> float:
    """Seconds to copy `nbytes` over the link, from [[bytes, bytes/s], ...]: the bandwidth
    interpolated in log size; below the smallest size measured, that copy's time (latency)."""
    if nbytes <= points[0][0]:
        return points[0][0] / points[0][1]
    return nbytes / interp(
        [math.log(p[0]) for p in points], [p[1] for p in points], math.log(nbytes)
    )


def step_seconds(points: list[list[float]], numel: float) -> float:
    """Seconds of one CPU optimizer step over `numel` elements, from [[elements, seconds],
    ...]: seconds per element interpolated in log size; below the smallest size, its time (the
    call's own overhead); above the largest, its per-element time."""
    if numel <= points[0][0]:
        return points[0][1]
    per = interp([math.log(p[0]) for p in points], [p[1] / p[0] for p in points], math.log(numel))
    return numel * per


def cpu_key(node: OpNode) -> str:
    """The section's key of a parameter's CPU step: its optimizer (the op's second argument:
    "adamw", the fused AdamW torchao runs) and "bf16" for 16-bit parameters, else "fp32"."""
    dtype = node.inputs[0].dtype if node.inputs else "float32"
    bits = "bf16" if dtype in ("bfloat16", "float16") else "fp32"
    return f"{node.arg(1, 'optimizer', 'adamw')}:{bits}"


def offload_times(node: OpNode, cost: OpCost, cal: Calibration | None) -> tuple[float, float]:
    """(host seconds, side-stream seconds) of one offload op."""
    section = require_section(cal)
    if cost.kind == "cpu_step":
        key = cpu_key(node)
        if not section.get(key):
            raise GobrrrError(
                f"the calibration's offload section has no CPU step times for "
                f"{key!r} (measured: fused AdamW): offload with AdamW, or "
                "measure this optimizer's step"
            )
        return step_seconds(section[key], node.inputs[0].numel if node.inputs else 0), 0.0
    return section[f"{cost.kind}_issue_s"], copy_seconds(section[cost.kind], cost.bytes)
