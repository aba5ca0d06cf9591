"""What the planner does to cost candidates faster gives the answers the plain paths give:
each distinct op costed once (`evaluate(memo=)`), the allocator replay within a budget run
first, the cycle collector paused and frozen per candidate (and left as it was found)."""

from __future__ import annotations

import dataclasses
import gc

import pytest

from gobrrr.capture import capture
from gobrrr.evaluate import evaluate
from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo, TensorInfo
from gobrrr.graph.meta import StepMeta
from gobrrr.hardware import Target
from gobrrr.memory.replay import _Process, replay
from gobrrr.models.registry import get_workload
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.checkpoint import checkpoint
from gobrrr.passes.fsdp import fsdp
from gobrrr.plan.knobs import every_kth
from gobrrr.plan.search import Planner

MiB = 2**20


def tiny_gpt2(batch_size: int = 4, seq_len: int = 32):
    return get_workload(
        "gpt2", batch_size=batch_size, seq_len=seq_len, n_layer=2, n_embd=64, n_head=4,
        vocab_size=256,
    )  # fmt: skip


@pytest.fixture(scope="module")
def graphs() -> list[StepGraph]:
    """A tiny GPT-2's step as the planner's passes make its candidates."""
    g = capture(lambda: tiny_gpt2(), precision="bf16-mixed")
    bf16 = capture(lambda: tiny_gpt2(), precision="bf16")
    blocks = list(g.meta.blocks)
    full, sel = every_kth(blocks, 1), every_kth(blocks, 1, "selective")
    acc = accumulate(checkpoint(bf16, dict(full)), 2)
    return [
        g,
        accumulate(g, 4),
        accumulate(checkpoint(g, dict(full)), 2),
        accumulate(checkpoint(g, dict(sel)), 2),
        fsdp(acc, 8, 2, reshard_after_forward=True, sync_each=True),
        fsdp(acc, 8, 2, reshard_after_forward=False, sync_each=True),
    ]


def test_memoised_evaluation_is_the_plain_one(graphs):
    target, memo = Target.resolve("h100"), {}
    for g in graphs:
        plain, fast = evaluate(g, target), evaluate(g, target, memo=memo)
        assert fast.time == plain.time  # every op's time, the schedule, the power limit
        assert fast.memory == plain.memory
    # an accumulated step repeats its micro-batch, blocks repeat their ops: few distinct
    assert len(memo) < sum(len(g.nodes) for g in graphs) / 10


def _contiguous(i: int, out_storage: int) -> OpNode:
    x = TensorInfo((1024, 1024), (1024, 1), "float32", 0)
    out = dataclasses.replace(x, storage=out_storage)
    return OpNode(i, "aten.contiguous.default", "forward", "m", (x,), (out,), ({"t": 0},))


def test_a_view_is_not_taken_for_a_copy_of_the_same_shapes():
    # `contiguous` returns its input itself where it is contiguous already (no kernel) and
    # copies it otherwise: the same op on the same shapes, told apart by whether its output
    # is its input's storage; the memo keeps them apart (by which storages its tensors share)
    storages = [StorageInfo(s, 4 * MiB, "activation", -1, None) for s in range(2)]
    nodes = (_contiguous(0, 0), _contiguous(1, 1))
    g = StepGraph(nodes=nodes, storages=tuple(storages), meta=StepMeta())
    target = Target.resolve("h100")
    plain, fast = evaluate(g, target).time.ops, evaluate(g, target, memo={}).time.ops
    assert plain[0].bytes == 0 and plain[1].bytes == 8 * MiB
    assert fast == plain


def _reference(graph, budget):
    """The replay within `budget` as first written: the unlimited replay where it stays
    within the budget, else the limited one, else the unlimited one with the failing op."""
    free = _Process(graph, (), {}, None).run(4)
    if free.stats.reserved_peak <= budget:
        return free
    limited = _Process(graph, (), {}, budget).run(4)
    if limited.oom_index is None:
        return limited
    return dataclasses.replace(free, oom_index=limited.oom_index)


def _churn() -> StepGraph:
    """30 and 31 MiB temporaries made and freed one after the other, then a 50 MiB one: the
    unlimited allocator keeps the first two segments cached and reserves 114 MiB; within
    less it releases them and makes the 50 MiB one in their place (52 MiB)."""
    st = [
        StorageInfo(0, 1 * MiB, "parameter", -1, None),
        StorageInfo(1, 30 * MiB, "temporary", 0, 0),
        StorageInfo(2, 31 * MiB, "temporary", 1, 1),
        StorageInfo(3, 50 * MiB, "temporary", 2, 2),
    ]
    nodes = [
        OpNode(i, "aten.empty.memory_format", "forward", "m", (), (), allocs=(i + 1,))
        for i in range(3)
    ]
    nodes = [dataclasses.replace(n, frees=(n.index + 1,)) for n in nodes]
    return StepGraph(nodes=tuple(nodes), storages=tuple(st), meta=StepMeta())


@pytest.mark.parametrize("budget_mib", [200, 90, 40])  # fits; after a release; fails
def test_replay_within_a_budget_is_the_reference_order(budget_mib):
    g, budget = _churn(), budget_mib * MiB
    got, want = replay(g, (), {}, budget), _reference(g, budget)
    assert got == want
    if budget_mib == 90:
        assert got.stats.alloc_retries > 0 and got.oom_index is None
    if budget_mib == 40:
        assert got.oom_index is not None


@pytest.mark.parametrize("freeze_first", [False, True])
def test_plan_leaves_the_cycle_collector_as_it_found_it(freeze_first):
    enabled = gc.isenabled()
    try:
        if freeze_first:  # a process that froze objects of its own: not unfrozen by a plan
            gc.disable()
            gc.freeze()
        on, frozen = gc.isenabled(), gc.get_freeze_count()
        Planner(tiny_gpt2, "h100", global_batch=4, seq=32).run()
        assert gc.isenabled() == on
        # nothing left frozen by the plan (what the process froze may have died since)
        assert gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
        if enabled:
            gc.enable()
