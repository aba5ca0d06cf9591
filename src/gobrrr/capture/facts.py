"""What a fake-tensor trace knows about the values of tensors it does not have.

A `Fact` bounds every element of a tensor (lo <= x <= hi) and, where the way the tensor was
made says so, gives the expected element value (`mean`) and the assumption that expectation
rests on (`basis`). Facts come from the ops that make tensors (zeros, arange, randint, rand,
the indices topk returns, ...) and from the values of real tensors, and they follow the ops
that transform them (views, casts, arithmetic, comparisons, reductions: fact_rules.py). A
fact is tied to its tensor's version counter (`fact_table.FactTable`): an in-place op no rule
models makes it unknown.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

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
    return Fact(
        min(f.lo for f in facts),
        max(f.hi for f in facts),
        mean,
        next((f.basis for f in facts if f.basis), ""),
    )


def of_real(t: torch.Tensor) -> Fact | None:
    """Exact bounds of a small real tensor, from its values."""
    if t.numel() == 0 or t.numel() > REAL_FACT_LIMIT or t.is_complex() or t.device.type == "meta":
        return None
    with unset_fake_temporarily():  # it may be asked while a FakeTensorMode is active
        v = t.detach()
        lo, hi, mean = float(v.min()), float(v.max()), float(v.double().mean())
    return Fact(lo, hi, mean, origin="a real tensor")


def safe_mul(a: float, b: float) -> float:
    return 0.0 if a == 0 or b == 0 else a * b


def span(a: Fact, b: Fact, fn: Callable[[float, float], float]) -> tuple[float, float]:
    vals = [fn(x, y) for x in (a.lo, a.hi) for y in (b.lo, b.hi)]
    if any(math.isnan(v) for v in vals):
        return -INF, INF
    return min(vals), max(vals)


def is_number(x: Any) -> bool:
    return isinstance(x, (bool, int, float)) and not isinstance(x, torch.SymInt)
