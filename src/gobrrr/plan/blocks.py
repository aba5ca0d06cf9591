"""What checkpointing each block saves and costs, read off one evaluated graph, and the
budget-optimal choice of policies (a multiple-choice knapsack over the blocks).

For block b of a graph traced without checkpointing:
- saved bytes: the activations its forward leaves for backward (storages created by its ops
  and alive when backward starts), rounded as the allocator rounds them;
- "selective" keeps those its matmuls, convolutions and attention made and recomputes the
  rest; "full" keeps none of them (the block's input is kept, and is the block before's);
- recompute time: the predicted device time of the forward ops the policy runs again.
The knapsack picks, per block, none / selective / full to save at least the bytes asked for at
the least recompute time. It is an estimate from per-block sums; the planner checks its choice
by running the checkpoint pass and evaluating the result.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from gobrrr.evaluate import Prediction
from gobrrr.graph.ir import StepGraph
from gobrrr.memory.replay import round_alloc
from gobrrr.training.checkpointing import SELECTIVE_SAVE

UNITS = 400  # the knapsack's resolution: the bytes asked for in this many steps


@dataclass(frozen=True)
class BlockCosts:
    """Per block, in forward order: bytes each policy saves (frees from what backward keeps)
    and seconds of recompute it adds."""

    names: tuple[str, ...]
    saves: dict[str, tuple[int, ...]]  # policy -> bytes per block
    seconds: dict[str, tuple[float, ...]]  # policy -> recompute seconds per block


def block_of(module: str, blocks: set[str], memo: dict[str, str | None]) -> str | None:
    """The block a module belongs to (itself or its closest enclosing block), or None."""
    if module not in memo:
        name, found = module, None
        while name:
            if name in blocks:
                found = name
                break
            name = name.rpartition(".")[0]
        memo[module] = found
    return memo[module]


def block_costs(graph: StepGraph, time: Prediction, blocks: list[str]) -> BlockCosts:
    """Each block's savings and recompute time under "selective" and "full"."""
    names, index = set(blocks), {b: i for i, b in enumerate(blocks)}
    memo: dict[str, str | None] = {}
    kept = {"full": [0] * len(blocks), "selective": [0] * len(blocks)}
    saved = [0] * len(blocks)
    for s in graph.storages:
        if s.kind != "activation" or s.created < 0:
            continue
        b = block_of(graph.nodes[s.created].module, names, memo)
        if b is None:
            continue
        saved[index[b]] += round_alloc(s.nbytes)
        if graph.nodes[s.created].op in SELECTIVE_SAVE:
            kept["selective"][index[b]] += round_alloc(s.nbytes)
    secs = {"full": [0.0] * len(blocks), "selective": [0.0] * len(blocks)}
    for node, op in zip(graph.nodes, time.ops, strict=True):
        if node.phase != "forward":
            continue
        b = block_of(node.module, names, memo)
        if b is None:
            continue
        secs["full"][index[b]] += op.device_s
        if node.op not in SELECTIVE_SAVE:
            secs["selective"][index[b]] += op.device_s
    saves = {p: tuple(x - k for x, k in zip(saved, kept[p], strict=True)) for p in kept}
    return BlockCosts(tuple(blocks), saves, {p: tuple(v) for p, v in secs.items()})


def scaled(costs: BlockCosts, totals: dict[str, tuple[int, float]]) -> BlockCosts:
    """`costs` with each policy's per-block bytes and seconds scaled so they add up to
    `totals[policy]` = (bytes, seconds) measured with every block under it (shares kept)."""
    saves, seconds = dict(costs.saves), dict(costs.seconds)
    for policy, (nbytes, secs) in totals.items():
        b, s = sum(saves[policy]), sum(seconds[policy])
        if b > 0 and nbytes > 0:
            saves[policy] = tuple(int(x * nbytes / b) for x in saves[policy])
        if s > 0 and secs > 0:
            seconds[policy] = tuple(x * secs / s for x in seconds[policy])
    return BlockCosts(costs.names, saves, seconds)


def knapsack(costs: BlockCosts, need: int) -> tuple[tuple[str, str], ...] | None:
    """Per block none / selective / full, saving at least `need` bytes at the least
    recompute time; None when checkpointing every block fully saves less than `need`."""
    if need <= 0:
        return ()
    if sum(costs.saves["full"]) < need:
        return None
    unit = max(1, math.ceil(need / UNITS))
    goal = math.ceil(need / unit)
    inf = float("inf")
    best = [0.0] + [inf] * goal  # best[k]: least seconds saving >= k units
    picks: list[list[str | None]] = []
    for i in range(len(costs.names)):
        nxt, pick = best[:], [None] * (goal + 1)
        for policy in ("selective", "full"):
            units, sec = costs.saves[policy][i] // unit, costs.seconds[policy][i]
            if units <= 0:
                continue
            for k in range(goal + 1):
                if best[k] == inf:
                    continue
                j = min(goal, k + units)
                if best[k] + sec < nxt[j]:
                    nxt[j], pick[j] = best[k] + sec, (policy, k)
        picks.append(pick)
        best = nxt
    if best[goal] == inf:
        return None
    chosen: list[tuple[str, str]] = []
    k = goal
    for i in reversed(range(len(costs.names))):
        p = picks[i][k]
        if p is not None:
            policy, k = p
            chosen.append((costs.names[i], policy))
    return tuple(reversed(chosen))
