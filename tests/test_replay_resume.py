"""The allocator replay with a budget, resumed from where it parts from the replay without one.

`memory.replay` runs a step's replay once with the budget and once without where it needs both
(a multi-GPU step always, a one-GPU step that runs out of memory). The two are one, op for op,
until a request asks for a segment past the budget: the second is resumed from a copy of the
first taken before that op. Each case here holds it to the second replay run from the start.
"""

import dataclasses
import random

import pytest

from gobrrr.graph.ir import OpNode, StepGraph, StorageInfo
from gobrrr.graph.meta import Parallel, StepMeta
from gobrrr.memory.replay import STEPS, _Process, replay

MiB = 2**20


def _step(parallel: bool, seed: int = 0) -> StepGraph:
    """Parameters, lazily made optimizer states, forward activations freed in backward in
    reverse, temporaries of mixed sizes (small and large pools), and scratch."""
    rng = random.Random(seed)
    storages, nodes = [], []

    def storage(nbytes, kind, created, freed):
        storages.append(StorageInfo(len(storages), nbytes, kind, created, freed))
        return len(storages) - 1

    params = [storage(rng.choice([3, 8, 12]) * MiB, "parameter", -1, None) for _ in range(4)]
    for p in params:  # Adam's state of each, made by the first optimizer op
        storage(storages[p].nbytes, "optimizer_state", -1, None)
    acts = []
    for _ in range(12):  # forward: one activation and one short-lived temporary each
        a = storage(rng.choice([1, 6, 20, 33]) * MiB + rng.randrange(4096), "activation", 0, 0)
        t = storage(rng.randrange(1, 600_000), "temporary", 0, 0)
        acts.append(a)
        nodes.append(("forward", [a, t], [t]))
    for a in reversed(acts):  # backward: each activation freed, a gradient-sized temporary
        g = storage(storages[a].nbytes // 2 + 512, "temporary", 0, 0)
        nodes.append(("backward", [g], [a, g]))
    nodes.append(("optimizer", [], []))
    ops = []
    for i, (phase, allocs, frees) in enumerate(nodes):
        for sid in allocs:
            storages[sid] = StorageInfo(sid, storages[sid].nbytes, storages[sid].kind, i, None)
        for sid in frees:
            s = storages[sid]
            storages[sid] = StorageInfo(sid, s.nbytes, s.kind, s.created, i)
        ops.append(
            OpNode(
                i, "aten.add.Tensor", phase, "m", (), (), allocs=tuple(allocs), frees=tuple(frees)
            )
        )
    meta = StepMeta(parallel=Parallel("fsdp", 8, 1)) if parallel else StepMeta()
    return StepGraph(nodes=tuple(ops), storages=tuple(storages), meta=meta)


SCRATCH = {3: (5 * MiB, 700_000), 14: (40 * MiB,)}


@pytest.mark.parametrize("parallel", [False, True])
@pytest.mark.parametrize("seed", [0, 1])
def test_the_other_replay_resumed_from_its_copy_is_the_one_run_from_the_start(parallel, seed):
    g = _step(parallel, seed)
    free = _Process(g, (), SCRATCH, None).run(STEPS)
    parted = 0
    # budgets from below the parameters to above the unlimited replay's reserved peak
    for budget in range(20 * MiB, free.stats.reserved_peak + 40 * MiB, 6 * MiB):
        first = _Process(g, (), SCRATCH, None if parallel else budget)
        first.run(STEPS, watch=budget)
        other = None if not parallel else budget
        fresh = _Process(g, (), SCRATCH, other).run(STEPS)
        if first.forked is not None:
            parted += 1
            assert first.forked.resume(STEPS) == fresh, budget
    assert parted >= 3  # the replays parted in several places


@pytest.mark.parametrize("parallel", [False, True])
def test_replay_with_a_budget_is_the_two_replays_run_from_the_start(parallel):
    # `replay`'s own answer (each budget: the limited replay, the unlimited one, or the
    # unlimited one with the failing op) against both replays run from the start
    g = _step(parallel, 2)
    free = _Process(g, (), SCRATCH, None).run(STEPS)
    for budget in range(20 * MiB, free.stats.reserved_peak + 40 * MiB, 6 * MiB):
        limited = _Process(g, (), SCRATCH, budget).run(STEPS)
        if parallel and free.stats.reserved_peak <= budget:
            want = free
        elif limited.oom_index is None:
            want = limited
        else:
            want = _replace_oom(free, limited.oom_index)
        assert replay(g, (), SCRATCH, budget) == want, budget


def _replace_oom(r, oom):
    return dataclasses.replace(r, oom_index=oom)
