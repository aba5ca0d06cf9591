"""The zoo's compact allocator trace (written on a GPU by benchmarks/zoo/diagnose.py), and
where gobrrr's predicted allocator sequence departs from it.

    PYTHONPATH=src:. python -m zoo.allocdiff tests/fixtures/zoo_diagnose_h100.json \
        [--cases NAME,NAME] [--step 4] [--show 40]

For each case traced by benchmarks/zoo/diagnose.py: the real events are replayed through
gobrrr.memory.allocator (a check that the replay itself is exact on them: its reserved and allocated
peaks against the GPU's), the case is predicted on the CPU and its process replayed as
gobrrr.memory.replay does, recording the same kind of events. Printed: per step, the segments each
side obtained (bytes, pool) and the op that asked; the allocated bytes by op name; and the
first runs where the request sequences of one step differ (difflib over (op, bytes); over
bytes alone for a trace recorded with diagnose.py --plain, whose events carry no op).
"""

from __future__ import annotations

import argparse
import difflib
import json
from collections import Counter, defaultdict
from pathlib import Path

from gobrrr.memory import replay as memory  # the step replay: STEPS, _Process, scratch
from gobrrr.memory.allocator import SMALL_SIZE, CachingAllocator, replay

MiB = 2**20
KINDS = {"alloc": 0, "free_completed": 1, "segment_alloc": 2, "segment_free": 3}


# -- the trace, as the GPU side writes it ---------------------------------------------------


def compact_trace(trace: list[dict], marks: list[tuple], phases: list[tuple]) -> dict:
    """The allocator's events as [kind, bytes | alloc id, op]; `op` indexes the returned ops
    (only ops that own an event are kept; -1: before the first op). A free names the alloc it
    frees by its index among the allocs (its address matched to the live alloc there)."""
    live: dict[int, int] = {}  # address -> alloc id
    events, ops, op_ids = [], [], {}
    n_alloc = n_free = 0
    i = -1
    for e in trace:
        kind = KINDS.get(e["action"])
        if kind is None:
            continue
        while i + 1 < len(marks) and marks[i + 1][0] <= n_alloc and marks[i + 1][1] <= n_free:
            i += 1
        op = -1 if i < 0 else op_ids.setdefault(i, len(op_ids))
        if op == len(ops):
            ops.append(list(marks[i][2:]))
        if kind == 0:
            live[e["addr"]] = n_alloc
            events.append([0, e["size"], op])
            n_alloc += 1
        elif kind == 1:
            events.append([1, live.pop(e["addr"], -1), op])
            n_free += 1
        else:  # a segment: its address too (replays break best-fit ties by address)
            events.append([kind, e["size"], op, e["addr"]])
    starts = [[name, _event_at(events, trace_counts)] for name, trace_counts in phases]
    return {"events": events, "ops": ops, "phase_starts": starts}


def _event_at(events: list[list], counts: tuple[int, int]) -> int:
    """Index of the first event after `counts` (allocs, frees) had been made."""
    a = f = 0
    for k, ev in enumerate(events):
        if a >= counts[0] and f >= counts[1]:
            return k
        a += ev[0] == 0
        f += ev[0] == 1
    return len(events)


# -- the real side ---------------------------------------------------------------------------


def real_steps(row: dict) -> list[dict]:
    """The row's events split at each step's forward: [{"name", "events"}], each event
    (kind, bytes, op label, alloc id) with the op label "aten op @ module|node"."""
    strings, ops = row["strings"], row["ops"]
    starts = [(0, "build")] + [
        (i, n.split(":")[0]) for n, i in row["phase_starts"] if n.endswith(":forward")
    ]
    sizes, out = {}, []
    n_alloc = 0
    bounds = [s for s, _ in starts[1:]] + [len(row["events"])]
    for (start, name), stop in zip(starts, bounds, strict=True):
        evs = []
        for ev in row["events"][start:stop]:
            kind, x, op = ev[0], ev[1], ev[2]
            label = _label(strings, ops[op]) if op >= 0 else "build"
            if kind == 0:
                sizes[n_alloc] = x
                evs.append((0, x, label, n_alloc))
                n_alloc += 1
            elif kind == 1:
                evs.append((1, sizes.get(x, 0), label, x))
            else:
                evs.append((kind, x, label, ev[3] if len(ev) > 3 else None))
        out.append({"name": name, "events": evs})
    return out


def _label(strings: list[str], op: list[int]) -> str:
    """ "mm @ module" (forward) or "mm @ MmBackward0" (backward): the op's name without its
    namespace and overload, as gobrrr's OpNode.name."""
    parts = strings[op[0]].split(".")
    name = parts[1] if len(parts) >= 2 else parts[0]
    where = strings[op[1]] or strings[op[3]]
    return f"{name} @ {where}" if where else name


def replay_real(row: dict) -> dict:
    """The real events through gobrrr's allocator, with cudaMalloc's addresses (and with the
    modelled ones, which differ where equal-size free blocks compete); the peaks beside the
    GPU's own."""
    evs = [
        ("a", e[3], e[1]) if e[0] == 0 else ("f", e[3])
        for s in real_steps(row)
        for e in s["events"]
        if e[0] in (0, 1)
    ]
    addrs = [e[3] for s in real_steps(row) for e in s["events"] if e[0] == 2]
    full = replay(evs, addresses=addrs)
    return {
        "reserved_replayed": full.stats.reserved_peak,
        "segments": full.stats.segments_peak,
        "reserved_modelled_addresses": replay(evs).stats.reserved_peak,
        "reserved_gpu": row["max_memory_reserved"],
        "segments_gpu": row["stats"].get("segment.all.peak"),
    }


# -- the predicted side ----------------------------------------------------------------------


class RecordingAllocator(CachingAllocator):
    """gobrrr's allocator, keeping (kind, bytes, op label, id) events as the diagnose JSON."""

    def __init__(self, label) -> None:
        super().__init__()
        self.events: list[tuple] = []
        self.label = label
        self._sizes: dict[int, int] = {}

    def malloc(self, nbytes: int, stream: str = "compute") -> int:
        h = super().malloc(nbytes, stream)
        self._sizes[h] = nbytes
        self.events.append((0, nbytes, self.label(), h))
        return h

    def free(self, handle: int) -> None:
        super().free(handle)
        self.events.append((1, self._sizes.pop(handle), self.label(), handle))

    def _new_segment(self, size: int, small: bool, stream: str):
        b = super()._new_segment(size, small, stream)
        if b is not None:
            self.events.append((2, size, self.label(), None))
        return b


def predicted_steps(est, steps: int = memory.STEPS) -> list[dict]:
    """The prediction's process replayed as gobrrr.memory.replay does, split like `real_steps`."""
    g = est.graph
    cal = est.memory_cal if est.memory_cal is not None else est.cal
    ws = memory.blas_workspace_ops(g, est.gpu, cal)
    scratch = memory.step_scratch(g, cal)
    proc = memory._Process(g, ws, scratch, None)
    where = {"node": None}

    def label():
        n = where["node"]
        return "build" if n is None else f"{n.name} @ {n.module or n.phase}"

    proc.alloc = RecordingAllocator(label)
    cuts = []

    def op(node):
        if node.index == 0:
            cuts.append(len(proc.alloc.events))
        where["node"] = node

    proc.watch = op
    proc.run(steps)
    bounds = [0, *cuts, len(proc.alloc.events)]
    names = ["build"] + [f"step{i + 1}" for i in range(len(cuts))]
    return [
        {"name": n, "events": proc.alloc.events[a:b]}
        for n, a, b in zip(names, bounds[:-1], bounds[1:], strict=True)
    ]


# -- the comparison --------------------------------------------------------------------------


def segments(step: dict) -> list[str]:
    return [
        f"{e[1] / MiB:8.1f} MiB {'S' if e[1] == 2 * MiB else 'L'}  {e[2]}"
        for e in step["events"]
        if e[0] == 2
    ]


def by_op(step: dict) -> Counter:
    """Bytes requested per op name in one step."""
    c: Counter = Counter()
    for e in step["events"]:
        if e[0] == 0:
            c[e[2].split(" @ ")[0]] += e[1]
    return c


def _key(e, plain: bool = False) -> tuple:
    return (e[1],) if plain else (e[2].split(" @ ")[0], e[1] if e[0] == 0 else -1)


def sequence_diff(real: dict, pred: dict, show: int, plain: bool = False) -> list[str]:
    """The runs where the two steps' alloc sequences differ, up to `show` lines; `plain`:
    compared by bytes alone (the real events carry no op)."""
    ra = [e for e in real["events"] if e[0] == 0]
    pa = [e for e in pred["events"] if e[0] == 0]
    sm = difflib.SequenceMatcher(
        None, [_key(e, plain) for e in ra], [_key(e, plain) for e in pa], autojunk=False
    )
    out = []
    for tag, i1, i2, j1, j2 in sm.get_opcodes():
        if tag == "equal":
            continue
        out.append(f"  {tag} real[{i1}:{i2}] pred[{j1}:{j2}]")
        for e in ra[i1 : min(i2, i1 + 4)]:
            out.append(f"     real {e[1]:>12d}  {e[2]}")
        for e in pa[j1 : min(j2, j1 + 4)]:
            out.append(f"     pred {e[1]:>12d}  {e[2]}")
        if len(out) >= show:
            break
    return out


def unmatched(real: dict, pred: dict) -> list[tuple[str, int, int, Counter]]:
    """Per op name: the requests one side makes and the other does not (sizes as a multiset),
    as (op, bytes only real, bytes only predicted, {size: +n real / -n predicted})."""
    r, p = defaultdict(Counter), defaultdict(Counter)
    for e in real["events"]:
        if e[0] == 0:
            r[e[2].split(" @ ")[0]][e[1]] += 1
    for e in pred["events"]:
        if e[0] == 0:
            p[e[2].split(" @ ")[0]][e[1]] += 1
    out = []
    for op in set(r) | set(p):
        diff = Counter(r[op])
        diff.subtract(p[op])
        diff = Counter({k: v for k, v in diff.items() if v})
        if diff:
            out.append(
                (
                    op,
                    sum(k * v for k, v in diff.items() if v > 0),
                    -sum(k * v for k, v in diff.items() if v < 0),
                    diff,
                )
            )
    return sorted(out, key=lambda t: -(t[1] + t[2]))


def report(row: dict, step: int, show: int) -> list[str]:
    from zoo import compare
    from zoo.cases import get_case

    out = [f"== {row['name']}"]
    if "error" in row:
        return out + [f"  error: {row['error']}"]
    out.append(f"  replay of the real events: {replay_real(row)}")
    real = real_steps(row)
    est = compare.predict(get_case(row["name"]))
    pred = predicted_steps(est)
    out.append(
        f"  predicted reserved {est.memory.reserved / MiB:.1f} MiB, real "
        f"{row['max_memory_reserved'] / MiB:.1f} MiB"
    )
    for r, p in zip(real, pred, strict=False):
        out.append(
            f"  {r['name']}: segments real {len(segments(r))} "
            f"({sum(e[1] for e in r['events'] if e[0] == 2) / MiB:.0f} MiB), predicted "
            f"{len(segments(p))} ({sum(e[1] for e in p['events'] if e[0] == 2) / MiB:.0f}"
            f" MiB); allocs real {sum(e[0] == 0 for e in r['events'])} predicted "
            f"{sum(e[0] == 0 for e in p['events'])}"
        )
    r, p = real[step], pred[step]
    plain = bool(row.get("plain"))
    if plain:  # no op labels on the real side: segments and the bytes sequence only
        for name, s in (("real", r), ("predicted", p)):
            out.append(f"  step {step} {name} segments:")
            out += ["    " + x for x in segments(s)[:30]]
        out.append(f"  step {step} first differences (bytes):")
        return out + sequence_diff(r, p, show, plain=True)
    rb, pb = by_op(r), by_op(p)
    out.append(f"  step {step} bytes requested by op (MiB, real / predicted), largest gaps:")
    gaps = sorted(set(rb) | set(pb), key=lambda k: -abs(rb[k] - pb[k]))[:15]
    out += [f"    {k:40s} {rb[k] / MiB:10.1f} {pb[k] / MiB:10.1f}" for k in gaps]
    out.append(
        f"  step {step} requests on one side only, by op (MiB only real / only "
        "predicted; sizes: +count real, -count predicted):"
    )
    for op, only_r, only_p, diff in unmatched(r, p)[:20]:
        sizes = ", ".join(f"{k}:{v:+d}" for k, v in sorted(diff.items(), key=lambda kv: -kv[0])[:6])
        out.append(f"    {op:40s} {only_r / MiB:9.1f} {only_p / MiB:9.1f}  {sizes}")
    for name, s in (("real", r), ("predicted", p)):
        out.append(f"  step {step} {name} segments:")
        out += ["    " + x for x in segments(s)[:30]]
    out.append(f"  step {step} first differences:")
    out += sequence_diff(r, p, show)
    return out


def small_large(step: dict) -> dict:
    """Requests by pool (small: <= 1 MiB) in one step: counts and bytes."""
    d = defaultdict(int)
    for e in step["events"]:
        if e[0] == 0:
            pool = "small" if e[1] <= SMALL_SIZE else "large"
            d[f"{pool}_n"] += 1
            d[f"{pool}_bytes"] += e[1]
    return dict(d)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("results")
    ap.add_argument("--cases")
    ap.add_argument("--step", type=int, default=1, help="which step to diff (0: the build)")
    ap.add_argument("--show", type=int, default=40)
    args = ap.parse_args(argv)
    doc = json.loads(Path(args.results).read_text())
    want = set(args.cases.split(",")) if args.cases else None
    for row in doc["alloc"]:
        if want is None or row["name"] in want:
            print("\n".join(report(row, args.step, args.show)), flush=True)


if __name__ == "__main__":
    main()
