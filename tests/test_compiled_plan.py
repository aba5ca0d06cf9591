"""`compile` as a planner knob: planned only under `--allow compile`, costed on the compiled
capture (a fresh `capture(compile=True)` of the chosen knobs gives the same prediction), and
chosen only where the cost model says it pays."""

from __future__ import annotations

import pytest

from gobrrr.capture import capture
from gobrrr.evaluate import evaluate
from gobrrr.models.registry import get_workload
from gobrrr.plan.knobs import Knobs, every_kth
from gobrrr.plan.search import Planner, describe, plan

SEQ = 4096


def long_gpt2(batch_size: int = 1, seq_len: int = SEQ):
    """A small GPT-2 at a long sequence: activations, not weights, decide its memory."""
    return get_workload(
        "gpt2",
        batch_size=batch_size,
        seq_len=seq_len,
        n_layer=4,
        n_embd=256,
        n_head=4,
        vocab_size=512,
        block_size=SEQ,
    )


@pytest.fixture(scope="module")
def free():
    p = Planner(long_gpt2, "h100", global_batch=1, seq=SEQ, allow=["compile"])
    return p, p.run()


def test_compile_pays_here_and_is_chosen(free):
    """Unconstrained, the compiled step is predicted faster (fused pointwise chains, no eager
    dispatch per op) and is the best plan; its prediction is a fresh compiled trace's."""
    p, r = free
    assert {pl.knobs.compile for pl in r.plans} == {"none", "model", "blocks"}
    assert r.best.knobs.compiled
    eager = p.cost(Knobs(micro_batch=1, fused_loss=r.best.knobs.fused_loss))
    assert r.best.units_per_s > eager.units_per_s
    fresh = evaluate(capture(long_gpt2, compile=True), p.target)
    ours = p.cost(Knobs(micro_batch=1, compile="model"))
    assert ours.peak_bytes == fresh.memory.peak and ours.step_s == fresh.time.step_s
    assert "torch.compile(model)" in describe(ours.knobs, 1, p.blocks)


def test_compile_is_not_chosen_where_it_does_not_fit(free):
    """A budget between the eager step with every block checkpointed and the compiled step
    (which the planner does not checkpoint): the plan checkpoints, eagerly."""
    p, _ = free
    compiled = p.cost(Knobs(micro_batch=1, compile="model"))
    full = p.cost(Knobs(micro_batch=1, checkpoint=every_kth(p.blocks, 1)))
    assert full.reserved_bytes < compiled.reserved_bytes
    budget = (full.reserved_bytes + compiled.reserved_bytes) // 2
    r = Planner(
        long_gpt2, "h100", global_batch=1, seq=SEQ, memory_budget=budget, allow=["compile"]
    ).run()
    assert r.best is not None and r.best.fits and not r.best.knobs.compiled
    assert r.best.knobs.checkpoint
    assert not any(pl.fits for pl in r.plans if pl.knobs.compiled)


def test_compile_is_planned_only_when_allowed():
    r = plan(long_gpt2, "h100", global_batch=1, seq=SEQ)
    assert {pl.knobs.compile for pl in r.plans} == {"none"}


def test_per_block_compile_is_costed_on_its_own_trace(free):
    """ "blocks" is a variant of its own: its prediction is a fresh per-block compiled
    trace's, the table names it, and its graph has one forward region per block."""
    p, r = free
    ours = p.cost(Knobs(micro_batch=1, compile="blocks"))
    fresh = evaluate(capture(long_gpt2, compile="blocks"), p.target)
    assert ours.peak_bytes == fresh.memory.peak and ours.step_s == fresh.time.step_s
    assert "torch.compile per block" in ours.changes
    assert "torch.compile(model)" not in ours.changes
    forwards = [reg for reg in fresh.graph.meta.compiled_regions if reg.kind == "forward"]
    assert len(forwards) == len(p.blocks)
