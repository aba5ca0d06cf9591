"""passes.fsdp on a tiny model: per-rank parameter, gradient and optimizer-state bytes against
ZeRO-3's closed forms and against what `fully_shard` itself allocates (a fake process group
on the CPU), the collectives per unit, and reshard_after_forward=False's cost by hand."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.testing._internal.distributed.fake_pg import FakeStore

from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.errors import GobrrrError
from gobrrr.graph.meta import Parallel
from gobrrr.memory.allocator import CachingAllocator
from gobrrr.memory.replay import round_alloc
from gobrrr.passes.accumulate import accumulate
from gobrrr.passes.fsdp import ALL_GATHER, REDUCE_SCATTER, fsdp

H, F, V, LAYERS = 16, 10, 37, 3  # F and V do not divide by 4: dim-0 padding


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.up, self.down = nn.Linear(H, F), nn.Linear(F, H)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.relu(self.up(x)))


class Tiny(nn.Module):
    """Embedding, three blocks (the repeated units), a norm and a head: the root's."""

    def __init__(self) -> None:
        super().__init__()
        self.embed = nn.Embedding(V, H)
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.norm = nn.LayerNorm(H)
        self.head = nn.Linear(H, V, bias=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids)
        for b in self.blocks:
            x = b(x)
        return self.head(self.norm(x))


def _workload() -> Workload:
    torch.manual_seed(0)
    return Workload(
        Tiny(),
        torch.randint(0, V, (2, 8)),
        step=lambda m, b: nn.functional.cross_entropy(m(b).flatten(0, 1).float(), b.flatten()),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
    )


@pytest.fixture(scope="module")
def graph():
    return capture(_workload(), precision="bf16")


def _shapes() -> dict[str, tuple[int, ...]]:
    return {n: tuple(p.shape) for n, p in Tiny().named_parameters()}


def _unit(name: str) -> str:
    parts = name.split(".")
    return ".".join(parts[:2]) if parts[0] == "blocks" else ""


def _shard_numel(shape: tuple[int, ...], world: int) -> int:
    """ZeRO-3 / FSDP2: dim 0 split in world chunks of ceil(d0 / world) rows (padded)."""
    return math.ceil(shape[0] / world) * math.prod(shape[1:])


def _fully_shard_numels(world: int) -> dict[str, int]:
    """The padded shard FSDP2 allocates per parameter, fully_shard on a fake process group."""
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
        model = Tiny()
        for b in model.blocks:
            fully_shard(b, mesh=mesh, mp_policy=mp)
        fully_shard(model, mesh=mesh, mp_policy=mp)
        out = {}
        for module in (*model.blocks, model):
            group = module._get_fsdp_state()._fsdp_param_group
            for fp in group.fsdp_params:
                assert fp._sharded_param_data.dtype == torch.float32
                out[id(fp.sharded_param)] = fp._sharded_param_data.numel()
        return {n: out[id(p)] for n, p in model.named_parameters()}
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("world", [2, 4])
def test_persistent_bytes_are_zero3_shards(graph, world):
    shapes = _shapes()
    params = sum(_shard_numel(s, world) for s in shapes.values()) * 4
    real = _fully_shard_numels(world)
    assert real == {n: _shard_numel(s, world) for n, s in shapes.items()}
    g = fsdp(graph, world)
    st = g.storages
    assert sum(s.nbytes for s in st if s.kind == "parameter") == params == sum(real.values()) * 4
    # AdamW: exp_avg and exp_avg_sq on the fp32 shards (its step counters hold no device bytes)
    assert sum(s.nbytes for s in st if s.kind == "optimizer_state") == 2 * params
    # the sharded gradients: one reduce-scatter output per unit, alive until zero_grad
    sharded = [s for s in st if s.kind == "gradient"]
    assert len(sharded) == LAYERS + 1 and sum(s.nbytes for s in sharded) == params
    assert all(s.freed is not None and g.nodes[s.freed].phase == "optimizer" for s in sharded)
    assert g.meta.parallel == Parallel("fsdp", world, 1)
    assert g.meta.passes[-1]["pass"] == "fsdp"


def _per_unit(world: int) -> dict[str, int]:
    """{unit: padded shard elements of its parameters}."""
    out: dict[str, int] = {}
    for n, s in _shapes().items():
        out[_unit(n)] = out.get(_unit(n), 0) + _shard_numel(s, world)
    return out


@pytest.mark.parametrize("reshard", [True, False])
def test_collectives_per_unit(graph, reshard):
    world = 4
    g = fsdp(graph, world, reshard_after_forward=reshard)
    shard = _per_unit(world)
    gathers: dict[str, list[int]] = {}
    reduces: dict[str, list[int]] = {}
    for n in g.nodes:
        if n.op == ALL_GATHER:
            assert n.stream == "comm"
            gathers.setdefault(n.module, []).append(n.outputs[0].nbytes)
        elif n.op == REDUCE_SCATTER:
            assert n.stream == "comm"
            reduces.setdefault(n.module, []).append(n.inputs[1].nbytes)
    times = 2 if reshard else 1  # forward, and again in backward when resharded
    # all-gather: world x the unit's padded shard, bf16; reduce-scatter: the same, fp32
    assert gathers == {u: [world * k * 2] * times for u, k in shard.items()}
    assert reduces == {u: [world * k * 4] for u, k in shard.items()}


def test_no_reshard_keeps_gathered_params_to_backward(graph):
    world = 4
    first_bwd = next(n.index for n in graph.nodes if n.phase == "backward")

    def live_at_backward_start(g) -> int:
        # the first backward op of the traced step, found again in the new graph
        i = [n.index for n in g.nodes if n.phase == "backward" and n.op.startswith("aten.")][0]
        assert g.nodes[i].op == graph.nodes[first_bwd].op
        return sum(
            round_alloc(s.nbytes)
            for s in g.storages
            if s.created <= i and (s.freed is None or s.freed >= i) and s.created >= 0
        )

    kept = live_at_backward_start(fsdp(graph, world, reshard_after_forward=False))
    freed = live_at_backward_start(fsdp(graph, world, reshard_after_forward=True))
    # every unit's unsharded bf16 buffers (one per parameter, world x its padded shard)
    by_hand = sum(round_alloc(world * _shard_numel(s, world) * 2) for s in _shapes().values())
    assert kept - freed == by_hand


def test_default_keeps_only_the_root(graph):
    """reshard_after_forward=None (fully_shard's default): blocks reshard, the root does not."""
    world = 4
    g = fsdp(graph, world, reshard_after_forward=None)
    gathers = [n.module for n in g.nodes if n.op == ALL_GATHER]
    assert gathers.count("") == 1 and len(gathers) == 2 * LAYERS + 1


def test_accumulation_keeps_fp32_unsharded_grads(graph):
    """set_requires_gradient_sync(False) on the first micro-batch: its bf16 gradients become
    unsharded fp32 ones (each parameter's whole size) until the last micro-batch reduces."""
    world = 4
    g = fsdp(accumulate(graph, 2), world)
    acc = [s for s in g.storages if s.label.endswith("(accumulated)")]
    assert sum(s.nbytes for s in acc) == sum(math.prod(s) for s in _shapes().values()) * 4
    assert len([n for n in g.nodes if n.op == REDUCE_SCATTER]) == LAYERS + 1
    r = g.meta.repeat
    assert r is not None and r.times == 1
    assert all(r.start <= n.index < r.end for n in g.nodes if n.op == REDUCE_SCATTER)


def test_rejects_mixed_precision_trace():
    g = capture(_workload(), precision="bf16-mixed")
    with pytest.raises(GobrrrError, match="precision 'bf16'"):
        fsdp(g, 4)


def test_one_unit_is_the_whole_model(graph):
    """units=[]: fully_shard(model) alone, one all-gather per gather and one reduce-scatter."""
    world = 2
    g = fsdp(graph, world, units=[])
    ops = [n.op for n in g.nodes]
    assert ops.count(ALL_GATHER) == 2 and ops.count(REDUCE_SCATTER) == 1
    total = sum(_per_unit(world).values())  # the padded shards are per parameter still
    rs = next(n for n in g.nodes if n.op == REDUCE_SCATTER)
    assert rs.inputs[1].nbytes == world * total * 4


def test_allocator_pools_are_per_stream():
    """A block freed by a stream goes back to that stream's pool: the compute stream does not
    reuse what FSDP2's side streams freed (the copy-in stream's all-gather buffers), so both
    segments stay reserved."""
    a = CachingAllocator()
    a.free(a.malloc(64 * 2**20, "comm"))
    a.malloc(64 * 2**20, "compute")
    assert a.reserved == 2 * 64 * 2**20
    b = CachingAllocator()
    b.free(b.malloc(64 * 2**20))
    b.malloc(64 * 2**20)
    assert b.reserved == 64 * 2**20


class HeadOnlyRoot(nn.Module):
    """Blocks, then a head: the root holds only the head, whose gradients backward makes first."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(LAYERS))
        self.head = nn.Linear(H, V)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for b in self.blocks:
            x = b(x)
        return self.head(x)


def test_a_root_holding_only_the_head_reduces_last():
    """FSDP2 reduce-scatters the root's gradients in autograd's final callback, after every
    block's, though the head's gradients are made first in backward."""
    torch.manual_seed(0)
    w = Workload(
        HeadOnlyRoot(),
        torch.randn(2, 8, H),
        step=lambda m, b: m(b).float().square().mean(),
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
    )
    g = fsdp(capture(w, precision="bf16"), 4)
    reduces = [n.module for n in g.nodes if n.op == REDUCE_SCATTER]
    assert reduces == ["blocks.2", "blocks.1", "blocks.0", ""]


def test_sync_each_reduce_scatters_every_micro_batch_and_keeps_only_shards(graph):
    """FSDP2's default accumulation (no set_requires_gradient_sync(False)): every micro-batch
    reduce-scatters, the later one's shard added into the first's; no unsharded fp32
    gradient outlives a micro-batch, and the traced `grad += new` does not run."""
    acc = accumulate(graph, 2)
    held = fsdp(acc, 4)
    each = fsdp(acc, 4, sync_each=True)
    units = ["blocks.2", "blocks.1", "blocks.0", ""]
    assert [n.module for n in held.nodes if n.op == REDUCE_SCATTER] == units
    assert [n.module for n in each.nodes if n.op == REDUCE_SCATTER] == units * 2
    adds = [n for n in each.nodes if n.op == "aten.add_.Tensor"]
    assert [n.module for n in adds] == units and all(n.stream == "comm" for n in adds)
    # the sharded gradients are the first micro-batch's reduce-scatter outputs: 4/N bytes a
    # parameter (padded shards), and nothing else of kind "gradient"
    shard = _per_unit(4)
    grads = sum(s.nbytes for s in each.storages if s.kind == "gradient")
    assert grads == sum(4 * k for k in shard.values())
    assert sum(s.nbytes for s in held.storages if s.kind == "gradient") > grads
    assert each.meta.passes[-1]["sync_each"] is True
