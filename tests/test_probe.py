"""The planner's probe: the workload built once, its answers against hand-derived values; and
the tracer cutting a workload whose batch is its own."""

from __future__ import annotations

import pytest
import torch

from gobrrr.errors import GobrrrError
from gobrrr.hardware import Target
from gobrrr.models.registry import get_workload
from gobrrr.plan.probe import Probe, samples
from gobrrr.plan.search import Planner
from gobrrr.plan.trace import Tracer
from gobrrr.workload import Workload


def gpt2_small_params() -> int:
    """GPT-2 small by hand: tied embeddings (50257 x 768) and positions (1024 x 768); per
    block two LayerNorms (2 x 2d), qkv (d x 3d + 3d), the attention's projection (d x d + d),
    the MLP (d x 4d + 4d, 4d x d + d): 12 d^2 + 13 d; the final LayerNorm (2d)."""
    d, vocab, positions, layers = 768, 50257, 1024, 12
    return vocab * d + positions * d + layers * (12 * d * d + 13 * d) + 2 * d


def test_gpt2_small_answers_by_hand():
    p = Probe("gpt2", 1024)
    assert p.blocks == tuple(f"transformer.h.{i}" for i in range(12))
    assert gpt2_small_params() == 124_439_808
    assert p.parameter_bytes == 4 * gpt2_small_params()  # fp32 as built
    assert p.batch == 8  # the built-in's default batch
    assert p.fused_loss_refusal is None
    assert p.offload_refusal is None
    assert p.states_refusal("bf16") is None and p.states_refusal("8bit") is None
    assert all(t.device.type == "meta" for t in p.workload.model.parameters())


def counting(calls: list[int]):
    """A tiny GPT-2 function workload that counts its builds."""

    def make(batch_size: int = 4, seq_len: int = 32) -> Workload:
        calls.append(batch_size)
        return get_workload(
            "gpt2",
            batch_size=batch_size,
            seq_len=seq_len,
            n_layer=2,
            n_embd=64,
            n_head=4,
            vocab_size=256,
        )

    return make


def test_the_probe_builds_once_whatever_it_is_asked():
    calls: list[int] = []
    p = Probe(counting(calls), 32)
    answers = (
        p.batch,
        p.parameter_bytes,
        p.blocks,
        p.fused_loss_refusal,
        p.offload_refusal,
        p.states_refusal("bf16"),
        p.states_refusal("8bit"),
        p.batch,
        p.blocks,
    )
    assert calls == [4]  # one build, at the workload's own batch
    assert answers[0] == 4 and answers[2] == ("transformer.h.0", "transformer.h.1")


def test_the_planner_builds_once_before_tracing():
    """Every other build of the workload is a trace's."""
    calls: list[int] = []
    planner = Planner(
        counting(calls),
        "h100",
        global_batch=4,
        seq=32,
        memory_budget=2**30,
        allow=["bf16-states", "8bit-states"],
    )
    assert calls[0] == 4 and len(calls) == 1 + planner.steps.traces
    assert planner.blocks == ["transformer.h.0", "transformer.h.1"]


def test_what_the_probe_refuses_it_says():
    def plain(batch_size: int = 4) -> Workload:
        return Workload(
            model=torch.nn.Linear(8, 8),
            batch=torch.randn(batch_size, 8),
            loss=lambda out, b: out.square().mean(),
            optimizer=lambda ps: torch.optim.SGD(ps, lr=0.1),
        )

    p = Probe(plain, None)
    assert p.blocks == () and p.parameter_bytes == 4 * (8 * 8 + 8)
    assert "neither gobrrr's GPT2/Llama" in p.fused_loss_refusal
    assert p.offload_refusal.startswith("the workload's optimizer is SGD")
    assert "only be changed for Adam or AdamW" in p.states_refusal("bf16")


def test_a_building_error_is_one_line():
    def broken(batch_size: int = 4) -> Workload:
        raise ValueError("no data here")

    with pytest.raises(GobrrrError, match="building the workload raised ValueError: no data"):
        Probe(broken, None)


def test_a_workload_of_its_own_batch_is_cut_and_left_whole():
    """A Workload given as it is: each micro-batch its first samples, the user's batch kept."""
    w = Workload(
        model=torch.nn.Linear(8, 3),
        batch=torch.randn(4, 8),
        loss=lambda out, b: out.square().mean(),
    )
    trace = Tracer(w, seq=None, precision="fp32", target=Target.resolve("h100", False))

    def batch(g) -> set[tuple[int, ...]]:  # the forward's (samples, 8) inputs, not the weight
        return {
            tuple(t.shape)
            for n in g.nodes
            if n.phase == "forward"
            for t in n.inputs
            if tuple(t.shape)[1:] == (8,)
        } - {(3, 8)}

    assert batch(trace(1)) == {(1, 8)} and batch(trace(2)) == {(2, 8)}
    assert samples(w) == 4 and w.batch.shape == (4, 8)
    with pytest.raises(GobrrrError, match="fixed at 4 samples"):
        trace(8)
