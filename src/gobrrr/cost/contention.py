"""What a collective and the compute kernels beside it cost each other, read off the
calibration's contention grid (`gobrrr.calibrate.sections.contention`).

An NCCL kernel holds SMs from its launch to its end; a compute kernel that runs beside it
gets the rest of the chip, and the collective gets what the compute leaves. On 4 H100s the
grid measured matmuls 2-87% slower beside a resident all-reduce (a matmul whose tiles just
fill the SMs in whole waves loses a wave to the SMs NCCL holds; one far from a wave boundary
barely notices), memory-bound kernels 4-20% and attention 2-14%; the collectives ran 1.5-8x
slower beside compute. A step's kernels are of many shapes, so the model takes, per class of
compute kernel, the median of the grid's kernels of that class, and for the collective the
median over every kernel of the grid; both read at the collective's size (log-interpolated
between the grid's sizes, held beyond them).

    compute_slowdown(op, nbytes, klass) -> fraction: a compute kernel of `klass` ("matmul",
        "memory", "attention") runs (1 + fraction) x its time alone while the collective `op`
        of `nbytes` (whole buffer) is resident beside it;
    collective_stretch(op, nbytes) -> factor: the collective takes factor x its time alone
        while compute runs beside it.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

CLASSES = ("matmul", "memory", "attention")


@dataclass(frozen=True)
class Contention:
    """{op: ((bytes, {class: slowdown fraction}, stretch), ...) sorted by bytes}."""

    table: Mapping[str, tuple[tuple[int, Mapping[str, float], float], ...]]

    @staticmethod
    def from_points(points: Iterable[Mapping]) -> Contention | None:
        """From the grid's points ({op, bytes, class, kernel_alone_s, kernel_beside_s,
        collective_alone_s, collective_beside_s}); None without any."""
        grouped: dict[tuple[str, int], list[Mapping]] = {}
        for p in points:
            grouped.setdefault((p["op"], int(p["bytes"])), []).append(p)
        if not grouped:
            return None
        table: dict[str, list] = {}
        for (op, nbytes), ps in sorted(grouped.items()):
            slow = {
                k: statistics.median(
                    max(q["kernel_beside_s"] / q["kernel_alone_s"] - 1.0, 0.0)
                    for q in ps
                    if q["class"] == k
                )
                for k in CLASSES
                if any(q["class"] == k for q in ps)
            }
            stretch = statistics.median(
                max(q["collective_beside_s"] / q["collective_alone_s"], 1.0) for q in ps
            )
            table.setdefault(op, []).append((nbytes, slow, stretch))
        return Contention({op: tuple(rows) for op, rows in table.items()})

    def _read(self, op: str, nbytes: float, pick) -> float:
        rows = self.table.get(op)
        if not rows:
            return pick(None)
        if nbytes <= rows[0][0]:
            return pick(rows[0])
        if nbytes >= rows[-1][0]:
            return pick(rows[-1])
        for lo, hi in zip(rows, rows[1:], strict=False):
            if lo[0] <= nbytes <= hi[0]:
                f = math.log(nbytes / lo[0]) / math.log(hi[0] / lo[0])
                return pick(lo) + f * (pick(hi) - pick(lo))
        raise AssertionError("unreachable: nbytes lies inside the measured sizes")

    def compute_slowdown(self, op: str, nbytes: float, klass: str) -> float:
        """The fraction a compute kernel of `klass` slows by beside the collective."""
        return self._read(op, nbytes, lambda row: 0.0 if row is None else row[1].get(klass, 0.0))

    def collective_stretch(self, op: str, nbytes: float) -> float:
        """The factor the collective's time grows by beside compute."""
        return self._read(op, nbytes, lambda row: 1.0 if row is None else row[2])

    def compute_only(self) -> Contention:
        """The same compute slowdowns, the collectives never stretched."""
        return Contention(
            {op: tuple((b, slow, 1.0) for b, slow, _ in rows) for op, rows in self.table.items()}
        )
