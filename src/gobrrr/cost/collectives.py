"""The time of NCCL's collectives: all-reduce, all-gather and reduce-scatter, as a function of
the bytes moved, the ranks taking part and the link between them.

NCCL's own accounting (nccl-tests, PERFORMANCE.md) gives the model its shape. A ring
all-reduce of `S` bytes over `n` ranks sends and receives 2(n-1)/n · S bytes on every rank's
link; an all-gather or reduce-scatter whose whole buffer is `S` bytes, (n-1)/n · S. That
"bus" traffic over the link's bus bandwidth is the time of a large message; a small one costs
a fixed latency (the kernel launch, the protocol's handshakes and, as PyTorch calls it, the
host's issue) whatever its size. Between the two the achieved bus bandwidth climbs with the
size, so the calibrated figure is a curve per collective: the seconds measured over message
sizes on the ranks that were measured (`gobrrr.calibrate.sections.collectives`), read at the
size asked for, converted through the bus factor when the ranks differ. Without a calibration
the link's datasheet bandwidth, at the default efficiency, plus a default latency.

Sizes are always those of the *whole* buffer: the all-reduce's tensor, the all-gather's output,
the reduce-scatter's input (so a rank's shard is bytes / n).
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

COLLECTIVES = ("all_reduce", "all_gather", "reduce_scatter")


def bus_factor(op: str, ranks: int) -> float:
    """Bus bytes each rank's link carries per byte of the whole buffer: 2(n-1)/n for an
    all-reduce (a reduce-scatter then an all-gather), (n-1)/n for an all-gather or a
    reduce-scatter; 0 for one rank (nothing moves)."""
    if op not in COLLECTIVES:
        raise ValueError(f"unknown collective {op!r}: one of {', '.join(COLLECTIVES)}")
    if ranks <= 1:
        return 0.0
    return (2.0 if op == "all_reduce" else 1.0) * (ranks - 1) / ranks


@dataclass(frozen=True)
class Link:
    """What connects the ranks of a collective.

    Fields:
        name: e.g. "nvlink4" (one host's GPUs through NVSwitch), "ib-ndr400" (hosts).
        bytes_per_s: each GPU's datasheet bandwidth in one direction (bytes/s).
        efficiency: the share of it NCCL's bus bandwidth reaches on large messages, used only
            without a calibration.
        latency_s: the fixed cost of one collective (s), used only without a calibration.
    """

    name: str
    bytes_per_s: float
    efficiency: float = 0.8
    latency_s: float = 30e-6

    @property
    def bus_bytes_per_s(self) -> float:
        return self.bytes_per_s * self.efficiency


#: Datasheet links. NVLink 4 (H100 SXM): 900 GB/s in both directions together, 18 links of
#: 25 GB/s each way; NVLink 3 (A100 SXM): 600 GB/s; PCIe 5 x16: 64 GB/s each way; NDR
#: InfiniBand: 400 Gb/s a port, one port a GPU. Latencies: NCCL's ring latency is several
#: microseconds on NVLink and tens across hosts; PyTorch's issue adds its own.
LINKS: dict[str, Link] = {
    "nvlink4": Link("nvlink4", 450e9),
    "nvlink3": Link("nvlink3", 300e9),
    "pcie5": Link("pcie5", 64e9, latency_s=40e-6),
    "pcie4": Link("pcie4", 32e9, latency_s=40e-6),
    "ib-ndr400": Link("ib-ndr400", 50e9, efficiency=0.85, latency_s=60e-6),
}


@dataclass(frozen=True)
class Curve:
    """Measured seconds of one collective over message sizes on `ranks` ranks: `points` is
    ((bytes, seconds), ...) sorted by bytes, each the median of the calibration's rounds.
    Not forced to grow with the size: NCCL changes protocol (LL, LL128, Simple) and channel
    count with the size, and a 3 MiB reduce-scatter on two H100s ran in 26 us where 1 MiB took
    41 (`collectives_h100_x2of4.json`)."""

    op: str
    ranks: int
    points: tuple[tuple[int, float], ...]

    @staticmethod
    def from_points(op: str, ranks: int, points: Iterable[tuple[int, float]]) -> Curve:
        pts = sorted((int(b), float(s)) for b, s in points)
        if not pts:
            raise ValueError(f"no measured points for {op} on {ranks} ranks")
        return Curve(op, ranks, tuple(pts))

    def seconds(self, nbytes: float) -> float:
        """Seconds for a whole buffer of `nbytes`: interpolated between measured sizes in
        log-log space; below the smallest, its time (latency-bound); above the largest, the
        largest's bus bandwidth held."""
        pts = self.points
        if nbytes <= pts[0][0]:
            return pts[0][1]
        if nbytes >= pts[-1][0]:
            return pts[-1][1] * nbytes / pts[-1][0]
        for (b0, s0), (b1, s1) in zip(pts, pts[1:], strict=False):
            if b0 <= nbytes <= b1:
                f = math.log(nbytes / b0) / math.log(b1 / b0)
                return math.exp(math.log(s0) + f * (math.log(s1) - math.log(s0)))
        raise AssertionError("unreachable: nbytes lies inside the measured sizes")


def curves_from_measurement(
    points: Iterable[Mapping], dtype: str = "bf16"
) -> dict[tuple[str, int], Curve]:
    """{(op, ranks): Curve} from a collectives calibration's points (dicts with op, dtype,
    bytes, ranks, seconds), taking those in `dtype`."""
    grouped: dict[tuple[str, int], list[tuple[int, float]]] = {}
    for p in points:
        if p.get("dtype", dtype) == dtype and p.get("seconds"):
            grouped.setdefault((p["op"], int(p["ranks"])), []).append((p["bytes"], p["seconds"]))
    return {k: Curve.from_points(k[0], k[1], v) for k, v in grouped.items()}


def collective_time(
    op: str,
    nbytes: float,
    ranks: int,
    link: Link,
    curves: Mapping[tuple[str, int], Curve] | None = None,
) -> float:
    """Seconds one collective `op` over a whole buffer of `nbytes` takes on `ranks` ranks.

    With `curves` (a calibration's): the curve measured on these ranks; else the one measured
    on the nearest rank count (by ratio), its time turned into bus bandwidth at this size and
    back through this rank count's bus factor (the latency, the smallest size's time, kept
    as it is). Without one: latency + bus bytes over the
    link's bus bandwidth. One rank: 0 (PyTorch skips the call)."""
    factor = bus_factor(op, ranks)
    if factor == 0.0 or nbytes <= 0:
        return 0.0
    measured = [r for (o, r) in (curves or {}) if o == op]
    if not measured:
        return link.latency_s + nbytes * factor / link.bus_bytes_per_s
    nearest = min(measured, key=lambda r: (abs(math.log(r / ranks)), r))
    curve = curves[(op, nearest)]
    t = curve.seconds(nbytes)
    if nearest == ranks:
        return t
    latency = curve.points[0][1]  # the smallest size's time: paid whatever the ranks
    return latency + max(t - latency, 0.0) * factor / bus_factor(op, nearest)


#: the link between one host's GPUs and between hosts, as `data_parallel_time` assumes them
HOST_LINK, CROSS_LINK = "nvlink4", "ib-ndr400"


def data_parallel_time(
    op: str,
    nbytes: float,
    dtype: str,
    world: int,
    hosts: int,
    points: Iterable[Mapping] = (),
) -> float:
    """Seconds of one collective over all `world` ranks of a data-parallel job on `hosts`
    hosts. Within one host: NVLink, read off the measured `points` (a calibration's
    `collectives`) in the buffer's dtype ("bf16" or "fp32"; an op measured in bf16 only, as
    the all-gather, takes bf16's curve: its bytes are what move). Across hosts, kept simple:
    one ring over every rank, bounded by its slowest hop, the hosts' InfiniBand at its
    datasheet rate (the NVLink measurements say nothing of it); NCCL's trees and the
    hierarchy of a ring within each host are not modelled."""
    if hosts > 1:
        return collective_time(op, nbytes, world, LINKS[CROSS_LINK])
    pts = list(points)
    curves = curves_from_measurement(pts, "bf16")
    if dtype != "bf16":
        curves.update(curves_from_measurement(pts, dtype))
    return collective_time(op, nbytes, world, LINKS[HOST_LINK], curves)


def hsdp_time(
    op: str,
    nbytes: float,
    dtype: str,
    world: int,
    hosts: int,
    points: Iterable[Mapping] = (),
) -> float:
    """Seconds of one collective of HSDP over `world` ranks on `hosts` hosts (FSDP2's 2-D mesh:
    sharded within a host, replicated across): the all-gathers and reduce-scatters run among
    one host's world / hosts ranks over NVLink, read off the measured `points` as
    `data_parallel_time` reads them; the all-reduce of the gradient shards runs among one rank
    a host (`hosts` ranks) over the network (`CROSS_LINK`, its datasheet rate: each GPU has
    its own port, so a host's rings run side by side)."""
    if op == "all_reduce":
        return collective_time(op, nbytes, hosts, LINKS[CROSS_LINK])
    return data_parallel_time(op, nbytes, dtype, world // hosts, 1, points)


def parallel_time(
    kind: str,
    op: str,
    nbytes: float,
    dtype: str,
    world: int,
    hosts: int,
    points: Iterable[Mapping] = (),
) -> float:
    """Seconds of one collective of a data-parallel step of recipe `kind` (`meta.parallel`):
    "hsdp", `hsdp_time`; any other ("ddp", "fsdp": every collective over all ranks),
    `data_parallel_time`."""
    if kind == "hsdp":
        return hsdp_time(op, nbytes, dtype, world, hosts, points)
    return data_parallel_time(op, nbytes, dtype, world, hosts, points)
