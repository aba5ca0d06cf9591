"""`gobrrr plan`: the accumulation pass against fresh traces, the knapsack against hand-derived
choices, and the search against the graphs a fresh trace of its chosen knobs gives."""

from __future__ import annotations

import json

import pytest
import torch

from gobrrr.capture import capture
from gobrrr.cli import main
from gobrrr.errors import GobrrrError
from gobrrr.evaluate import evaluate
from gobrrr.models.registry import get_workload
from gobrrr.passes.accumulate import accumulate
from gobrrr.plan.blocks import BlockCosts, knapsack, scaled
from gobrrr.plan.knobs import Knobs, every_kth
from gobrrr.plan.search import Planner, plan
from gobrrr.training.fused_loss import use_fused_loss

MiB = 2**20


def tiny_gpt2(batch_size: int = 8, seq_len: int = 64):
    return get_workload(
        "gpt2",
        batch_size=batch_size,
        seq_len=seq_len,
        n_layer=4,
        n_embd=64,
        n_head=4,
        vocab_size=512,
    )


SMALL = {
    "gpt2": (tiny_gpt2, 64),
    "convnet": (lambda batch_size=8, seq_len=None: get_workload("convnet", batch_size), None),
    "mlp": (lambda batch_size=8, seq_len=None: get_workload("mlp", batch_size), None),
}


# -- accumulation ---------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SMALL))
def test_accumulate_matches_a_trace_of_the_accumulated_step(name):
    """Three micro-batches of 2 before one optimizer step, traced as PyTorch runs them, against
    the pass over the one-micro-batch trace: the same allocated and reserved peaks (the later
    micro-batches start with every gradient allocated) but for the 512-byte blocks of the
    scaled losses, the same tokens; time within 10% (the pass leaves out the batch's slices
    and the loss's 1/n scaling, 3 host ops per micro-batch that count on a step of a few
    ms)."""
    make, seq = SMALL[name]
    one = capture(lambda: make(batch_size=2, seq_len=seq))
    traced = capture(lambda: make(batch_size=6, seq_len=seq), accumulation=3)
    derived = accumulate(one, 3)
    a, b = evaluate(derived, "h100"), evaluate(traced, "h100")
    assert a.memory.peak == pytest.approx(b.memory.peak, abs=4 * 512)
    assert a.memory.reserved == pytest.approx(b.memory.reserved, abs=4 * 512)
    assert a.time.tokens == b.time.tokens
    assert a.time.step_s == pytest.approx(b.time.step_s, rel=0.10)
    assert evaluate(one, "h100").memory.peak < a.memory.peak  # gradients held across


def test_accumulate_counts_the_later_micro_batches_in_time_and_flops():
    one = capture(lambda: tiny_gpt2(batch_size=2))
    e1 = evaluate(one, "h100")
    e4, e8 = (evaluate(accumulate(one, n), "h100") for n in (4, 8))
    fwd_bwd, grads = e1.time.model_flops, one.meta.trainable_params
    # n forward+backward, and n - 1 additions of every gradient (AccumulateGrad's add_)
    assert e4.time.model_flops == pytest.approx(4 * fwd_bwd + 3 * grads, rel=1e-12)
    assert e8.time.model_flops == pytest.approx(8 * fwd_bwd + 7 * grads, rel=1e-12)
    # each further micro-batch adds the same time: the steady state of the repeated segment
    assert e8.time.step_s - e4.time.step_s == pytest.approx(
        (e4.time.step_s - evaluate(accumulate(one, 2), "h100").time.step_s) * 2, rel=1e-6
    )
    # the global batch lives on the device whole: tokens and targets, 2 x 64 int64 each
    # per micro-batch (4 more micro-batches: 2 x 4 x 1 KiB)
    assert e8.memory.peak - e4.memory.peak == 2 * 4 * 2 * 64 * 8
    assert accumulate(one, 1) is one
    with pytest.raises(GobrrrError, match="accumulated already"):
        accumulate(accumulate(one, 2), 2)


# -- the knapsack ---------------------------------------------------------------------------
COSTS = BlockCosts(
    ("b0", "b1", "b2"),
    saves={"selective": (10, 10, 10), "full": (30, 30, 30)},
    seconds={"selective": (1.0, 1.0, 1.0), "full": (5.0, 5.0, 5.0)},
)


@pytest.mark.parametrize(
    "need, want",
    [
        (0, []),
        (25, ["selective"] * 3),  # 30 bytes for 3 s, not one full block's 30 for 5 s
        (30, ["selective"] * 3),
        (31, ["full", "selective"]),  # 40 for 6 s (3 selective + 1 full: 7 s)
        (70, ["full", "full", "selective"]),  # 70 for 11 s
        (90, ["full"] * 3),
    ],
)
def test_knapsack_saves_what_is_asked_at_the_least_recompute(need, want):
    """The blocks cost the same, so the choice is which policies, in what number."""
    got = knapsack(COSTS, need)
    assert got is not None
    assert sorted(p for _, p in got) == sorted(want)
    assert len({b for b, _ in got}) == len(got)  # a block gets one policy
    saved = sum(COSTS.saves[p][COSTS.names.index(b)] for b, p in got)
    assert saved >= need


def test_knapsack_says_when_nothing_saves_enough():
    assert knapsack(COSTS, 91) is None


def test_scaled_costs_add_up_to_what_was_measured():
    s = scaled(COSTS, {"full": (180, 30.0), "selective": (15, 6.0)})
    assert sum(s.saves["full"]) == 180 and sum(s.saves["selective"]) == 15
    assert sum(s.seconds["full"]) == pytest.approx(30.0)
    assert sum(s.seconds["selective"]) == pytest.approx(6.0)


# -- the search -----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def planned():
    """tiny GPT-2 at global batch 16 under a budget that the step as given exceeds."""
    free = Planner(tiny_gpt2, "h100", global_batch=16, seq=64)
    user = free.cost(Knobs(micro_batch=16))
    least = free.cost(Knobs(micro_batch=1, accumulation=16, checkpoint=every_kth(free.blocks, 1)))
    budget = (user.reserved_bytes + least.reserved_bytes) // 2
    p = Planner(tiny_gpt2, "h100", global_batch=16, seq=64, memory_budget=budget)
    return p, p.run(), budget


def test_plan_fits_the_budget_and_ranks_by_throughput(planned):
    _, r, budget = planned
    assert not r.user.fits and r.best is not None
    assert r.best.reserved_bytes <= budget and r.budget_bytes == budget
    fitting = [p for p in r.plans if p.fits]
    assert [p.units_per_s for p in fitting] == sorted(
        (p.units_per_s for p in fitting), reverse=True
    )
    assert all(not p.fits for p in r.plans[len(fitting) :])
    assert r.best.knobs.global_batch == 16
    assert r.traces <= 6  # micro-batches 1, 2 and 4, with and without the fused loss


def test_planned_knobs_match_a_fresh_trace_of_them(planned):
    """The best plan's graph, made by passes over two traces, against the step traced with
    those knobs applied (checkpoint wrappers, accumulation): the same allocated peak."""
    p, r, _ = planned
    k = r.best.knobs

    def make():
        w = tiny_gpt2(batch_size=16)
        if k.fused_loss:
            use_fused_loss(w.model)
        return w

    traced = capture(make, accumulation=k.accumulation, checkpoint=dict(k.checkpoint) or "none")
    fresh = evaluate(traced, p.target)
    assert r.best.peak_bytes == pytest.approx(fresh.memory.peak, rel=0.002)
    assert r.best.step_s == pytest.approx(fresh.time.step_s, rel=0.10)


def test_plan_is_no_slower_than_the_grid_it_contains(planned):
    p, r, _ = planned
    grid = [
        p.cost(Knobs(micro_batch=m, accumulation=16 // m, checkpoint=c))
        for m in (1, 2, 4, 8, 16)
        for c in ((), every_kth(p.blocks, 1))
    ]
    best_grid = max(g.units_per_s for g in grid if g.fits)
    assert r.best.units_per_s >= best_grid * (1 - 1e-9)


def test_nothing_fits_lists_the_closest_and_exits_1(capsys):
    code = main(
        [
            "plan",
            "--model",
            "gpt2",
            "--seq",
            "128",
            "--global-batch",
            "2",
            "--memory-budget",
            "1.2GiB",
            "--json",
        ]
    )
    out = json.loads(capsys.readouterr().out)
    assert code == 1 and out["fits"] is False and out["best"] is None
    assert out["plans"] and all(not p["fits"] for p in out["plans"])
    assert min(p["reserved_bytes"] for p in out["plans"]) > 1.2 * 2**30


@pytest.mark.parametrize(
    "argv, what",
    [
        (["--allow", "turbo"], "--allow turbo: unknown"),
        (["--memory-budget", "100MiB"], "smaller than the parameters alone"),
        (["--memory-budget", "lots"], "expected a size"),
        (["--margin", "1.5"], "--margin"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(capsys, argv, what):
    code = main(["plan", "--model", "gpt2", "--seq", "64", "--global-batch", "2", *argv, "--json"])
    cap = capsys.readouterr()
    assert code == 2
    assert what in json.loads(cap.out)["error"] + (json.loads(cap.out)["hint"] or "")
    assert len(cap.err.strip().splitlines()) == 1


def test_a_model_without_repeated_blocks_says_what_was_tried():
    import torch

    import gobrrr

    def single(batch_size: int = 4, seq_len=None):
        return gobrrr.Workload(
            model=torch.nn.Linear(32, 32),
            batch=torch.randn(batch_size, 32),
            loss=lambda out, b: out.square().mean(),
        )

    r = plan(single, "h100", global_batch=4)
    assert r.blocks == 0 and any("micro-batch and accumulation only" in n for n in r.notes)
    assert any(n.startswith("fused linear + cross-entropy not planned") for n in r.notes)
    assert all(not p.knobs.checkpoint and not p.knobs.fused_loss for p in r.plans)


def test_the_fused_loss_variant_has_no_logits(planned):
    """Traced as CUDA runs it: gobrrr's kernel op, and no (tokens, vocab) tensor anywhere."""
    p, _, _ = planned
    plain = p.search.graph(Knobs(micro_batch=2, accumulation=8))
    fused = p.search.graph(Knobs(micro_batch=2, accumulation=8, fused_loss=True))
    vocab = 512

    def logits(g):
        return [
            n.op
            for n in g.nodes
            for t in n.outputs
            if t.shape and t.shape[-1] == vocab and len(t.shape) >= 2 and t.numel >= 2 * 64 * vocab
        ]

    assert logits(plain) and not logits(fused)
    assert any(n.op == "gobrrr.linear_cross_entropy.default" for n in fused.nodes)
    assert (
        p.cost(Knobs(micro_batch=2, accumulation=8, fused_loss=True)).peak_bytes
        < p.cost(Knobs(micro_batch=2, accumulation=8)).peak_bytes
    )


def test_bf16_states_are_planned_only_when_allowed():
    r = plan(tiny_gpt2, "h100", global_batch=4, seq=64, allow=["bf16-states"])
    states = {p.knobs.optimizer_states for p in r.plans}
    assert states == {"as-is", "bf16"}
    assert {
        p.knobs.optimizer_states for p in plan(tiny_gpt2, "h100", global_batch=4, seq=64).plans
    } == {"as-is"}
    a = next(p for p in r.plans if p.knobs == Knobs(micro_batch=4))
    b = next(p for p in r.plans if p.knobs == Knobs(micro_batch=4, optimizer_states="bf16"))
    assert b.peak_bytes < a.peak_bytes


def test_bf16_weights_are_the_pure_bf16_step_and_only_when_allowed():
    """The bf16-weights variant is the step traced at precision "bf16": its predicted peak is
    a fresh "bf16" trace's, its parameters take half the bytes of the user's fp32 ones."""
    p = Planner(tiny_gpt2, "h100", global_batch=4, seq=64, allow=["bf16-weights"])
    r = p.run()
    assert {pl.knobs.weights for pl in r.plans} == {"as-is", "bf16"}
    knobs = Knobs(micro_batch=4, weights="bf16")
    fresh = evaluate(capture(lambda: tiny_gpt2(4, 64), precision="bf16"), p.target)
    assert p.cost(knobs).peak_bytes == fresh.memory.peak
    params = {
        k: sum(s.nbytes for s in p.search.graph(k).storages if s.kind == "parameter")
        for k in (Knobs(micro_batch=4), knobs)
    }
    assert params[knobs] * 2 == params[Knobs(micro_batch=4)]
    assert "weights, gradients and states in bf16 (pure bf16)" in p.cost(knobs).changes
    assert {pl.knobs.weights for pl in plan(tiny_gpt2, "h100", global_batch=4, seq=64).plans} == {
        "as-is"
    }


def test_plan_json_round_trips_its_knobs(planned):
    _, r, _ = planned
    d = json.loads(json.dumps(r.to_dict()))
    assert d["version"] == 1
    assert d["torch"] == torch.__version__  # the version that traced the step
    assert Knobs.from_dict(d["best"]["knobs"]) == r.best.knobs
    for key in ("tokens_per_s", "peak_bytes", "reserved_bytes", "fits", "why"):
        assert key in d["plans"][0]
