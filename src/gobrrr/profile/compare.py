"""Predicted vs measured: per op kind, per module, per phase and for the whole step.

The two sides meet at step-graph nodes: a measured op joined to node i (MeasuredOp.node) is
held against the prediction's op i (OpTime.index). Relative error = (predicted - measured) /
measured: +0.25 means the prediction is 25 % too slow, -0.25 25 % too fast.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import asdict, dataclass
from typing import Any

from gobrrr.profile.analyze import _top_module
from gobrrr.profile.result import ProfileResult


@dataclass(frozen=True)
class CompareRow:
    """Seconds predicted and measured for one group; rel_error None when nothing measured."""

    name: str
    predicted_s: float
    measured_s: float
    rel_error: float | None
    ops: int


@dataclass(frozen=True)
class Comparison:
    step: CompareRow
    kinds: tuple[CompareRow, ...]
    modules: tuple[CompareRow, ...]
    phases: tuple[CompareRow, ...]
    matched_ops: int  # measured ops held against a predicted op
    measured_ops: int

    def to_dict(self) -> dict:
        return asdict(self)


def _row(name: str, pred: float, meas: float, n: int) -> CompareRow:
    return CompareRow(name, pred, meas, (pred - meas) / meas if meas > 0 else None, n)


def compare(prediction: Any, result: ProfileResult) -> Comparison:
    """Hold a roofline Prediction (`.ops` with index/kind/module/phase/device_s, `.step_s`)
    against a ProfileResult profiled with the same StepGraph. Only joined ops enter the
    per-group rows, so both sides of a row cover the same ops."""
    by_index = {p.index: p for p in prediction.ops}
    sums: dict[str, dict[str, list[float]]] = {
        k: defaultdict(lambda: [0.0, 0.0, 0]) for k in ("kind", "module", "phase")
    }
    matched = 0
    for m in result.ops:
        p = by_index.get(m.node) if m.node >= 0 else None
        if p is None:
            continue
        matched += 1
        keys = {"kind": p.kind, "module": _top_module(p.module), "phase": p.phase}
        for what, key in keys.items():
            acc = sums[what][key]
            acc[0] += p.device_s
            acc[1] += m.device_s
            acc[2] += 1

    def rows(what: str) -> tuple[CompareRow, ...]:
        out = [_row(k, a[0], a[1], int(a[2])) for k, a in sums[what].items()]
        return tuple(sorted(out, key=lambda r: -r.measured_s))

    step = _row("step", float(prediction.step_s), result.step_s, len(result.ops))
    return Comparison(
        step=step,
        kinds=rows("kind"),
        modules=rows("module"),
        phases=rows("phase"),
        matched_ops=matched,
        measured_ops=len(result.ops),
    )
