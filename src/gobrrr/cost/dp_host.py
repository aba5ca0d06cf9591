"""The host time FSDP2's hooks take per unit, from a calibration's `dp_host` section
(`gobrrr.calibrate.sections.dp_host`).

FSDP2 runs Python at every unit's pre- and post-forward and pre- and post-backward (copy-in
and copy-out of the all-gather, reshard, the reduce-scatter's copy-in, DTensor bookkeeping).
Measured per unit and phase beyond an unwrapped model's host time, over the unit's parameter
tensors, on the slowest rank. Here: the least-squares line through the points measured on the
nearest rank count (by ratio) with the same reshard_after_forward and phase, evaluated at the
unit's parameter count (never below zero, nor below the smallest point where the line would
fall under it). No section: 0 (the hooks cost only the ops they run).

The same section measures the ranks' skew (`rank_skew`): run together, the slowest rank issues
the same host work later than the average one, and every collective waits for it."""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any


def hook_host_s(
    section: Mapping[str, Any] | None, phase: str, params: int, reshard: bool, ranks: int
) -> float:
    """Host seconds FSDP2's hooks add to one unit of `params` parameter tensors in `phase`
    ("forward" | "backward") on `ranks` ranks."""
    points = [
        p
        for p in (section or {}).get("points", ())
        if p.get("phase") == phase and bool(p.get("reshard")) == bool(reshard)
    ]
    if not points or ranks < 2:
        return 0.0
    nearest = _nearest_ranks(points, ranks)
    xs = [float(p["params"]) for p in points if int(p["ranks"]) == nearest]
    ys = [float(p["seconds"]) for p in points if int(p["ranks"]) == nearest]
    a, b = _line(xs, ys)
    return max(a + b * params, min(ys), 0.0)


def _nearest_ranks(points: list[Mapping[str, Any]], ranks: int) -> int:
    """The rank count measured among `points` nearest `ranks` by ratio (the smaller on a tie)."""
    return min({int(p["ranks"]) for p in points}, key=lambda r: (abs(math.log(r / ranks)), r))


def _line(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """(intercept, slope) of the least-squares line; one distinct x: (its mean, 0)."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    var = sum((x - mx) ** 2 for x in xs)
    if var == 0:
        return my, 0.0
    b = sum((x - mx) * (y - my) for x, y in zip(xs, ys, strict=True)) / var
    return my - b * mx, b


def rank_skew(section: Mapping[str, Any] | None, phase: str, ranks: int) -> float:
    """How much longer the slowest of `ranks` ranks takes to issue a phase's host work than
    the average rank ("forward" | "backward"; >= 1): the section's `skew` points at the
    nearest measured rank count (by ratio), the one with the most host seconds (the closest
    to a real step's). No points, or one rank: 1."""
    points = [p for p in (section or {}).get("skew", ()) if p.get("phase") == phase]
    if not points or ranks < 2:
        return 1.0
    nearest = _nearest_ranks(points, ranks)
    longest = max((p for p in points if int(p["ranks"]) == nearest), key=lambda p: p["host_s"])
    return max(float(longest["factor"]), 1.0)
