"""What a fake-tensor trace knows about the values of tensors it does not have.

A `Fact` bounds every element of a tensor (lo <= x <= hi) and, where the way the tensor was
made says so, gives the expected element value (`mean`) and the assumption that expectation
rests on (`basis`). Facts come from the ops that make tensors (zeros, arange, randint, rand,
one_hot, the indices topk returns, ...) and from the values of real tensors, and they follow
the ops that transform them (views, casts, arithmetic, comparisons, reductions). A fact is
tied to its tensor's version counter: an in-place op it does not model makes it unknown.

    table = FactTable()
    table.propagate(func, args, kwargs, out)   # after each op
    table.get(t)                               # Fact | None
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

INF = math.inf
REAL_FACT_LIMIT = 1 << 16  # elements: real tensors up to this size get facts from their values


@dataclass(frozen=True)
class Fact:
    """Bounds on a tensor's elements, and their expected value where it is known.

    lo, hi: every element lies in [lo, hi] (±inf when unbounded).
    mean: the mean element value (for a bool tensor, the share of True), or None. With no
        `basis` it is the exact mean over the whole tensor (a slice of it does not keep it);
        with one it is each element's expected value under that assumption.
    basis: the assumption kind `mean` rests on ("" = none: it follows from how the tensor was
        made); see `gobrrr.capture.assume.KINDS`.
    uniform: elements are uniform draws on [lo, hi), so a comparison has a known probability.
    origin: the op that made the tensor (named in messages)."""

    lo: float
    hi: float
    mean: float | None = None
    basis: str = ""
    uniform: bool = False
    origin: str = ""

    @property
    def exact(self) -> bool:
        return self.lo == self.hi

    @property
    def boolean(self) -> bool:
        return self.lo >= 0 and self.hi <= 1


def exact(v: float, origin: str = "") -> Fact:
    return Fact(float(v), float(v), float(v), origin=origin)


def union(facts: list[Fact | None], weights: list[int] | None = None) -> Fact | None:
    """The fact of a tensor whose elements come from any of `facts` (cat, where, ...)."""
    if not facts or any(f is None for f in facts):
        return None
    mean = None
    if weights and all(f.mean is not None for f in facts) and sum(weights):
        mean = sum(f.mean * w for f, w in zip(facts, weights, strict=True)) / sum(weights)
    return Fact(min(f.lo for f in facts), max(f.hi for f in facts), mean,
                next((f.basis for f in facts if f.basis), ""))


def of_real(t: torch.Tensor) -> Fact | None:
    """Exact bounds of a small real tensor, from its values."""
    if t.numel() == 0 or t.numel() > REAL_FACT_LIMIT or t.is_complex() or t.device.type == "meta":
        return None
    with unset_fake_temporarily():  # it may be asked while a FakeTensorMode is active
        v = t.detach()
        lo, hi, mean = float(v.min()), float(v.max()), float(v.double().mean())
    return Fact(lo, hi, mean, origin="a real tensor")


def _mul(a: float, b: float) -> float:
    return 0.0 if a == 0 or b == 0 else a * b


def _span(a: Fact, b: Fact, fn: Callable[[float, float], float]) -> tuple[float, float]:
    vals = [fn(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    if any(math.isnan(v) for v in vals):
        return -INF, INF
    return min(vals), max(vals)


def _number(x: Any) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, torch.SymInt)


class FactTable:
    """Facts of live tensors, tied to each tensor's version counter."""

    def __init__(self) -> None:
        self._facts = WeakTensorKeyDictionary()

    def get(self, x: Any) -> Fact | None:
        """The fact of a tensor (or a Python number: exact), None when unknown."""
        if _number(x):
            return exact(x)
        if not isinstance(x, torch.Tensor):
            return None
        hit = self._facts.get(x)
        if hit is not None:
            version, fact = hit
            if _version(x) == version:
                return fact
            return None
        if not isinstance(x, FakeTensor):
            fact = of_real(x)
            if fact is not None:
                self.set(x, fact)
            return fact
        return None

    def set(self, t: torch.Tensor, fact: Fact | None, bump: int = 0) -> None:
        """Record `fact` for `t`; `bump` = 1 for an in-place op whose version counter is
        incremented once the op returns."""
        v = _version(t)
        if fact is None or v is None:
            self._facts.pop(t, None)
            return
        self._facts[t] = (v + bump, fact)

    def propagate(self, func: Any, args: tuple, kwargs: dict, out: Any) -> None:
        """Give the tensors `func` returned (or mutated) the facts its rule derives."""
        name = func.__name__.split(".")[0]  # "add_" of aten.add_.Tensor
        inplace = name.endswith("_") and not name.startswith("_") and bool(args) and \
            isinstance(args[0], torch.Tensor) and out is args[0]
        rule = RULES.get(name.rstrip("_") if inplace else name)
        if rule is None or not _wanted(out):
            return
        ctx = _Ctx(self, func, args, kwargs, out)
        try:
            facts = rule(ctx)
        except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
            facts = None  # an argument layout the rule does not know: the facts stay unknown
        outs = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
        if isinstance(facts, Fact) or facts is None:
            facts = [facts] * len(outs)
        origin = str(func).removesuffix(".default")
        for t, f in zip(outs, facts, strict=False):
            self.set(t, f if f is None or f.origin else replace(f, origin=origin),
                     bump=1 if inplace else 0)


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


def _wanted(out: Any) -> bool:
    return any(isinstance(t, torch.Tensor) for t in tree_leaves(out))


class _Ctx:
    """One op's arguments, as a rule reads them."""

    def __init__(self, table: FactTable, func: Any, args: tuple, kwargs: dict, out: Any):
        self.table, self.func, self.args, self.kwargs, self.out = table, func, args, kwargs, out
        self.names = [a.name for a in func._schema.arguments]

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def fact(self, i: int = 0, name: str = "self") -> Fact | None:
        return self.table.get(self.arg(i, name))

    @property
    def out0(self) -> torch.Tensor:
        return next(t for t in tree_leaves(self.out) if isinstance(t, torch.Tensor))

    def reduced(self, i: int = 0) -> int:
        """Elements of input `i` folded into each output element."""
        n_out = self.out0.numel()
        return self.args[i].numel() // n_out if n_out else 0

    def dim_size(self, dim_index: int, name: str = "dim") -> int:
        x = self.args[0]
        dim = self.arg(dim_index, name, None)
        if dim is None:
            return x.numel()
        return x.shape[dim] if x.dim() else 1


# -- rules: ctx -> Fact | list[Fact | None] | None -------------------------------------------

def _same(ctx: _Ctx) -> Fact | None:
    return ctx.fact()


def _cast(ctx: _Ctx) -> Fact | None:
    f, out, src = ctx.fact(), ctx.out0, ctx.args[0]
    if f is None:
        return None
    from_float = isinstance(src, torch.Tensor) and src.is_floating_point()
    if out.dtype == torch.bool:
        if f.lo > 0 or f.hi < 0:
            return exact(1)
        if f.lo == f.hi == 0:
            return exact(0)
        return f if f.boolean and not from_float else Fact(0, 1)  # 0/1 integers keep values
    if not out.is_floating_point() and not out.is_complex():
        keep = f.exact or not from_float
        return Fact(math.trunc(f.lo) if f.lo > -INF else -INF,
                    math.trunc(f.hi) if f.hi < INF else INF, f.mean if keep else None, f.basis)
    return f


def _subset(ctx: _Ctx) -> Fact | None:
    """A view or gather of some of the elements: an exact whole-tensor mean does not hold."""
    f = ctx.fact()
    if f is None or f.basis or f.exact or f.mean is None:
        return f
    return replace(f, mean=None)


def _const(value_index: int, name: str) -> Callable[[_Ctx], Fact | None]:
    def rule(ctx: _Ctx) -> Fact | None:
        f = ctx.fact(value_index, name)
        return f if f is not None and f.exact else None
    return rule


def _fill(v: float) -> Callable[[_Ctx], Fact]:
    return lambda ctx: exact(v)


def _arange(ctx: _Ctx) -> Fact | None:
    n = ctx.out0.numel()
    if n == 0:
        return None
    nums = [a for a in ctx.args if _number(a)]
    start, step = (0, 1) if len(nums) == 1 else (nums[0], nums[2] if len(nums) > 2 else 1)
    last = start + (n - 1) * step
    return Fact(min(start, last), max(start, last), (start + last) / 2)


def _rand(ctx: _Ctx) -> Fact:
    return Fact(0.0, 1.0, 0.5, "likely-draw", uniform=True)


def _uniform(ctx: _Ctx) -> Fact:
    lo, hi = ctx.arg(1, "from", 0.0), ctx.arg(2, "to", 1.0)
    return Fact(lo, hi, (lo + hi) / 2, "likely-draw", uniform=True)


def _randint(ctx: _Ctx) -> Fact:
    nums = [a for a in ctx.args if _number(a)]
    low, high = (0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
    return Fact(low, high - 1, (low + high - 1) / 2, "likely-draw", uniform=True)


def _randperm(ctx: _Ctx) -> Fact:
    n = ctx.args[0]
    return Fact(0, n - 1, (n - 1) / 2)  # a permutation: its mean is exact


def _bernoulli(ctx: _Ctx) -> Fact:
    p = ctx.arg(1, "p", None)
    return Fact(0, 1, float(p), "likely-draw") if _number(p) else Fact(0, 1)


def _linspace(ctx: _Ctx) -> Fact | None:
    a, b = ctx.arg(0, "start"), ctx.arg(1, "end")
    return Fact(min(a, b), max(a, b), (a + b) / 2) if _number(a) and _number(b) else None


def _binary(fn: Callable[[float, float], float], linear: bool = False
            ) -> Callable[[_Ctx], Fact | None]:
    def rule(ctx: _Ctx) -> Fact | None:
        a, b = ctx.fact(0), ctx.fact(1, "other")
        alpha = ctx.kwargs.get("alpha", 1)
        if a is None or b is None:
            return None
        if alpha != 1:
            b = Fact(*sorted((b.lo * alpha, b.hi * alpha)),
                     None if b.mean is None else b.mean * alpha, b.basis)
        lo, hi = _span(a, b, fn)
        mean = None
        if a.mean is not None and b.mean is not None and (linear or a.exact or b.exact):
            mean = fn(a.mean, b.mean)
        return Fact(lo, hi, mean, a.basis or b.basis)
    return rule


def _div(ctx: _Ctx) -> Fact | None:
    a, b = ctx.fact(0), ctx.fact(1, "other")
    if a is None or b is None or b.lo <= 0 <= b.hi:
        return None
    mode = ctx.kwargs.get("rounding_mode")
    rnd = {"floor": math.floor, "trunc": math.trunc}.get(mode, lambda v: v)
    lo, hi = _span(a, b, lambda x, y: x / y)
    lo, hi = rnd(lo) if lo > -INF else lo, rnd(hi) if hi < INF else hi
    mean = a.mean / b.mean if a.mean is not None and b.exact and (mode is None or lo == hi) \
        else None
    return Fact(lo, hi, mean, a.basis)


def _floordiv(ctx: _Ctx) -> Fact | None:
    ctx.kwargs = {**ctx.kwargs, "rounding_mode": "floor"}
    return _div(ctx)


def _neg(ctx: _Ctx) -> Fact | None:
    f = ctx.fact()
    return None if f is None else Fact(-f.hi, -f.lo, None if f.mean is None else -f.mean, f.basis)


def _not(ctx: _Ctx) -> Fact | None:
    f = ctx.fact()
    if f is None or not f.boolean:
        return None
    return Fact(1 - f.hi, 1 - f.lo, None if f.mean is None else 1 - f.mean, f.basis)


def _logic(both: bool) -> Callable[[_Ctx], Fact | None]:
    def rule(ctx: _Ctx) -> Fact | None:
        a, b = ctx.fact(0), ctx.fact(1, "other")
        if a is None or b is None or not (a.boolean and b.boolean):
            return None
        pick = min if both else max
        return Fact(pick(a.lo, b.lo), pick(a.hi, b.hi))
    return rule


def _clamp(ctx: _Ctx) -> Fact | None:
    f = ctx.fact()
    if f is None:
        return None
    name = ctx.func.__name__.split(".")[0].rstrip("_")
    lo = ctx.arg(1, "min") if name in ("clamp", "clamp_min") else None
    hi = ctx.arg(2, "max") if name == "clamp" else ctx.arg(1, "max") if name == "clamp_max" \
        else None
    lo = lo if _number(lo) else -INF
    hi = hi if _number(hi) else INF
    return Fact(min(max(f.lo, lo), hi), min(max(f.hi, lo), hi))


_CMP = {"lt": operator.lt, "le": operator.le, "gt": operator.gt, "ge": operator.ge,
        "eq": operator.eq, "ne": operator.ne}


def _decided(name: str, a: Fact, b: Fact, integral: bool) -> bool | None:
    """The comparison's value for every element, or None when the bounds leave it open.
    A uniform draw of floats never reaches its upper bound."""
    below = a.hi < b.lo or a.uniform and not integral and a.hi <= b.lo  # a < b everywhere
    if name in ("lt", "le", "gt", "ge"):
        true, false = {"lt": (below, a.lo >= b.hi), "le": (a.hi <= b.lo, a.lo > b.hi),
                       "gt": (a.lo > b.hi, a.hi <= b.lo), "ge": (a.lo >= b.hi, below)}[name]
    else:
        same = a.exact and b.exact and a.lo == b.lo
        apart = a.hi < b.lo or b.hi < a.lo
        true, false = (same, apart) if name == "eq" else (apart, same)
    return True if true else False if false else None


def _compare(ctx: _Ctx) -> Fact | None:
    a, b = ctx.fact(0), ctx.fact(1, "other")
    if a is None or b is None:
        return None
    name = ctx.func.__name__.split(".")[0].rstrip("_")
    x = ctx.args[0]
    integral = isinstance(x, torch.Tensor) and not x.is_floating_point()
    known = _decided(name, a, b, integral)
    if known is not None:
        return exact(float(known))
    return _likely(a, b, name, integral)


def _likely(a: Fact, b: Fact, name: str, integral: bool) -> Fact:
    """An undecided comparison: its probability where `a` is uniform (a random draw, ids
    spread evenly), else the comparison of `a`'s expected value under its assumption, else
    unknown."""
    p = _chance(a, b, name, integral) if a.uniform and a.hi > a.lo else None
    if p is not None:
        return Fact(0, 1, p, a.basis or "likely-draw")
    if a.mean is not None and b.exact and a.basis:
        return Fact(0, 1, float(_CMP[name](a.mean, b.lo)), a.basis)
    return Fact(0, 1)


def _chance(a: Fact, b: Fact, name: str, integral: bool) -> float | None:
    """P(a <op> b) for `a` uniform on [lo, hi) (floats) or on the integers lo..hi; `b` a
    constant, or for == and != any value inside a's range."""
    if name in ("eq", "ne"):
        if not integral or b.lo < a.lo or b.hi > a.hi:
            return None
        p = 1 / (a.hi - a.lo + 1)
        return p if name == "eq" else 1 - p
    if not b.exact:
        return None
    c = b.lo
    if integral:  # the share of lo..hi below c (or at most c)
        n = a.hi - a.lo + 1
        below = min(max(math.ceil(c) - a.lo, 0), n) / n
        at_most = min(max(math.floor(c) - a.lo + 1, 0), n) / n
    else:
        below = at_most = min(max((c - a.lo) / (a.hi - a.lo), 0.0), 1.0)
    return {"lt": below, "le": at_most, "gt": 1 - at_most, "ge": 1 - below}[name]


def _sum(ctx: _Ctx) -> Fact | None:
    f, n = ctx.fact(), ctx.reduced()
    if f is None or n == 0:
        return None if f is None else exact(0)
    if f.mean is not None and not f.basis and ctx.out0.numel() == 1:
        return exact(f.mean * n)  # the exact mean of all the elements, times their count
    return Fact(_mul(f.lo, n), _mul(f.hi, n), None if f.mean is None else f.mean * n, f.basis)


def _bounds(ctx: _Ctx) -> Fact | None:
    """A reduction to extremes (amax, amin): the bounds hold, a whole-tensor mean does not."""
    f = ctx.fact()
    return f if f is None or f.exact else Fact(f.lo, f.hi)


def _extreme(ctx: _Ctx) -> Fact | list[Fact | None] | None:
    f = _bounds(ctx)
    if len(ctx.args) > 1 and isinstance(ctx.args[1], torch.Tensor):  # max.other: elementwise
        return _binary(max if ctx.func.__name__.startswith("max") else min)(ctx)
    if isinstance(ctx.out, (tuple, list)):  # (values, indices) of max.dim / min.dim
        return [f, _chosen(ctx.dim_size(1))]
    return f


def _index_range(size: int) -> Fact:
    return Fact(0, max(size - 1, 0))


def _chosen(size: int) -> Fact:
    """Indices a selection picks (topk, argmax: the experts a router chooses), taken as
    spread evenly over the `size` candidates."""
    return Fact(0, max(size - 1, 0), (size - 1) / 2, "balanced", uniform=size > 1)


def _arg(ctx: _Ctx) -> Fact:
    return _chosen(ctx.dim_size(1))


def _topk(ctx: _Ctx) -> list[Fact | None]:
    dim = ctx.arg(2, "dim", -1)
    return [_bounds(ctx), _chosen(ctx.args[0].shape[dim] if ctx.args[0].dim() else 1)]


def _sort(ctx: _Ctx) -> list[Fact | None]:
    dim = ctx.arg(1, "dim", -1)
    if not isinstance(dim, int):  # sort.stable(self, *, stable, dim)
        dim = ctx.kwargs.get("dim", -1)
    if ctx.func.__name__.startswith("argsort"):
        return [_index_range(ctx.args[0].shape[dim] if ctx.args[0].dim() else 1)]
    return [ctx.fact(), _index_range(ctx.args[0].shape[dim] if ctx.args[0].dim() else 1)]


def _any(ctx: _Ctx) -> Fact | None:
    f, n = ctx.fact(), ctx.reduced()
    if f is None:
        return Fact(0, 1, 0.0, "check-passes")
    if n == 0 or f.lo == f.hi == 0:
        return exact(0)
    if f.lo > 0 or f.hi < 0 or f.mean is not None and not f.basis and f.boolean:
        return exact(float(f.lo > 0 or f.hi < 0 or f.mean > 0))  # some element is set
    if f.mean is not None and f.boolean and f.basis == "likely-draw":
        p = 1 - (1 - f.mean) ** n
        return Fact(0, 1, p, "likely-draw")
    return Fact(0, 1, 0.0, "check-passes")


def _all(ctx: _Ctx) -> Fact | None:
    f, n = ctx.fact(), ctx.reduced()
    if n == 0 or f is not None and (f.lo > 0 or f.hi < 0):
        return exact(1)
    if f is not None and (f.lo == f.hi == 0 or f.boolean and f.mean is not None
                          and not f.basis and f.mean < 1):
        return exact(0)
    return Fact(0, 1, 1.0, "check-passes")


def _cumsum(ctx: _Ctx) -> Fact | None:
    f, x = ctx.fact(), ctx.args[0]
    if f is None:
        return None
    n = x.shape[ctx.arg(1, "dim")] if x.dim() else 1
    return Fact(min(f.lo, _mul(f.lo, n)), max(f.hi, _mul(f.hi, n)))


def _histc(ctx: _Ctx) -> Fact:
    x, bins = ctx.args[0], ctx.arg(1, "bins", 100)
    return Fact(0, x.numel(), x.numel() / bins, "balanced")


def _cat(ctx: _Ctx) -> Fact | None:
    ts = [t for t in ctx.args[0] if isinstance(t, torch.Tensor)]
    return union([ctx.table.get(t) for t in ts], [t.numel() for t in ts])


def _where(ctx: _Ctx) -> Fact | None:
    if len(ctx.args) < 3:
        return None
    c, a, b = (ctx.table.get(x) for x in ctx.args[:3])
    if c is not None and c.exact:
        return a if c.lo else b
    return union([a, b])


def _masked_fill(ctx: _Ctx) -> Fact | None:
    x, m, v = ctx.fact(), ctx.fact(1, "mask"), ctx.fact(2, "value")
    if m is not None and m.exact:
        return v if m.lo else x
    return union([x, v])


def _copy(ctx: _Ctx) -> Fact | None:
    return ctx.fact(1, "src")


# every element kept (a whole-tensor mean holds) / some elements (it does not)
_VIEWS = ("view _unsafe_view reshape expand expand_as permute transpose t unsqueeze squeeze "
          "flatten unflatten movedim repeat tile flip roll clone contiguous detach alias "
          "lift_fresh lift_fresh_copy _reshape_alias expand_copy view_copy permute_copy").split()
_SUBSETS = ("slice select as_strided narrow unbind split split_with_sizes chunk diagonal "
            "index_select gather index take masked_select").split()

RULES: dict[str, Callable[[_Ctx], Any]] = {
    **{n: _same for n in _VIEWS},
    **{n: _subset for n in _SUBSETS},
    **{n: _cast for n in ("_to_copy", "to", "type_as", "_to_dtype")},
    **{n: _fill(0) for n in ("zeros", "zeros_like", "new_zeros", "zero")},
    **{n: _fill(1) for n in ("ones", "ones_like", "new_ones")},
    "full": _const(1, "fill_value"), "full_like": _const(1, "fill_value"),
    "new_full": _const(2, "fill_value"), "fill": _const(1, "value"),
    "scalar_tensor": _const(0, "s"),
    "arange": _arange, "linspace": _linspace,
    "rand": _rand, "rand_like": _rand, "uniform": _uniform,
    "randint": _randint, "randint_like": _randint, "randperm": _randperm,
    "bernoulli": _bernoulli,
    "add": _binary(operator.add, linear=True), "sub": _binary(operator.sub, linear=True),
    "rsub": _binary(lambda a, b: b - a, linear=True), "mul": _binary(_mul),
    "maximum": _binary(max), "minimum": _binary(min),
    "div": _div, "floor_divide": _floordiv,
    "neg": _neg, "logical_not": _not, "bitwise_not": _not,
    "logical_and": _logic(True), "bitwise_and": _logic(True), "__and__": _logic(True),
    "logical_or": _logic(False), "bitwise_or": _logic(False), "__or__": _logic(False),
    "clamp": _clamp, "clamp_min": _clamp, "clamp_max": _clamp,
    **{n: _compare for n in _CMP},
    "sum": _sum, "mean": _same, "amax": _bounds, "amin": _bounds,
    "max": _extreme, "min": _extreme, "argmax": _arg, "argmin": _arg,
    "topk": _topk, "sort": _sort, "argsort": _sort,
    "any": _any, "all": _all, "cumsum": _cumsum,
    "histc": _histc,
    "cat": _cat, "stack": _cat, "where": _where, "masked_fill": _masked_fill, "copy": _copy,
}
