"""Micro-batch pass: the step graph at any micro-batch, derived from traces at two.

A step traced at micro-batches b1 < b2 runs, for the workloads gobrrr traces, the same ops on
the same storages at both; only integers differ: tensor shapes, strides and offsets, integer
arguments (view sizes, split sizes, numels; whole-number floats such as the token count a
router's auxiliary loss divides by), storage bytes, meta.tokens and counts in meta's
assumptions. Each is taken as an exact affine function of the micro-batch,

    v(b) = v1 + (v2 - v1) * (b - b1) / (b2 - b1),

so `BatchFamily.at(b)` gives the graph at any b >= b1 without tracing (llama3-70b at seq
4096, 18.7k ops: ~0.25 s, where one trace takes 6-9 s). Where the step's structure itself
depends on the batch (other ops, storages or allocation order; a float that is not a count),
or an integer cannot follow it (a batch x batch tensor grows quadratically; a count that is
not whole per sample), the family refuses with `BatchDependentStructure`: each micro-batch
must then be traced.

Where to trace: TRACE_AT = (2, 4).
- Not at 1, and 1 is traced, not derived: a batch of one specialises. Slicing a one-row batch
  leaves it contiguous, so HF's shifted-label loss skips a copy of the logits; a broadcast
  position embedding's gradient needs no sum over the batch (HF GPT-2); channels-last pooling
  squeezes once more (torchvision ResNets); a clone keeps a size-1 dimension's stride
  (Whisper's labels). gobrrr's built-ins happen to derive 1 exactly; most zoo models do not.
- 4 and not 3: an integer whose change from 2 to 4 is odd is not a whole number per sample
  (rounded or halved somewhere, e.g. wav2vec2's SpecAugment mask count): odd b then raises
  instead of guessing.
Two traces cannot tell an affine integer from one that merely agrees at b1 and b2 (a count
drawn at random while the batch is built); `check` holds a derived graph against a fresh
trace, for tests and the planner's `--verify`.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from gobrrr.errors import GobrrrError
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo
from gobrrr.graph.meta import StepMeta
from gobrrr.passes import gc_paused
from gobrrr.workload import Workload, iter_tensors

#: The micro-batches the planner traces a workload at, to derive every other one.
TRACE_AT = (2, 4)

_META_OWN = ("passes", "micro_batch")  # meta keys this pass writes


class BatchDependentStructure(GobrrrError):
    """The step graph is not the same list of ops at two micro-batches (or one of its
    integers does not follow the batch linearly): trace each micro-batch instead."""


class _Lin:
    """An integer leaf that varies: v1 at b1, v1 + d at b2 (a float where the traces held a
    whole-number float, e.g. a token count a loss divides by)."""

    __slots__ = ("d", "is_float", "v1")

    def __init__(self, v1: int, d: int, is_float: bool = False) -> None:
        self.v1, self.d, self.is_float = v1, d, is_float


@dataclass(frozen=True)
class Mismatch:
    """The first place a derived graph differs from a traced one.

    Fields:
        where: "node 12 (aten.view.default)", "storage 7" or "meta".
        field: the field that differs ("args", "outputs[0]", "nbytes", "tokens", ...).
        derived: its value in the derived graph.
        traced: its value in the traced graph.
    """

    where: str
    field: str
    derived: Any
    traced: Any

    def __str__(self) -> str:
        return f"{self.where}: {self.field} derived {self.derived!r}, traced {self.traced!r}"


# -- diffing two traces -----------------------------------------------------------------------


def _refuse(where: str, what: str, v1: Any, v2: Any, b1: int, b2: int) -> BatchDependentStructure:
    return BatchDependentStructure(
        f"the step's structure depends on the micro-batch: {where}: {what} is {v1!r} at "
        f"micro-batch {b1} and {v2!r} at {b2}",
        hint="each micro-batch must be traced (it cannot be derived from two traces)",
    )


_NUM = re.compile(r"-?\d+")


class _Differ:
    """Diffs two traces into templates: equal parts stay, varying integers become _Lin."""

    def __init__(self, b1: int, b2: int) -> None:
        self.b1, self.b2 = b1, b2
        self.deltas: list[tuple[int, str]] = []  # (v2 - v1, where) of every varying integer

    def fail(self, where: str, what: str, v1: Any, v2: Any) -> BatchDependentStructure:
        return _refuse(where, what, v1, v2, self.b1, self.b2)

    def lin(self, v1: int, v2: int, where: str, is_float: bool = False) -> _Lin:
        self.deltas.append((v2 - v1, where))
        return _Lin(v1, v2 - v1, is_float)

    def tree(self, a: Any, b: Any, where: str, what: str) -> Any:
        """A JSON value (args, kwargs, meta) with its varying integers as _Lin."""
        ta = type(a)
        if ta is not type(b):
            raise self.fail(where, what, a, b)
        if a == b:
            return a
        if ta is int:
            return self.lin(a, b, f"{where} {what}")
        if ta is float and a.is_integer() and b.is_integer():  # a count, as a float
            return self.lin(int(a), int(b), f"{where} {what}", is_float=True)
        if ta in (list, tuple) and len(a) == len(b):
            return ta(self.tree(x, y, where, what) for x, y in zip(a, b, strict=True))
        if ta is dict and a.keys() == b.keys():
            return {k: self.tree(a[k], b[k], where, f"{what}[{k!r}]") for k in a}
        if ta is str and _NUM.split(a) == _NUM.split(b):  # "4096 bins" and "8192 bins"
            return _Text(
                _NUM.split(a),
                self.tree(
                    [int(x) for x in _NUM.findall(a)],
                    [int(x) for x in _NUM.findall(b)],
                    where,
                    what,
                ),
            )
        raise self.fail(where, what, a, b)

    def ints(
        self, a: tuple[int, ...], b: tuple[int, ...], where: str, what: str
    ) -> tuple[tuple[int, int], ...]:
        """(position, v2 - v1) of each entry of two int tuples of one length that differs."""
        out = tuple((i, y - x) for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y)
        self.deltas.extend((d, f"{where} {what}[{i}]") for i, d in out)
        return out

    def tensor(self, t1: TensorInfo, t2: TensorInfo, where: str, what: str):
        """t1 itself where equal, else (t1, shape deltas, stride deltas, offset delta)."""
        if t1 == t2:
            return t1
        if (t1.dtype, t1.storage, len(t1.shape)) != (t2.dtype, t2.storage, len(t2.shape)):
            raise self.fail(where, what, t1, t2)
        shape = self.ints(t1.shape, t2.shape, where, f"{what}.shape")
        if len(shape) > 1:
            raise BatchDependentStructure(
                f"{where}: {what} has shape {t1.shape} at micro-batch {self.b1} and {t2.shape} "
                f"at {self.b2}: more than one dimension follows the batch, so its size grows "
                "faster than linearly (e.g. a batch x batch similarity matrix)",
                hint="each micro-batch must be traced (it cannot be derived from two traces)",
            )
        stride = self.ints(t1.stride, t2.stride, where, f"{what}.stride")
        offset = self.ints((t1.offset,), (t2.offset,), where, f"{what}.offset")
        return (t1, shape, stride, offset[0][1] if offset else 0)


class _Text:
    """A string whose numbers vary: its pieces between numbers, and the numbers' template."""

    __slots__ = ("nums", "parts")

    def __init__(self, parts: list[str], nums: list[Any]) -> None:
        self.parts, self.nums = parts, nums


# -- rebuilding at a micro-batch ---------------------------------------------------------------


def _fill(t: Any, k: int, den: int) -> Any:
    """The template `t` at b = b1 + k (every d * k divisible by den: checked before)."""
    tt = type(t)
    if tt is _Lin:
        v = t.v1 + t.d * k // den
        return float(v) if t.is_float else v
    if tt is list:
        return [_fill(x, k, den) for x in t]
    if tt is tuple:
        return tuple(_fill(x, k, den) for x in t)
    if tt is dict:
        return {key: _fill(v, k, den) for key, v in t.items()}
    if tt is _Text:
        nums = _fill(t.nums, k, den)
        return "".join(p + (str(nums[i]) if i < len(nums) else "") for i, p in enumerate(t.parts))
    return t


def _bump(
    values: tuple[int, ...], deltas: tuple[tuple[int, int], ...], k: int, den: int
) -> tuple[int, ...]:
    out = list(values)
    for i, d in deltas:
        out[i] += d * k // den
    return tuple(out)


def _tensor_at(r: Any, k: int, den: int) -> TensorInfo:
    if type(r) is TensorInfo:
        return r
    t, shape, stride, doff = r
    return TensorInfo(
        _bump(t.shape, shape, k, den) if shape else t.shape,
        _bump(t.stride, stride, k, den) if stride else t.stride,
        t.dtype,
        t.storage,
        t.offset + doff * k // den,
    )


def _node_at(r: Any, k: int, den: int) -> OpNode:
    if type(r) is OpNode:
        return r
    n, ins, outs, args, kwargs = r
    return OpNode(
        index=n.index,
        op=n.op,
        phase=n.phase,
        module=n.module,
        inputs=tuple(_tensor_at(t, k, den) for t in ins) if ins is not None else n.inputs,
        outputs=tuple(_tensor_at(t, k, den) for t in outs) if outs is not None else n.outputs,
        args=_fill(args, k, den) if args is not None else n.args,
        kwargs=_fill(kwargs, k, den) if kwargs is not None else n.kwargs,
        allocs=n.allocs,
        frees=n.frees,
        stream=n.stream,
        saved=n.saved,
    )


# -- the family ---------------------------------------------------------------------------------


class BatchFamily:
    """One workload's step graph at every micro-batch, from its traces at b1 < b2.

    `at(b)` gives the graph at micro-batch b (samples per forward/backward): derived for
    b >= b1, traced (once, by `trace`) below b1, where a batch of one specialises. `check(g, b)`
    holds the derivation against a fresh trace. Raises BatchDependentStructure when the two
    traces are not one structure (then each micro-batch must be traced).

    Attributes: b1, b2 (the traced micro-batches); step (b - b1 must be a multiple of it to
    derive b: 1 unless some integer changes by a fraction per sample); varying (how many
    integers of the step follow the batch).
    """

    def __init__(
        self,
        g1: StepGraph,
        b1: int,
        g2: StepGraph,
        b2: int,
        trace: Callable[[int], StepGraph] | None = None,
    ) -> None:
        for name, b in (("b1", b1), ("b2", b2)):
            _check_batch(b, name)
        if b1 >= b2:
            raise GobrrrError(
                f"a batch family needs two micro-batches b1 < b2, got b1={b1}, "
                f"b2={b2}: trace at two sizes, e.g. {TRACE_AT}"
            )
        self.b1, self.b2, self.graph1 = b1, b2, g1
        self._trace = trace
        self._traced: dict[int, StepGraph] = {}
        differ = _Differ(b1, b2)
        self._nodes = _diff_nodes(differ, g1, g2)
        self._storages = _diff_storages(differ, g1, g2)
        self._meta = differ.tree(
            _own_meta(g1.meta, False), _own_meta(g2.meta, False), "meta", "meta"
        )  # in its JSON form: integers at the leaves
        self.step, self._coarsest = _period(differ.deltas, b2 - b1)
        self.varying = len(differ.deltas)  # integers that follow the batch

    def at(self, b: int) -> StepGraph:
        """The step graph at micro-batch `b` (>= 1): derived without tracing where b >= b1;
        below b1 traced once with the family's trace function (see the module docstring).

        Raises BatchDependentStructure where b cannot be derived (b - b1 not a multiple of
        `self.step`; below b1 without a trace function): trace b then.
        """
        _check_batch(b, "micro_batch")
        if b >= self.b1:
            return self.derive(b)
        if self._trace is None:
            raise BatchDependentStructure(
                f"micro-batch {b} is below the smallest traced one ({self.b1}): a batch of one "
                "specialises (size-1 dimensions broadcast, squeeze, or skip a copy), so it is "
                "not derived",
                hint=f"trace micro-batch {b} (family() does it for you)",
            )
        if b not in self._traced:
            self._traced[b] = self._trace(b)
        g = self._traced[b]
        return StepGraph(
            nodes=g.nodes,
            storages=g.storages,
            version=g.version,
            meta=_with_pass(g.meta, b, traced=True),
        )

    def derive(self, b: int) -> StepGraph:
        """The affine derivation at micro-batch `b` (>= 1), below b1 too (what `check`
        tests; `at` traces there instead)."""
        _check_batch(b, "micro_batch")
        k, den = b - self.b1, self.b2 - self.b1
        if k % self.step:
            d, where = self._coarsest
            raise BatchDependentStructure(
                f"micro-batch {b} cannot be derived from traces at {self.b1} and {self.b2}: "
                f"{where} changes by {d} between them, which is not a whole number per sample",
                hint=f"trace micro-batch {b} (derivable: {self.b1} + multiples of {self.step})",
            )
        with gc_paused():  # ~10^5 small objects: a collection pass would double the time
            nodes = tuple(_node_at(r, k, den) for r in self._nodes)
            storages = tuple(
                s if type(s) is StorageInfo else _storage_at(s, k, den) for s in self._storages
            )
        _check_sizes(b, storages)
        filled = {**self.graph1.meta.to_dict(), **_fill(self._meta, k, den)}
        meta = _with_pass(StepMeta.from_dict(filled), b, traced=False)
        return StepGraph(nodes=nodes, storages=storages, meta=meta, version=self.graph1.version)

    def check(self, graph: StepGraph, b: int) -> Mismatch | None:
        """The first difference between `derive(b)` and `graph`, a fresh trace at b (None:
        equal node by node, storage by storage, and in meta but for this pass's own keys)."""
        return first_mismatch(self.derive(b), graph)


def family(
    trace: Callable[[int], StepGraph], b1: int = TRACE_AT[0], b2: int = TRACE_AT[1]
) -> BatchFamily:
    """Trace a workload at micro-batches b1 and b2 (`trace(b)` -> StepGraph, e.g.
    `lambda b: capture(workload_factory(model, b, seq), precision=p)`) and return the family
    deriving every other micro-batch (and tracing those below b1 when asked for).

    A process's first trace of a model can differ from its later ones (torch.jit's profiling
    executor rewrites a scripted function after its first runs: DeBERTa's attention gains a
    detach), so where the two traces differ, b1 is traced once more before giving up."""
    g1, g2 = trace(b1), trace(b2)
    try:
        return BatchFamily(g1, b1, g2, b2, trace=trace)
    except BatchDependentStructure:
        return BatchFamily(trace(b1), b1, g2, b2, trace=trace)


def trace_sizes(source: Any) -> tuple[int, int]:
    """The two micro-batches to trace `source` at for a family: TRACE_AT. A Workload object
    keeps its own batch and each micro-batch is cut from it (its first samples), so only
    its batch size and smaller can be traced: a batch under TRACE_AT[1] samples raises
    BatchDependentStructure, and each micro-batch asked for is traced instead. (A function
    or a built-in name builds the batch at each micro-batch: TRACE_AT.)"""
    if isinstance(source, Workload):
        first = next(iter(iter_tensors(source.batch)), None)
        own = int(first.shape[0]) if first is not None and first.dim() else 1
        if own < TRACE_AT[1]:
            raise BatchDependentStructure(
                f"the workload's batch is fixed at {own} samples, fewer than the "
                f"{TRACE_AT[1]} a family is traced at: each micro-batch is traced"
            )
    return TRACE_AT


def _with_pass(meta: StepMeta, b: int, traced: bool) -> StepMeta:
    """`meta` with the micro-batch set and this pass appended to meta.passes."""
    step = {"pass": "micro_batch", "micro_batch": b, **({"traced": True} if traced else {})}
    return meta.with_pass(step, micro_batch=b)


def _check_batch(b: Any, name: str) -> None:
    if type(b) is not int or b < 1:
        raise GobrrrError(f"{name} must be a whole number >= 1, got {b!r}")


def _own_meta(meta: StepMeta, keep: bool) -> dict[str, Any]:
    """`meta`'s JSON form, with only (keep) or without this pass's own keys."""
    return {k: v for k, v in meta.to_dict().items() if (k in _META_OWN) == keep}


def _diff_nodes(differ: _Differ, g1: StepGraph, g2: StepGraph) -> tuple[Any, ...]:
    if len(g1.nodes) != len(g2.nodes):
        raise differ.fail("the graph", "the number of ops", len(g1.nodes), len(g2.nodes))
    return tuple(
        n1 if n1 == n2 else _diff_node(differ, n1, n2)
        for n1, n2 in zip(g1.nodes, g2.nodes, strict=True)
    )


def _diff_node(differ: _Differ, n1: OpNode, n2: OpNode) -> tuple[Any, ...]:
    where = f"node {n1.index} ({n1.op})"
    for what in ("op", "phase", "module", "allocs", "frees"):
        if getattr(n1, what) != getattr(n2, what):
            raise differ.fail(where, what, getattr(n1, what), getattr(n2, what))
    ios = []
    for what in ("inputs", "outputs"):
        a, b = getattr(n1, what), getattr(n2, what)
        if len(a) != len(b):
            raise differ.fail(where, f"the number of {what}", len(a), len(b))
        pairs = enumerate(zip(a, b, strict=True))
        ios.append(
            None
            if a == b
            else tuple(differ.tensor(x, y, where, f"{what}[{i}]") for i, (x, y) in pairs)
        )
    args = None if n1.args == n2.args else differ.tree(n1.args, n2.args, where, "args")
    kwargs = None if n1.kwargs == n2.kwargs else differ.tree(n1.kwargs, n2.kwargs, where, "kwargs")
    return (n1, ios[0], ios[1], args, kwargs)


def _diff_storages(differ: _Differ, g1: StepGraph, g2: StepGraph) -> tuple[Any, ...]:
    if len(g1.storages) != len(g2.storages):
        raise differ.fail("the graph", "the number of storages", len(g1.storages), len(g2.storages))
    out: list[Any] = []
    for s1, s2 in zip(g1.storages, g2.storages, strict=True):
        if s1 == s2:
            out.append(s1)
            continue
        for what in ("kind", "created", "freed", "label", "module"):
            if getattr(s1, what) != getattr(s2, what):
                raise differ.fail(f"storage {s1.id}", what, getattr(s1, what), getattr(s2, what))
        differ.ints((s1.nbytes,), (s2.nbytes,), f"storage {s1.id}", "nbytes")
        out.append((s1, s2.nbytes - s1.nbytes))
    return tuple(out)


def _storage_at(r: tuple[StorageInfo, int], k: int, den: int) -> StorageInfo:
    s, d = r
    return StorageInfo(
        id=s.id,
        nbytes=s.nbytes + d * k // den,
        kind=s.kind,
        created=s.created,
        freed=s.freed,
        label=s.label,
        module=s.module,
    )


def _period(deltas: list[tuple[int, str]], den: int) -> tuple[int, tuple[int, str]]:
    """The smallest p such that every delta * p is divisible by den, and the delta that needs
    the largest share of it (for the error message)."""
    step, coarsest = 1, (0, "")
    for d, where in deltas:
        need = den // math.gcd(d, den)
        if need > 1 and step % need:
            step = math.lcm(step, need)
            coarsest = (d, where)
    return step, coarsest


def _check_sizes(b: int, storages: tuple[StorageInfo, ...]) -> None:
    """A size that reached below zero at b: the affine fit does not hold there."""
    if any(s.nbytes < 0 for s in storages):
        s = next(s for s in storages if s.nbytes < 0)
        raise BatchDependentStructure(
            f"micro-batch {b} cannot be derived: storage {s.id} would hold {s.nbytes} bytes",
            hint=f"trace micro-batch {b}",
        )


# -- comparing two graphs -------------------------------------------------------------------------


def first_mismatch(derived: StepGraph, traced: StepGraph) -> Mismatch | None:
    """The first difference between two step graphs, node by node, then storage by storage,
    then in meta (this pass's own keys left out); None when they are equal."""
    if len(derived.nodes) != len(traced.nodes):
        return Mismatch("graph", "ops", len(derived.nodes), len(traced.nodes))
    for a, b in zip(derived.nodes, traced.nodes, strict=True):
        if a != b:
            f = next(
                f
                for f in (
                    "op",
                    "phase",
                    "module",
                    "inputs",
                    "outputs",
                    "args",
                    "kwargs",
                    "allocs",
                    "frees",
                    "index",
                )
                if getattr(a, f) != getattr(b, f)
            )
            return Mismatch(f"node {a.index} ({a.op})", f, getattr(a, f), getattr(b, f))
    if len(derived.storages) != len(traced.storages):
        return Mismatch("graph", "storages", len(derived.storages), len(traced.storages))
    for a, b in zip(derived.storages, traced.storages, strict=True):
        if a != b:
            f = next(
                f
                for f in ("nbytes", "kind", "created", "freed", "label", "module", "id")
                if getattr(a, f) != getattr(b, f)
            )
            return Mismatch(f"storage {a.id}", f, getattr(a, f), getattr(b, f))
    ma, mb = _own_meta(derived.meta, False), _own_meta(traced.meta, False)
    for key in sorted(ma.keys() | mb.keys()):
        if ma.get(key) != mb.get(key):
            return Mismatch("meta", key, ma.get(key), mb.get(key))
    return None


__all__ = [
    "TRACE_AT",
    "BatchDependentStructure",
    "BatchFamily",
    "Mismatch",
    "family",
    "first_mismatch",
    "trace_sizes",
]
