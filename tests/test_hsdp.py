"""HSDP (FSDP2's fully_shard on a 2-D mesh (hosts, ranks per host)) as `passes.fsdp(...,
hsdp=True)`, held against the real thing: four gloo processes on the CPU as 2 hosts x 2 ranks,
wrapped by `training.distributed.data_parallel(..., hosts=2)`, one training step with every
collective FSDP2 issues recorded (all-gather, reduce-scatter, all-reduce: group size,
elements, dtype) and every parameter's padded shard read off fully_shard. The pass must shard
as fully_shard does and issue the same collectives over the same groups; the cross-host
all-reduce must be timed on the network and the intra-host collectives on NVLink."""

from __future__ import annotations

import json
import math
import os
import socket
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn

from gobrrr import Workload
from gobrrr.capture import capture
from gobrrr.cost.collectives import CROSS_LINK, LINKS, collective_time, hsdp_time, parallel_time
from gobrrr.errors import GobrrrError
from gobrrr.estimate import check_parallel, shard
from gobrrr.evaluate import evaluate
from gobrrr.graph.meta import Parallel
from gobrrr.passes.fsdp import ALL_GATHER, ALL_REDUCE, REDUCE_SCATTER, fsdp
from tests.test_fsdp import LAYERS, F, H, Tiny, V  # the same tiny model

HOSTS, PER_HOST = 2, 2
WORLD = HOSTS * PER_HOST


def _loss(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return nn.functional.cross_entropy(model(ids).flatten(0, 1).float(), ids.flatten())


def _workload() -> Workload:
    torch.manual_seed(0)
    return Workload(
        Tiny(),
        torch.randint(0, V, (2, 8)),
        step=_loss,
        optimizer=lambda p: torch.optim.AdamW(p, lr=1e-4, foreach=True),
    )


# ------------------------------------------------------------------ the real step, 4 ranks
_COLLECTIVES = {
    "all_gather_single": ("all_gather", 0),  # output first: the whole buffer
    "reduce_scatter_single": ("reduce_scatter", 1),  # (output, input): the input is whole
    "all_reduce": ("all_reduce", 0),
}


def _record(calls: list) -> None:
    """Wrap torch.distributed's collectives FSDP2 calls (`_fsdp_collectives` looks them up
    on the module at call time) to record (collective, group size, elements, dtype)."""
    for name, (what, at) in _COLLECTIVES.items():
        real = getattr(dist, name)

        def wrapped(*args, _real=real, _what=what, _at=at, **kwargs):
            t = args[_at] if len(args) > _at else kwargs.get("input" if _at else "output")
            if _what == "all_reduce":
                t = args[0] if args else kwargs["tensor"]
            group = kwargs.get("group")
            calls.append([_what, dist.get_world_size(group), t.numel(), str(t.dtype)])
            return _real(*args, **kwargs)

        setattr(dist, name, wrapped)


def _rank(rank: int, port: int, out: str) -> None:
    from gobrrr.training.distributed import Group, data_parallel

    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=WORLD
    )
    try:
        w = _workload()
        group = Group(rank, WORLD, rank % PER_HOST, torch.device("cpu"))
        model = data_parallel(w.model, "hsdp", group, hosts=HOSTS)
        shards = {}
        for module in (*model.blocks, model):
            for fp in module._get_fsdp_state()._fsdp_param_group.fsdp_params:
                shards[id(fp.sharded_param)] = [
                    fp._sharded_param_data.numel(),
                    str(fp._sharded_param_data.dtype),
                ]
        shards = {n: shards[id(p)] for n, p in model.named_parameters()}
        opt = w.optimizer(model.parameters())
        calls: list = []
        _record(calls)
        _loss(model, w.batch).backward()
        opt.step()
        opt.zero_grad()
        Path(out, f"{rank}.json").write_text(json.dumps({"shards": shards, "calls": calls}))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def real(tmp_path_factory) -> list[dict]:
    """Each rank's padded shards and collectives in one HSDP step (2 hosts x 2 ranks)."""
    out = tmp_path_factory.mktemp("hsdp")
    ctx = mp.start_processes(
        _rank, args=(_free_port(), str(out)), nprocs=WORLD, start_method="spawn", join=False
    )
    while not ctx.join(timeout=60):
        pass
    return [json.loads(Path(out, f"{r}.json").read_text()) for r in range(WORLD)]


@pytest.fixture(scope="module")
def graph():
    return capture(_workload(), precision="bf16")


# ----------------------------------------------------------------------------------- tests
def test_shards_are_one_hosts_as_fully_shard_makes_them(real, graph):
    g = fsdp(graph, WORLD, HOSTS, hsdp=True)
    mine = {s.label: s.nbytes for s in g.storages if s.kind == "parameter"}
    shapes = {n: tuple(p.shape) for n, p in Tiny().named_parameters()}
    by_hand = {n: math.ceil(s[0] / PER_HOST) * math.prod(s[1:]) for n, s in shapes.items()}
    for r in real:  # every rank holds 1/PER_HOST of each parameter (padded), in fp32
        assert {n: k for n, (k, _) in r["shards"].items()} == by_hand
        assert {d for _, d in r["shards"].values()} == {"torch.float32"}
    assert mine == {n: 4 * k for n, k in by_hand.items()}
    # optimizer states on the same shards: AdamW's two fp32 moments
    states = sum(s.nbytes for s in g.storages if s.kind == "optimizer_state")
    assert states == 2 * sum(mine.values())
    assert g.meta.parallel == Parallel("hsdp", WORLD, HOSTS)
    assert g.meta.passes[-1]["hsdp"] is True and g.meta.passes[-1]["shard"] == PER_HOST


def test_collectives_match_the_real_step(real, graph):
    """The same all-gathers and reduce-scatters over one host's ranks, and one all-reduce
    per unit of its fp32 gradient shard over the hosts, as the pass puts in the step."""
    g = fsdp(graph, WORLD, HOSTS, hsdp=True)
    names = {ALL_GATHER: "all_gather", REDUCE_SCATTER: "reduce_scatter", ALL_REDUCE: "all_reduce"}
    mine = Counter()
    for n in g.nodes:
        if n.op in names:
            t = n.inputs[1] if n.op == REDUCE_SCATTER else n.inputs[0]
            t = n.outputs[0] if n.op == ALL_GATHER else t
            dtype = "torch.float32" if t.dtype == "float32" else "torch.bfloat16"
            mine[(names[n.op], n.args[0], math.prod(t.shape), dtype)] += 1
            assert n.stream == "comm"
    for r in real:
        assert Counter(tuple(c) for c in r["calls"]) == mine
    ars = [k for k in mine if k[0] == "all_reduce"]
    assert {k[1] for k in ars} == {HOSTS} and sum(mine[k] for k in ars) == LAYERS + 1


def test_all_reduce_follows_its_reduce_scatter_on_the_same_buffer(graph):
    g = fsdp(graph, WORLD, HOSTS, hsdp=True)
    for i, n in enumerate(g.nodes):
        if n.op == ALL_REDUCE:
            rs = g.nodes[i - 1]
            assert rs.op == REDUCE_SCATTER and rs.outputs[0].storage == n.inputs[0].storage
            assert g.storages[n.inputs[0].storage].kind == "gradient"  # the sharded grads
            assert not n.allocs  # in place: no buffer of its own


def test_plain_fsdp_over_hosts_stays_fully_sharded(graph):
    """hsdp=False with hosts > 1: sharded over every rank, no all-reduce (as before)."""
    g = fsdp(graph, WORLD, HOSTS)
    assert g.meta.parallel == Parallel("fsdp", WORLD, HOSTS)
    assert not any(n.op == ALL_REDUCE for n in g.nodes)
    assert {n.args[0] for n in g.nodes if n.op in (ALL_GATHER, REDUCE_SCATTER)} == {WORLD}
    assert "hsdp" not in g.meta.passes[-1]


def test_hsdp_times_within_and_across_hosts():
    """All-gathers and reduce-scatters among one host's GPUs on NVLink, the all-reduce among
    one GPU a host on the network; FSDP's collectives over all ranks, one ring across hosts."""
    mib = 64 * 2**20
    ar = hsdp_time("all_reduce", mib, "fp32", 64, 8)
    assert ar == collective_time("all_reduce", mib, 8, LINKS[CROSS_LINK])
    assert ar == LINKS[CROSS_LINK].latency_s + mib * 2 * 7 / 8 / LINKS[CROSS_LINK].bus_bytes_per_s
    ag = hsdp_time("all_gather", mib, "bf16", 64, 8)
    assert ag == parallel_time("fsdp", "all_gather", mib, "bf16", 8, 1)
    assert ag < parallel_time("fsdp", "all_gather", mib, "bf16", 64, 8)  # NVLink, not IB


def test_estimate_costs_the_cross_host_all_reduce(graph):
    est = evaluate(shard(graph, "hsdp", WORLD, HOSTS), "h100")
    ars = [o for o in est.time.ops if est.graph.nodes[o.index].op == ALL_REDUCE]
    assert len(ars) == LAYERS + 1
    for o in ars:
        nbytes = est.graph.nodes[o.index].inputs[0].nbytes
        assert o.device_s == collective_time("all_reduce", nbytes, HOSTS, LINKS[CROSS_LINK])


def test_hsdp_needs_several_hosts(graph):
    with pytest.raises(GobrrrError, match="--nodes 2 or more"):
        check_parallel(4, 1, "hsdp")
    with pytest.raises(GobrrrError, match="hosts > 1"):
        fsdp(graph, 4, 1, hsdp=True)


# ----------------------------------------------- the estimate command's data-parallel knobs
class Flat(nn.Module):
    """Modules of different classes, none repeated: nothing FSDP2 wraps as a unit by default."""

    def __init__(self) -> None:
        super().__init__()
        self.embed, self.mid, self.out = nn.Embedding(V, H), nn.Linear(H, F), nn.Linear(F, V)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(self.mid(self.embed(ids))))


def _flat_workload() -> Workload:
    torch.manual_seed(0)
    return Workload(Flat(), torch.randint(0, V, (2, 8)), step=_loss)


def _cli(capsys, *args: str) -> tuple[int, str, str]:
    from gobrrr.cli.app import main

    rc = main(["estimate", *args])
    out, err = capsys.readouterr()
    return rc, out, err


SPEC = f"{__file__}:_workload"


@pytest.mark.parametrize(
    ("args", "says"),
    [
        (["--units", "blocks.0,blokcs.1"], "did you mean 'blocks.1'"),
        (["--parallel", "hsdp", "--nodes", "1"], "--nodes 2 or more"),
        (["--nodes", "3"], "--nodes 3 must divide --gpus 4"),
        (["--parallel", "ddp", "--units", "blocks.0"], "--units: FSDP2's units"),
        (["--parallel", "ddp", "--no-reshard"], "--no-reshard: FSDP2's units"),
        (["--units", ","], "expected module names"),
        (["--parallel", "hsdp", "--nodes", "2", "--compile"], "not modelled"),
    ],
)
def test_bad_knobs_are_one_line_exit_2(capsys, args, says):
    base = [SPEC, "--gpus", "4", "--parallel", "fsdp"]
    rc, _, err = _cli(capsys, *base, *args)
    assert rc == 2 and says in err and len(err.strip().splitlines()) == 1, err


def test_a_model_without_blocks_needs_units(capsys):
    rc, _, err = _cli(capsys, f"{__file__}:_flat_workload", "--gpus", "2", "--parallel", "fsdp")
    assert rc == 2 and "no repeated blocks" in err and "--units" in err
    rc, out, _ = _cli(
        capsys,
        f"{__file__}:_flat_workload",
        "--gpus",
        "2",
        "--parallel",
        "fsdp",
        "--units",
        "mid",
        "--json",
    )
    assert rc == 0 and json.loads(out)["workload"]["passes"][-1]["units"] == ["mid"]


def test_units_and_reshard_reach_the_pass(capsys):
    rc, out, _ = _cli(
        capsys,
        SPEC,
        "--gpus",
        "4",
        "--nodes",
        "2",
        "--parallel",
        "hsdp",
        "--units",
        "blocks.0,blocks.2",
        "--no-reshard",
        "--json",
    )
    assert rc == 0
    d = json.loads(out)
    record = d["workload"]["passes"][-1]
    assert record["units"] == ["blocks.0", "blocks.2"]
    assert record["reshard_after_forward"] is False and record["shard"] == 2
    assert d["parallel"]["kind"] == "hsdp" and d["parallel"]["per_rank_state"]["shards"] == 2
