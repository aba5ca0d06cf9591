"""Per-rank parameters, gradients and optimizer states of a data-parallel step against ZeRO's
closed forms, computed here from the model's own parameter shapes (not from the graph):
FSDP2 and HSDP shard fp32 parameters, fp32 gradients (reduce_dtype) and AdamW's two fp32
moments, Psi x 4/N, 4/N and 8/N, each parameter padded to ceil(d0 / N) rows; DDP replicates
them, 4 Psi, 4 Psi and 8 Psi. On a tiny model and on the Llama-3.2-1B shape (fake tensors),
through `report.estimate.per_rank_state` (the estimate's line and JSON), and the memory
replay's breakdown of the same graph."""

from __future__ import annotations

import io
import math

import pytest
import torch
from rich.console import Console
from torch import nn

from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.estimate import shard
from gobrrr.evaluate import evaluate
from gobrrr.memory.replay import round_alloc
from gobrrr.models.llama import LLAMA_CONFIGS, Llama
from gobrrr.models.registry import get_workload
from gobrrr.report.estimate import estimate_dict, per_rank_state
from gobrrr.report.terminal import print_estimate

H, F, V = 16, 10, 37  # F and V do not divide by 4 or 8: dim-0 padding


class Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(H, F), nn.ReLU(), nn.Linear(F, H)) for _ in range(3)
        )
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = x + b(x)
        return self.head(x)


def _tiny() -> Workload:
    torch.manual_seed(0)
    return Workload(
        Tiny(),
        torch.randint(0, V, (2, 8)),
        step=lambda m, b: nn.functional.cross_entropy(m(b).flatten(0, 1).float(), b.flatten()),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
    )


def _llama() -> Workload:
    return get_workload("llama3-1b", batch_size=1, seq_len=64)


def _shapes(name: str) -> list[tuple[int, ...]]:
    """The model's parameter shapes (tied ones once), from the model itself on the meta
    device."""
    with torch.device("meta"):
        model = Tiny() if name == "tiny" else Llama(LLAMA_CONFIGS["llama3-1b"])
    return [tuple(p.shape) for p in model.parameters()]


def _padded(shapes: list[tuple[int, ...]], n: int) -> int:
    """Elements of one rank's shards: ceil(d0 / n) rows of each parameter."""
    return sum(math.ceil(s[0] / n) * math.prod(s[1:]) for s in shapes)


MODELS = {"tiny": _tiny, "llama3-1b": _llama}


@pytest.fixture(scope="module", params=list(MODELS))
def traced(request):
    """(name, the "bf16" trace FSDP2 shards, the "bf16-mixed" trace DDP replicates)."""
    make = MODELS[request.param]
    return request.param, capture(make, precision="bf16"), capture(make, precision="bf16-mixed")


@pytest.mark.parametrize(("kind", "world", "hosts", "n"), [("fsdp", 8, 1, 8), ("hsdp", 8, 2, 4)])
def test_sharded_state_is_zero3(traced, kind, world, hosts, n):
    name, bf16, _ = traced
    shapes = _shapes(name)
    psi = sum(math.prod(s) for s in shapes)
    state = per_rank_state(shard(bf16, kind, world, hosts))
    assert state["rule"] == "ZeRO-3" and state["shards"] == n
    closed = state["closed_form"]
    assert closed == {
        "parameters_bytes": psi * 4 / n,
        "gradients_bytes": psi * 4 / n,
        "optimizer_states_bytes": psi * 8 / n,
    }
    # the graph's bytes: exactly the padded shards; above the closed form by the padding only
    padded = _padded(shapes, n)
    assert state["parameters_bytes"] == 4 * padded
    assert state["gradients_bytes"] == 4 * padded
    assert state["optimizer_states_bytes"] == 8 * padded
    pad = 4 * (padded - psi / n)
    assert 0 <= state["parameters_bytes"] - closed["parameters_bytes"] == pytest.approx(pad)
    assert pad <= 4 * sum(math.prod(s[1:]) for s in shapes)  # under one row a parameter


def test_ddp_state_is_replicated(traced):
    name, _, mixed = traced
    psi = sum(math.prod(s) for s in _shapes(name))
    state = per_rank_state(shard(mixed, "ddp", 4))
    assert state["rule"] == "replicated" and state["shards"] == 1
    got = [state[k] for k in ("parameters_bytes", "gradients_bytes", "optimizer_states_bytes")]
    assert got == [4 * psi, 4 * psi, 8 * psi]
    assert list(state["closed_form"].values()) == got


def test_one_gpu_has_no_per_rank_state(traced):
    assert per_rank_state(traced[1]) is None


def test_replay_breakdown_holds_the_same_shards():
    """The memory replay's persistent bytes by kind are the same shards, each allocation
    rounded to the allocator's 512-byte blocks."""
    shapes, n = _shapes("tiny"), 4
    est = evaluate(shard(capture(_tiny, precision="bf16"), "fsdp", n), "h100")
    blocks = sum(round_alloc(4 * math.ceil(s[0] / n) * math.prod(s[1:])) for s in shapes)
    assert est.memory.persistent["parameter"] == blocks
    assert est.memory.persistent["optimizer_state"] == 2 * blocks


def test_estimate_output_says_it():
    est = evaluate(shard(capture(_tiny, precision="bf16"), "fsdp", 4), "h100")
    data = estimate_dict(est)["parallel"]["per_rank_state"]
    assert data == per_rank_state(est.graph)
    out = io.StringIO()
    print_estimate(est, Console(file=out, width=200))
    line = next(x for x in out.getvalue().splitlines() if x.startswith("per rank:"))
    assert "ZeRO-3: Psi x 4/N, 4/N, 8/N with N = 4 = " in line
    assert f"parameters {data['parameters_bytes'] / 2**20:,.2f} MiB" in line
