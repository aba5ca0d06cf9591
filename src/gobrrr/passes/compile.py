"""The compile pass: what Inductor's generated kernels never allocate.

    graph = inductor(capture(workload, compile=True))   # capture(compile=True) applies it

A compiled capture (`gobrrr.capture.compiled`) records the ATen ops of the graphs
AOTAutograd partitioned, one by one, each output allocated as eager code would allocate it.
Inductor runs them differently: extern kernels (matmuls, convolutions, attention, custom ops
and fallbacks: `gobrrr.cost.fusion.extern`) alone, and each run of the ops between them as
fused kernels (`gobrrr.cost.fusion.fuse`, the groups the time model costs), whose
intermediate values stay in registers. So a tensor made inside a fused group is allocated
only if something outside the group reads it: an extern kernel, a later group, the
backward (the tensors the forward saves are its graph's outputs), the eager code after the
compiled region, or the next step. The rest become storages of 0 bytes (their ops keep their
shapes, so the time model still sees what the group computes); meta.inductor says how many
and how many bytes.

What is allocated, Inductor's generated code allocates and frees as its wrapper writes it
(`torch/_inductor/codegen/wrapper.py`, `scheduler.py`), not as eager code would:
- a kernel's inputs are freed after the kernel, so a fused group's outputs are allocated while
  every input it reads is still alive (eager frees an input after the op that last reads it,
  inside the group);
- a fused kernel writes an output in place into an input it is the last to read
  (`decide_inplace_update`): same dtype, the output's size 95-100% of the input's, and the
  input made inside this graph, or a tensor the forward saved for backward that is neither an
  input nor an output of the forward (a donated buffer, AOTAutograd's
  `collect_bw_donated_buffer_idxs`), a buffer made in the graph before a donated one (as
  Inductor's code chose where both were read last: tests/test_inductor_memory.py); a graph's
  own inputs are never reused;
- an allocation takes the buffer of a dead tensor made inside the same graph run with the
  same dtype and size (`AllocateLine.plan`, the memory planner's pool), which then stays
  allocated from that tensor's death to its reuse;
- a misaligned 16-bit matmul runs on zero-padded copies of its operands (pad_mm; the copies'
  bytes are `gobrrr.cost.pad_mm`'s, allocated with the matmul), and an operand read
  last by it is freed once its copy is made.
meta.inductor counts the buffers written in place ("in_place"), taken from the pool
("reused") and the matmuls padded ("padded").
"""

from __future__ import annotations

import dataclasses

from gobrrr.cost import pad_mm
from gobrrr.cost.flops import graph_costs
from gobrrr.cost.fusion import fuse, last_uses, regions
from gobrrr.graph.ir import StepGraph


def unallocated(graph: StepGraph) -> set[int]:
    """Storages made inside a fused group of a compiled region and read only inside it."""
    uses = last_uses(graph)
    out: set[int] = set()
    for g in fuse(graph, graph_costs(graph)):
        hi = g.nodes[-1]
        for i in g.nodes:
            for sid in graph.nodes[i].allocs:
                s = graph.storages[sid]
                if s.freed is not None and s.freed <= hi and uses.get(sid, i) <= hi:
                    out.add(sid)
    return out


def inductor(graph: StepGraph) -> StepGraph:
    """`graph` (a compiled capture: meta.compiled_regions) with the storages Inductor
    fuses away at 0 bytes, and the rest allocated and freed as Inductor's generated code
    does (see the module docstring). A graph without compiled regions is returned as it is."""
    if not graph.meta.compiled_regions or graph.meta.inductor:
        return graph
    gone = unallocated(graph)
    fused_bytes = sum(graph.storages[sid].nbytes for sid in gone)
    plan = _Planner(
        graph, [_Life(s.created, s.freed, 0 if s.id in gone else s.nbytes) for s in graph.storages]
    )
    counts = plan.run()
    storages = tuple(
        dataclasses.replace(s, created=life.created, freed=life.freed, nbytes=life.nbytes)
        for s, life in zip(graph.storages, plan.storages, strict=True)
    )
    meta = graph.meta.replace(
        inductor={"unallocated": len(gone), "unallocated_bytes": fused_bytes, **counts}
    )
    return dataclasses.replace(graph, nodes=tuple(plan.nodes), storages=storages, meta=meta)


IN_PLACE_MIN = 0.95  # an output written into an input holds 95-100% of its bytes


@dataclasses.dataclass
class _Life:
    """A storage's allocation as the planner moves it."""

    created: int
    freed: int | None
    nbytes: int


class _Planner:
    """Inductor's frees, in-place writes and buffer reuse over a compiled capture's graph
    (`storages`: copies, changed in place; `nodes`: the graph's nodes, replaced as their
    allocations and frees move)."""

    def __init__(self, graph: StepGraph, storages: list[_Life]) -> None:
        self.graph, self.storages = graph, storages
        self.nodes = list(graph.nodes)
        self.region = regions(graph)
        self.runs = graph.meta.compiled_regions
        self.costs = graph_costs(graph)
        self.made_by = graph.allocated_by()
        self.dtype: dict[int, str] = {}
        for n in graph.nodes:
            for t in (*n.outputs, *n.inputs):
                self.dtype.setdefault(t.storage, t.dtype)
        self.readers: dict[int, list[int]] = {}
        for n in graph.nodes:
            for sid in {t.storage for t in n.inputs}:
                self.readers.setdefault(sid, []).append(n.index)
        self.handed: set[int] = set()  # storages whose block another took over

    def run(self) -> dict[str, int]:
        groups = fuse(self.graph, self.costs)
        donated = self._donated()
        in_place = reused = 0
        held: dict[int, list[int]] = {}  # group's last op -> storages it freed late
        for g in groups:
            lo, hi = g.nodes[0], g.nodes[-1]
            for sid in self._dying_inputs(lo, hi):
                if self.storages[sid].freed != hi:
                    self._move_free(sid, hi)
                held.setdefault(hi, []).append(sid)
        for g in groups:
            lo, hi = g.nodes[0], g.nodes[-1]
            first = self.runs[self.region[lo]][1]
            free = [
                sid
                for sid in held.get(hi, ())
                if self.storages[sid].nbytes > 0
                and (self.storages[sid].created >= first or sid in donated)
            ]
            free.sort(key=lambda sid: self.storages[sid].created < first)  # donated last
            for out in self._outputs(lo, hi):
                for sid in free:
                    if sid not in self.handed and self._fits_in_place(sid, out):
                        self._take_over(sid, out)
                        in_place += 1
                        break
        for _, first, last in self.runs:
            reused += self._pool(first, last)
        return {"in_place": in_place, "reused": reused, "padded": self._padded()}

    def _padded(self) -> int:
        """A matmul operand that pad_mm copies and nothing reads after the matmul is freed
        once its copy is made, before the matmul runs (`cost.pad_mm`: the copies are the
        matmul's scratch). Returns how many matmuls pad."""
        made = pad_mm.by_op(self.graph, self.costs)
        for i, copies in made.items():
            for t, _ in copies:
                s = self.storages[t.storage]
                if (
                    s.freed == i
                    and 0 <= s.created < i
                    and s.nbytes > 0
                    and t.storage not in self.handed
                ):
                    self._move_free(t.storage, i - 1)
        return len(made)

    def _donated(self) -> set[int]:
        """Storages a forward run made and only backward runs read after it."""
        out: set[int] = set()
        for kind, first, last in self.runs:
            if kind != "forward":
                continue
            for sid, made in self.made_by.items():
                if not first <= made <= last:
                    continue
                later = [i for i in self.readers.get(sid, ()) if i > last]
                if later and all(
                    self.region[i] >= 0 and self.runs[self.region[i]][0] == "backward"
                    for i in later
                ):
                    out.add(sid)
        return out

    def _dying_inputs(self, lo: int, hi: int) -> list[int]:
        """Storages made before the group, read in it and freed inside it."""
        out = []
        for i in range(lo, hi + 1):
            for sid in {t.storage for t in self.nodes[i].inputs}:
                s = self.storages[sid]
                if (
                    s.nbytes > 0
                    and s.created < lo
                    and s.freed is not None
                    and lo <= s.freed <= hi
                    and sid not in out
                ):
                    out.append(sid)
        return out

    def _outputs(self, lo: int, hi: int) -> list[int]:
        """Storages the group allocates that outlive it, largest first."""
        made = [
            sid
            for i in range(lo, hi + 1)
            for sid in self.nodes[i].allocs
            if self.storages[sid].nbytes > 0 and self.made_by.get(sid) == i
        ]
        return sorted(made, key=lambda sid: -self.storages[sid].nbytes)

    def _fits_in_place(self, old: int, new: int) -> bool:
        a, b = self.storages[old].nbytes, self.storages[new].nbytes
        return self.dtype.get(old) == self.dtype.get(new) and IN_PLACE_MIN * a <= b <= a

    def _pool(self, first: int, last: int) -> int:
        """Allocations inside one graph run served by the buffer of a dead tensor made in the
        same run, of the same dtype and bytes (the memory planner's pool)."""
        pool: dict[tuple[str, int], list[int]] = {}
        frees: dict[int, list[int]] = {}
        for sid, made in self.made_by.items():
            s = self.storages[sid]
            if (
                first <= made <= last
                and s.nbytes > 0
                and s.freed is not None
                and made <= s.freed < last
            ):
                frees.setdefault(s.freed, []).append(sid)
        done = 0
        for i in range(first, last + 1):
            for sid in list(self.nodes[i].allocs):
                s = self.storages[sid]
                key = (self.dtype.get(sid, ""), s.nbytes)
                if s.nbytes > 0 and self.made_by.get(sid) == i and pool.get(key):
                    self._take_over(pool[key].pop(), sid)
                    done += 1
            for sid in frees.get(i, ()):
                s = self.storages[sid]
                if sid not in self.handed:  # its block went to another already
                    pool.setdefault((self.dtype.get(sid, ""), s.nbytes), []).append(sid)
        return done

    def _move_free(self, sid: int, to: int) -> None:
        """`sid` freed after op `to` instead."""
        at = self.storages[sid].freed
        node = self.nodes[at]
        self.nodes[at] = dataclasses.replace(node, frees=tuple(s for s in node.frees if s != sid))
        node = self.nodes[to]
        self.nodes[to] = dataclasses.replace(node, frees=(*node.frees, sid))
        self.storages[sid].freed = to

    def _take_over(self, old: int, new: int) -> None:
        """`new` is written into `old`'s block: `old` holds it until the op that makes `new`,
        which then holds it (at least its bytes). The storages keep what they are (an
        activation saved for backward, a gradient) and the ops what they make."""
        self.handed.add(old)
        self._move_free(old, self.made_by[new] - 1)
        s_old, s_new = self.storages[old], self.storages[new]
        s_new.nbytes = max(s_new.nbytes, s_old.nbytes)
