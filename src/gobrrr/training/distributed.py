"""Data parallelism on the user's real model through `torch.distributed`: DDP, or FSDP2
(`fully_shard`) set up as torchtitan sets it up and as `gobrrr.passes.fsdp` models it.

    group = process_group()                 # inside a torchrun process
    model = data_parallel(model, "fsdp", group)
    with gradient_sync(model, last):        # skip the sync on all micro-batches but the last
        loss.backward()

- "ddp": `DistributedDataParallel` with its default buckets (25 MiB, the first 1 MiB), as
  `passes.ddp` forms them; the mixed precision stays the step's autocast.
- "fsdp": every unit (default: the repeated blocks, `training.checkpointing.block_names`) and
  then the root wrapped with `fully_shard(mp_policy=MixedPrecisionPolicy(param_dtype=bf16,
  reduce_dtype=fp32))`, `reshard_after_forward` as given (the root's included, as torchtitan
  passes it), sharded over every rank (a 1-D mesh, whatever the hosts).
- "hsdp": the same on a 2-D mesh of (hosts, ranks per host), `hosts` > 1: sharded within a
  host and replicated across hosts (`passes.fsdp(..., hsdp=True)`).
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from gobrrr.errors import GobrrrError, did_you_mean
from gobrrr.training.checkpointing import block_names

#: the data-parallel recipes gobrrr predicts and applies
PARALLEL = ("ddp", "fsdp", "hsdp")

#: how long a rank waits for the others (at set-up and in any collective) before it fails
DEFAULT_TIMEOUT_S = 600.0

_TORCHRUN_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


@dataclass(frozen=True)
class Group:
    """This process's place in the job: its rank, the world size, its rank within the host
    and the device it trains on."""

    rank: int
    world: int
    local_rank: int
    device: torch.device

    @property
    def is_first(self) -> bool:
        return self.rank == 0


def under_torchrun() -> bool:
    """Whether this process was started by torchrun (its environment names rank and world)."""
    return all(k in os.environ for k in _TORCHRUN_ENV)


def process_group(timeout_s: float = DEFAULT_TIMEOUT_S, backend: str | None = None) -> Group:
    """Join the job torchrun started (NCCL on GPUs, gloo on CPUs), or return the group
    already joined. Not under torchrun: a GobrrrError saying how to start one."""
    if not dist.is_initialized():
        if not under_torchrun():
            missing = [k for k in _TORCHRUN_ENV if k not in os.environ]
            raise GobrrrError(
                f"not a torchrun process ({', '.join(missing)} not set): start it as "
                "`torchrun --nproc-per-node N -m gobrrr ...`"
            )
        cuda = torch.cuda.is_available()
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]))
        dist.init_process_group(
            backend or ("nccl" if cuda else "gloo"),
            timeout=datetime.timedelta(seconds=timeout_s),
        )
    local = int(os.environ.get("LOCAL_RANK", dist.get_rank()))
    device = torch.device("cuda", torch.cuda.current_device()) if _nccl() else torch.device("cpu")
    return Group(dist.get_rank(), dist.get_world_size(), local, device)


def _nccl() -> bool:
    return dist.get_backend() == "nccl"


def data_parallel(
    model: nn.Module,
    parallel: str,
    group: Group,
    *,
    units: Sequence[str] | None = None,
    reshard_after_forward: bool = True,
    hosts: int = 1,
) -> nn.Module:
    """`model` (on `group.device`) wrapped for `parallel`: the module that trains. DDP returns
    its wrapper; FSDP2 changes the model in place and returns it."""
    if parallel not in PARALLEL:
        raise GobrrrError(f"unknown parallel {parallel!r}: choose one of {', '.join(PARALLEL)}")
    if hosts < 1 or group.world % hosts:
        raise GobrrrError(f"{hosts} hosts do not split {group.world} ranks evenly")
    if parallel == "hsdp" and hosts < 2:
        raise GobrrrError("hsdp replicates across hosts: give hosts > 1 (one host: 'fsdp')")
    # torch.distributed.fsdp costs half a second to import: only here, where a job wraps
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.nn.parallel import DistributedDataParallel

    if parallel == "ddp":
        ids = [group.device.index] if group.device.type == "cuda" else None
        return DistributedDataParallel(model, device_ids=ids)
    mesh = _mesh(group, hosts if parallel == "hsdp" else 1)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for name in unit_names(model, units):
        fully_shard(
            model.get_submodule(name),
            mesh=mesh,
            mp_policy=policy,
            reshard_after_forward=reshard_after_forward,
        )
    fully_shard(model, mesh=mesh, mp_policy=policy, reshard_after_forward=reshard_after_forward)
    return model


def unit_names(model: nn.Module, units: Sequence[str] | None = None) -> list[str]:
    """The modules FSDP2 wraps before the root: `units` as given (each checked), or the
    repeated blocks. None found: a GobrrrError, FSDP2 would shard the whole model as one
    unit and gather all of it at once."""
    if units is None:
        names = block_names(model)
        if not names:
            raise GobrrrError(
                f"{type(model).__name__} has no repeated blocks to shard as FSDP2 units "
                "(an nn.ModuleList or nn.Sequential of two or more modules of one class): "
                "name the units, or use parallel='ddp'"
            )
        return names
    known = dict(model.named_modules())
    for name in units:
        if not name or name not in known:
            raise GobrrrError(
                f"FSDP2 unit {name!r} is not a module of {type(model).__name__}"
                f"{did_you_mean(str(name), known)}: name units as model.named_modules() does"
            )
    return list(units)


def _mesh(group: Group, hosts: int):
    """The job's DeviceMesh: one dimension, or (hosts, GPUs a host) for HSDP."""
    from torch.distributed.device_mesh import init_device_mesh

    kind = group.device.type
    if hosts == 1:
        return init_device_mesh(kind, (group.world,))
    return init_device_mesh(kind, (hosts, group.world // hosts), mesh_dim_names=("hosts", "gpus"))


@contextlib.contextmanager
def gradient_sync(model: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, the backward syncs gradients across ranks only when `enabled`
    (DDP's `no_sync`; FSDP2's `set_requires_gradient_sync`); a model that is neither is
    left as it is."""
    if enabled:
        yield
        return
    from torch.distributed.fsdp import FSDPModule
    from torch.nn.parallel import DistributedDataParallel

    if isinstance(model, DistributedDataParallel):
        with model.no_sync():
            yield
        return
    if isinstance(model, FSDPModule):
        model.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            model.set_requires_gradient_sync(True)
        return
    yield


__all__ = [
    "DEFAULT_TIMEOUT_S",
    "PARALLEL",
    "Group",
    "data_parallel",
    "gradient_sync",
    "process_group",
    "under_torchrun",
    "unit_names",
]
