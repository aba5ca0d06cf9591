"""The facts (gobrrr.capture.facts) of the live tensors of a trace, kept as the ops run.

Each op's outputs get the fact its rule derives (fact_rules.py); a fact is tied to its tensor's
version counter, so an in-place op no rule models makes it unknown.

    table = FactTable()
    table.propagate(func, args, kwargs, out)   # after each op
    table.get(t)                               # Fact | None
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import torch
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils._pytree import tree_leaves
from torch.utils.weak import WeakTensorKeyDictionary

from gobrrr.capture.fact_rules import derive
from gobrrr.capture.facts import Fact, exact, is_number, of_real


class FactTable:
    """Facts of live tensors, tied to each tensor's version counter."""

    def __init__(self) -> None:
        self._facts = WeakTensorKeyDictionary()

    def get(self, x: Any) -> Fact | None:
        """The fact of a tensor (or a Python number: exact), None when unknown."""
        if is_number(x):
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
        inplace = (
            name.endswith("_")
            and not name.startswith("_")
            and bool(args)
            and isinstance(args[0], torch.Tensor)
            and out is args[0]
        )
        if not _wanted(out):
            return
        found, facts = derive(
            self.get, name.rstrip("_") if inplace else name, func, args, kwargs, out
        )
        if not found:
            return
        outs = _out_tensors(out)
        if isinstance(facts, Fact) or facts is None:
            facts = [facts] * len(outs)
        origin = str(func).removesuffix(".default")
        for t, f in zip(outs, facts, strict=False):
            self.set(
                t,
                f if f is None or f.origin else replace(f, origin=origin),
                bump=1 if inplace else 0,
            )


def _version(t: torch.Tensor) -> int | None:
    try:
        return t._version
    except RuntimeError:  # inference tensors carry no version counter
        return None


def _wanted(out: Any) -> bool:
    """Only fake outputs need facts kept: a real tensor's come from its values when asked."""
    return any(isinstance(t, FakeTensor) for t in _out_tensors(out))


def _out_tensors(out: Any) -> list[torch.Tensor]:
    """The tensors an op returned, in `tree_leaves`' order (most ops return one tensor: no
    walk over it; every op of the step comes here)."""
    if isinstance(out, torch.Tensor):
        return [out]
    return [t for t in tree_leaves(out) if isinstance(t, torch.Tensor)]
