"""How facts (gobrrr.capture.facts) follow the ops that make and transform tensors.

Each rule reads one op's arguments (`Ctx`) and returns the fact of its output (a list for ops
with several outputs), or None where the values are unknown. Creation ops give bounds from
their arguments (zeros, arange, randint, rand); views keep them; arithmetic, comparisons and
reductions derive them; the indices a selection (topk, argmax) picks are taken as spread
evenly over the candidates (the "balanced" assumption, named when a read relies on it).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from gobrrr.capture.facts import INF, Fact, exact, is_number, safe_mul, span, union

# The fact of an op's argument (a tensor, or a Python number: exact), None when unknown.
FactOf = Callable[[Any], Fact | None]


def derive(
    fact_of: FactOf, name: str, func: Any, args: tuple, kwargs: dict, out: Any
) -> tuple[bool, Fact | list[Fact | None] | None]:
    """(whether a rule knows op `name`, the fact(s) it derives for `out`)."""
    rule = RULES.get(name)
    if rule is None:
        return False, None
    try:
        return True, rule(Ctx(fact_of, func, args, kwargs, out))
    except (IndexError, KeyError, TypeError, ValueError, ZeroDivisionError, OverflowError):
        return True, None  # an argument layout the rule does not know: the facts stay unknown


class Ctx:
    """One op's arguments, as a rule reads them."""

    def __init__(self, fact_of: FactOf, func: Any, args: tuple, kwargs: dict, out: Any):
        self.fact_of, self.func, self.args, self.kwargs, self.out = fact_of, func, args, kwargs, out

    def arg(self, i: int, name: str, default: Any = None) -> Any:
        if i < len(self.args):
            return self.args[i]
        return self.kwargs.get(name, default)

    def fact(self, i: int = 0, name: str = "self") -> Fact | None:
        return self.fact_of(self.arg(i, name))

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


def _same(ctx: Ctx) -> Fact | None:
    return ctx.fact()


def _cast(ctx: Ctx) -> Fact | None:
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
        return Fact(
            math.trunc(f.lo) if f.lo > -INF else -INF,
            math.trunc(f.hi) if f.hi < INF else INF,
            f.mean if keep else None,
            f.basis,
        )
    return f


def _subset(ctx: Ctx) -> Fact | None:
    """A view or gather of some of the elements: an exact whole-tensor mean does not hold."""
    f = ctx.fact()
    if f is None or f.basis or f.exact or f.mean is None:
        return f
    return replace(f, mean=None)


def _const(value_index: int, name: str) -> Callable[[Ctx], Fact | None]:
    def rule(ctx: Ctx) -> Fact | None:
        f = ctx.fact(value_index, name)
        return f if f is not None and f.exact else None

    return rule


def _fill(v: float) -> Callable[[Ctx], Fact]:
    return lambda ctx: exact(v)


def _arange(ctx: Ctx) -> Fact | None:
    n = ctx.out0.numel()
    if n == 0:
        return None
    nums = [a for a in ctx.args if is_number(a)]
    start, step = (0, 1) if len(nums) == 1 else (nums[0], nums[2] if len(nums) > 2 else 1)
    last = start + (n - 1) * step
    return Fact(min(start, last), max(start, last), (start + last) / 2)


def _rand(ctx: Ctx) -> Fact:
    return Fact(0.0, 1.0, 0.5, "likely-draw", uniform=True)


def _uniform(ctx: Ctx) -> Fact:
    lo, hi = ctx.arg(1, "from", 0.0), ctx.arg(2, "to", 1.0)
    return Fact(lo, hi, (lo + hi) / 2, "likely-draw", uniform=True)


def _randint(ctx: Ctx) -> Fact:
    nums = [a for a in ctx.args if is_number(a)]
    low, high = (0, nums[0]) if len(nums) == 1 else (nums[0], nums[1])
    return Fact(low, high - 1, (low + high - 1) / 2, "likely-draw", uniform=True)


def _randperm(ctx: Ctx) -> Fact:
    n = ctx.args[0]
    return Fact(0, n - 1, (n - 1) / 2)  # a permutation: its mean is exact


def _bernoulli(ctx: Ctx) -> Fact:
    p = ctx.arg(1, "p", None)
    return Fact(0, 1, float(p), "likely-draw") if is_number(p) else Fact(0, 1)


def _linspace(ctx: Ctx) -> Fact | None:
    a, b = ctx.arg(0, "start"), ctx.arg(1, "end")
    return Fact(min(a, b), max(a, b), (a + b) / 2) if is_number(a) and is_number(b) else None


def _binary(
    fn: Callable[[float, float], float], linear: bool = False
) -> Callable[[Ctx], Fact | None]:
    def rule(ctx: Ctx) -> Fact | None:
        a, b = ctx.fact(0), ctx.fact(1, "other")
        alpha = ctx.kwargs.get("alpha", 1)
        if a is None or b is None:
            return None
        if alpha != 1:
            b = Fact(
                *sorted((b.lo * alpha, b.hi * alpha)),
                None if b.mean is None else b.mean * alpha,
                b.basis,
            )
        lo, hi = span(a, b, fn)
        mean = None
        if a.mean is not None and b.mean is not None and (linear or a.exact or b.exact):
            mean = fn(a.mean, b.mean)
        return Fact(lo, hi, mean, a.basis or b.basis)

    return rule


def _div(ctx: Ctx) -> Fact | None:
    a, b = ctx.fact(0), ctx.fact(1, "other")
    if a is None or b is None or b.lo <= 0 <= b.hi:
        return None
    mode = ctx.kwargs.get("rounding_mode")
    rnd = {"floor": math.floor, "trunc": math.trunc}.get(mode, lambda v: v)
    lo, hi = span(a, b, lambda x, y: x / y)
    lo, hi = rnd(lo) if lo > -INF else lo, rnd(hi) if hi < INF else hi
    mean = (
        a.mean / b.mean if a.mean is not None and b.exact and (mode is None or lo == hi) else None
    )
    return Fact(lo, hi, mean, a.basis)


def _floordiv(ctx: Ctx) -> Fact | None:
    ctx.kwargs = {**ctx.kwargs, "rounding_mode": "floor"}
    return _div(ctx)


def _neg(ctx: Ctx) -> Fact | None:
    f = ctx.fact()
    return None if f is None else Fact(-f.hi, -f.lo, None if f.mean is None else -f.mean, f.basis)


def _not(ctx: Ctx) -> Fact | None:
    f = ctx.fact()
    if f is None or not f.boolean:
        return None
    return Fact(1 - f.hi, 1 - f.lo, None if f.mean is None else 1 - f.mean, f.basis)


def _logic(both: bool) -> Callable[[Ctx], Fact | None]:
    def rule(ctx: Ctx) -> Fact | None:
        a, b = ctx.fact(0), ctx.fact(1, "other")
        if a is None or b is None or not (a.boolean and b.boolean):
            return None
        pick = min if both else max
        return Fact(pick(a.lo, b.lo), pick(a.hi, b.hi))

    return rule


def _clamp(ctx: Ctx) -> Fact | None:
    f = ctx.fact()
    if f is None:
        return None
    name = ctx.func.__name__.split(".")[0].rstrip("_")
    lo = ctx.arg(1, "min") if name in ("clamp", "clamp_min") else None
    hi = (
        ctx.arg(2, "max") if name == "clamp" else ctx.arg(1, "max") if name == "clamp_max" else None
    )
    lo = lo if is_number(lo) else -INF
    hi = hi if is_number(hi) else INF
    return Fact(min(max(f.lo, lo), hi), min(max(f.hi, lo), hi))


_CMP = {
    "lt": operator.lt,
    "le": operator.le,
    "gt": operator.gt,
    "ge": operator.ge,
    "eq": operator.eq,
    "ne": operator.ne,
}


def _decided(name: str, a: Fact, b: Fact, integral: bool) -> bool | None:
    """The comparison's value for every element, or None when the bounds leave it open.
    A uniform draw of floats never reaches its upper bound."""
    below = a.hi < b.lo or a.uniform and not integral and a.hi <= b.lo  # a < b everywhere
    if name in ("lt", "le", "gt", "ge"):
        true, false = {
            "lt": (below, a.lo >= b.hi),
            "le": (a.hi <= b.lo, a.lo > b.hi),
            "gt": (a.lo > b.hi, a.hi <= b.lo),
            "ge": (a.lo >= b.hi, below),
        }[name]
    else:
        same = a.exact and b.exact and a.lo == b.lo
        apart = a.hi < b.lo or b.hi < a.lo
        true, false = (same, apart) if name == "eq" else (apart, same)
    return True if true else False if false else None


def _compare(ctx: Ctx) -> Fact | None:
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


def _sum(ctx: Ctx) -> Fact | None:
    f, n = ctx.fact(), ctx.reduced()
    if f is None or n == 0:
        return None if f is None else exact(0)
    if f.mean is not None and not f.basis and ctx.out0.numel() == 1:
        return exact(f.mean * n)  # the exact mean of all the elements, times their count
    mean = None if f.mean is None else f.mean * n
    return Fact(safe_mul(f.lo, n), safe_mul(f.hi, n), mean, f.basis)


def _bounds(ctx: Ctx) -> Fact | None:
    """A reduction to extremes (amax, amin): the bounds hold, a whole-tensor mean does not."""
    f = ctx.fact()
    return f if f is None or f.exact else Fact(f.lo, f.hi)


def _extreme(ctx: Ctx) -> Fact | list[Fact | None] | None:
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


def _arg(ctx: Ctx) -> Fact:
    return _chosen(ctx.dim_size(1))


def _topk(ctx: Ctx) -> list[Fact | None]:
    dim = ctx.arg(2, "dim", -1)
    return [_bounds(ctx), _chosen(ctx.args[0].shape[dim] if ctx.args[0].dim() else 1)]


def _sort(ctx: Ctx) -> list[Fact | None]:
    dim = ctx.arg(1, "dim", -1)
    if not isinstance(dim, int):  # sort.stable(self, *, stable, dim)
        dim = ctx.kwargs.get("dim", -1)
    if ctx.func.__name__.startswith("argsort"):
        return [_index_range(ctx.args[0].shape[dim] if ctx.args[0].dim() else 1)]
    return [ctx.fact(), _index_range(ctx.args[0].shape[dim] if ctx.args[0].dim() else 1)]


def _any(ctx: Ctx) -> Fact | None:
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


def _all(ctx: Ctx) -> Fact | None:
    f, n = ctx.fact(), ctx.reduced()
    if n == 0 or f is not None and (f.lo > 0 or f.hi < 0):
        return exact(1)
    if f is not None and (
        f.lo == f.hi == 0 or f.boolean and f.mean is not None and not f.basis and f.mean < 1
    ):
        return exact(0)
    return Fact(0, 1, 1.0, "check-passes")


def _cumsum(ctx: Ctx) -> Fact | None:
    f, x = ctx.fact(), ctx.args[0]
    if f is None:
        return None
    n = x.shape[ctx.arg(1, "dim")] if x.dim() else 1
    return Fact(min(f.lo, safe_mul(f.lo, n)), max(f.hi, safe_mul(f.hi, n)))


def _histc(ctx: Ctx) -> Fact:
    x, bins = ctx.args[0], ctx.arg(1, "bins", 100)
    return Fact(0, x.numel(), x.numel() / bins, "balanced")


def _cat(ctx: Ctx) -> Fact | None:
    ts = [t for t in ctx.args[0] if isinstance(t, torch.Tensor)]
    return union([ctx.fact_of(t) for t in ts], [t.numel() for t in ts])


def _where(ctx: Ctx) -> Fact | None:
    if len(ctx.args) < 3:
        return None
    c, a, b = (ctx.fact_of(x) for x in ctx.args[:3])
    if c is not None and c.exact:
        return a if c.lo else b
    return union([a, b])


def _masked_fill(ctx: Ctx) -> Fact | None:
    x, m, v = ctx.fact(), ctx.fact(1, "mask"), ctx.fact(2, "value")
    if m is not None and m.exact:
        return v if m.lo else x
    return union([x, v])


def _copy(ctx: Ctx) -> Fact | None:
    return ctx.fact(1, "src")


# every element kept (a whole-tensor mean holds) / some elements (it does not)
_VIEWS = (
    "view _unsafe_view reshape expand expand_as permute transpose t unsqueeze squeeze "
    "flatten unflatten movedim repeat tile flip roll clone contiguous detach alias "
    "lift_fresh lift_fresh_copy _reshape_alias expand_copy view_copy permute_copy"
).split()
_SUBSETS = (
    "slice select as_strided narrow unbind split split_with_sizes chunk diagonal "
    "index_select gather index take masked_select"
).split()

RULES: dict[str, Callable[[Ctx], Any]] = {
    **{n: _same for n in _VIEWS},
    **{n: _subset for n in _SUBSETS},
    **{n: _cast for n in ("_to_copy", "to", "type_as", "_to_dtype")},
    **{n: _fill(0) for n in ("zeros", "zeros_like", "new_zeros", "zero")},
    **{n: _fill(1) for n in ("ones", "ones_like", "new_ones")},
    "full": _const(1, "fill_value"),
    "full_like": _const(1, "fill_value"),
    "new_full": _const(2, "fill_value"),
    "fill": _const(1, "value"),
    "scalar_tensor": _const(0, "s"),
    "arange": _arange,
    "linspace": _linspace,
    "rand": _rand,
    "rand_like": _rand,
    "uniform": _uniform,
    "randint": _randint,
    "randint_like": _randint,
    "randperm": _randperm,
    "bernoulli": _bernoulli,
    "add": _binary(operator.add, linear=True),
    "sub": _binary(operator.sub, linear=True),
    "rsub": _binary(lambda a, b: b - a, linear=True),
    "mul": _binary(safe_mul),
    "maximum": _binary(max),
    "minimum": _binary(min),
    "div": _div,
    "floor_divide": _floordiv,
    "neg": _neg,
    "logical_not": _not,
    "bitwise_not": _not,
    "logical_and": _logic(True),
    "bitwise_and": _logic(True),
    "__and__": _logic(True),
    "logical_or": _logic(False),
    "bitwise_or": _logic(False),
    "__or__": _logic(False),
    "clamp": _clamp,
    "clamp_min": _clamp,
    "clamp_max": _clamp,
    **{n: _compare for n in _CMP},
    "sum": _sum,
    "mean": _same,
    "amax": _bounds,
    "amin": _bounds,
    "max": _extreme,
    "min": _extreme,
    "argmax": _arg,
    "argmin": _arg,
    "topk": _topk,
    "sort": _sort,
    "argsort": _sort,
    "any": _any,
    "all": _all,
    "cumsum": _cumsum,
    "histc": _histc,
    "cat": _cat,
    "stack": _cat,
    "where": _where,
    "masked_fill": _masked_fill,
    "copy": _copy,
}
