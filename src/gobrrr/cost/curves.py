"""Reading calibration measurements: curves over one size and grids over two, interpolated
linearly in log size and clamped at their edges."""

from __future__ import annotations

import math


def measured(
    curves: dict[str, list[list[float]]],
    direction: str,
    dtype: str,
    x: float,
    variants: tuple[str, ...] = (),
) -> float | None:
    """A calibration curve {"direction:bf16" | "direction:fp32": [[x, value], ...]} at x
    (linear in log x, clamped), for a tensor of `dtype`: the first of `variants` measured
    ("direction:bf16:<variant>", e.g. a layout), else the plain curve; None when not
    measured."""
    points = curve_points(curves, direction, dtype, variants)
    if not points:
        return None
    return interp([math.log(p[0]) for p in points], [p[1] for p in points], math.log(max(x, 1.0)))


def curve_points(
    curves: dict[str, list[list[float]]], direction: str, dtype: str, variants: tuple[str, ...] = ()
) -> list[list[float]] | None:
    """The points `measured` reads: "direction:bf16|fp32:<variant>" for the first of
    `variants` measured, else "direction:bf16|fp32"; None when neither was."""
    key = f"{direction}:{'bf16' if dtype in ('bfloat16', 'float16') else 'fp32'}"
    return next(
        (curves[f"{key}:{v}"] for v in variants if curves.get(f"{key}:{v}")), curves.get(key)
    )


def curve(points: list[list[float]] | None, flops: float) -> float:
    """Achieved fraction of the large-matmul rate at this size (log-linear interpolation)."""
    if not points:
        return 1.0
    flops = max(flops, 1.0)
    if flops <= points[0][0]:
        return points[0][1] * flops / points[0][0]  # below the range: latency-bound
    return interp([math.log(p[0]) for p in points], [p[1] for p in points], math.log(flops))


def interp(xs: list[float], ys: list[float], x: float) -> float:
    """Piecewise-linear in x, clamped at the ends."""
    if x <= xs[0]:
        return ys[0]
    for i in range(1, len(xs)):
        if x <= xs[i]:
            t = (x - xs[i - 1]) / (xs[i] - xs[i - 1])
            return ys[i - 1] + t * (ys[i] - ys[i - 1])
    return ys[-1]


def grid_value(points: list[list[float]], mn: float, k: float) -> float:
    """A value measured on a [[mn, k, value]] grid of (output elements, depth), at (mn, k):
    linear in log k along each measured mn (over the depths measured there: the grid may be
    ragged), then in log mn, clamped at the grid's edges."""
    rows: dict[float, list[tuple[float, float]]] = {}
    for p in points:
        rows.setdefault(p[0], []).append((math.log(p[1]), p[2]))
    lk = math.log(max(k, 1.0))
    mns = sorted(rows)
    at_mn = [interp(*zip(*sorted(rows[m]), strict=True), lk) for m in mns]
    return interp([math.log(m) for m in mns], at_mn, math.log(max(mn, 1.0)))


def grid(points: list[list[float]], mn: float, k: float) -> float:
    """Achieved FLOP/s at (output elements, depth) from a measured [[mn, k, rate]] grid;
    below the grid the rate falls in proportion (fewer tiles to spread over the SMs, or less
    depth to amortise each tile over)."""
    mns = min(p[0] for p in points)
    ks = min(p[1] for p in points)
    return grid_value(points, mn, k) * min(1.0, mn / mns) * min(1.0, k / ks)
