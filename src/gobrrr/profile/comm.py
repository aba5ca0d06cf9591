"""Communication in a profiled multi-GPU step: NCCL kernels against every other kernel.

    summary = communication(kernels)   # kernels: [(name, start_s, end_s), ...] of one rank

NCCL runs each collective as one kernel on the GPU (its name says which: `ncclDevKernel_
AllGather_RING_LL(...)`, `ncclKernel_AllReduce_RING_LL_Sum_float(...)`). On one rank:
- busy: the length of the union of the NCCL kernels (seconds the GPU communicates);
- exposed: the part of that union no other kernel overlaps (communication the step waits
  for; a rank that reaches a collective first waits inside its kernel for the others, so this
  includes the skew between ranks);
- per collective (all_gather, reduce_scatter, all_reduce, ...): kernels, busy and exposed
  the same way over that collective's kernels alone.
Memcpy and memset count as other kernels, as they do in `benchmarks/multigpu/steps.py`.

Only the standard library is used: `steps.py` loads this file by its path on a GPU machine
where the rest of gobrrr need not import.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

Interval = tuple[float, float]
#: (kernel name, start s, end s)
Kernel = tuple[str, float, float]

#: kernel-name fragment (lower case, no underscores) -> collective, most specific first:
#: "reducescatter" and "allreduce" before "reduce", "allgather" before "gather"
_COLLECTIVES = (
    ("reducescatter", "reduce_scatter"),
    ("allgather", "all_gather"),
    ("allreduce", "all_reduce"),
    ("alltoall", "all_to_all"),
    ("broadcast", "broadcast"),
    ("sendrecv", "send_recv"),
    ("send", "send_recv"),
    ("recv", "send_recv"),
    ("reduce", "reduce"),
    ("gather", "gather"),
    ("scatter", "scatter"),
)


def is_nccl(name: str) -> bool:
    """Whether a GPU kernel is NCCL's (its name contains "nccl", any case)."""
    return "nccl" in name.lower()


def collective_of(name: str) -> str:
    """The collective an NCCL kernel runs, from its name: "all_gather", "reduce_scatter",
    "all_reduce", "broadcast", "send_recv", ...; "other" when the name says none."""
    # the part after the kernel's prefix and before its arguments: "AllGather_RING_LL"
    core = name.split("(", 1)[0].lower()
    for prefix in ("nccldevkernel_", "ncclkernel_"):
        core = core.removeprefix(prefix)
    core = core.replace("_", "")
    for fragment, collective in _COLLECTIVES:
        if fragment in core:
            return collective
    return "other"


def union(intervals: Iterable[Interval]) -> list[Interval]:
    """The sorted, disjoint intervals covering exactly what `intervals` cover (touching
    intervals merge)."""
    out: list[list[float]] = []
    for s, e in sorted(intervals):
        if out and s <= out[-1][1]:
            out[-1][1] = max(out[-1][1], e)
        else:
            out.append([s, e])
    return [(s, e) for s, e in out]


def length(intervals: Iterable[Interval]) -> float:
    """Summed length of intervals (seconds; a union's, so nothing counts twice)."""
    return sum(e - s for s, e in intervals)


def uncovered(a: Sequence[Interval], b: Sequence[Interval]) -> float:
    """Length of union `a` that union `b` does not cover (both sorted and disjoint, as
    `union` returns them)."""
    total, j = 0.0, 0
    for s, e in a:
        cur = s
        while j < len(b) and b[j][1] <= cur:
            j += 1
        k = j
        while k < len(b) and b[k][0] < e:
            if b[k][0] > cur:
                total += b[k][0] - cur
            cur = max(cur, b[k][1])
            k += 1
        if cur < e:
            total += e - cur
    return total


def communication(kernels: Iterable[Kernel]) -> dict:
    """One rank's profiled step (its GPU kernels) summarised in seconds: `comm_busy_s`,
    `comm_exposed_s`, `compute_busy_s` (the union of every other kernel), `span_s` (first
    kernel's start to last kernel's end), `nccl_kernels` (count) and `collectives`: per
    collective {"kernels", "busy_s", "exposed_s"}."""
    comm: dict[str, list[Interval]] = {}
    compute: list[Interval] = []
    for name, s, e in kernels:
        if is_nccl(name):
            comm.setdefault(collective_of(name), []).append((s, e))
        else:
            compute.append((s, e))
    every_comm = [iv for ivs in comm.values() for iv in ivs]
    comm_u, compute_u = union(every_comm), union(compute)
    every = union(every_comm + compute)
    return {
        "comm_busy_s": length(comm_u),
        "comm_exposed_s": uncovered(comm_u, compute_u),
        "compute_busy_s": length(compute_u),
        "nccl_kernels": len(every_comm),
        "span_s": (every[-1][1] - every[0][0]) if every else 0.0,
        "collectives": {
            op: {
                "kernels": len(ivs),
                "busy_s": length(union(ivs)),
                "exposed_s": uncovered(union(ivs), compute_u),
            }
            for op, ivs in sorted(comm.items())
        },
    }
