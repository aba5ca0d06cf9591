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

Across ranks (every rank's kernels on one clock; one host's ranks share it):

    payload = starts(kernels, clock_ns)         # this rank's NCCL starts: what the ranks swap
    latest, note = match(every_payload, clock_ns)
    summary = communication(kernels, latest, note)   # or rank_communication(kernels, exchange)

the k-th NCCL kernel of a collective on one rank is the same collective as the k-th of that
collective on every other rank (ranks issue collectives in one order). Its kernel splits at
the latest start over the ranks: before it the kernel WAITS for peers not there yet (rank
skew: a slow CPU, a host-bound FSDP2 forward), after it the collective TRANSFERS. A
prediction of ranks in lockstep predicts the transfer, not the wait. Added per rank:
`comm_wait_s` (union of the waits), `comm_transfer_busy_s` (union of the transfers),
`comm_transfer_exposed_s` (the transfers' union no other kernel overlaps) and
`comm_wait_exposed_s` (the rest of `comm_exposed_s`: exposed = transfer exposed + wait
exposed), per collective `wait_s`, `transfer_busy_s`, `transfer_exposed_s`, and `kernels`: per
NCCL kernel in start order its collective, `k`, start (s from the rank's first kernel), wait,
transfer and exposed transfer, to set beside a prediction's collectives; `comm_split` says
what was matched. Where the ranks' counts differ there is no split (its figures None) and
`comm_split` says so; busy and exposed stay the rank's own.

Only the standard library is used: `steps.py` loads this file by its path on a GPU machine
where the rest of gobrrr need not import.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

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


def communication(
    kernels: Iterable[Kernel], latest: dict[str, list[float]] | None = None, note: str = ""
) -> dict:
    """One rank's profiled step (its GPU kernels) summarised in seconds: `comm_busy_s`,
    `comm_exposed_s`, `compute_busy_s` (the union of every other kernel), `span_s` (first
    kernel's start to last kernel's end), `nccl_kernels` (count) and `collectives`: per
    collective {"kernels", "busy_s", "exposed_s"}. With `note` (what `match` says), the
    split into waiting and transfer is added: at `latest` (per collective, the latest start
    over the ranks of its k-th kernel, on this rank's clock), or None figures where `latest`
    is None (the ranks' counts differ)."""
    kernels = list(kernels)
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
    out = {
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
    if note:
        _add_split(out, comm, compute_u, latest, note)
    return out


#: the figures the split adds to a rank's summary, and to each collective's
SPLIT_KEYS = (
    "comm_wait_s",
    "comm_wait_exposed_s",
    "comm_transfer_busy_s",
    "comm_transfer_exposed_s",
)
COLLECTIVE_SPLIT_KEYS = ("wait_s", "transfer_busy_s", "transfer_exposed_s")


def _add_split(
    out: dict,
    comm: dict[str, list[Interval]],
    compute_u: list[Interval],
    latest: dict[str, list[float]] | None,
    note: str,
) -> None:
    """`out` (communication's summary) with the wait / transfer split, in place."""
    out["comm_split"] = note
    if latest is None:
        out.update(dict.fromkeys(SPLIT_KEYS))
        for c in out["collectives"].values():
            c.update(dict.fromkeys(COLLECTIVE_SPLIT_KEYS))
        return
    waits: list[Interval] = []
    transfers: list[Interval] = []
    each: list[dict] = []
    for op, ivs in comm.items():
        w, t = split(sorted(ivs), latest[op])
        waits += w
        transfers += t
        each += _each(op, sorted(ivs), latest[op], compute_u)
        out["collectives"][op].update(
            wait_s=length(union(w)),
            transfer_busy_s=length(union(t)),
            transfer_exposed_s=uncovered(union(t), compute_u),
        )
    transfer_u = union(transfers)
    out.update(
        comm_wait_s=length(union(waits)),
        # the exposed NCCL time that is no transfer: exposed = transfer exposed + this
        comm_wait_exposed_s=uncovered(union(waits + transfers), union(compute_u + transfer_u)),
        comm_transfer_busy_s=length(transfer_u),
        comm_transfer_exposed_s=uncovered(transfer_u, compute_u),
    )
    t0 = min([s for s, _ in compute_u] + [k["start_s"] for k in each], default=0.0)
    for k in each:
        k["start_s"] -= t0
    out["kernels"] = sorted(each, key=lambda k: k["start_s"])


def _each(
    op: str, kernels: Sequence[Interval], latest: Sequence[float], compute_u: list[Interval]
) -> list[dict]:
    """One record per NCCL kernel of collective `op` (in start order, `k`: its place among
    that collective's kernels): its start (s, this rank's clock), the seconds it waits for
    the other ranks, transfers, and transfers with no other kernel running (exposed)."""
    out = []
    for k, ((s, e), cut) in enumerate(zip(kernels, latest, strict=True)):
        cut = min(max(cut, s), e)
        out.append(
            {
                "op": op,
                "k": k,
                "start_s": s,
                "wait_s": cut - s,
                "transfer_s": e - cut,
                "transfer_exposed_s": uncovered([(cut, e)], compute_u) if e > cut else 0.0,
            }
        )
    return out


def split(kernels: Sequence[Interval], latest: Sequence[float]) -> tuple[list, list]:
    """(waits, transfers) of one collective's kernels on one rank, in start order, the k-th
    cut at `latest[k]` (s): its start to the latest start over the ranks waits, the rest
    transfers (a kernel that ended before the cut, which a clock's error can make, is all
    wait). Empty pieces are left out."""
    waits, transfers = [], []
    for (s, e), cut in zip(kernels, latest, strict=True):
        cut = min(max(cut, s), e)
        if cut > s:
            waits.append((s, cut))
        if e > cut:
            transfers.append((cut, e))
    return waits, transfers


def starts(kernels: Iterable[Kernel], clock_ns: int = 0) -> dict:
    """What one rank sends the others to match its collectives: {"clock_ns": the instant
    its kernel times count from (ns, an integer so that no precision is lost), "starts": per
    collective its NCCL kernels' starts in order (s from clock_ns)}."""
    out: dict[str, list[float]] = {}
    for name, s, _ in kernels:
        if is_nccl(name):
            out.setdefault(collective_of(name), []).append(s)
    return {"clock_ns": clock_ns, "starts": {op: sorted(ss) for op, ss in sorted(out.items())}}


def match(payloads: Sequence[dict], clock_ns: int = 0) -> tuple[dict[str, list[float]] | None, str]:
    """(per collective, the latest start over the ranks of its k-th kernel in seconds from
    `clock_ns` (the rank's own), a sentence on what was matched) from every rank's `starts`;
    (None, why) where the ranks ran different numbers of a collective."""
    ops = sorted({op for p in payloads for op in p["starts"]})
    counts = {op: [len(p["starts"].get(op, ())) for p in payloads] for op in ops}
    if differ := {op: n for op, n in counts.items() if len(set(n)) > 1}:
        said = "; ".join(f"{op}: {'/'.join(map(str, n))}" for op, n in differ.items())
        return None, (
            f"NCCL kernels per collective differ across the ranks ({said}): waiting and "
            f"transfer not split, busy and exposed are each rank's own"
        )
    latest = {}
    for op in ops:
        shifted = [
            [s + (p["clock_ns"] - clock_ns) / 1e9 for s in p["starts"][op]] for p in payloads
        ]
        latest[op] = [max(k) for k in zip(*shifted, strict=True)]
    kernels = sum(counts[op][0] for op in ops)
    return latest, f"matched {kernels} NCCL kernels per rank over {len(payloads)} ranks"


def rank_communication(
    kernels: Iterable[Kernel], exchange: Callable[[dict], list[dict]], clock_ns: int = 0
) -> dict:
    """`communication` of one rank's kernels with the split, its collectives matched with
    the other ranks' through `exchange` (this rank's `starts` -> every rank's, in rank
    order: an all-gather; every rank calls it once). `clock_ns`: the instant this rank's
    kernel times count from."""
    kernels = list(kernels)
    latest, note = match(exchange(starts(kernels, clock_ns)), clock_ns)
    return communication(kernels, latest, note)


def ranks_communication(
    kernels_by_rank: Sequence[Sequence[Kernel]], clocks_ns: Sequence[int] | None = None
) -> list[dict]:
    """`rank_communication` of every rank at once (kernels_by_rank[r]: rank r's kernels, its
    times from clocks_ns[r], default 0 for all)."""
    clocks = list(clocks_ns) if clocks_ns is not None else [0] * len(kernels_by_rank)
    payloads = [starts(k, c) for k, c in zip(kernels_by_rank, clocks, strict=True)]
    return [
        rank_communication(k, lambda _: payloads, c)
        for k, c in zip(kernels_by_rank, clocks, strict=True)
    ]
