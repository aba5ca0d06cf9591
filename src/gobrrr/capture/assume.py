"""Values a fake-tensor trace must read, given under stated assumptions.

A training step may read a tensor's values: `.item()`, `bool(t)`, `nonzero`, boolean indexing,
`bincount` in mixture-of-experts routing, CTC's target lengths. Fake tensors have no values,
so each such op is answered here from what the trace knows about the tensor (`facts.Fact`):
exactly where the way it was made decides it (a uniform draw compared with 0, a mask of ids
that are all in range), else under a named assumption (checks pass, routing is balanced, a
mask selects every element). Every answer is recorded (kind, op, module, phase, count) and
lands in the graph's meta.assumptions; where no assumption is sound, one GobrrrError names
the op, the module and what to change.

While the workload is built, `RealSmall` runs ops on small real tensors for real (schedules
such as `torch.linspace(0, drop_path, depth).tolist()` need their values); the capture makes
what is left of them fake once the workload is built.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from gobrrr.capture.compiled import ignore_compile_internals
from gobrrr.capture.fact_table import FactTable
from gobrrr.capture.facts import INF, Fact, exact
from gobrrr.errors import GobrrrError

REAL_LIMIT = 1 << 16  # elements: a build-time op whose outputs are this small runs for real

KINDS = {
    "derived": "read exactly: the value follows from how the batch and constants were made",
    "check-passes": "checks take their common branch: any() of a test is False, all() True",
    "likely-draw": "a comparison with a random draw takes its more likely outcome",
    "balanced": "ids spread evenly over their bins (routing balanced across experts)",
    "all-selected": "a mask selects every element it could (an upper bound)",
    "upper-bound": "a count or length takes its largest possible value",
    "distinct": "unique finds every value it could (an upper bound)",
    "optimizer-scale": "a value the optimizer reads only scales its update: which ops run "
    "does not depend on it (taken as 1.0)",
}


@dataclass(frozen=True)
class Assumption:
    """`count` reads of kind `kind` (see KINDS) made by `op` in `module` during `phase`
    ("build" = while the workload was built); `value`: what the trace took."""

    kind: str
    what: str
    op: str
    module: str
    phase: str
    value: str
    count: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _all_real(args: tuple, kwargs: dict) -> bool:
    ins = _tensors((args, kwargs))
    return bool(ins) and not any(isinstance(t, FakeTensor) for t in ins)


def _python(value: float, dtype: torch.dtype) -> bool | int | float:
    if dtype == torch.bool:
        return bool(round(value))
    if dtype.is_floating_point or dtype.is_complex:
        return float(value)
    return int(round(value))


class Values:
    """What one capture knows about tensor values, what it assumed and where the host waited.

    `where()` says (module, phase, recorded ops so far) at the moment of a read; the capture
    points it at its driver while the step is traced."""

    def __init__(self) -> None:
        self.table = FactTable()
        self._counts: dict[tuple[str, str, str, str, str], int] = {}
        self.syncs: list[int] = []  # indices of recorded ops after which the host waits
        self.where: Callable[[], tuple[str, str, int | None]] = lambda: ("", "build", None)
        self.last: tuple[Any, int] | None = None  # the last op to return a tensor, and its id
        self.host = WeakTensorKeyDictionary()  # tensors a real step keeps in host memory

    def during(self, phase: str) -> None:
        """Reads from now on happen outside the recorded step, in `phase`."""
        self.where = lambda: ("", phase, None)

    def note(
        self, kind: str, func: Any, value: str, t: torch.Tensor | None = None, recorded: bool = True
    ) -> None:
        """Record one read of `t`. Unless `t` lives in host memory, the host waits for the
        GPU: at the op (`recorded`: it lands in the graph), else after the last recorded op."""
        module, phase, n = self.where()
        op = str(func).removesuffix(".default")
        key = (kind, op, module, phase, value)
        self._counts[key] = self._counts.get(key, 0) + 1
        if n is not None and not (t is not None and t in self.host):
            self.syncs.append(n if recorded else max(n - 1, 0))

    def follow_host(self, args: tuple, kwargs: dict, out: Any) -> None:
        """What an op computes from host tensors alone stays on the host."""
        ins = _tensors((args, kwargs))
        if ins and all(t in self.host for t in ins):
            for t in _tensors(out):
                self.host[t] = True

    def sync(self) -> None:
        """The op about to be recorded makes the host wait for the GPU (no value assumed)."""
        _, _, n = self.where()
        if n is not None:
            self.syncs.append(n)

    def assumptions(self) -> list[Assumption]:
        return [
            Assumption(k, KINDS[k], op, m, ph, v, c)
            for (k, op, m, ph, v), c in self._counts.items()
        ]

    def fail(self, func: Any, t: torch.Tensor | None, why: str) -> GobrrrError:
        module, phase, _ = self.where()
        fact = self.table.get(t) if t is not None else None
        origin = fact.origin if fact and fact.origin else ""
        if not origin and self.last is not None and self.last[1] == id(t):
            origin = str(self.last[0]).removesuffix(".default")
        made = f" of a tensor made by {origin}" if origin else ""
        return GobrrrError(
            f"the step reads tensor values ({str(func).removesuffix('.default')}{made}) in "
            f"module '{module or '<top>'}', phase {phase}, and no assumption about them is "
            f"sound: {why}. Make the value known when the workload is built (a Python number, "
            "or a tensor computed from constants), or move the read out of the training step"
        )

    def answerable(self, t: Any) -> bool:
        """Whether reads of `t`'s values can be answered as the GPU's run would answer them:
        its fact gives every element, or an expected value (exact, or under the fact's named
        basis), or bounds from the ops the step made it with (checks of such a tensor take
        their common branch, named). A tensor with no fact, or bounds alone from the user's
        batch, is not."""
        f = self.table.get(t) if isinstance(t, torch.Tensor) else None
        if f is None:
            return False
        return f.exact or f.mean is not None or f.origin != "a real tensor"

    # -- what a read answers ----------------------------------------------------------------

    def read(self, func: Any, t: torch.Tensor) -> bool | int | float:
        """`.item()` of a fake tensor."""
        f = self.table.get(t)
        if f is not None and f.exact:
            kind, value = "derived", f.lo
        elif f is not None and f.mean is not None and f.basis:
            kind, value = f.basis, f.mean
        elif (
            f is not None and f.hi < INF and not t.dtype.is_floating_point and t.dtype != torch.bool
        ):
            kind, value = "upper-bound", f.hi
        elif t.dtype.is_floating_point and self.where()[1] in ("warm-up", "optimizer"):
            kind, value = "optimizer-scale", 1.0  # Adafactor's norms, clipping factors
        else:
            raise self.fail(
                func,
                t,
                "its value is not bounded by how it was made, and a "
                "branch on it could go either way",
            )
        out = _python(value, t.dtype)
        odds = f" (p={value:.2f})" if kind == "likely-draw" and t.dtype == torch.bool else ""
        self.note(kind, func, f"{out!r}{odds}", t, recorded=False)
        return out

    def selected(self, func: Any, mask: torch.Tensor, numel: int) -> int:
        """How many elements of `mask` (broadcast to `numel`) are set."""
        f = self.table.get(mask)
        if f is not None and (f.lo > 0 or f.hi < 0):  # no element is zero
            kind, n = "derived", numel
        elif f is not None and f.boolean and f.mean is not None:  # exact (all 0: none), or expected
            kind, n = f.basis or "derived", int(round(f.mean * numel))
        else:
            kind, n = "all-selected", numel
        self.note(kind, func, f"{n} of {numel}", mask)
        return n

    def bound(self, func: Any, t: torch.Tensor, floor: int = 0) -> tuple[int, str]:
        """The largest value of integer tensor `t`, at least `floor` (bincount's minlength - 1),
        and the kind of read that gave it."""
        f = self.table.get(t)
        if t.numel() == 0:
            return floor, "derived"
        if f is None or f.hi == INF or f.lo < 0 and func.__name__.startswith("bincount"):
            raise self.fail(
                func, t, "the largest value decides the output's shape and nothing bounds it"
            )
        top = int(f.hi)
        return max(top, floor), "derived" if f.exact or top <= floor else "upper-bound"


class ValueMode(TorchDispatchMode):
    """Answers data-dependent ops on fake tensors (Values) and keeps the facts current.

    Sits just above FakeTensorMode: gobrrr's recorder, above it, records what it answers."""

    ignore_compile_internals = classmethod(ignore_compile_internals)

    def __init__(self, values: Values) -> None:
        super().__init__()
        self.values = values

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        try:
            if func is _GROUPED_MM and args[0].dtype not in (torch.bfloat16, torch.float16):
                out = _grouped_mm_fallback(self.values, func, args, kwargs)
            else:
                out = func(*args, **kwargs)
        except (DataDependentOutputException, DynamicOutputShapeException):
            out = self._resolve(func, args, kwargs)
        self.values.table.propagate(func, args, kwargs, out)
        if len(self.values.host):
            self.values.follow_host(args, kwargs, out)
        if isinstance(out, torch.Tensor):
            self.values.last = (func, id(out))
        return out

    def _resolve(self, func: Any, args: tuple, kwargs: dict) -> Any:
        if _all_real(args, kwargs):  # constants: their values are here
            with unset_fake_temporarily():
                return func(*args, **kwargs)
        handler = RESOLVERS.get(func.__name__.split(".")[0])
        if handler is None:
            t = next(iter(_tensors(args)), None)
            raise self.values.fail(func, t, "gobrrr has no rule for this op")
        return handler(self.values, func, args, kwargs)


# -- resolvers: (values, func, args, kwargs) -> what the op returns ------------------------------


def _item(v: Values, func: Any, args: tuple, kwargs: dict) -> Any:
    return v.read(func, args[0])


def _nonzero(v: Values, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    x = args[0]
    n = v.selected(func, x, x.numel())
    out = torch.empty((n, x.dim()), dtype=torch.long, device=x.device)
    v.table.set(out, Fact(0, max(max(x.shape, default=1) - 1, 0), origin=str(func)))
    return out


def _masked_select(v: Values, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    x, mask = args[0], args[1] if len(args) > 1 else kwargs["mask"]
    numel = torch.broadcast_shapes(x.shape, mask.shape).numel()
    return x.new_empty((v.selected(func, mask, numel),))


def _long_indices(v: Values, func: Any, indices: list) -> list:
    """Each boolean index becomes the long indices of the elements it selects."""
    out: list = []
    for ix in indices:
        if isinstance(ix, torch.Tensor) and ix.dtype in (torch.bool, torch.uint8):
            n = v.selected(func, ix, ix.numel())
            for size in ix.shape:
                long = torch.empty((n,), dtype=torch.long, device=ix.device)
                v.table.set(long, Fact(0, max(size - 1, 0)))
                out.append(long)
        else:
            out.append(ix)
    return out


def _index(v: Values, func: Any, args: tuple, kwargs: dict) -> Any:
    x, indices, *rest = args
    return func(x, _long_indices(v, func, list(indices)), *rest, **kwargs)


def _bincount(v: Values, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    x = args[0]
    weights = args[1] if len(args) > 1 else kwargs.get("weights")
    minlength = args[2] if len(args) > 2 else kwargs.get("minlength", 0)
    top, kind = v.bound(func, x, minlength - 1)
    length = top + 1
    v.note(kind, func, f"{length} bins", x)
    dtype = (
        torch.long
        if weights is None
        else (torch.double if weights.dtype != torch.float else torch.float)
    )
    out = torch.empty((length,), dtype=dtype, device=x.device)
    if weights is None and length:
        v.table.set(out, Fact(0, x.numel(), x.numel() / length, "balanced", origin=str(func)))
    return out


def _repeat_interleave(v: Values, func: Any, args: tuple, kwargs: dict) -> Any:
    repeats = args[0]
    f = v.table.get(repeats)
    if f is not None and f.mean is not None and (f.exact or f.basis):
        n = int(round(f.mean * repeats.numel()))
        v.note("derived" if f.exact else f.basis, func, str(n), repeats)
    elif f is not None and f.hi < INF:
        n = int(f.hi) * repeats.numel()
        v.note("upper-bound", func, str(n), repeats)
    else:
        raise v.fail(func, repeats, "the output length is the sum of the repeats")
    return func(*args, **{**kwargs, "output_size": n})


def _unique(v: Values, func: Any, args: tuple, kwargs: dict) -> tuple:
    x = args[0]
    name = func.__name__.split(".")[0]
    schema = [a.name for a in func._schema.arguments]

    def flag(key: str) -> bool:
        i = schema.index(key) if key in schema else -1
        return bool(args[i] if 0 <= i < len(args) else kwargs.get(key, False))

    f = v.table.get(x)
    n = x.numel()
    if f is not None and f.hi < INF and f.lo > -INF and not x.dtype.is_floating_point:
        n = min(n, int(f.hi - f.lo) + 1)
    v.note("derived" if f is not None and f.exact else "distinct", func, f"{n} of {x.numel()}", x)
    values = x.new_empty((n,))
    inverse = x.new_empty(x.shape if flag("return_inverse") else (0,), dtype=torch.long)
    if name == "_unique":
        return values, inverse
    counts = x.new_empty((n,) if flag("return_counts") else (0,), dtype=torch.long)
    return values, inverse, counts


def _ctc_loss(v: Values, func: Any, args: tuple, kwargs: dict) -> tuple:
    log_probs, _, _, target_lengths = args[:4]
    if isinstance(target_lengths, torch.Tensor):
        longest, kind = v.bound(func, target_lengths)
    else:
        longest, kind = max(target_lengths, default=0), "derived"
    v.note(kind, func, f"longest target {longest}", log_probs)
    steps, batch = log_probs.shape[0], log_probs.shape[1]
    return (log_probs.new_empty((batch,)), log_probs.new_empty((batch, steps, 2 * longest + 1)))


_GROUPED_MM = getattr(torch.ops.aten, "_grouped_mm", None)
_GROUPED_MM = _GROUPED_MM.default if _GROUPED_MM is not None else None


def _grouped_mm_fallback(v: Values, func: Any, args: tuple, kwargs: dict) -> torch.Tensor:
    """`_grouped_mm` on other than 16-bit inputs (fp32 under autocast: CUDA autocast has no
    rule for it, and Hugging Face's experts cast the input to the fp32 weight): CUDA runs its
    fallback, which copies `offs` to the host (the host waits) and loops over the groups, one
    matmul each, in fp32. PyTorch's meta function refuses these dtypes; the output's shape is
    the 16-bit call's, its dtype the inputs'."""
    a, b, *rest = args
    stand_in = [
        torch.empty_strided(t.shape, t.stride(), dtype=torch.bfloat16, device=t.device)
        for t in (a, b)
    ]
    ref = func(*stand_in, *rest, **{k: w for k, w in kwargs.items() if k != "out_dtype"})
    dtype = kwargs.get("out_dtype") or (rest[2] if len(rest) > 2 else None) or a.dtype
    v.sync()
    return torch.empty_strided(ref.shape, ref.stride(), dtype=dtype, device=a.device)


RESOLVERS: dict[str, Callable[..., Any]] = {
    "_local_scalar_dense": _item,
    "item": _item,
    "nonzero": _nonzero,
    "argwhere": _nonzero,
    "masked_select": _masked_select,
    "index": _index,
    "index_put": _index,
    "index_put_": _index,
    "_index_put_impl_": _index,
    "bincount": _bincount,
    "repeat_interleave": _repeat_interleave,
    "_unique2": _unique,
    "_unique": _unique,
    "unique_consecutive": _unique,
    "_ctc_loss": _ctc_loss,
}


_FACTORIES = (
    "rand",
    "randn",
    "randint",
    "randperm",
    "zeros",
    "ones",
    "full",
    "empty",
    "arange",
    "linspace",
    "tensor",
    "as_tensor",
    "scalar_tensor",
    "eye",
)


class HostMode(TorchFunctionMode):
    """While the step is traced: a tensor made by a factory function without a `device`
    (`torch.rand([])` in Hugging Face's LayerDrop) lives in host memory on a GPU run too, and
    so does what is computed from it alone; reading it does not make the host wait for the
    GPU. The trace's fake tensors are all on the CPU, so only the call says so."""

    def __init__(self, values: Values) -> None:
        super().__init__()
        self.values = values
        self.factories = {getattr(torch, n) for n in _FACTORIES}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if (
            func in self.factories
            and kwargs.get("device") is None
            and isinstance(out, torch.Tensor)
        ):
            self.values.host[out] = True
        return out


# -- the build: small tensors real -------------------------------------------------------------


class RealSmall(TorchDispatchMode):
    """While the workload is built: an op none of whose inputs is fake and whose outputs are
    small CPU tensors (at most REAL_LIMIT elements in all) runs for real, so constructors that
    read what they compute (`linspace(...).tolist()`, `unique`) get values. Larger outputs stay
    fake: a 70B model still builds without memory."""

    def __init__(self, limit: int = REAL_LIMIT) -> None:
        super().__init__()
        self.limit = limit
        self._made: set[int] = set()  # the storages it made real (their _cdata)

    def made(self, t: torch.Tensor) -> bool:
        """`t` is a real tensor whose storage this mode made (not one from outside)."""
        return t.untyped_storage()._cdata in self._made

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)  # fake (or real, for a value read of real tensors)
        if any(isinstance(t, FakeTensor) for t in _tensors((args, kwargs))):
            return out
        outs = _tensors(out)
        if (
            not outs
            or not all(isinstance(t, FakeTensor) and t.device.type == "cpu" for t in outs)
            or sum(t.numel() for t in outs) > self.limit
        ):
            return out
        with unset_fake_temporarily():
            real = func(*args, **kwargs)
        self._made.update(t.untyped_storage()._cdata for t in _tensors(real))
        return real


def fake_copy(t: torch.Tensor, mode: Any, table: FactTable) -> torch.Tensor:
    """`t` as a fake tensor of `mode` (itself if it is one), keeping what its values say."""
    if isinstance(t, FakeTensor):
        return t
    fake = mode.from_tensor(t)
    if not t.is_floating_point():
        f = table.get(t)
        table.set(fake, f)
    return fake


__all__ = [
    "KINDS",
    "REAL_LIMIT",
    "Assumption",
    "HostMode",
    "RealSmall",
    "ValueMode",
    "Values",
    "exact",
    "fake_copy",
]
